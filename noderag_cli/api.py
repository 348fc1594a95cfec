"""The Python API: what the CLI, scripts and tests call.

    from noderag_cli import api
    result = api.index("ws", "docs/")
    hits = api.query("ws", "Who founded the Korven Institute?")
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import yaml

from .cache import Cache, cache_damage, salvage_cache
from .config import Config, SearchConfig, changed, load_config
from .embeddings import Embedder, check_embedding, model_id
from .engines.base import Engine
from .engines.identity import identity
from .engines.offline import OfflineEngine
from .errors import ConfigError, DamagedError, InputError, NoBuildError, QuestionFileError, WorkspaceError
from .executor import make_executor
from .files import atomic_write_bytes
from .index import assemble
from .index.chunk import check_input_folder, document_chunks, scan
from .index.decompose import cache_key, input_name
from .index.pipeline import (
    STAGES,
    IndexResult,
    Reporter,
    compare_documents,
    damaged_outputs,
    decide,
    indexed_state,
    run_pipeline,
    scan_digest_of,
    settings_digest,
)
from .node_types import NODE_TYPES
from .questions import Question, read_jsonl
from .workspace import Generation, Workspace, damaged, refuse_output_inside, repair_hint

if TYPE_CHECKING:  # the search imports faiss and its structures, which `stats` and `index` do not need
    from .search.results import Retrieval
    from .search.retriever import Retriever


@dataclass(frozen=True)
class Reading:
    """What to read of the input folder, as `index`'s flags say it (None: as the config says); kept
    in the workspace's config, so the next run reads the same."""

    follow_symlinks: bool | None = None
    include: list[str] | None = None
    exclude: list[str] | None = None


def workspace_config(ws: Workspace, config_path: Path | None = None, reading: Reading | None = None) -> Config:
    """The config an `index` run uses: the file given, else the workspace's own snapshot, else
    defaults; `reading` (the CLI's flags), where given, over its `chunk` settings."""
    if config_path is None and ws.config_path.is_file():
        config_path = ws.config_path
    config = load_config(config_path)
    changes = {k: v for k, v in vars(reading or Reading()).items() if v is not None}
    if changes:
        config = config.model_copy(update={"chunk": changed(config.chunk, **changes)})
    return config


def make_engine(config: Config, cache: Cache | None, embedder: Embedder, executor=None,
                notice: Callable[[str], None] | None = None, cap=None) -> Engine:
    """The engine a config names; with a cluster's `executor`, its LLM calls run on the cluster.
    `notice` shows an LLM engine's waits on the server; `cap` is the run's spending cap."""
    if config.llm.engine == "litellm":
        from .engines.llm import LiteLLMEngine

        # it checks the server before its first request: a run with nothing to ask never calls out
        return LiteLLMEngine(config.llm, cache, executor=executor, check_connection=True, notice=notice, cap=cap)
    return OfflineEngine(embedder, cache)


_DISK_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EIO, errno.ENOENT,
                errno.ENOTDIR, errno.EISDIR}


def index(
    workspace: str | Path, input_folder: str | Path, config: Config | None = None, config_path: Path | None = None,
    reporter: Reporter | None = None, stop_after: str | None = None, reading: Reading | None = None,
    max_cost_usd: float | None = None,
) -> IndexResult:
    """Index (or update) WORKSPACE from every document under input_folder. `reading`, where given,
    over the config's `chunk` settings of what to read (and kept in its snapshot); `max_cost_usd`
    over `llm.max_cost_usd`, for this run.

    Raises InputError (bad input folder), ConfigError, BadInputError (the estimate is over the
    spending cap), WorkspaceError (path is a file, locked, other embedding model, cannot be
    written), SpendingCapError (stopped at the cap, the work paid for kept); nothing is created
    before the input is checked.
    """
    ws = Workspace(Path(workspace))
    ws.check_usable()
    check_input_folder(Path(input_folder))
    config = config or workspace_config(ws, config_path, reading)
    if max_cost_usd is not None:
        config = config.model_copy(update={"llm": changed(config.llm, max_cost_usd=max_cost_usd)})
    cap = None
    if config.llm.max_cost_usd is not None:
        from .estimate import spending_cap

        cap = spending_cap(ws, Path(input_folder), config)  # before anything is changed: refused runs change nothing
    with ws.lock():
        aside = ws.set_aside_manifest()
        if aside is not None:
            message = (f"workspace file {ws.manifest_path} was damaged: kept as {aside.name}; every stage runs again, "
                       "its work taken from the cache (nothing is paid twice)")
            ws.logger().warning(message)
            if reporter is not None:
                reporter.warn(message)
        problem = cache_damage(ws.cache_path, thorough=True)  # every page read once: a flipped bit is found here
        if problem:
            _salvage_damaged_cache(ws, problem, reporter)
        try:
            return _run_index(ws, Path(input_folder), config, reporter, stop_after, cap)
        except sqlite3.DatabaseError as err:  # found damaged while the run read it: salvaged, then one more go
            _salvage_damaged_cache(ws, str(err), reporter)
        try:
            return _run_index(ws, Path(input_folder), config, reporter, stop_after, cap)
        except sqlite3.DatabaseError as err:
            raise WorkspaceError(f"workspace file {ws.cache_path} is still unusable after salvage ({err}); "
                                 "move it aside and run `noderag index` again") from err


def _run_index(ws: Workspace, input_folder: Path, config: Config, reporter: Reporter | None,
               stop_after: str | None, cap=None) -> IndexResult:
    executor = make_executor(config.executor)
    try:
        reporter = reporter or Reporter()
        embedder = Embedder(config.embedding, ws.cache, executor, cap=cap)
        engine = make_engine(config, ws.cache, embedder, executor, notice=reporter.warn, cap=cap)
        return run_pipeline(ws, input_folder, config, engine, embedder, executor, reporter, stop_after)
    except OSError as err:
        if isinstance(err, ConnectionError) or err.errno not in _DISK_ERRORS:
            raise
        where = f" ({err.filename})" if err.filename else ""
        raise WorkspaceError(f"cannot write workspace {ws.root}: {err.strerror or err}{where}") from err
    finally:
        executor.close()
        ws.close()


def _salvage_damaged_cache(ws: Workspace, problem: str, reporter: Reporter | None) -> None:
    """A damaged cache.sqlite: keep what SQLite can still read, keep the damaged file beside it,
    say so, and go on (what is lost is recomputed, LLM replies included)."""
    kept, rows = salvage_cache(ws.cache_path)
    message = (f"workspace file {ws.cache_path} was damaged ({problem}); kept {rows:,} readable entries, "
               f"the damaged file is now {kept.name}")
    ws.logger().warning(message)
    if reporter is not None:
        reporter.warn(message)


class Session:
    """An opened build for many questions: everything is opened once. The build stays readable
    (an `index` run does not remove it) until `close`, or the end of the process."""

    def __init__(self, retriever: Retriever):
        self.retriever = retriever

    @property
    def generation(self) -> str:
        """The build the answers come from ("" for a workspace of the older layout)."""
        return self.retriever.generation.name

    def search_settings(self, **changes) -> SearchConfig:
        """This session's search settings with some changed (validated: ConfigError), for `params`."""
        return changed(self.retriever.config.search, **changes)

    def retrieve(self, question: str, params: SearchConfig | None = None, explain: bool = False) -> Retrieval:
        """The context; `explain`: with the path the walk took to each node (search/paths.py)."""
        return self.retriever.retrieve(question, params, explain)

    def ask(self, question: str, answer: bool = True, params: SearchConfig | None = None,
            explain: bool = False) -> Retrieval:
        result = self.retriever.retrieve(question, params, explain)
        return self.retriever.answer(result) if answer else result

    def close(self) -> None:
        self.retriever.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


COMPILED_FROM_QUESTIONS = 1000
"""Questions in one process from which the search's compiled kernels pay for their ~0.7 s load
(they save about half a millisecond per question); the CLI opens smaller batches without them."""


def build_config(generation: Generation, ws: Workspace, config_path: Path | None = None) -> Config:
    """The config to search a build with: the file given (searching with the build's own embedding
    model when it names none), else the config the build was made with."""
    own_path = ws.config_path if generation.legacy else generation.path("config.yaml")
    own_file = own_path if own_path.is_file() else None
    try:
        own = load_config(own_file)
    except ConfigError as err:  # written by noderag itself: unreadable is damaged, and `index` writes it again
        if generation.legacy:
            raise
        raise damaged(own_path, ws.root, str(err).split(": ", 1)[-1],
                      repair_hint(ws.root, generation.manifest.get("input"))) from None
    if config_path is None:
        return own
    config = load_config(config_path)
    if "embedding" not in (yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}):
        config = config.model_copy(update={"embedding": own.embedding})
    check_embedding(ws.root, model_id(own.embedding), model_id(config.embedding))
    return config


def open_workspace(workspace: str | Path, config: Config | None = None, config_path: Path | None = None,
                   compiled: bool = True) -> Session:
    """Open a workspace's current build for search, without writing anything to it. A config file
    given here that names no embedding section searches with the build's own embedding model; one
    that names another model is refused. `compiled`: run the walk, the selection and the budget as
    numba kernels (search/kernels.py), for long-lived sessions; the results are the same either way."""
    ws = Workspace(Path(workspace))
    generation = ws.open_generation()
    try:
        if config is None:
            config = build_config(generation, ws, config_path)
        from .search.retriever import Retriever

        embedder = Embedder(config.embedding, None)
        engine = make_engine(config, ws.read_only_cache(), embedder)
        return Session(Retriever(generation, config, engine, embedder, compiled=compiled))
    except BaseException:
        generation.close()
        raise


def query(workspace: str | Path, question: str, answer: bool = True, config: Config | None = None) -> Retrieval:
    with open_workspace(workspace, config, compiled=False) as session:
        return session.ask(question, answer=answer)


def read_questions(path: str | Path) -> tuple[list[Question], list[str]]:
    return read_jsonl(Path(path))


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
    if fmt == "graphml" and target.is_dir():
        raise InputError(f"--out {target} is a folder; GraphML goes to a file")
    if fmt == "csv" and target.exists() and not target.is_dir():
        raise InputError(f"--out {target} is a file; the CSV export is a folder (nodes.csv, edges.csv)")
    with ws.open_generation() as generation:
        try:
            write = exporter.write_graphml if fmt == "graphml" else exporter.write_csv
            counts = write(generation, target)
        except OSError as err:
            raise InputError(f"cannot write {target}: {err.strerror or err}") from err
    files = [str(target)] if fmt == "graphml" else [str(target / "nodes.csv"), str(target / "edges.csv")]
    return {"format": fmt, "generation": generation.name, "files": files, **counts}


__all__ = ["index", "query", "open_workspace", "stats", "plan", "init", "gc", "export", "read_questions", "workspace_config", "make_engine",
           "Session", "Workspace", "WorkspaceError", "IndexResult", "QuestionFileError"]
