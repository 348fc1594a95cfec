"""`noderag gc`: remove what no current table or build refers to, so deleted documents' text does
not stay on disk for good.

Collected: builds that are no longer current and that no reader holds; temporary files a killed
run left; stage files no stage declares (from older versions); and cache entries that the last run
of every stage did not need. Each stage run records the cache keys it asked for or wrote
(`stages/<stage>.cache_keys.parquet`), and the decompose stage's rows name every chunk's key, so
the entries kept are exactly those a rerun of any stage would look up: an `index` after `gc`
re-pays nothing. (`noderag ablate`'s LLM replies, which no stage needs, go too.) The cache is rewritten into a new file
with only the entries kept, then renamed over the old one: a `query` that has the old file open
keeps reading it. An `index` run cannot start meanwhile (gc holds the workspace lock).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from pathlib import Path

import pyarrow as pa

from .cache import CACHE_TABLE, LLM, cache_damage, read_only_uri
from .index.stages import STAGES
from .index.state import RUNNING, Manifest, live_cache_keys
from .workspace import CACHE_KEYS, GENERATIONS_DIR, Workspace


def _size(path: Path) -> int:
    """Bytes of a file or a folder's files, links not followed (a link counts as nothing)."""
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    if not path.is_dir():
        return 0
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path)
               for name in names if not os.path.islink(os.path.join(root, name)))


def _stray_files(ws: Workspace) -> list[Path]:
    """Temporary files of interrupted writes, and stage files that no stage declares."""
    declared = {f"{stage.name}.{name}" for stage in STAGES for name in (*stage.files, CACHE_KEYS)}
    stray = [p for p in ws.stages_dir.iterdir() if p.is_file() and p.name not in declared] \
        if ws.stages_dir.is_dir() else []
    for folder in (ws.root, *(p for p in (ws.root / GENERATIONS_DIR).glob("*") if p.is_dir() and not p.is_symlink())):
        stray += [p for p in folder.glob(".*.tmp") if p.is_file() and not p.is_symlink()]
    return sorted(set(stray))


def _sweep_cache(ws: Workspace, live: list[tuple[str, str]], dry_run: bool) -> dict:
    """Count, and unless dry_run remove, the cache entries not in `live` (and how many of those are
    paid LLM replies). A dry run opens the cache read-only: it works on a read-only workspace."""
    path = ws.cache_path
    before = _size(path) + _size(path.with_name(path.name + "-wal"))
    wanted = "EXISTS (SELECT 1 FROM live WHERE live.ns = kv.ns AND live.key = kv.key)"
    db = sqlite3.connect(read_only_uri(path), uri=True, isolation_level=None) if dry_run else \
        sqlite3.connect(path, isolation_level=None)
    fresh = path.with_name(f".{path.name}.gc.tmp")
    try:
        db.execute("CREATE TEMP TABLE live (ns TEXT, key TEXT, PRIMARY KEY (ns, key)) WITHOUT ROWID")
        db.executemany("INSERT INTO live VALUES (?, ?)", live)
        total = db.execute("SELECT COUNT(*) FROM kv").fetchone()[0]
        dead, dead_bytes, paid = db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(LENGTH(key) + LENGTH(value)), 0), COALESCE(SUM(ns = '{LLM}'), 0) "
            f"FROM kv WHERE NOT {wanted}").fetchone()
        report = {"entries": total, "removed": dead, "bytes": dead_bytes, "paid_replies": paid}
        if dry_run or not dead:
            return report
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        db.execute("ATTACH DATABASE ? AS fresh", [str(fresh)])
        db.execute(CACHE_TABLE.replace("EXISTS kv", "EXISTS fresh.kv"))
        db.execute("BEGIN")
        db.execute(f"INSERT INTO fresh.kv SELECT * FROM kv WHERE {wanted} ORDER BY ns, key")
        db.execute("COMMIT")
        db.execute("DETACH DATABASE fresh")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except BaseException:
        db.close()
        with contextlib.suppress(FileNotFoundError):
            fresh.unlink()
        raise
    db.close()
    with open(fresh, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(fresh, path)  # a reader that has the old file open keeps it until it closes it
    for suffix in ("-wal", "-shm"):  # the old file's; no writer runs while gc holds the lock
        with contextlib.suppress(FileNotFoundError):
            path.with_name(path.name + suffix).unlink()
    report["bytes"] = max(0, before - _size(path))
    return report


def collect(workspace: Path, dry_run: bool = False, include_unfinished: bool = False) -> dict:
    """What `noderag gc` removes (with `dry_run`, would remove, without writing anything or taking
    the lock) and how many bytes that frees. After an index run that did not finish, the cache
    entries no finished stage needs are kept (they are what that run paid for, and the next run
    asks for them) unless `include_unfinished`; the report says how many, and how many of them are
    paid LLM replies."""
    ws = Workspace(Path(workspace))
    ws.check_indexed()
    with contextlib.nullcontext() if dry_run else ws.lock():
        manifest = Manifest.load(ws)
        current = ws.current_name()
        folder = ws.root / GENERATIONS_DIR
        old = [p for p in sorted(folder.iterdir()) if (p.is_dir() or p.is_symlink()) and p.name != current] \
            if folder.is_dir() else []
        sizes = {p.name: _size(p) for p in old}
        removed = list(sizes) if dry_run else ws.remove_unused_generations()
        held = [name for name in sizes if name not in removed]
        stray = _stray_files(ws)
        stray_bytes = sum(_size(p) for p in stray)
        if not dry_run:
            for path in stray:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        cache: dict = {"entries": 0, "removed": 0, "bytes": 0, "skipped": None}
        if ws.cache_path.is_file():
            problem = cache_damage(ws.cache_path)
            live, why = live_cache_keys(ws, manifest) if not problem else (None, None)
            if problem:
                cache["skipped"] = f"{ws.cache_path} is damaged ({problem}); `noderag index` salvages it first"
            elif live is None:
                cache["skipped"] = why
            else:
                unfinished = [name for name, entry in manifest.stages.items() if entry.state == RUNNING]
                keep = bool(unfinished) and not include_unfinished
                try:
                    cache |= _sweep_cache(ws, live, dry_run or keep)
                except (sqlite3.DatabaseError, pa.ArrowException) as err:
                    cache["skipped"] = f"{ws.cache_path} could not be read ({err}); `noderag index` salvages it"
                if keep and "removed" in cache:
                    cache["unfinished"] = {"entries": cache["removed"], "paid_replies": cache["paid_replies"]}
                    cache["skipped"] = (
                        f"the last index run did not finish (stage {unfinished[0]}): the {cache['removed']:,} cache "
                        f"entries no finished stage needs ({cache['paid_replies']:,} of them paid LLM replies) are "
                        "kept for the next run; `noderag gc --include-unfinished` removes them, and that run pays "
                        "for them again")
                    cache["removed"] = cache["bytes"] = 0
        if not dry_run and cache.get("removed") and ws.cache_path.is_file():
            manifest.record_cache(ws.cache)  # what gc leaves is what the next run may expect
            manifest.save(ws)
        freed = sum(sizes[name] for name in removed) + stray_bytes + cache["bytes"]
        return {"workspace": str(ws.root), "dry_run": dry_run, "generations": removed, "held_generations": held,
                "files": [p.relative_to(ws.root).as_posix() for p in stray], "cache": cache, "bytes_freed": freed}
