"""The Python API: what the CLI, scripts and tests call.

    from noderag_cli import api
    result = api.index("ws", "docs/")
    hits = api.query("ws", "Who founded the Korven Institute?")
"""

from __future__ import annotations

from pathlib import Path

from .config import Config, load_config
from .embeddings import Embedder
from .engines.base import Engine
from .index.pipeline import IndexResult, Reporter, run_pipeline
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


__all__ = ["index", "workspace_config", "make_engine", "Workspace", "WorkspaceError", "IndexResult"]
