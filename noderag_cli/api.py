"""The Python API: what the CLI, scripts and tests call. A facade: each function lives with the
work it does (indexing in index/run.py, what a workspace holds in index/status.py, search in
search/session.py) and is named here once.

    from noderag_cli import api
    result = api.index("ws", "docs/")
    hits = api.query("ws", "Who founded the Korven Institute?")

The search's names (`open_workspace`, `query`, `Session`, `COMPILED_FROM_QUESTIONS`) are imported
on first use: they bring faiss and the search's structures, which `index` and `stats` do not need.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from .engines import make_engine
from .errors import InputError, QuestionFileError, WorkspaceError
from .files import atomic_write_bytes, check_output
from .index.pipeline import IndexResult
from .index.run import Reading, index, workspace_config
from .index.stages import Reporter
from .index.status import plan, stats
from .questions import Question, read_jsonl
from .workspace import Workspace, refuse_output_inside

if TYPE_CHECKING:
    from .search.session import COMPILED_FROM_QUESTIONS, Session, open_workspace, query

_SEARCH = ("open_workspace", "query", "Session", "COMPILED_FROM_QUESTIONS")


def __getattr__(name: str):
    if name in _SEARCH:
        return getattr(importlib.import_module(".search.session", __package__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_questions(path: str | Path) -> tuple[list[Question], list[str]]:
    return read_jsonl(Path(path))


def init(workspace: str | Path, llm: str | None = None, force: bool = False, prompts: bool = False) -> list[Path]:
    """Write WORKSPACE/config.yaml with every setting, its meaning and its default (with an LLM
    preset's settings when `llm` names one); the next `noderag index WORKSPACE` uses it. With
    `prompts`, also the built-in prompts as files in WORKSPACE/prompts, which the config then
    names (`llm.prompts`). Existing files are replaced only with `force` (an indexed workspace
    then re-runs what the changed settings touch). Returns the files written."""
    from .config import Config, config_to_yaml, preset
    from .engines.prompts import write_prompts

    config, header = preset(llm) if llm else (Config(), "")
    ws = Workspace(Path(workspace))
    ws.check_usable()
    folder = ws.root / "prompts"
    for path in (ws.config_path, *([folder] if prompts else [])):
        if path.exists() and not force:
            raise InputError(f"{path} exists; edit it, or `noderag init {ws.root} --force` to write a new one")
    if prompts:
        config = config.model_copy(update={"llm": config.llm.model_copy(update={"prompts": folder.name})})
    try:
        ws.root.mkdir(parents=True, exist_ok=True)
        written = write_prompts(folder) if prompts else []
        text = (header + "\n" if header else "") + config_to_yaml(config, commented=True)
        atomic_write_bytes(ws.config_path, text.encode())
    except OSError as err:
        raise WorkspaceError(f"cannot write to {ws.root}: {err.strerror or err}") from err
    return [ws.config_path, *written]


def gc(workspace: str | Path, dry_run: bool = False, include_unfinished: bool = False) -> dict:
    """Remove (or with `dry_run` list) what no current table or build refers to: old builds no
    reader holds, leftover temporary and stage files, cache entries no stage needs, but not those an
    unfinished run paid for unless `include_unfinished` (collect.py)."""
    from .collect import collect

    return collect(Path(workspace), dry_run, include_unfinished)


def export(workspace: str | Path, fmt: str, out: str | Path | None = None) -> dict:
    """Write the current build's graph as GraphML (a file) or Neo4j bulk-import CSV (a folder with
    nodes.csv and edges.csv), by default `<workspace name>.graphml` or `<workspace name>-csv/` in
    the current folder; never writes to the workspace. Returns what was written."""
    from . import export as exporter

    if fmt not in exporter.FORMATS:
        raise InputError(f"unknown export format '{fmt}'; valid: {', '.join(exporter.FORMATS)}")
    ws = Workspace(Path(workspace))
    target = Path(out) if out is not None else Path(f"{ws.root.resolve().name}" + (".graphml" if fmt == "graphml"
                                                                                   else "-csv"))
    refuse_output_inside(target)
    if fmt == "graphml":
        check_output(target, "--out")
    if fmt == "csv" and (target.is_symlink() or (target.exists() and not target.is_dir())):
        raise InputError(f"--out {target} is a file or a link; the CSV export is a folder (nodes.csv, edges.csv)")
    with ws.open_generation() as generation:
        write = exporter.write_graphml if fmt == "graphml" else exporter.write_csv
        counts = write(generation, target)
    files = [str(target)] if fmt == "graphml" else [str(target / "nodes.csv"), str(target / "edges.csv")]
    return {"format": fmt, "generation": generation.name, "files": files, **counts}


__all__ = ["index", "query", "open_workspace", "stats", "plan", "init", "gc", "export", "read_questions",
           "workspace_config", "make_engine", "Reading", "Reporter", "Session", "COMPILED_FROM_QUESTIONS",
           "IndexResult", "WorkspaceError", "QuestionFileError"]
