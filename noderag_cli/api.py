"""The Python API: what the CLI, scripts and tests call.

    from noderag_cli import api
    result = api.index("ws", "docs/")
    hits = api.query("ws", "Who founded the Korven Institute?")
"""

from __future__ import annotations

from pathlib import Path

import pyarrow.compute as pc

from .config import Config, SearchConfig, load_config
from .embeddings import Embedder
from .engines.base import Engine
from .evaluate.datasets import Question, QuestionFileError, read_jsonl
from .graph import NODE_TYPES
from .index.pipeline import STAGES, IndexResult, Reporter, run_pipeline
from .search.retriever import Retrieval, Retriever
from .workspace import Workspace, WorkspaceError


def workspace_config(ws: Workspace, config_path: Path | None = None, overrides: dict | None = None) -> Config:
    """The config a command runs with: the file given, else the workspace's own snapshot, else defaults."""
    if config_path is None and ws.config_path.is_file():
        config_path = ws.config_path
    return load_config(config_path, overrides)


def make_engine(config: Config, ws: Workspace, embedder: Embedder) -> Engine:
    if config.llm.engine == "litellm":
        from .engines.llm import LiteLLMEngine

        return LiteLLMEngine(config.llm, ws.cache)
    from .engines.offline import OfflineEngine

    return OfflineEngine(embedder)


def index(
    workspace: str | Path, input_folder: str | Path, config: Config | None = None, config_path: Path | None = None,
    reporter: Reporter | None = None, stop_after: str | None = None,
) -> IndexResult:
    ws = Workspace(Path(workspace))
    ws.check_usable()
    with ws.lock():
        config = config or workspace_config(ws, config_path)
        embedder = Embedder(config.embedding, ws.cache)
        engine = make_engine(config, ws, embedder)
        if config.llm.engine != "offline":
            engine.check_connection()
        try:
            return run_pipeline(ws, Path(input_folder), config, engine, embedder, reporter, stop_after)
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


def open_workspace(workspace: str | Path, config: Config | None = None, config_path: Path | None = None,
                   overrides: dict | None = None) -> Session:
    """Load a workspace for search. Embedding settings always come from the workspace itself."""
    ws = Workspace(Path(workspace))
    if not ws.root.is_dir():
        raise WorkspaceError(f"workspace not found: {ws.root}")
    own = workspace_config(ws)
    config = config or load_config(config_path, overrides) if (config_path or config) else workspace_config(ws, None, overrides)
    if config.embedding != own.embedding:
        raise WorkspaceError(
            f"workspace {ws.root} was indexed with embedding {own.embedding.backend}:{own.embedding.model}; "
            "the config asks for another model"
        )
    embedder = Embedder(config.embedding, None)
    engine = make_engine(config, ws, embedder)
    return Session(Retriever(ws, config, engine, embedder))


def query(workspace: str | Path, question: str, answer: bool = True, config: Config | None = None) -> Retrieval:
    return open_workspace(workspace, config).ask(question, answer=answer)


def read_questions(path: str | Path) -> tuple[list[Question], list[str]]:
    return read_jsonl(Path(path))


def _documents_status(ws: Workspace) -> list[dict]:
    documents = ws.read_table(ws.path("documents.parquet")).to_pylist()
    failed_chunks: dict[str, str] = {}
    failures_path = ws.stage_path("decompose", "failures.parquet")
    if failures_path.is_file():
        failures = ws.read_table(failures_path)
        failed_chunks = dict(zip(failures["item"].to_pylist(), failures["reason"].to_pylist(), strict=True))
    if failed_chunks:
        chunks = ws.read_table(ws.stage_path("chunk", "chunks.parquet"), ["chunk_id", "doc_id"])
        for chunk, doc in zip(chunks["chunk_id"].to_pylist(), chunks["doc_id"].to_pylist(), strict=True):
            if chunk in failed_chunks:
                for row in documents:
                    if row["doc_id"] == doc:
                        row["status"], row["reason"] = "failed", failed_chunks[chunk]
    manifest = ws.read_manifest()
    if manifest.get("stages", {}).get("similarity", {}).get("state") != "done":
        for row in documents:
            if row["status"] == "indexed":
                row["status"] = "pending"
    return documents


def stats(workspace: str | Path) -> dict:
    """Everything `noderag stats` shows, as plain data."""
    ws = Workspace(Path(workspace))
    if not ws.exists():
        raise WorkspaceError(f"{ws.root} is not a noderag workspace (no manifest.json)")
    manifest = ws.read_manifest()
    report: dict = {"workspace": str(ws.root), "stages": manifest.get("stages", {}),
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
        {k: row[k] for k in ("path", "status", "chunks", "reason", "title")} for row in documents]}
    llm_totals: dict[str, float] = {}
    for info in report["stages"].values():
        for key, value in (info.get("llm") or {}).items():
            llm_totals[key] = llm_totals.get(key, 0) + value
    report["llm"] = llm_totals
    report["files"] = {p.relative_to(ws.root).as_posix(): p.stat().st_size
                       for p in sorted(ws.root.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    return report


def plan(workspace: str | Path, input_folder: str | Path, config_path: Path | None = None) -> dict:
    """What `index` would do, without changing anything: document changes, stages to run, LLM estimate."""
    from .index.chunk import scan

    ws = Workspace(Path(workspace))
    ws.check_usable()
    config = workspace_config(ws, config_path) if ws.root.is_dir() else load_config(config_path)
    files = scan(Path(input_folder), config.chunk.extensions, config.chunk.max_file_bytes)
    before = {}
    if ws.path("documents.parquet").is_file():
        before = {row["path"]: row["content_hash"] for row in ws.read_table(ws.path("documents.parquet")).to_pylist()}
    now = {f.path: f.content_hash for f in files}
    deleted_hashes = {h for p, h in before.items() if p not in now}
    counts = {"new": 0, "changed": 0, "deleted": 0, "renamed": 0, "unchanged": 0,
              "skipped": sum(1 for f in files if f.reason)}
    for path, digest in now.items():
        if path not in before:
            counts["renamed" if digest in deleted_hashes else "new"] += 1
        elif before[path] != digest:
            counts["changed"] += 1
        else:
            counts["unchanged"] += 1
    counts["deleted"] = sum(1 for p in before if p not in now) - counts["renamed"]
    manifest = ws.read_manifest() if ws.exists() else {"stages": {}}
    dirty = any(counts[k] for k in ("new", "changed", "deleted", "renamed"))
    stages = {}
    for stage in STAGES:
        state = manifest["stages"].get(stage, {}).get("state")
        stages[stage] = "would run" if state != "done" else ("would update (cached work reused)" if dirty else "unchanged")
    result = {"workspace": str(ws.root), "documents": counts, "stages": stages}
    if config.llm.engine != "offline":
        from .estimate import estimate_llm

        result["llm"] = estimate_llm(ws, Path(input_folder), config)
    return result


__all__ = ["index", "query", "open_workspace", "stats", "plan", "read_questions", "workspace_config", "make_engine",
           "Session", "Workspace", "WorkspaceError", "IndexResult", "QuestionFileError"]
