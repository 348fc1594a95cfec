"""The Python API: what the CLI, scripts and tests call.

    from noderag_cli import api
    result = api.index("ws", "docs/")
    hits = api.query("ws", "Who founded the Korven Institute?")
"""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.compute as pc
import yaml

from .config import Config, SearchConfig, load_config
from .embeddings import Embedder
from .engines.base import Engine
from .engines.offline import OfflineEngine
from .evaluate.datasets import Question, QuestionFileError, read_jsonl
from .graph import NODE_TYPES
from .index.chunk import check_input_folder, document_chunks, scan
from .index.decompose import cache_key
from .index.pipeline import (
    STAGES,
    IndexResult,
    Reporter,
    compare_documents,
    engine_settings,
    indexed_state,
    run_pipeline,
    settings_digest,
)
from .workspace import Workspace, WorkspaceError

if TYPE_CHECKING:  # the search imports scipy (0.3 s), which indexing does not need
    from .search.retriever import Retrieval, Retriever


def workspace_config(ws: Workspace, config_path: Path | None = None, overrides: dict | None = None) -> Config:
    """The config a command runs with: the file given, else the workspace's own snapshot, else defaults."""
    if config_path is None and ws.config_path.is_file():
        config_path = ws.config_path
    return load_config(config_path, overrides)


def make_engine(config: Config, ws: Workspace, embedder: Embedder) -> Engine:
    if config.llm.engine == "litellm":
        from .engines.llm import LiteLLMEngine

        return LiteLLMEngine(config.llm, ws.cache)
    return OfflineEngine(embedder, ws.cache)


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR}


def index(
    workspace: str | Path, input_folder: str | Path, config: Config | None = None, config_path: Path | None = None,
    reporter: Reporter | None = None, stop_after: str | None = None,
) -> IndexResult:
    """Index (or update) WORKSPACE from every .txt/.md file under input_folder.

    Raises InputError (bad input folder), ConfigError, WorkspaceError (path is a file, locked,
    other embedding model, cannot be written); nothing is created before the input is checked.
    """
    ws = Workspace(Path(workspace))
    ws.check_usable()
    check_input_folder(Path(input_folder))
    config = config or workspace_config(ws, config_path)
    with ws.lock():
        try:
            embedder = Embedder(config.embedding, ws.cache)
            engine = make_engine(config, ws, embedder)
            if config.llm.engine != "offline":
                engine.check_connection()
            return run_pipeline(ws, Path(input_folder), config, engine, embedder, reporter, stop_after)
        except OSError as err:
            if isinstance(err, ConnectionError) or err.errno not in _DISK_ERRORS:
                raise
            where = f" ({err.filename})" if err.filename else ""
            raise WorkspaceError(f"cannot write workspace {ws.root}: {err.strerror or err}{where}") from err
        except sqlite3.DatabaseError as err:
            raise WorkspaceError(f"workspace cache {ws.root / 'cache.sqlite'} is unusable: {err}") from err
        finally:
            ws.close()


class Session:
    """An opened workspace for many questions: everything is loaded once."""

    def __init__(self, retriever: Retriever):
        self.retriever = retriever

    def retrieve(self, question: str, params: SearchConfig | None = None) -> Retrieval:
        return self.retriever.retrieve(question, params)

    def ask(self, question: str, answer: bool = True, params: SearchConfig | None = None) -> Retrieval:
        result = self.retriever.retrieve(question, params)
        return self.retriever.answer(result) if answer else result


COMPILED_FROM_QUESTIONS = 1000
"""Questions in one process from which the search's compiled kernels pay for their ~0.7 s load
(they save about half a millisecond per question); the CLI opens smaller batches without them."""


def open_workspace(workspace: str | Path, config: Config | None = None, config_path: Path | None = None,
                   overrides: dict | None = None, compiled: bool = True) -> Session:
    """Load a workspace for search. A config file given here that names no embedding section
    searches with the workspace's own embedding model; one that names another model is refused.
    `compiled`: run the walk, the selection and the budget as numba kernels (search/kernels.py),
    for long-lived sessions; the results are the same either way."""
    ws = Workspace(Path(workspace))
    if not ws.root.is_dir():
        raise WorkspaceError(f"workspace not found: {ws.root}")
    own = workspace_config(ws)
    if config is None and config_path is not None:
        config = load_config(config_path, overrides)
        if "embedding" not in (yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}):
            config = config.model_copy(update={"embedding": own.embedding})
    elif config is None:
        config = workspace_config(ws, None, overrides)
    if _model_of(config.embedding) != _model_of(own.embedding):
        raise WorkspaceError(
            f"workspace {ws.root} was indexed with embedding {own.embedding.backend}:{own.embedding.model}; "
            "the config asks for another model"
        )
    from .search.retriever import Retriever

    embedder = Embedder(config.embedding, None)
    engine = make_engine(config, ws, embedder)
    return Session(Retriever(ws, config, engine, embedder, compiled=compiled))


def _model_of(embedding) -> tuple:
    return embedding.backend, embedding.model, embedding.dim


def query(workspace: str | Path, question: str, answer: bool = True, config: Config | None = None) -> Retrieval:
    return open_workspace(workspace, config, compiled=False).ask(question, answer=answer)


def read_questions(path: str | Path) -> tuple[list[Question], list[str]]:
    return read_jsonl(Path(path))


def engine_name(config: Config) -> str:
    """The name an engine for this config will carry (it keys the decomposition cache)."""
    if config.llm.engine == "litellm":
        from .engines.prompts import engine_name as llm_engine_name

        return llm_engine_name(config.llm.model)
    return OfflineEngine.name


def _decomposed(ws: Workspace, config: Config, chunks: list[tuple[str, str]]) -> set[int]:
    """Positions of the (title, text) chunks whose decomposition is already in the cache."""
    if not chunks or not ws.path("cache.sqlite").is_file():
        return set()
    settings = engine_settings(config, engine_name(config))
    keys = [cache_key(settings, title, text) for title, text in chunks]
    found = ws.cache.get_many("decompose", keys)
    return {i for i, key in enumerate(keys) if key in found}


def _documents_status(ws: Workspace) -> list[dict]:
    """Every document of the latest scan (and every one still in the graph) with its status:

    - indexed: in the last complete build, with this content;
    - pending: new, changed, renamed or removed since the last complete build; the next
      `noderag index` finishes it (`chunks_done` of `chunks` are already decomposed);
    - failed: a chunk's decomposition failed (reason given); the next run retries it;
    - skipped: unreadable, empty, binary... (reason given).
    """
    documents = ws.read_table(ws.path("documents.parquet")).to_pylist()
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
        flat = [(r["doc_id"], title, text) for r in pending for _, title, text in chunks_of.get(r["doc_id"], [])]
        done = _decomposed(ws, config, [(title, text) for _, title, text in flat])
        done_by_doc: dict[str, int] = {}
        for position, (doc, _, _) in enumerate(flat):
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


def stats(workspace: str | Path) -> dict:
    """Everything `noderag stats` shows, as plain data."""
    ws = Workspace(Path(workspace))
    if not ws.exists():
        raise WorkspaceError(f"{ws.root} is not a noderag workspace (no manifest.json)")
    manifest = ws.read_manifest()
    recorded = manifest.get("stages", {})
    ordered = {stage: recorded[stage] for stage in STAGES if stage in recorded}
    report: dict = {"workspace": str(ws.root), "input": manifest.get("input"), "stages": ordered,
                    "nodes": {t: 0 for t in NODE_TYPES},
                    "edges": {"by_kind": {}, "non_hnsw": 0, "hnsw": 0, "merged_total": 0},
                    "vectors": {"count": 0, "dim": manifest.get("embedding", {}).get("dim"),
                                "model": manifest.get("embedding", {}).get("model")}}
    if ws.path("nodes.parquet").is_file():
        nodes = ws.read_table(ws.path("nodes.parquet"), ["type", "vector_row"])
        counts = nodes.group_by("type").aggregate([("type", "count")]).to_pylist()
        report["nodes"].update({row["type"]: row["type_count"] for row in counts})
        report["vectors"]["count"] = int(pc.sum(pc.greater_equal(nodes["vector_row"], 0)).as_py() or 0)
    if ws.path("edges.parquet").is_file():
        edges = ws.read_table(ws.path("edges.parquet"), ["kind", "hnsw"])
        kinds = edges.group_by("kind").aggregate([("kind", "count")]).to_pylist()
        report["edges"]["by_kind"] = {row["kind"]: row["kind_count"] for row in sorted(kinds, key=lambda r: r["kind"])}
        report["edges"]["hnsw"] = int(pc.sum(edges["hnsw"]).as_py() or 0)
        report["edges"]["non_hnsw"] = int(pc.sum(pc.not_equal(edges["kind"], "similarity")).as_py() or 0)
        report["edges"]["merged_total"] = edges.num_rows
    documents = _documents_status(ws) if ws.path("documents.parquet").is_file() else []
    by_status: dict[str, int] = {}
    for row in documents:
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
    report["documents"] = {"by_status": by_status, "list": [
        {k: row[k] for k in ("path", "status", "reason", "chunks", "chunks_done", "title")} for row in documents]}
    llm_totals: dict[str, float] = {}
    for info in report["stages"].values():
        for key, value in (info.get("llm") or {}).items():
            llm_totals[key] = llm_totals.get(key, 0) + value
    report["llm"] = llm_totals
    report["files"] = {p.relative_to(ws.root).as_posix(): p.stat().st_size
                       for p in sorted(ws.root.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    return report


def plan(workspace: str | Path, input_folder: str | Path, config_path: Path | None = None) -> dict:
    """What `index` would do, without writing anything: documents new, changed, renamed, deleted and
    unchanged since the last complete build; chunks still to decompose; each stage's fate; and with
    an LLM engine, the estimated calls, tokens and cost."""
    ws = Workspace(Path(workspace))
    ws.check_usable()
    config = workspace_config(ws, config_path) if ws.root.is_dir() else load_config(config_path)
    files = scan(Path(input_folder), config.chunk.extensions, config.chunk.max_file_bytes)
    readable = [f for f in files if not f.reason]
    changes = compare_documents(indexed_state(ws), {f.path: f.content_hash for f in readable})
    counts = {k: len(v) for k, v in changes.items()} | {"skipped": len(files) - len(readable)}
    touched = set(changes["new"]) | set(changes["changed"]) | {p.split(" -> ")[1] for p in changes["renamed"]}
    fresh = [f for f in readable if f.path in touched]
    cache = ws.cache if ws.path("cache.sqlite").is_file() else None
    pieces = document_chunks(fresh, config.chunk.chunk_tokens, config.chunk.overlap_tokens, cache, store=False)
    new_chunks = [(title, text) for title, chunks in pieces for text, _, _ in chunks]
    to_decompose = len(new_chunks) - len(_decomposed(ws, config, new_chunks))
    manifest = ws.read_manifest() if ws.exists() else {"stages": {}}
    name = engine_name(config)
    stages: dict[str, str] = {}
    upstream_runs = False
    for stage in STAGES:
        entry = manifest["stages"].get(stage, {})
        if entry.get("state") != "done":
            action = "run (interrupted before)" if entry.get("state") == "running" else "run"
        elif entry.get("settings") != settings_digest(config, name, stage):
            action = "re-run: its settings changed"
        elif entry.get("failures"):
            action = f"re-run: retry {entry['failures']} failed item(s)"
        elif stage == "chunk" and (counts["new"] or counts["changed"] or counts["renamed"] or counts["deleted"]):
            action = "re-run: documents changed"
        elif upstream_runs:
            action = "re-run if its inputs changed (cached work reused)"
        else:
            action = "skip (unchanged)"
        upstream_runs = upstream_runs or not action.startswith("skip")
        stages[stage] = action
    result = {"workspace": str(ws.root), "input": str(input_folder), "documents": counts,
              "changes": {k: v for k, v in changes.items() if k != "unchanged"},
              "skipped": [{"path": f.path, "reason": f.reason} for f in files if f.reason],
              "chunks": {"in_changed_documents": len(new_chunks), "to_decompose": to_decompose},
              "stages": stages}
    if config.llm.engine != "offline":
        from .estimate import estimate_llm

        result["llm"] = estimate_llm(ws, Path(input_folder), config)
    if cache is not None:
        ws.close()
    return result


__all__ = ["index", "query", "open_workspace", "stats", "plan", "read_questions", "workspace_config", "make_engine",
           "Session", "Workspace", "WorkspaceError", "IndexResult", "QuestionFileError"]
