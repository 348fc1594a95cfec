"""A workspace's recorded state, typed, and what is read from it: the manifest (`Manifest`, a
`StageEntry` per stage of stages.STAGES), loaded and saved here and nowhere else; the documents
of the last build against the folder now (`indexed_state`, `compare_documents`); each document's
status, the items that failed, the chunks already decomposed; and the cache entries the finished
stages need (what `gc` keeps)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..cache import DECOMPOSE, LLM, Cache
from ..config import Config
from ..engines.identity import identity
from ..workspace import CACHE_KEYS, FORMAT_VERSION, Workspace
from . import assemble
from .decompose import cache_keys, input_key, input_name
from .outputs import CHUNKS, DECOMPOSE_FAILURES, DOCUMENTS, FAILURES, OCCURRENCES
from .stages import STAGES

RUNNING, DONE = "running", "done"
_ENTRY_FIELDS = ("state", "fingerprint", "settings", "outputs", "files", "seconds", "llm", "last_files")


@dataclass
class StageEntry:
    """What the manifest records of a stage's last run: `running` from its start, `done` once its
    outputs are committed (with their combined digest, each file's checksum, its time and LLM usage);
    `details` holds the counts its function reported (nodes, edges, failures, ...)."""

    state: str
    fingerprint: str = ""
    settings: str = ""
    outputs: str | None = None
    files: dict[str, str] | None = None  # None: recorded before per-file checksums were
    seconds: float = 0.0
    llm: dict = field(default_factory=dict)
    details: dict = field(default_factory=dict)
    # while running: the checksums the last committed run recorded (`committed_files`), so that a
    # run killed midway leaves the next one the earlier outputs it may still reuse
    last_files: dict[str, str] | None = None

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def committed_files(self) -> dict[str, str]:
        """The checksums of the outputs of the stage's last committed run: those it recorded when
        done, those kept from before when running (a stage only reuses a file that matches them)."""
        return (self.files if self.done else self.last_files) or {}

    @property
    def failures(self) -> int:
        return int(self.details.get("failures") or 0)

    @classmethod
    def from_json(cls, data: dict) -> StageEntry:
        return cls(**{k: data[k] for k in _ENTRY_FIELDS if k in data},
                   details={k: v for k, v in data.items() if k not in _ENTRY_FIELDS})

    def to_json(self) -> dict:
        """The manifest's JSON of it (and `stats`'s): the counts beside the fields, as recorded."""
        data = {"state": self.state, "fingerprint": self.fingerprint, "settings": self.settings}
        if self.done:
            data |= {"outputs": self.outputs, "files": self.files, "seconds": self.seconds, "llm": self.llm}
        elif self.last_files:
            data["last_files"] = self.last_files
        return data | self.details


@dataclass
class Manifest:
    """The workspace's manifest.json: per stage its last run, the embedding model of its vectors,
    the input folder it was indexed from. (The file's format and checksum: `Workspace.read_manifest`.)"""

    stages: dict[str, StageEntry] = field(default_factory=dict)
    embedding: dict = field(default_factory=dict)  # model, dim, vectors (what decides a vector's bits)
    input: str | None = None
    cache: dict = field(default_factory=dict)  # what the cache held when the last run or gc left it (`cache_loss`)
    rebuild_pending: bool = False  # an `index --rebuild` that has not finished: the next run finishes it
    extra: dict = field(default_factory=dict)  # keys another version wrote, kept as they are

    @classmethod
    def load(cls, ws: Workspace) -> Manifest:
        data = ws.read_manifest()
        known = ("format_version", "stages", "embedding", "input", "cache", "rebuild_pending")
        return cls({name: StageEntry.from_json(entry) for name, entry in data.get("stages", {}).items()},
                   data.get("embedding") or {}, data.get("input"), data.get("cache") or {},
                   data.get("rebuild_pending") is True, {k: v for k, v in data.items() if k not in known})

    def save(self, ws: Workspace) -> None:
        data = {**self.extra, "format_version": FORMAT_VERSION,
                "stages": {name: entry.to_json() for name, entry in self.stages.items()}}
        if self.embedding:
            data["embedding"] = self.embedding
        if self.input is not None:
            data["input"] = self.input
        if self.cache:
            data["cache"] = self.cache
        if self.rebuild_pending:
            data["rebuild_pending"] = True
        ws.write_manifest(data)

    def record_cache(self, cache: Cache) -> None:
        """What the cache holds now, as the run or gc that wrote it leaves it: only an outside hand
        makes it hold less before the next one (`cache_loss`)."""
        counts = cache.counts()
        self.cache = {"entries": sum(counts.values()), "paid_replies": counts.get(LLM, 0)}

    def entry(self, stage: str) -> StageEntry | None:
        return self.stages.get(stage)

    def done(self, stage: str) -> bool:
        entry = self.stages.get(stage)
        return entry is not None and entry.done


def compare_documents(before: dict[str, str], now: dict[str, str]) -> dict[str, list[str]]:
    """Paths by change between two {path: content hash} maps; a rename is a path that vanished
    while a new path appeared with the same content (matched one to one, in path order)."""
    gone = sorted(p for p in before if p not in now)
    added = sorted(p for p in now if p not in before)
    gone_by_hash: dict[str, list[str]] = {}
    for path in gone:
        gone_by_hash.setdefault(before[path], []).append(path)
    renamed, new = [], []
    for path in added:
        candidates = gone_by_hash.get(now[path])
        if candidates:
            renamed.append(f"{candidates.pop(0)} -> {path}")
        else:
            new.append(path)
    deleted = sorted(p for paths in gone_by_hash.values() for p in paths)
    changed = sorted(p for p in now if p in before and before[p] != now[p])
    unchanged = sorted(p for p in now if p in before and before[p] == now[p])
    return {"new": new, "changed": changed, "renamed": renamed, "deleted": deleted, "unchanged": unchanged}


def indexed_state(ws: Workspace) -> dict[str, str]:
    """{path: content hash} of the documents in the last complete build (empty when none): those
    indexed, and those kept at their last content while they could not be read."""
    table = assemble.built_documents(ws, ["path", "content_hash", "status", "chunks"])
    if table is None:
        return {}
    chunks = table["chunks"].to_pylist() if "chunks" in table.column_names else [0] * table.num_rows
    return {p: h for p, h, s, n in zip(table["path"].to_pylist(), table["content_hash"].to_pylist(),
                                       table["status"].to_pylist(), chunks, strict=True)
            if s == "indexed" or (s == "failed" and n)}


def decomposed(ws: Workspace, cache: Cache | None, config: Config, chunks: list[tuple[str, str, str]]) -> set[int]:
    """Positions of the (chunk id, title, text) chunks already decomposed: in the cache, or in the
    rows the decompose stage keeps (where a pure engine's work is, once committed)."""
    if not chunks:
        return set()
    keys = cache_keys(identity(config.llm), ((title, text) for _, title, text in chunks))
    found = cache.get_many(DECOMPOSE, keys) if cache is not None else {}
    rows = OCCURRENCES.path(ws)
    kept: set[str] = set()
    if rows.is_file() and len(found) < len(keys):
        with contextlib.suppress(OSError, pa.ArrowException):
            kept = set(pc.unique(pq.read_table(rows, columns=["input"])["input"]).to_pylist())
    return {i for i, (key, (chunk, _, _)) in enumerate(zip(keys, chunks, strict=True))
            if key in found or input_name(chunk, key) in kept}


def documents_status(ws: Workspace, config: Config) -> list[dict]:
    """Every document of the latest scan (and every one still in the graph) with its status:

    - indexed: in the last complete build, with this content;
    - pending: new, changed, renamed or removed since the last complete build; the next
      `noderag index` finishes it (`chunks_done` of `chunks` are already decomposed);
    - failed: a chunk's decomposition failed (reason given); the next run retries it;
    - skipped: unreadable, empty, binary... (reason given).

    `config`: the workspace's (its engine decides which chunks are already decomposed)."""
    latest = DOCUMENTS.path(ws)
    if not latest.is_file():
        return []
    documents = ws.read_table(latest).to_pylist()
    indexed = indexed_state(ws)
    changes = compare_documents(indexed, {r["path"]: r["content_hash"] for r in documents
                                          if r["status"] == "indexed" or (r["status"] == "failed" and r["chunks"])})
    why = {p: "new" for p in changes["new"]} | {p: "changed" for p in changes["changed"]}
    why |= {pair.split(" -> ")[1]: f"renamed from {pair.split(' -> ')[0]}" for pair in changes["renamed"]}
    failed_chunks: dict[str, str] = {}
    failures_path = DECOMPOSE_FAILURES.path(ws)
    if failures_path.is_file():
        failures = [row for row in _failure_rows(ws, failures_path) if not row["final"]]
        failed_chunks = {row["item"]: row["reason"] for row in failures}
    chunks_of: dict[str, list[tuple[str, str, str]]] = {}
    chunks_path = CHUNKS.path(ws)
    if chunks_path.is_file():
        chunks = ws.read_table(chunks_path, ["chunk_id", "doc_id", "title", "text"])
        for row in zip(*(chunks[c].to_pylist() for c in ("chunk_id", "doc_id", "title", "text")), strict=True):
            chunks_of.setdefault(row[1], []).append((row[0], row[2], row[3]))
    pending = [r for r in documents if r["status"] == "indexed" and r["path"] in why]
    if pending:
        flat = [(r["doc_id"], chunk, title, text) for r in pending for chunk, title, text in chunks_of.get(r["doc_id"], [])]
        done = decomposed(ws, ws.read_only_cache(), config, [(chunk, title, text) for _, chunk, title, text in flat])
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


def _failure_rows(ws: Workspace, path) -> list[dict]:
    """A failures table's rows (stage, item, reason, final); a table from before `final` existed
    holds retryable failures only."""
    table = ws.read_table(path)
    rows = table.select([c for c in ("stage", "item", "reason", "final") if c in table.column_names]).to_pylist()
    return [{"final": False, **row} for row in rows]


def failed_items(ws: Workspace) -> list[dict]:
    """Items that failed, with the reason and whether a rerun retries them (`final`: never): those of
    the stages after decomposition (an entity's attribute, a community's elements), which belong to
    no one document, so the document list cannot show them, and decomposition's final ones."""
    rows = []
    for output in (o for stage in STAGES for o in stage.outputs if o.file == FAILURES):
        path = output.path(ws)
        if path.is_file():
            rows += [row for row in _failure_rows(ws, path) if output != DECOMPOSE_FAILURES or row["final"]]
    return rows


def live_cache_keys(ws: Workspace, manifest: Manifest) -> tuple[list[tuple[str, str]] | None, str | None]:
    """(ns, key) of every cache entry a stage needs, or (None, why that is not known)."""
    live: set[tuple[str, str]] = set()
    for stage in STAGES:
        if not manifest.done(stage.name):
            continue
        path = ws.stage_path(stage.name, CACHE_KEYS)
        if not path.is_file():
            return None, (f"stage {stage.name} last ran before noderag recorded what it needs from the cache; "
                          f"run `noderag index {ws.root} --input FOLDER` after a change, or remove the cache")
        table = pq.read_table(path)
        live.update(zip(table["ns"].to_pylist(), table["key"].to_pylist(), strict=True))
    occurrences = OCCURRENCES.path(ws)
    if occurrences.is_file():
        names = pc.unique(pq.read_table(occurrences, columns=["input"])["input"]).to_pylist()
        live.update((DECOMPOSE, input_key(name)) for name in names)
    return sorted(live), None


def cache_loss(ws: Workspace, manifest: Manifest) -> tuple[str, int] | None:
    """(the message, the paid LLM replies lost) when the cache lost what the last run or gc left in
    it (`Manifest.record_cache`): every entry, or paid replies (which no run removes); emptied,
    truncated or replaced since. None when not. The message names the file and what it held."""
    recorded = manifest.cache
    if not recorded.get("entries"):
        return None
    cache = ws.read_only_cache()
    counts = cache.counts() if cache is not None else {}
    entries, paid = sum(counts.values()), counts.get(LLM, 0)
    if paid >= recorded.get("paid_replies", 0) and entries:  # a run drops entries of its own (checkpoints), never all
        return None
    lost_paid = max(recorded.get("paid_replies", 0) - paid, 0)
    held = f"{recorded['entries']:,} entries" + (f" ({recorded['paid_replies']:,} of them paid LLM replies)"
                                                  if recorded.get("paid_replies") else "")
    return (f"workspace file {ws.cache_path} holds {entries:,} entries where the last run left {held}: it was emptied "
            "or replaced since", lost_paid)
