"""Runs the indexing stages in order, each checkpointed in the manifest.

Each stage is one `Stage` record in `STAGES`: its name, the files of earlier stages it reads
(its inputs, handles from outputs.py), the config sections its output depends on, the engine
task it spends, its output files and its function. A stage is skipped when its fingerprint (its
settings, the engine, and the checksums of the files it reads) matches the last committed run, its outputs are on disk with the
digest recorded, and it left no failed items (`decide`, which `index --dry-run` asks too);
otherwise it runs, commits its outputs atomically, and only then is marked done. Since every
stage is a pure function of its inputs (caches only save work: chunking, decompositions, token
counts and vectors are looked up by content), an interrupted, resumed or incremental run yields
the same tables as a fresh build of the same folder. Graph-wide steps (betweenness, Leiden,
K-means) always run on the whole updated graph; similarity edges reuse the neighbour lists a
change does not touch (see similarity_edges). The last stage, `assemble`, writes the build as a
new generation and makes it current (index/assemble.py).

The stages themselves, and the test hook that crashes a run at a chosen point: stages.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa

from .. import ivf, readers
from ..config import COST_ONLY, Config, changed, config_to_yaml
from ..embeddings import Embedder, VectorMemory, check_embedding
from ..engines.base import Engine, EngineStats
from ..errors import InputError, WorkspaceError
from ..executor import Executor, keeping_memory_if_it_fits, memory_fits, release_memory
from ..files import atomic_write_bytes, file_digests, json_digest, write_parquet
from ..generation import Generation
from ..node_types import NODE_TYPES
from ..workspace import CACHE_KEYS, NODES, VECTOR_DIGESTS, Workspace
from . import assemble
from .outputs import Output
from .scan import keep_last_content, remember
from .scan import scan as scan_files
from .stages import KILL_ENV, STAGES, ReadAhead, Reporter, Stage, StageRun, keep_tables_for, kill_point
from .state import DONE, RUNNING, Manifest, StageEntry, compare_documents, indexed_state

STAGE_VERSION = 5  # 5: vectors on the half-precision grid they are stored in; a workspace of 4 re-derives its tables
OUTPUTS_DAMAGED = "its outputs are missing or damaged"


@dataclass
class IndexResult:
    stages: dict[str, dict] = field(default_factory=dict)
    node_counts: dict[str, int] = field(default_factory=dict)
    edge_count: int = 0
    skipped_files: list[tuple[str, str]] = field(default_factory=list)
    failures: int = 0
    seconds: float = 0.0
    documents: dict[str, int] = field(default_factory=dict)  # new/changed/renamed/deleted/unchanged vs. last build
    generation: str | None = None  # the build now current
    rate_limit_waits: int = 0  # 429 replies the LLM engine waited out in this run
    rate_limit_seconds: float = 0.0

    def as_dict(self) -> dict:
        """The summary `index --json` prints (docs/usage.md)."""
        return {"seconds": round(self.seconds, 3), "nodes": self.node_counts, "edges": self.edge_count,
                "documents": self.documents, "skipped_files": [{"path": p, "reason": r} for p, r in self.skipped_files],
                "failures": self.failures,
                "rate_limited": {"waits": self.rate_limit_waits, "seconds": round(self.rate_limit_seconds, 1)},
                "stages": {name: {k: (round(v, 3) if isinstance(v, float) else v) for k, v in info.items()}
                           for name, info in self.stages.items()}}


def _settings(config: Config, engine_identity: dict, stage: Stage) -> dict:
    sections = {}
    for name in stage.settings:
        if name == "engine":
            sections[name] = engine_identity
        elif name == "config":  # the whole config: the build carries a snapshot of it
            sections[name] = config_to_yaml(config, build=True)
        elif name == "readers":  # the library versions that decide the text of the formats it reads
            sections[name] = readers.identity(config.chunk.extensions)
        else:
            sections[name] = getattr(config, name).model_dump(mode="json", exclude=COST_ONLY)
    return sections


def output_digests(stage: Stage, entry: StageEntry) -> dict[Output, str | None]:
    """The checksum of each output of a stage that is done, as its run recorded it (one recorded
    before per-file checksums: the digest of them all, for each)."""
    return {output: (entry.files or {}).get(output.file, entry.outputs) for output in stage.outputs}


def settings_digest(config: Config, engine_identity: dict, stage: Stage) -> str:
    own = {"stage_version": stage.version} if stage.version else {}
    return json_digest({"version": STAGE_VERSION, "settings": _settings(config, engine_identity, stage), **own})


def fingerprint(stage: Stage, settings: str, input_digests: dict[Output, str], scan_digest: str) -> str:
    """What a stage's result depends on: its settings, the checksum of each file it reads (its
    declared inputs: a file of an earlier stage that it does not read does not re-run it), and for
    the chunk stage the scan of the input folder."""
    return json_digest({"stage": stage.name, "settings": settings,
                        "inputs": [input_digests[o] for o in stage.inputs],
                        "scan": scan_digest if stage.reads_input else None})


class _CountingReporter(Reporter):
    """Forwards to the run's reporter and counts finished items for the kill hook."""

    def __init__(self, reporter: Reporter, stage: str):
        self.reporter, self.stage, self.done = reporter, stage, 0
        wanted = os.environ.get(KILL_ENV, "")
        name, _, point = wanted.partition(":")
        self.kill_after = int(point) if name == stage and point.isdigit() else None

    def stage_started(self, stage: str, total: int | None) -> None:
        self.reporter.stage_started(stage, total)

    def advance(self, n: int = 1) -> None:
        self.done += n
        self.reporter.advance(n)
        if self.kill_after is not None and self.done >= self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def warn(self, message: str) -> None:
        self.reporter.warn(message)


def outputs_digest(ws: Workspace, stage: Stage) -> str | None:
    """The digest of a stage's outputs as they are on disk now (None when one is missing); for
    assemble, the contents digest of the current generation, whose files are checked against
    their recorded checksums."""
    if stage.name == "assemble":
        return assemble.current_contents(ws)
    paths = [output.path(ws) for output in stage.outputs]
    if not all(p.is_file() for p in paths):
        return None
    return json_digest(file_digests(paths))


def damaged_outputs(ws: Workspace, stage: Stage, entry: StageEntry | None) -> list[Path]:
    """A finished stage's output files that are missing or no longer match the checksums its run
    recorded (every file, when the run recorded only their combined digest)."""
    if entry is None or not entry.done:
        return []
    if stage.name == "assemble":  # the current build's files, against its own manifest
        with assemble.open_current(ws) as built:
            return [] if built is None else [Path(line.split(": ", 1)[0]) for line in built.verify()]
    paths = [output.path(ws) for output in stage.outputs]
    recorded = entry.files
    if recorded is None:
        return [] if outputs_digest(ws, stage) == entry.outputs else paths
    present = [p for p in paths if p.is_file()]
    found = dict(zip(present, file_digests(present), strict=True))
    return [p for p, output in zip(paths, stage.outputs, strict=True)
            if p not in found or found[p] != recorded.get(output.file)]


@dataclass
class Decision:
    run: bool
    reason: str  # why it runs, or "unchanged"
    fingerprint: str | None = None


def decide(ws: Workspace, stage: Stage, entry: StageEntry | None, settings: str, upstream: dict[Output, str | None],
           scan_digest: str, rebuild: bool = False) -> Decision:
    """Whether a stage must run: the one rule for `index` and `index --dry-run`. `upstream`
    holds the checksum of each earlier stage's output, None for one that is about to be rewritten
    (the dry-run's case: then a stage whose other inputs match may still find its inputs unchanged).
    `rebuild` (`index --rebuild`): the stages that keep work against the anchor run."""
    if entry is None or not entry.done:
        return Decision(True, "interrupted before" if entry is not None and entry.state == RUNNING else "not run yet")
    if entry.settings != settings:
        return Decision(True, "its settings changed")
    if entry.failures:
        return Decision(True, f"retry {entry.failures} failed item(s)")
    if any(upstream.get(o) is None for o in stage.inputs):
        return Decision(True, "its inputs may change (cached work is reused)")
    expected = fingerprint(stage, settings, upstream, scan_digest)
    if entry.fingerprint != expected:
        return Decision(True, "the input folder changed" if stage.reads_input else "its inputs changed", expected)
    if outputs_digest(ws, stage) != entry.outputs:
        return Decision(True, OUTPUTS_DAMAGED, expected)
    if rebuild and stage.anchored:
        return Decision(True, "a full build was asked (--rebuild)", expected)
    return Decision(False, "unchanged", expected)


def scan_digest_of(files) -> str:
    """What the chunk stage's fingerprint takes of the scan (a document kept at its last content
    while unreadable differs from the same document read)."""
    return json_digest([(f.path, f.content_hash, *((f.reason,) if f.kept else ())) for f in files])


def run_config(config: Config, exact: bool) -> Config:
    """The config a run builds with: `index --exact` over `index.update`, for this run only."""
    return config.model_copy(update={"index": changed(config.index, update="exact")}) if exact else config


def run_pipeline(
    ws: Workspace, input_folder: Path, config: Config, engine: Engine, embedder: Embedder, executor: Executor,
    reporter: Reporter | None = None, stop_after: str | None = None, exact: bool = False, rebuild: bool = False,
    anchor_from: Workspace | None = None,
) -> IndexResult:
    """Index input_folder into ws, the per-document and per-chunk work on `executor`. Caller holds
    the workspace lock. `exact`: this run updates in exact mode (`index.update`), whatever the
    config says (which is kept as it is); `rebuild`: a full build whatever changed (a new anchor);
    `anchor_from`: the workspace whose build anchors an incremental update (anchor.py; default ws)."""
    reporter = reporter or Reporter()
    log = ws.logger()
    started = time.perf_counter()
    manifest = Manifest.load(ws)
    check_embedding(ws.root, manifest.embedding.get("model"), embedder.model_id)
    reporter.stage_started("scan", None)  # not a stage: reading and hashing the files, shown as it goes
    with ThreadPoolExecutor(1) as pool:  # the last build's vectors are mapped and checked beside the scan
        recalled = pool.submit(_recall_vectors, ws, embedder) \
            if manifest.embedding.get("vectors") == embedder.vector_id else None
        files = scan_files(input_folder, config.chunk, reporter.advance, ws.cache)
        if recalled is not None:
            recalled.result()
    remember(ws.cache, files)
    reporter.stage_finished("scan", time.perf_counter() - started, skipped=False)
    files = keep_last_content(files, indexed_state(ws))
    readable = [f for f in files if not f.reason or f.kept]
    if not readable:
        detail = f" ({len(files)} skipped as unreadable)" if files else ""
        raise InputError(
            f"no readable {'/'.join(config.chunk.extensions)} files under {input_folder}{detail}; nothing was changed"
        )
    result = IndexResult(skipped_files=[(f.path, f.reason) for f in files if f.reason and not f.kept])
    for path, reason in result.skipped_files:
        reporter.warn(f"skipped {path}: {reason}")
        log.warning("skipped %s: %s", path, reason)
    changes = compare_documents(indexed_state(ws), {f.path: f.content_hash for f in readable})
    result.documents = {k: len(v) for k, v in changes.items()}
    scan = scan_digest_of(files)
    log.info("run started: input %s, %s", Path(input_folder).resolve(), result.documents)
    removed = ws.remove_unused_generations()  # left by a killed run, or held by a reader last time
    if removed:
        log.info("removed unused generations %s", ", ".join(removed))

    manifest.embedding = {"model": embedder.model_id, "dim": embedder.dim, "vectors": embedder.vector_id}
    manifest.input = str(Path(input_folder).resolve())
    if stop_after is None:  # a --rebuild killed before its end is finished by the next run, flag or not
        manifest.rebuild_pending = rebuild = rebuild or manifest.rebuild_pending
    manifest.save(ws)
    atomic_write_bytes(ws.config_path, config_to_yaml(config, commented=True).encode())
    config = run_config(config, exact)

    digests: dict[Output, str | None] = {}
    engine_log = logging.getLogger("noderag.llm")  # the engine's lines (its waits on the server) into noderag.log
    level = engine_log.level
    engine_log.setLevel(logging.INFO)
    for handler in log.handlers:
        engine_log.addHandler(handler)
    try:
        input_bytes = sum(f.size for f in readable)
        del readable  # the scanned files are let go once the stages that read them are done (`_run_each_stage`)
        # a run expected to fit its memory budget keeps what it frees and the tables it reads
        tables = {} if memory_fits(input_bytes, config.executor.memory_mb) else None
        if tables is None:
            embedder.hold_in_files(ws.spill_dir)
        with keeping_memory_if_it_fits(input_bytes, config.executor.memory_mb):
            _run_stages(ws, files, config, engine, embedder, reporter, stop_after, manifest, digests, executor,
                        scan, result, log, rebuild, anchor_from, tables)
    finally:
        for handler in log.handlers:
            engine_log.removeHandler(handler)
        engine_log.setLevel(level)
    manifest.record_cache(ws.cache)
    if manifest.done("assemble"):
        manifest.rebuild_pending = False
    manifest.save(ws)
    result.seconds = time.perf_counter() - started
    result.failures = sum(entry.failures for entry in manifest.stages.values())
    built = assemble.current_manifest(ws)
    if built is not None and manifest.done("assemble"):
        result.generation = built["name"]
        result.node_counts = {t: built["counts"]["nodes"].get(t, 0) for t in NODE_TYPES}
        result.edge_count = built["counts"]["edges"]["merged_total"]
    log.info("run finished in %.2fs, %d failures", result.seconds, result.failures)
    return result


def _run_stages(ws: Workspace, files: list, config: Config, engine: Engine, embedder: Embedder, reporter: Reporter,
                stop_after: str | None, manifest: Manifest, digests: dict, executor: Executor,
                scan: str, result: IndexResult, log, rebuild: bool, anchor_from: Workspace | None,
                tables: dict | None = None) -> None:
    """Each stage in order: skipped when `decide` finds it unchanged, else run, then committed.
    `tables`: the tables the stages have read, kept while a later stage reads them (`StageRun.read`);
    then each stage's own last outputs are also read ahead while the stage before it runs."""
    ahead = ReadAhead() if tables is not None else None
    try:
        _run_each_stage(ws, files, config, engine, embedder, reporter, stop_after, manifest, digests, executor, scan,
                        result, log, rebuild, anchor_from, tables, ahead)
    finally:
        if ahead is not None:
            ahead.close()


def _run_each_stage(ws: Workspace, files: list, config: Config, engine: Engine, embedder: Embedder,
                    reporter: Reporter, stop_after: str | None, manifest: Manifest, digests: dict,
                    executor: Executor, scan: str, result: IndexResult, log, rebuild: bool,
                    anchor_from: Workspace | None, tables: dict | None, ahead: ReadAhead | None) -> None:
    for number, stage in enumerate(STAGES):
        if not any(later.reads_input for later in STAGES[number:]):
            files.clear()  # the scan's record of every file, a text file's text with it: over 1 KB a file
        keep_tables_for(tables, STAGES[number:])
        settings = settings_digest(config, engine.identity, stage)
        entry = manifest.entry(stage.name)
        decision = decide(ws, stage, entry, settings, digests, scan, rebuild)
        if not decision.run:
            digests.update(output_digests(stage, entry))
            reporter.stage_finished(stage.name, 0.0, skipped=True)
            result.stages[stage.name] = {"skipped": True, "seconds": entry.seconds}
            log.info("stage %s unchanged, skipped", stage.name)
            if stage.name == stop_after:
                break
            continue
        if decision.reason == OUTPUTS_DAMAGED:
            for path in damaged_outputs(ws, stage, entry):
                message = f"workspace file {path} is missing or damaged: rebuilt, with its work taken from the cache"
                reporter.warn(message)
                log.warning(message)
        stage_print = decision.fingerprint or fingerprint(stage, settings, digests, scan)
        committed = entry.committed_files if entry is not None else {}
        manifest.stages[stage.name] = StageEntry(RUNNING, stage_print, settings, last_files=committed or None)
        manifest.save(ws)
        log.info("stage %s started (%s)", stage.name, decision.reason)
        kill_point(stage.name, "start")
        if ahead is not None and number + 1 < len(STAGES):  # what the next stage reads back of its last run
            following = manifest.entry(STAGES[number + 1].name)
            ahead.start(STAGES[number + 1].read_back_paths(ws, following.committed_files if following else {}))
        before = _snapshot(engine.stats)
        vectors_before = embedder.computed
        release_memory()
        _reset_peak_memory()
        t0 = time.perf_counter()
        ws.cache.start_recording()
        hand_on = frozenset(STAGES[number + 1].inputs) if number + 1 < len(STAGES) else frozenset()
        info = stage.run(StageRun(stage, ws, files, config, engine, embedder, _CountingReporter(reporter, stage.name),
                                  executor, committed, rebuild, anchor_from, tables, ahead, hand_on))
        _write_cache_keys(ws, stage.name, ws.cache.stop_recording())
        executor.release()
        if ahead is not None:
            ahead.drop(stage.read_back_paths(ws))
        seconds = time.perf_counter() - t0
        info["peak_rss_mb"] = _peak_memory_mb()
        checksums = file_digests([output.path(ws) for output in stage.outputs])
        recorded = {output.file: checksum for output, checksum in zip(stage.outputs, checksums, strict=True)}
        digest = info.pop("outputs_digest", None) or json_digest(list(recorded.values()))  # assemble says its own
        digests.update({output: recorded[output.file] for output in stage.outputs})
        kill_point(stage.name, "commit")
        llm = _delta(before, engine.stats, stage.task)
        if llm and engine.price_known is False:  # never a made-up zero
            llm["cost_usd"], llm["price_known"] = None, False
        result.rate_limit_waits += llm.get("rate_limit_waits", 0)
        result.rate_limit_seconds += llm.get("rate_limit_seconds", 0.0)
        info["vectors_computed"] = embedder.computed - vectors_before
        manifest.stages[stage.name] = StageEntry(DONE, stage_print, settings, digest, recorded, round(seconds, 3), llm,
                                                 info)
        manifest.save(ws)
        reporter.stage_finished(stage.name, seconds, skipped=False, peak_mb=info["peak_rss_mb"])
        result.stages[stage.name] = {"skipped": False, "seconds": seconds, **info}
        log.info("stage %s done in %.2fs %s", stage.name, seconds, info)
        if stage.name == stop_after:
            break


def _reset_peak_memory() -> None:
    """Start this process's peak resident memory afresh (Linux), so each stage reports its own."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")


def _peak_memory_mb() -> int | None:
    """This process's peak resident memory since the last reset, in MB (Linux); workers not counted."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def _write_cache_keys(ws: Workspace, stage: str, touched: dict[str, set[str]]) -> None:
    """The cache entries a stage's run asked for or wrote, sorted: what `noderag gc` keeps for it."""
    rows = sorted((ns, key) for ns, keys in touched.items() for key in keys)
    table = pa.table({"ns": pa.array([r[0] for r in rows], pa.string()), "key": pa.array([r[1] for r in rows], pa.string())})
    write_parquet(ws.stage_path(stage, CACHE_KEYS), table)


def _recall_vectors(ws: Workspace, embedder: Embedder) -> None:
    """The last complete build's vectors, by the digests of their texts, into the embedder's memory:
    an update's unchanged nodes then cost no cache look-up (9,000 of them took ~0.1 s on MuSiQue).
    The digests are the build's own (`VECTOR_DIGESTS`); a build without them (made before builds kept
    them, or whose vectors an earlier version embedded) has its texts hashed."""
    try:
        with assemble.open_current(ws) as built:
            if built is None or built.verify(("vectors.faiss",)):
                return  # a damaged file is read by no one: the embed stage then finds every vector in the cache
            keys = _stored_digests(built)
            if keys is None:
                if built.verify((NODES,)):
                    return
                keys = _text_digests(built)
            vectors = ivf.read_stored(built.path("vectors.faiss"))  # mapped, as stored: no float32 copy
    except (OSError, RuntimeError, pa.ArrowInvalid, WorkspaceError):
        return  # a damaged earlier build: the cache still has every vector
    if keys is not None and len(keys) == len(vectors):
        embedder.remember(keys, vectors)  # the file's rows, mapped


def _stored_digests(built: Generation) -> np.ndarray | None:
    """The digests a build keeps of its vectors' texts, in their order; None where it has none, or
    they do not match its manifest."""
    if VECTOR_DIGESTS not in built.manifest.get("files", {}) or built.verify((VECTOR_DIGESTS,)):
        return None
    table = built.table(VECTOR_DIGESTS.removesuffix(".parquet"))
    if "text_digest" not in table.column_names:
        return None
    column = table["text_digest"].combine_chunks()
    return np.frombuffer(column.buffers()[1], "S16", len(column), column.offset * 16)


def _text_digests(built: Generation) -> np.ndarray | None:
    """The digests of the texts of a build's vectors, in their order, from its nodes table."""
    nodes = built.table("nodes", ["text", "vector_row"])
    rows = nodes["vector_row"].to_numpy()
    embedded = np.flatnonzero(rows >= 0)
    by_row = embedded[np.argsort(rows[embedded])]  # the nodes in the order of their vectors
    if not np.array_equal(rows[by_row], np.arange(len(by_row))):
        return None
    return VectorMemory.digests(nodes["text"].take(pa.array(by_row)).to_pylist())


def _snapshot(stats: EngineStats) -> dict:
    return {k: dict(vars(v)) for k, v in stats.by_task.items()}


def _delta(before: dict, stats: EngineStats, task: str | None) -> dict:
    if task is None or task not in stats.by_task:
        return {}
    now = vars(stats.by_task[task])
    prior = before.get(task, {})
    return {k: round(v - prior.get(k, 0), 6) if isinstance(v, float) else v - prior.get(k, 0) for k, v in now.items()}
