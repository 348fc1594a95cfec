"""What a workspace holds and what an `index` run would do, read from its files without writing:
`stats` (counts, stage states, documents and their status, failed items, LLM usage) and `plan`
(`index --dry-run`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..cache import Cache, cache_damage
from ..config import Config, changed
from ..engines.identity import identity
from ..errors import DamagedError, NoBuildError
from ..generation import Generation, repair_hint
from ..node_types import NODE_TYPES
from ..workspace import Workspace
from . import assemble
from .chunk import document_chunks
from .decompose import cache_key, input_name
from .pipeline import (
    compare_documents,
    damaged_outputs,
    decide,
    indexed_state,
    scan_digest_of,
    settings_digest,
)
from .run import Reading, workspace_config
from .scan import scan
from .stages import STAGES


def _decomposed(ws: Workspace, cache: Cache | None, config: Config, chunks: list[tuple[str, str, str]]) -> set[int]:
    """Positions of the (chunk id, title, text) chunks already decomposed: in the cache, or in the
    rows the decompose stage keeps (where a pure engine's work is, once committed)."""
    if not chunks:
        return set()
    keys = [cache_key(identity(config.llm), title, text) for _, title, text in chunks]
    found = cache.get_many("decompose", keys) if cache is not None else {}
    rows = ws.stage_path("decompose", "occurrences.parquet")
    kept: set[str] = set()
    if rows.is_file() and len(found) < len(keys):
        with contextlib.suppress(OSError, pa.ArrowException):
            kept = set(pc.unique(pq.read_table(rows, columns=["input"])["input"]).to_pylist())
    return {i for i, (key, (chunk, _, _)) in enumerate(zip(keys, chunks, strict=True))
            if key in found or input_name(chunk, key) in kept}

def _documents_status(ws: Workspace) -> list[dict]:
    """Every document of the latest scan (and every one still in the graph) with its status:

    - indexed: in the last complete build, with this content;
    - pending: new, changed, renamed or removed since the last complete build; the next
      `noderag index` finishes it (`chunks_done` of `chunks` are already decomposed);
    - failed: a chunk's decomposition failed (reason given); the next run retries it;
    - skipped: unreadable, empty, binary... (reason given).
    """
    latest = ws.stage_path("chunk", "documents.parquet")
    if not latest.is_file():
        latest = ws.legacy_path("documents.parquet")
    if not latest.is_file():
        return []
    documents = ws.read_table(latest).to_pylist()
    indexed = indexed_state(ws)
    changes = compare_documents(indexed, {r["path"]: r["content_hash"] for r in documents if r["status"] == "indexed"})
    why = {p: "new" for p in changes["new"]} | {p: "changed" for p in changes["changed"]}
    why |= {pair.split(" -> ")[1]: f"renamed from {pair.split(' -> ')[0]}" for pair in changes["renamed"]}
    failed_chunks: dict[str, str] = {}
    failures_path = ws.stage_path("decompose", "failures.parquet")
    if failures_path.is_file():
        failures = ws.read_table(failures_path)
        failed_chunks = dict(zip(failures["item"].to_pylist(), failures["reason"].to_pylist(), strict=True))
    chunks_of: dict[str, list[tuple[str, str, str]]] = {}
    chunks_path = ws.stage_path("chunk", "chunks.parquet")
    if chunks_path.is_file():
        chunks = ws.read_table(chunks_path, ["chunk_id", "doc_id", "title", "text"])
        for row in zip(*(chunks[c].to_pylist() for c in ("chunk_id", "doc_id", "title", "text")), strict=True):
            chunks_of.setdefault(row[1], []).append((row[0], row[2], row[3]))
    pending = [r for r in documents if r["status"] == "indexed" and r["path"] in why]
    if pending:
        config = workspace_config(ws)
        flat = [(r["doc_id"], chunk, title, text) for r in pending for chunk, title, text in chunks_of.get(r["doc_id"], [])]
        done = _decomposed(ws, ws.read_only_cache(), config, [(chunk, title, text) for _, chunk, title, text in flat])
        done_by_doc: dict[str, int] = {}
        for position, (doc, _, _, _) in enumerate(flat):
            done_by_doc[doc] = done_by_doc.get(doc, 0) + (position in done)
    for row in documents:
        row["chunks_done"] = row["chunks"] if row["status"] == "indexed" else 0
        if row["status"] != "indexed":
            continue
        failed = [failed_chunks[c] for c, _, _ in chunks_of.get(row["doc_id"], []) if c in failed_chunks]
        if failed:
            row["status"], row["reason"] = "failed", f"{len(failed)} chunk(s) failed: {failed[0]}"
        elif row["path"] in why:
            row["status"], row["reason"] = "pending", why[row["path"]]
            row["chunks_done"] = done_by_doc.get(row["doc_id"], 0)
    for path in changes["deleted"]:
        documents.append({"doc_id": "", "path": path, "title": "", "content_hash": indexed[path], "bytes": 0,
                          "status": "pending", "reason": "removed from the input; still in the graph until the next run",
                          "chunks": 0, "chunks_done": 0})
    return sorted(documents, key=lambda r: r["path"])

def _failed_items(ws: Workspace) -> list[dict]:
    """Items of the stages after decomposition that failed (an entity's attribute, a community's
    elements), with the reason: they belong to no one document, so the document list cannot show them."""
    rows = []
    for stage in STAGES:
        path = ws.stage_path(stage.name, "failures.parquet")
        if stage.name != "decompose" and "failures.parquet" in stage.outputs and path.is_file():
            rows += ws.read_table(path, ["stage", "item", "reason"]).to_pylist()
    return rows

def _legacy_counts(generation: Generation) -> dict:
    """`assemble.counts` of a build in the layout from before generations, from its tables."""
    return assemble.counts(generation.table("nodes", ["type", "vector_row"]), generation.table("edges", ["kind", "hnsw"]))

def stats(workspace: str | Path, verify: bool = False) -> dict:
    """Everything `noderag stats` shows, as plain data; never writes to the workspace. With
    `verify`, every file of the current build is checked against its recorded checksum, and the
    cache against SQLite's own check: a mismatch raises WorkspaceError naming the file."""
    ws = Workspace(Path(workspace))
    ws.check_indexed()
    manifest = ws.read_manifest()
    recorded = manifest.get("stages", {})
    ordered = {stage.name: recorded[stage.name] for stage in STAGES if stage.name in recorded}
    report: dict = {"workspace": str(ws.root), "input": manifest.get("input"), "stages": ordered, "generation": None,
                    "nodes": {}, "edges": {"by_kind": {}, "non_hnsw": 0, "hnsw": 0, "merged_total": 0},
                    "vectors": {"count": 0, "dim": manifest.get("embedding", {}).get("dim"),
                                "model": manifest.get("embedding", {}).get("model")}}
    try:
        generation = ws.open_generation()
    except NoBuildError:
        if verify:  # a workspace with no usable build does not pass a check
            raise
        generation = None
    if generation is not None:
        with generation:
            built = _legacy_counts(generation) if generation.legacy else generation.manifest["counts"]
            report["generation"] = generation.name or "(older layout: the next `noderag index` moves it)"
            report["nodes"], report["edges"] = dict(built["nodes"]), built["edges"]
            report["vectors"]["count"] = built["vectors"]
            if verify:
                problems = generation.verify()
                if problems:
                    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                    raise DamagedError(f"workspace file {problems[0]}{more}; "
                                       + repair_hint(ws.root, manifest.get("input")))
                report["verified"] = {"generation": generation.name, "files": len(generation.manifest.get("files", {}))}
    if verify:
        damaged = [path for stage in STAGES if stage.name != "assemble"  # the build: checked above
                   for path in damaged_outputs(ws, stage, recorded.get(stage.name, {}))]
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise DamagedError(f"workspace file {damaged[0]} does not match the checksum recorded when it was "
                               f"written{more}; " + repair_hint(ws.root, manifest.get("input")))
        problem = cache_damage(ws.cache_path, thorough=True)
        if problem:
            raise DamagedError(f"workspace file {ws.cache_path} is damaged ({problem[:160]}); "
                               f"`noderag index {ws.root} --input {manifest.get('input') or 'FOLDER'}` keeps what is "
                               "readable and rebuilds the rest")
    report["nodes"] = {t: report["nodes"].get(t, 0) for t in NODE_TYPES}
    documents = _documents_status(ws)
    by_status: dict[str, int] = {}
    for row in documents:
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
    report["documents"] = {"by_status": by_status, "list": [
        {k: row[k] for k in ("path", "status", "reason", "chunks", "chunks_done", "title")} for row in documents]}
    report["failed_items"] = _failed_items(ws)
    llm_totals: dict[str, float | bool | None] = {}
    for info in report["stages"].values():
        for key, value in (info.get("llm") or {}).items():
            if key == "price_known":
                llm_totals[key] = False
            elif value is None or llm_totals.get(key, 0) is None:  # an unknown price: the total is unknown too
                llm_totals[key] = None
            else:
                llm_totals[key] = llm_totals.get(key, 0) + value
    report["llm"] = llm_totals
    report["files"] = {p.relative_to(ws.root).as_posix(): p.stat().st_size
                       for p in sorted(ws.root.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    ws.close()
    return report

def plan(workspace: str | Path, input_folder: str | Path, config_path: Path | None = None,
         reading: Reading | None = None, max_cost_usd: float | None = None) -> dict:
    """What `index` would do, without writing anything: documents new, changed, renamed, deleted and
    unchanged since the last complete build; chunks still to decompose; each stage's fate, by the
    pipeline's own rule (`pipeline.decide`); and with an LLM engine, the estimated calls, tokens
    and cost, and whether they fit in the spending cap."""
    ws = Workspace(Path(workspace))
    ws.check_usable()
    config = workspace_config(ws, config_path, reading)
    if max_cost_usd is not None:
        config = config.model_copy(update={"llm": changed(config.llm, max_cost_usd=max_cost_usd)})
    files = scan(Path(input_folder), config.chunk)
    readable = [f for f in files if not f.reason]
    changes = compare_documents(indexed_state(ws), {f.path: f.content_hash for f in readable})
    counts = {k: len(v) for k, v in changes.items()} | {"skipped": len(files) - len(readable)}
    touched = set(changes["new"]) | set(changes["changed"]) | {p.split(" -> ")[1] for p in changes["renamed"]}
    fresh = [f for f in readable if f.path in touched]
    cache = ws.read_only_cache()
    pieces = document_chunks(fresh, config.chunk, cache=ws.read_only_cache())
    new_chunks = [(c[2], entry.title, c[0]) for entry in pieces for c in entry.chunks]
    to_decompose = len(new_chunks) - len(_decomposed(ws, cache, config, new_chunks))
    manifest = ws.read_manifest() if ws.exists() else {"stages": {}}
    engine_identity = identity(config.llm)
    scan_digest = scan_digest_of(files)
    stages: dict[str, str] = {}
    digests: dict[str, str | None] = {}
    for stage in STAGES:
        entry = manifest["stages"].get(stage.name, {})
        decision = decide(ws, stage, entry, settings_digest(config, engine_identity, stage), digests, scan_digest)
        digests[stage.name] = None if decision.run else entry["outputs"]
        stages[stage.name] = f"run: {decision.reason}" if decision.run else "skip (unchanged)"
    result = {"workspace": str(ws.root), "input": str(input_folder), "documents": counts,
              "changes": {k: v for k, v in changes.items() if k != "unchanged"},
              "formats": dict(sorted(Counter(f.reader for f in readable).items())), "left_out": files.left_out,
              "skipped": [{"path": f.path, "reason": f.reason} for f in files if f.reason] +
                         [{"path": f.path, "reason": entry.failure} for f, entry in zip(fresh, pieces, strict=True)
                          if entry.failure],
              "chunks": {"in_changed_documents": len(new_chunks), "to_decompose": to_decompose},
              "stages": stages}
    if config.llm.engine != "offline":
        from .estimate import estimate_llm

        result["llm"] = estimate_llm(ws, Path(input_folder), config)
        limit, estimate = config.llm.max_cost_usd, result["llm"]["total"]["cost_usd"]
        if limit is not None:
            result["llm"]["spending_cap"] = {"limit_usd": limit, "fits": None if estimate is None else estimate <= limit}
    ws.close()
    return result
