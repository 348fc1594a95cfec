"""The workspace folder: paths, manifest, lock, atomic table I/O and the call cache.

Layout (every file written atomically: temporary file, fsync, rename):

    config.yaml        effective config (env var names only, never secrets)
    manifest.json      embedding model and dim; input folder; per stage: state (running|done),
                       fingerprint (settings + upstream output digests), settings digest, outputs
                       digest, seconds, LLM usage, vectors computed, stage counts
    documents.parquet  one row per input file of the latest scan (see `index.chunk.DOCUMENT_SCHEMA`)
    nodes.parquet      the heterograph's nodes (see `graph.NODE_SCHEMA`)
    edges.parquet      its edges (see `graph.EDGE_SCHEMA`)
    vectors.faiss      HNSW index; row i is the node whose `vector_row` is i
    stages/            each stage's committed outputs; `similarity.documents.parquet` is the
                       documents table the final tables were built from (the last complete build)
    cache.sqlite       content-addressed cache: chunking per document content ("chunks"),
                       decomposition per chunk ("decompose"), token counts ("tokens"), vectors
                       ("embedding"), LLM calls ("llm"); entries are never stale, only unused
    noderag.log        what each run did
    .lock              held (flock) by the one `index` run allowed at a time; the kernel
                       releases it when the process dies, however it dies

A stage is marked done in the manifest only after all its outputs are written, so a
killed run leaves at most a stage marked running, which the next run re-runs. The final
tables (nodes, edges, vectors) are replaced only by the last stage, so queries keep
seeing the previous complete build while an update runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

FORMAT_VERSION = 1


class WorkspaceError(RuntimeError):
    """A workspace that cannot be used as asked (locked, not indexed, wrong model...)."""


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


FEW_VALUES = frozenset({"type", "kind", "status", "stage", "reason"})
"""Columns dictionary-encoded in parquet: a handful of distinct values. For ids and texts the
encoder's attempt only costs time (writing the neighbour lists took twice as long with it)."""


def write_parquet(path: Path, table: pa.Table) -> None:
    """Deterministic bytes for the same table: no statistics timestamps, fixed compression."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd", write_statistics=False, store_schema=True,
                   use_dictionary=[name for name in table.column_names if name in FEW_VALUES])
    atomic_write_bytes(path, sink.getvalue().to_pybytes())


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def json_digest(obj) -> str:
    return hashlib.blake2b(json.dumps(obj, sort_keys=True).encode(), digest_size=16).hexdigest()


class Cache:
    """Content-addressed key/value store in SQLite, one table, namespaced keys.

    Written as results arrive (each `put_many` commits), so a killed run re-pays nothing.
    """

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("CREATE TABLE IF NOT EXISTS kv (ns TEXT, key TEXT, value BLOB, PRIMARY KEY (ns, key))")

    def get_many(self, ns: str, keys: Iterable[str]) -> dict[str, bytes]:
        keys = list(dict.fromkeys(keys))
        found: dict[str, bytes] = {}
        with self._lock:
            for start in range(0, len(keys), 900):
                part = keys[start : start + 900]
                marks = ",".join("?" * len(part))
                rows = self._db.execute(f"SELECT key, value FROM kv WHERE ns=? AND key IN ({marks})", [ns, *part])
                found.update(rows.fetchall())
        return found

    def get(self, ns: str, key: str) -> bytes | None:
        return self.get_many(ns, [key]).get(key)

    def put_many(self, ns: str, items: Iterable[tuple[str, bytes]]) -> None:
        rows = [(ns, key, value) for key, value in items]
        if not rows:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")

    def put(self, ns: str, key: str, value: bytes) -> None:
        self.put_many(ns, [(key, value)])

    def count(self, ns: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM kv WHERE ns=?", [ns]).fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()


class Workspace:
    """A workspace folder. Opening one never writes to it; `create` and `lock` do."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._cache: Cache | None = None

    # paths ---------------------------------------------------------------
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
    def log_path(self) -> Path:
        return self.root / "noderag.log"

    def path(self, name: str) -> Path:
        return self.root / name

    def stage_path(self, stage: str, name: str) -> Path:
        return self.stages_dir / f"{stage}.{name}"

    # lifecycle -------------------------------------------------------------
    def check_usable(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise WorkspaceError(f"workspace path {self.root} exists and is not a folder")

    def create(self) -> None:
        self.check_usable()
        try:
            self.stages_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise WorkspaceError(f"cannot create workspace {self.root}: {err.strerror}") from err
        if not os.access(self.root, os.W_OK):
            raise WorkspaceError(f"workspace {self.root} is not writable")

    def exists(self) -> bool:
        return self.manifest_path.is_file()

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Exclusive for one indexing run. flock dies with its process, so a crash never leaves it stuck."""
        self.create()
        try:
            handle = open(self.root / ".lock", "a+")
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
        if not self.manifest_path.is_file():
            return {"format_version": FORMAT_VERSION, "stages": {}}
        try:
            manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise WorkspaceError(
                f"workspace manifest {self.manifest_path} is corrupt ({err}); remove it and run `noderag index` "
                "to rebuild the tables (cached work is reused)"
            ) from err
        if manifest.get("format_version") != FORMAT_VERSION:
            raise WorkspaceError(
                f"workspace {self.root} has format version {manifest.get('format_version')}, this noderag reads {FORMAT_VERSION}"
            )
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        atomic_write_bytes(self.manifest_path, json.dumps(manifest, indent=2, sort_keys=True).encode())

    # tables ----------------------------------------------------------------
    def write_table(self, path: Path, table: pa.Table) -> None:
        write_parquet(path, table)

    def read_table(self, path: Path, columns: list[str] | None = None) -> pa.Table:
        if not path.is_file():
            raise WorkspaceError(f"workspace {self.root} is missing {path.relative_to(self.root)}; run `noderag index` again")
        return pq.read_table(path, columns=columns)

    # cache -----------------------------------------------------------------
    @property
    def cache(self) -> Cache:
        if self._cache is None:
            self.create()
            self._cache = Cache(self.root / "cache.sqlite")
        return self._cache

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
            self._cache = None

    # log -------------------------------------------------------------------
    def logger(self) -> logging.Logger:
        log = logging.getLogger(f"noderag.{self.root.resolve()}")
        if not log.handlers:
            handler = logging.FileHandler(self.log_path, encoding="utf-8")
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        return log
