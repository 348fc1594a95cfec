"""The workspace store: the one module that knows the folder's layout and names its files.

    config.yaml        the config of the latest `index` run (env var names only, never secrets)
    manifest.json      embedding model; input folder; per stage: state (running|done), fingerprint
                       (settings + upstream output digests), settings digest, outputs digest,
                       seconds, LLM usage, vectors computed, stage counts
    stages/            each stage's committed outputs, `<stage>.<name>`; `chunk.documents.parquet`
                       is the latest scan (see `index.chunk.DOCUMENT_SCHEMA`)
    CURRENT            the name of the current generation: the last complete build
    generations/<g>/   one complete, immutable build: the node, edge and document tables, the
                       vectors, the config it was built with, and every structure the search reads
                       (`search/prepare.py`), memory-mappable; its manifest.json records each file's
                       size and checksum. `.readers` is flocked shared by every process reading it.
    cache.sqlite       content-addressed cache, one namespace per kind of work (`cache.NAMESPACES`:
                       what each holds); entries are never stale, only unused
    noderag.log        what each run did
    .lock              held (flock) by the one `index` run allowed at a time; the kernel
                       releases it when the process dies, however it dies

Every file is written atomically (temporary file, fsync, rename). A build becomes visible by
one atomic rename of CURRENT, after its generation is complete on disk, so a reader sees the
old build or the new one, never a mixture; a reader resolves CURRENT once, when it opens.
Old generations are removed by the next `index`, except those a reader still holds.

A workspace written before generations existed keeps its final tables at the top level
(nodes.parquet, edges.parquet, vectors.faiss, documents.parquet). It is not read as it is: opening
it names the `index` command that moves it to this layout, without redoing any stage's work
(`assemble.legacy_documents` is all that run reads of it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .cache import Cache
from .errors import InputError, NoBuildError, WorkspaceError
from .files import (
    atomic_write_bytes,
    fsync_dir,
    json_digest,
)
from .generation import GENERATION_VERSION, READERS_FILE, Generation, GenerationWriter, damaged, repair_hint

FORMAT_VERSION = 1
CACHE_FILE = "cache.sqlite"
CACHE_KEYS = "cache_keys.parquet"  # beside each stage's outputs: the cache entries its last run needed
CURRENT_FILE = "CURRENT"
GENERATIONS_DIR = "generations"
NODES = "nodes.parquet"  # a node table: a stage's (`stages/<stage>.nodes.parquet`) and a build's
EDGES = "edges.parquet"  # an edge table, likewise
VECTOR_DIGESTS = "vector_ids.parquet"  # a build's vector rows: node ids and text digests (index/embed.py)
LEGACY_FINAL = (NODES, EDGES, "vectors.faiss", "documents.parquet",
                "stages/similarity.documents.parquet")
LOCK_FILE = ".lock"
LOG_FILE = "noderag.log"
WRITTEN_IN_PLACE = (LOCK_FILE, LOG_FILE, CACHE_FILE, CACHE_FILE + "-wal", CACHE_FILE + "-shm", CACHE_FILE + "-journal",
                    "stages", GENERATIONS_DIR, "evaluation")
"""What a run opens and writes in place, or writes inside: never a link (`check_no_links`)."""
_NO_FOLLOW = os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _input_of(manifest_path: Path) -> str | None:
    """The input folder a (possibly damaged) manifest names, if its text still shows it."""
    try:
        found = re.search(r'"input":\s*"((?:[^"\\]|\\.)*)"', manifest_path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None
    return json.loads(f'"{found.group(1)}"') if found else None


def workspace_holding(path: Path) -> Path | None:
    """The workspace folder `path` lies in (itself or a folder above it, by its manifest or CURRENT
    beside its stages or generations), or None: no command writes its output into a workspace,
    where an index run would clean it away or, inside a build, break what queries read."""
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        if ((folder / "manifest.json").is_file() or (folder / CURRENT_FILE).is_file()) and \
                ((folder / "stages").is_dir() or (folder / GENERATIONS_DIR).is_dir()):
            return folder
    return None


def refuse_output_inside(path: Path, option: str = "--out") -> None:
    """InputError (exit 2, one line) when `path` lies in a workspace (`workspace_holding`)."""
    holder = workspace_holding(path)
    if holder is not None:
        raise InputError(f"{option} {path} is inside workspace {holder}: outputs are never written into a "
                         "workspace; choose a folder outside it")


class Workspace:
    """A workspace folder. Opening one never writes to it; `create`, `lock` and indexing do."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._cache: Cache | None = None

    # names ---------------------------------------------------------------
    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def stages_dir(self) -> Path:
        return self.root / "stages"

    @property
    def spill_dir(self) -> Path:
        """Where a stage's arrays go past its memory budget (spill.py): emptied by each stage that
        spills, and at its end."""
        return self.stages_dir / ".spill"

    @property
    def log_path(self) -> Path:
        return self.root / LOG_FILE

    @property
    def evaluation_dir(self) -> Path:
        """What `ablate` builds beyond the graph for the seed systems (evaluate/hierarchy.py)."""
        return self.root / "evaluation"

    @property
    def cache_path(self) -> Path:
        return self.root / CACHE_FILE

    @property
    def lock_path(self) -> Path:
        return self.root / LOCK_FILE

    def stage_path(self, stage: str, name: str) -> Path:
        return self.stages_dir / f"{stage}.{name}"

    def generation_dir(self, name: str) -> Path:
        return self.root / GENERATIONS_DIR / name

    # lifecycle -------------------------------------------------------------
    def check_usable(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise WorkspaceError(f"workspace path {self.root} exists and is not a folder")

    def create(self) -> None:
        self.check_usable()
        self.check_no_links()
        try:
            self.stages_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WorkspaceError(f"cannot create workspace {self.root}: {err.strerror}") from err
        if not os.access(self.root, os.W_OK):
            raise WorkspaceError(f"workspace {self.root} is not writable")

    def check_no_links(self) -> None:
        """WorkspaceError (one line, naming the link and its removal) when a file or folder a run
        writes in place is a symbolic link: the lock, the log, the cache and its journals, the stages,
        generations and evaluation folders. A run never writes, truncates or deletes through a link
        (files written by rename replace a link there, not what it leads to)."""
        for name in WRITTEN_IN_PLACE:
            path = self.root / name
            if path.is_symlink():
                raise WorkspaceError(f"{path} is a symbolic link (to {os.readlink(path)}): a workspace's files are never "
                                     f"written through links; remove it (rm {path}) and run the command again")

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    def check_folder(self) -> None:
        """WorkspaceError unless the workspace path is an existing folder."""
        if not self.root.is_dir():
            raise WorkspaceError(f"workspace not found: {self.root}" if not self.root.exists()
                                 else f"{self.root} is a file, not a workspace folder")

    def check_indexed(self) -> None:
        """WorkspaceError unless the path is a folder that an `index` run has made a workspace."""
        self.check_folder()
        if not self.exists():
            if (self.root / CURRENT_FILE).is_file() or self.stages_dir.is_dir():  # a workspace that lost it
                raise damaged(self.manifest_path, self.root, "missing",
                              f"`noderag index {self.root} --input FOLDER` rebuilds it (finished work is reused from "
                              "the cache)")
            raise WorkspaceError(f"{self.root} is not a noderag workspace (no manifest.json)")

    def indexing_pid(self) -> int | None:
        """The pid of the `index` run holding the lock at this moment (0 when it wrote none yet), or
        None when no run holds it; asked without writing anything."""
        try:
            fd = os.open(self.lock_path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(holder) if holder.isdigit() else 0
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive for one indexing run. flock dies with its process, so a crash never leaves it stuck."""
        self.create()
        try:
            handle = os.fdopen(os.open(self.lock_path, os.O_RDWR | os.O_CREAT | _NO_FOLLOW, 0o644), "r+")
        except OSError as err:
            raise WorkspaceError(f"cannot lock workspace {self.root}: {err.strerror}") from err
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            handle.seek(0)
            holder = handle.read().strip()
            handle.close()
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise WorkspaceError(
                f"workspace {self.root} is being indexed by another run{who}; wait for it to finish"
            ) from err
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(str(os.getpid()))
            handle.flush()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()

    # manifest ----------------------------------------------------------------
    def read_manifest(self) -> dict:
        """The workspace's manifest (what each stage did, with its outputs' checksums), checked against
        the checksum it carries of itself. A damaged one names the command that rebuilds it."""
        problem, manifest = self.manifest_damage()
        if problem:
            raise damaged(self.manifest_path, self.root, problem,
                          f"`noderag index {self.root} --input {_input_of(self.manifest_path) or 'FOLDER'}` rebuilds it "
                          "(finished work is reused from the cache)")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise WorkspaceError(
                f"workspace {self.root} has format version {manifest.get('format_version')}, this noderag reads {FORMAT_VERSION}"
            )
        return manifest

    def manifest_damage(self) -> tuple[str | None, dict]:
        """(what is wrong with the manifest or None, the manifest as read): a manifest that is no
        JSON, or whose checksum of itself does not match (one flipped bit in a digest reads fine)."""
        if not self.manifest_path.is_file():
            return None, {"format_version": FORMAT_VERSION, "stages": {}}
        try:
            manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as err:
            return f"unreadable: {str(err).splitlines()[0][:120]}", {}
        if not isinstance(manifest, dict):
            return "not a manifest", {}
        recorded = manifest.pop("checksum", None)
        if recorded is not None and recorded != json_digest(manifest):
            return "its checksum of itself differs", {}
        return None, manifest

    def set_aside_manifest(self) -> Path | None:
        """A damaged manifest moved aside (manifest.json.damaged-<time>), so `index` starts afresh:
        every stage runs again, its work taken from the cache. Returns where it went, or None."""
        problem, _ = self.manifest_damage()
        if problem is None:
            return None
        aside = self.manifest_path.with_name(f"manifest.json.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        os.replace(self.manifest_path, aside)
        return aside

    def write_manifest(self, manifest: dict) -> None:
        body = {k: v for k, v in manifest.items() if k != "checksum"}
        atomic_write_bytes(self.manifest_path,
                           json.dumps({**body, "checksum": json_digest(body)}, indent=2, sort_keys=True).encode())

    # stage tables ----------------------------------------------------------------
    def read_table(self, path: Path, columns: list[str] | None = None) -> pa.Table:
        if not path.is_file():
            raise WorkspaceError(f"workspace {self.root} is missing {path.relative_to(self.root)}; run `noderag index` again")
        try:
            return pq.read_table(path, columns=columns)
        except (OSError, pa.ArrowException) as err:
            raise damaged(path, self.root, f"unreadable: {str(err).splitlines()[0][:120]}",
                          repair_hint(self.root, self.read_manifest().get("input"))) from None

    # generations -------------------------------------------------------------
    def _read_current(self) -> tuple[str | None, str | None]:
        """(the generation CURRENT names, why it names none): (None, None) when there is no CURRENT.
        A generation found without its manifest is looked up again while CURRENT names another
        meanwhile: a run published a newer build and removed that one between the two reads."""
        path = self.root / CURRENT_FILE
        for _ in range(100):
            try:
                name = path.read_text(encoding="ascii").strip()
            except FileNotFoundError:
                return None, None
            except (OSError, UnicodeDecodeError):
                return None, "unreadable"
            if not name or not name.isalnum():
                return None, "it names no generation"
            if (self.generation_dir(name) / "manifest.json").is_file():
                return name, None
            try:
                if path.read_text(encoding="ascii").strip() != name:
                    continue
            except (OSError, UnicodeDecodeError):
                pass
            break
        return None, f"it names {name}, whose manifest is missing"  # named by `_no_generation`

    def current_name(self) -> str | None:
        """The generation CURRENT names, or None when there is none (or CURRENT is unreadable)."""
        return self._read_current()[0]

    def new_generation(self) -> GenerationWriter:
        folder = self.root / GENERATIONS_DIR
        taken = [int(p.name[1:]) for p in folder.glob("g*") if p.name[1:].isdigit()] if folder.is_dir() else []
        name = f"g{max(taken, default=0) + 1:06d}"
        return GenerationWriter(self.generation_dir(name), name)

    def publish(self, name: str) -> None:
        """Make generation `name` current: one atomic rename, then the folder is synced."""
        atomic_write_bytes(self.root / CURRENT_FILE, f"{name}\n".encode())
        fsync_dir(self.root)

    def remove_unused_generations(self) -> list[str]:
        """Remove every generation but the current one that no reader holds; returns the names
        removed. A held one stays until a later run; a link in generations/ is removed itself, never
        followed. Caller holds the workspace lock."""
        folder = self.root / GENERATIONS_DIR
        if not folder.is_dir():
            return []
        current, removed = self.current_name(), []
        for path in sorted(folder.iterdir()):
            if path.name == current:
                continue
            if path.is_symlink():  # not a build of this workspace: the link goes, never what it leads to
                path.unlink()
                removed.append(path.name)
                continue
            if not path.is_dir():
                continue
            try:
                fd = os.open(path / READERS_FILE, os.O_RDONLY)
            except FileNotFoundError:
                fd = None
            try:
                if fd is not None:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with contextlib.suppress(FileNotFoundError):
                    (path / "manifest.json").unlink()  # a late reader sees it gone, and re-resolves
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path.name)
            except OSError as err:
                if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
            finally:
                if fd is not None:
                    os.close(fd)
        return removed

    def remove_legacy_final(self) -> None:
        """The top-level final tables of the layout from before generations, once a generation
        holds the build (a reader that has them open keeps reading them)."""
        for name in LEGACY_FINAL:
            with contextlib.suppress(FileNotFoundError):
                (self.root / name).unlink()

    def has_legacy_build(self) -> bool:
        manifest = self.read_manifest() if self.exists() else {}
        return (manifest.get("stages", {}).get("similarity", {}).get("state") == "done"
                and all((self.root / n).is_file() for n in LEGACY_FINAL[:4]))

    def open_generation(self) -> Generation:
        """The current build, held against removal until `close`. Never writes: a read-only
        workspace opens the same way. Raises WorkspaceError (one line) when there is no
        complete build, or when a file of it is missing or has the wrong size."""
        self.check_folder()
        for _ in range(200):  # a generation removed between reading CURRENT and locking it: resolve again
            name = self.current_name()
            if name is None:
                return self._no_generation()
            folder = self.generation_dir(name)
            try:
                fd = os.open(folder / READERS_FILE, os.O_RDONLY)
            except FileNotFoundError:
                if self.current_name() != name or not (folder / "manifest.json").is_file():
                    time.sleep(0.01)  # replaced meanwhile, and being removed: resolve CURRENT again
                    continue
                fd = self._recreate_readers(folder)  # the current build is never removed: the file was lost
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError as err:
                os.close(fd)
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):  # being removed right now
                    time.sleep(0.01)
                    continue
                fd = None  # a file system without flock: read without the hold
            try:
                manifest = json.loads((folder / "manifest.json").read_text(encoding="utf-8"))
            except FileNotFoundError:
                if fd is not None:
                    os.close(fd)
                time.sleep(0.01)
                continue
            except (OSError, ValueError) as err:
                if fd is not None:
                    os.close(fd)
                raise damaged(folder / "manifest.json", self.root, f"unreadable: {err}",
                              repair_hint(self.root, self._input())) from None
            recorded = manifest.pop("checksum", None) if isinstance(manifest, dict) else None
            if not isinstance(manifest, dict) or (recorded is not None and recorded != json_digest(manifest)):
                if fd is not None:
                    os.close(fd)
                raise damaged(folder / "manifest.json", self.root, "its checksum of itself differs",
                              repair_hint(self.root, self._input()))
            if manifest.get("format") != GENERATION_VERSION:
                if fd is not None:
                    os.close(fd)
                raise damaged(folder / "manifest.json", self.root, f"a build of format {manifest.get('format')}, "
                              f"this noderag reads {GENERATION_VERSION}", repair_hint(self.root, self._input()))
            manifest.setdefault("input", self._input())
            generation = Generation(self.root, name, folder, manifest, fd)
            try:
                generation.check_sizes()
            except WorkspaceError:
                generation.close()
                raise
            return generation
        raise WorkspaceError(f"workspace {self.root}: could not hold its current build; try again")

    def _recreate_readers(self, folder: Path) -> int:
        """A current build's lost `.readers` (the file readers hold it by), made again by this
        reader; DamagedError naming it when the workspace cannot be written."""
        try:
            return os.open(folder / READERS_FILE, os.O_RDONLY | os.O_CREAT, 0o644)
        except OSError as err:
            raise damaged(folder / READERS_FILE, self.root, f"missing, and cannot be made again here "
                          f"({err.strerror or err})", repair_hint(self.root, self._input())) from None

    def _built_before(self) -> str | None:
        """The newest complete build left in generations/ when CURRENT is missing: a run that made it
        had finished (its manifest says so), so CURRENT was lost, not never written."""
        try:
            done = self.read_manifest().get("stages", {}).get("assemble", {}).get("state") == "done"
        except WorkspaceError:
            return None
        folder = self.root / GENERATIONS_DIR
        names = sorted(p.name for p in folder.glob("g*") if (p / "manifest.json").is_file()) if folder.is_dir() else []
        return names[-1] if done and names else None

    def _input(self) -> str | None:
        try:
            return self.read_manifest().get("input")
        except WorkspaceError:
            return None

    def _no_generation(self) -> Generation:
        _, problem = self._read_current()
        if problem:
            named = self.root / CURRENT_FILE
            written = named.read_text(encoding="ascii", errors="replace").strip() if named.is_file() else ""
            if written.isalnum() and self.generation_dir(written).is_dir():  # the build is there, its manifest not
                named, problem = self.generation_dir(written) / "manifest.json", "missing"
            raise damaged(named, self.root, problem, repair_hint(self.root, self._input()))
        if self.has_legacy_build():
            raise WorkspaceError(f"workspace {self.root} holds a build of the layout from before generations; "
                                 f"`noderag index {self.root} --input {self._input() or 'FOLDER'}` moves it to this "
                                 "layout (no stage work is redone)")
        if not self.exists():
            raise NoBuildError(f"{self.root} is not a noderag workspace; run `noderag index {self.root} --input FOLDER` "
                               "to build one")
        built = self._built_before()
        if built:
            raise damaged(self.root / CURRENT_FILE, self.root, f"missing, though build {built} was made",
                          repair_hint(self.root, self._input()))
        pid = self.indexing_pid()
        if pid is not None:
            raise NoBuildError(f"workspace {self.root} is being indexed for the first time"
                               + (f" (pid {pid})" if pid else "") + "; it can be queried as soon as that run finishes")
        raise NoBuildError(f"indexing of {self.root} did not finish; run `noderag index {self.root} --input "
                           f"{self._input() or 'FOLDER'}` to complete it")

    # cache -----------------------------------------------------------------
    @property
    def cache(self) -> Cache:
        """The read-write cache, for indexing (creates the workspace)."""
        if self._cache is None or self._cache.read_only:
            self.close()
            self.create()
            self._cache = Cache(self.cache_path)
        return self._cache

    def read_only_cache(self) -> Cache | None:
        """The cache for commands that never write (query, stats, dry-run); None when absent."""
        if self._cache is not None:
            return self._cache
        if not self.cache_path.is_file():
            return None
        try:
            self._cache = Cache(self.cache_path, read_only=True)
        except sqlite3.DatabaseError:
            return None
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # log -------------------------------------------------------------------
    def logger(self) -> logging.Logger:
        log = logging.getLogger(f"noderag.{self.root.resolve()}")
        if not log.handlers:
            self.check_no_links()
            handler = _NoFollowFileHandler(self.log_path, encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        return log


class _NoFollowFileHandler(logging.FileHandler):
    """The log opened for appending without following a link put in its place."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NO_FOLLOW, 0o644)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)
