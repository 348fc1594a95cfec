"""The indexing stages, declared once: each is one `Stage` record in `STAGES` (its name, the
files of earlier stages it reads, the config sections its output depends on, the engine task it
spends, its output files, all as handles from outputs.py, and its function), and its function,
which gets a `StageRun`: it reads only the inputs its stage declares.

Test hook (documented here because it is not a feature): when the environment variable
`NODERAG_TEST_KILL_AT` is `<stage>:start`, `<stage>:<n>`, `<stage>:commit` or `assemble:publish`,
the run SIGKILLs itself when that stage starts, after it reported n finished items, after it
wrote its outputs but before the manifest records it done, or (assemble) after the new
generation is complete but before CURRENT names it. Tests use it to crash a real `noderag index`
process at a chosen point.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import ivf, nlp
from ..cache import SCAN
from ..config import Config
from ..embeddings import Embedder
from ..engines.base import Engine
from ..executor import Executor, release_memory
from ..files import as_read_back, atomic_write_with, bytes_digest, write_parquets
from ..generation import GENERATION_VERSION
from ..graph import Graph, edge_rows, union_of_merged
from ..search import prepare
from ..spill import Spill, budget_mb
from ..workspace import EDGES, NODES, Workspace
from . import anchor, assemble, attributes, chunk, communities, decompose, embed, similarity_edges, text
from .outputs import (
    ANCHOR_CHUNKS,
    ASSIGNMENTS,
    ATTRIBUTE_EDGES,
    ATTRIBUTE_FAILURES,
    ATTRIBUTE_NODES,
    ATTRIBUTE_SUMMARIES,
    CHUNK_IDS,
    CHUNKS,
    COMMUNITY_EDGES,
    COMMUNITY_FAILURES,
    COMMUNITY_NODES,
    COMMUNITY_SUMMARIES,
    DECOMPOSE_EDGES,
    DECOMPOSE_FAILURES,
    DECOMPOSE_NODES,
    DOCUMENTS,
    EDGE_OUTPUTS,
    FAILURES,
    LINKS,
    NEIGHBOURS,
    NODE_OUTPUTS,
    OCCURRENCES,
    SEMANTIC_CENTROIDS,
    SIMILARITY_CENTROIDS,
    SIMILARITY_EDGES,
    TEXT_EDGES,
    TEXT_NODES,
    VECTOR_IDS,
    VECTORS,
    Output,
)

KILL_ENV = "NODERAG_TEST_KILL_AT"


class Reporter:
    """Progress hooks; the CLI shows them with Rich, the API default is silent."""

    def stage_started(self, stage: str, total: int | None) -> None: ...

    def advance(self, n: int = 1) -> None: ...

    def stage_finished(self, stage: str, seconds: float, skipped: bool, peak_mb: int | None = None) -> None: ...

    def warn(self, message: str) -> None: ...


@dataclass
class StageRun:
    """What a stage's function gets: the workspace, the run's inputs and helpers for its files."""

    stage: Stage
    ws: Workspace
    files: list
    config: Config
    engine: Engine
    embedder: Embedder
    reporter: Reporter
    executor: Executor
    recorded: dict = field(default_factory=dict)  # the checksums of its outputs the last committed run recorded
    rebuild: bool = False  # `index --rebuild`: summaries and communities built in full, a new anchor
    anchor_from: Workspace | None = None  # whose published build is the anchor (default: ws; the estimate's is another)
    tables: dict | None = None  # the run's tables read so far, for the stages after (`read`); None: none kept
    ahead: ReadAhead | None = None  # its own last outputs read while the stage before it ran (`last`)
    hand_on: frozenset = frozenset()  # its outputs the next stage reads: kept in `tables` as written

    def spill(self) -> Spill:
        """Where this stage's largest arrays go past the memory budget (`executor.memory_mb`)."""
        return Spill(self.ws.spill_dir, budget_mb(self.config.executor.memory_mb))

    def load_anchor(self) -> tuple[anchor.Anchor | None, str]:
        """The anchor an anchored stage keeps its work against, or None and why it builds in full
        (`anchor.load`)."""
        chunk_ids = self.read(CHUNK_IDS)["chunk_id"].combine_chunks()
        return anchor.load(self.anchor_from or self.ws, self.config.index, chunk_ids, self.rebuild)

    def input_path(self, output: Output) -> Path:
        """The file of an output this stage declared as an input; UndeclaredInput otherwise: a read
        the reuse check does not watch would let the stage's result go stale silently."""
        if output not in self.stage.inputs:
            raise UndeclaredInput(f"stage {self.stage.name} reads {output.stage}.{output.file}, which is not among "
                                  "its declared inputs (stages.STAGES)")
        return output.path(self.ws)

    def read(self, output: Output, columns: list[str] | None = None) -> pa.Table:
        """An input's table; with the run's `tables`, the one read by an earlier stage of the run, or
        written by it (`write_all`), while its file is the same: a stage table is read by up to five
        stages, and decoding it again each time costs more than holding it between them."""
        path = self.input_path(output)
        if self.tables is None:
            return self.ws.read_table(path, columns)
        key = (output, tuple(columns) if columns is not None else None)
        stamp = _file_stamp(path)
        held, whole = self.tables.get(key), self.tables.get((output, None))
        if held is not None and stamp is not None and held[0] == stamp:
            return held[1]
        if whole is not None and stamp is not None and whole[0] == stamp:
            return whole[1].select(columns)
        table = self.ws.read_table(path, columns)
        self.tables[key] = (stamp, table)
        return table

    def path(self, name: str) -> Path:
        """The file of this stage's own output `name`."""
        return self.stage.output(name).path(self.ws)

    def last(self, name: str) -> pa.Table | None:
        """This stage's output `name` as the last run left it, if it matches the checksum that run
        recorded: the only way a stage reuses its own earlier work, so a damaged file is rebuilt
        (from the cache: nothing is paid twice), never carried on. None, with one warning naming
        the file, when it does not; None, silently, when it is missing, unreadable or was never
        recorded. Taken from the read-ahead when it read the same file."""
        if name not in self.stage.reads_back:
            raise UndeclaredInput(f"stage {self.stage.name} reads back its last {name}, which is not among its "
                                  "declared reads_back (stages.STAGES)")
        path = self.path(name)
        expected = self.recorded.get(name)
        if expected is None or not path.is_file():
            return None
        read = self.ahead.take(path) if self.ahead is not None else None
        _, digest, table = read or _read_back(path, use_threads=True)  # the file read once: hashed and parsed
        if digest is None:
            return None
        if digest != expected:
            message = (f"workspace file {path} does not match the checksum recorded when it was written: rebuilt, "
                       "with the work it holds taken from the cache")
            self.reporter.warn(message)
            self.ws.logger().warning(message)
            return None
        return table

    def write(self, name: str, table: pa.Table) -> None:
        self.write_all({name: table})

    def write_all(self, tables: dict[str, pa.Table]) -> None:
        """Several of this stage's outputs, side by side (`files.write_parquets`). In a run that
        keeps its tables, those the next stage reads (`hand_on`) are kept as their files read back
        (`files.as_read_back`): that stage would otherwise decode what this one just encoded. The
        others are not held for stages further on, which read them when they come."""
        write_parquets({self.path(name): table for name, table in tables.items()})
        if self.tables is None:
            return
        for name, table in tables.items():
            output = self.stage.output(name)
            kept = as_read_back(table) if output in self.hand_on else None
            if kept is not None:
                self.tables[(output, None)] = (_file_stamp(output.path(self.ws)), kept)

    def count_tokens(self) -> Callable[[list[str]], list[int]]:
        """`nlp.count_tokens`, with the counts of the texts of the stage's last nodes table taken
        from it (`trusted`: a damaged table is not believed): same text, same count."""
        last = self.last(NODES)
        if last is None:
            return nlp.count_tokens
        return nlp.counting_known(last["text"].to_pylist(), last["tokens"].to_pylist())

    def nodes(self, *outputs: Output) -> pa.Table:
        """Node tables, one after the other."""
        return pa.concat_tables([self.read(o) for o in outputs])

    def edges(self, *outputs: Output) -> pa.Table:
        """Edge tables, merged (`graph.merge_edges`). Every stage writes its edges merged (one row
        per pair, sorted): one table is taken as it is, several are merged as sorted tables
        (`graph.union_of_merged`)."""
        tables = [self.read(o) for o in outputs]
        return tables[0] if len(tables) == 1 else union_of_merged(tables)

    def write_graph(self, nodes: pa.Table, edges: pa.Table) -> None:
        self.write_all({NODES: nodes, EDGES: edges})

    def commit_graph(self, nodes: pa.Table, edges: pa.Table, failures: dict[str, str],
                     more: dict[str, pa.Table] | None = None) -> dict[str, int]:
        """The stage's graph, failures and `more` of its outputs written; the failure counts for its
        details: `failures`, those the next run retries, and `final_failures`, those no run would
        change (an engine whose `failures_are_final`), each said once, by the run that met it."""
        final = self.engine.failures_are_final
        self.write_all({NODES: nodes, EDGES: edges, FAILURES: _failures_table(self.stage.name, failures, final),
                        **(more or {})})
        if final and failures:
            item, reason = min(failures.items())
            self.reporter.warn(f"{self.stage.name}: {len(failures)} item(s) have no result with the {self.engine.name} "
                               f"engine (e.g. {item}: {reason}); every run would give the same, so none retries them")
        return {"failures": 0 if final else len(failures), "final_failures": len(failures) if final else 0}


def _file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells a file from the one written before it under its name (written by rename: a new
    inode), or None when it cannot be read."""
    try:
        info = path.stat()
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


class ReadAhead:
    """A stage's own last outputs (`Stage.reads_back`), read and hashed on a thread while the stage
    before it runs: an update's stage reads back its whole last tables before it can start (the
    decompose stage 2.5-3 s of them at 100,000 passages), and the stage before leaves a core idle."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1)
        self._reads: dict[Path, Future] = {}

    def start(self, paths: list[Path]) -> None:
        for path in paths:
            if path not in self._reads:
                self._reads[path] = self._pool.submit(_read_back, path)

    def take(self, path: Path) -> tuple | None:
        """`_read_back(path)` as read ahead, if it is still the file read; else None."""
        read = self._reads.pop(path, None)
        if read is None:
            return None
        result = read.result()
        return result if result[0] is not None and result[0] == _file_stamp(path) else None

    def drop(self, paths: list[Path]) -> None:
        """Let go of what was read ahead for these paths and not taken (a stage that did not need it)."""
        for path in paths:
            read = self._reads.pop(path, None)
            if read is not None:
                read.cancel()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._reads.clear()


def _read_back(path: Path, use_threads: bool = False) -> tuple[tuple | None, str | None, pa.Table | None]:
    """(file stamp, checksum, table) of a stage file, read once; (None, None, None) when it cannot
    be read, no table when it does not parse. On one thread by default: a read ahead takes the
    core the running stage leaves."""
    stamp = _file_stamp(path)
    try:
        data = path.read_bytes()
    except OSError:
        return None, None, None
    try:
        table = pq.read_table(pa.BufferReader(data), use_threads=use_threads)
    except (OSError, pa.ArrowException):
        table = None
    return stamp, bytes_digest(data), table


def keep_tables_for(tables: dict | None, stages: tuple[Stage, ...]) -> None:
    """Let go of the run's tables that none of `stages` (those still to run) reads."""
    if tables:
        wanted = {output for stage in stages for output in stage.inputs}
        for key in [key for key in tables if key[0] not in wanted]:
            del tables[key]


class UndeclaredInput(RuntimeError):
    """A stage read a file it did not declare as an input: a defect of the stage, not of the input."""


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[StageRun], dict]
    inputs: tuple[Output, ...] = ()  # the other stages' files it reads (outputs.py)
    settings: tuple[str, ...] = ()  # config sections its output depends on; "engine": the engine's identity
    task: str | None = None  # the engine task whose usage is accounted to it
    outputs: tuple[Output, ...] = ()  # its files in stages/ (assemble: a generation instead; its function
    # returns the generation's contents digest as "outputs_digest", which saves hashing it again)
    reads_input: bool = False  # its fingerprint includes the scan of the input folder
    anchored: bool = False  # keeps its work against the last full build in an incremental update (anchor.py)
    reads_back: tuple[str, ...] = ()  # its own outputs the last run left that it reads again (`StageRun.last`)
    version: int | tuple[int, ...] = 0  # of its own definition, beside STAGE_VERSION: a change re-runs it alone

    def __post_init__(self):
        if any(o.stage != self.name for o in self.outputs):
            raise ValueError(f"stage {self.name} declares an output of another stage")

    def output(self, name: str) -> Output:
        for output in self.outputs:
            if output.file == name:
                return output
        raise ValueError(f"stage {self.name} declares no output {name}")

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(o.file for o in self.outputs)

    def read_back_paths(self, ws: Workspace, recorded: dict | None = None) -> list[Path]:
        """The files of `reads_back`; with `recorded`, those among them it holds checksums of."""
        return [self.output(name).path(ws) for name in self.reads_back if recorded is None or name in recorded]


def _failures_table(stage: str, failures: dict[str, str], final: bool) -> pa.Table:
    """A stage's failed items; `final`: no run would change them (`StageRun.commit_graph`)."""
    items = sorted(failures)
    return pa.table({"item": pa.array(items, pa.string()), "stage": pa.array([stage] * len(items), pa.string()),
                     "reason": pa.array([failures[i] for i in items], pa.string()),
                     "final": pa.array([final] * len(items), pa.bool_())})


# the stages' functions, in pipeline order -------------------------------------------------


def _chunk(run: StageRun) -> dict:
    run.reporter.stage_started(run.stage.name, None)
    settings = run.config.chunk
    last = [run.last(o.file) for o in (DOCUMENTS, CHUNKS)]
    previous = chunk.previous_chunks(*last, run.files, settings.chunk_tokens, settings.overlap_tokens,
                                     chunk.reader_identities(run.files))
    documents, chunks, counts = chunk.run(run.files, settings, previous, run.executor, run.ws.cache)
    run.ws.cache.touch(SCAN, [f.scan_key for f in run.files if f.scan_key])  # kept by `noderag gc`
    run.write_all({DOCUMENTS.file: documents, CHUNKS.file: chunks, CHUNK_IDS.file: anchor.chunks_table(chunks["chunk_id"])})
    failed = documents.filter(pc.equal(documents["status"], "failed"))
    for path, reason in zip(failed["path"].to_pylist(), failed["reason"].to_pylist(), strict=True):
        run.reporter.warn(f"could not read {path}: {reason}")
    return {"documents": documents.num_rows, "chunks": chunks.num_rows, "extracted": counts["extracted"],
            "failures": counts["failed"]}


def _decompose(run: StageRun) -> dict:
    chunks = run.read(CHUNKS)
    run.reporter.stage_started(run.stage.name, chunks.num_rows)
    rows_paths = (run.path(OCCURRENCES.file), run.path(LINKS.file))
    kept = [run.last(o.file) for o in (OCCURRENCES, LINKS)]
    spill = run.spill()
    rows, failures, work, changed, checkpoints = decompose.decompose_chunks(
        chunks, run.engine, run.ws.cache, run.reporter.advance,
        decompose.stored_rows(*kept) if all(t is not None for t in kept) else None, run.executor, spill.folder,
    )
    del kept
    last = tuple(run.last(name) for name in (NODES, EDGES)) if changed is not None else (None,)
    # each write goes on beside the work that follows it (Arrow encodes without the interpreter)
    with ThreadPoolExecutor(1) as pool:
        rows_written = pool.submit(rows.write, rows_paths)
        nodes, edges = rows.graph(last if all(t is not None for t in last) else None, changed)
        rows_written.result()
        rows.close()
        spill.close()
        del rows  # the stage's largest tables: let go before the vectors are made
        release_memory()
        committed = pool.submit(run.commit_graph, nodes, edges, failures)
        # every new S and T vector now, while the units are at hand: K-means and the embed stage find
        # them in memory; an update's other nodes have theirs there already, from the last build
        units, texts = nodes, chunks
        if changed is not None:
            units = nodes.filter(pc.is_in(nodes["id"], value_set=pc.unique(changed[0]["node"])))
            texts = chunks.filter(pc.is_in(chunks["chunk_id"], value_set=pc.unique(changed[0]["chunk"])))
        run.embedder.embed_ahead(units.filter(pc.equal(units["type"], "S"))["text"].to_pylist()
                                 + texts["text"].to_pylist())
        failed = committed.result()
    if decompose.forget_checkpoints(checkpoints, run.engine, run.ws.cache):
        run.ws.cache.compact()
    return {"nodes": nodes.num_rows, "edges": edges.num_rows, **failed, **work}


def _attributes(run: StageRun) -> dict:
    g = run.config.graph
    nodes, edges = run.nodes(DECOMPOSE_NODES), run.edges(DECOMPOSE_EDGES)
    run.reporter.stage_started(run.stage.name, None)
    kept_against, why = run.load_anchor()
    failed_before = run.last(FAILURES) if kept_against else None
    new_nodes, new_edges, failures, summaries = attributes.run(
        nodes, edges, run.engine, g.betweenness_pivots, g.seed, g.attribute_max_tokens, g.summary_leaf_tokens,
        run.reporter.advance, run.count_tokens(), anchor=kept_against,
        resummarize_share=run.config.index.resummarize_share,
        failed_before=None if failed_before is None else failed_before["item"].combine_chunks(),
    )
    run.embedder.embed_ahead(new_nodes["text"].to_pylist())
    anchor_chunks = kept_against.chunks if kept_against else run.read(CHUNK_IDS)["chunk_id"]
    failed = run.commit_graph(new_nodes, new_edges, failures, {ATTRIBUTE_SUMMARIES.file: summaries,
                                                               ANCHOR_CHUNKS.file: anchor.chunks_table(anchor_chunks)})
    return {"nodes": new_nodes.num_rows, "edges": new_edges.num_rows, **failed, **_anchor_info(kept_against, why, summaries)}


def _communities(run: StageRun) -> dict:
    g = run.config.graph
    node_outputs = (DECOMPOSE_NODES, ATTRIBUTE_NODES)
    ids = pa.concat_tables([run.read(output, ["id", "type"]) for output in node_outputs])
    by_id = pc.sort_indices(ids, [("id", "ascending")])
    graph = Graph.from_tables(ids.take(by_id), run.edges(DECOMPOSE_EDGES, ATTRIBUTE_EDGES))  # edges let go once in it
    del ids
    run.reporter.stage_started(run.stage.name, None)
    kept_against, why = run.load_anchor()
    membership = communities.membership(graph, kept_against, g.seed, g.leiden_resolution)
    release_memory()  # what Leiden freed, before the texts are read (into Arrow's pool, not the heap it freed)
    nodes = run.nodes(*node_outputs).take(by_id)  # read once the communities are found, sorted (one copy)
    new_nodes, new_edges, assignments, failures, summaries, centroids = communities.run(
        nodes, graph, membership, run.engine, run.embedder, g.seed, g.max_community_tokens,
        g.summary_leaf_tokens, run.reporter.advance, run.count_tokens(), anchor=kept_against,
        resummarize_share=run.config.index.resummarize_share,
    )
    failed = run.commit_graph(new_nodes, new_edges, failures, {ASSIGNMENTS.file: assignments.sort_by("id"),
                                                               COMMUNITY_SUMMARIES.file: summaries,
                                                               SEMANTIC_CENTROIDS.file: centroids})
    n_communities = len(set(assignments["community"].to_pylist()) - {-1})
    return {"nodes": new_nodes.num_rows, "edges": new_edges.num_rows, "communities": n_communities, **failed,
            **_anchor_info(kept_against, why, summaries)}


def _anchor_info(kept_against: anchor.Anchor | None, why: str, summaries: pa.Table) -> dict:
    """What an anchored stage reports: how it built its summaries, and how many it kept stale."""
    if kept_against is None:
        return {"update": f"full build ({why})"}
    return {"update": f"incremental ({why})", "stale": int(pc.sum(summaries["stale"]).as_py() or 0)}


def _text(run: StageRun) -> dict:
    run.reporter.stage_started(run.stage.name, None)
    nodes, edges = text.run(run.read(CHUNKS), run.read(DECOMPOSE_NODES))
    run.write_graph(nodes, edges)
    return {"nodes": nodes.num_rows, "edges": edges.num_rows}


def _embed(run: StageRun) -> dict:
    # the embedded nodes' ids and texts alone, each table filtered as it is read: not every column of every node
    nodes = pa.concat_tables([embed.embedded(run.read(output, embed.COLUMNS)) for output in NODE_OUTPUTS])
    run.reporter.stage_started(run.stage.name, None)
    ids, index = embed.run(nodes, run.embedder)
    spilled = run.embedder.spilled_mb  # the run's vectors held in files until now (a run over its memory budget)
    run.embedder.forget()  # every vector is in the index now; the stages after read them from its file
    run.write(VECTOR_IDS.file, ids)
    atomic_write_with(run.path(VECTORS.file), lambda name: faiss.write_index(index, name))
    return {"vectors": ids.num_rows, "dim": index.d, **({"spilled_mb": spilled} if spilled else {})}


def _similarity(run: StageRun) -> dict:
    id_column = run.read(VECTOR_IDS, ["id"])["id"].combine_chunks()
    ids = id_column.to_pylist()
    run.reporter.stage_started(run.stage.name, len(ids))  # counted in rows whose candidates are found
    vectors = ivf.read_stored(run.input_path(VECTORS))  # mapped: only the quantised copy is held whole
    settings = run.config.similarity
    signature = {"model": run.embedder.model_id, "neighbours": settings.neighbours,
                 "version": similarity_edges.VERSION}
    keys = similarity_edges.keys(ids, vectors)
    info = {}
    if len(ids) < settings.exact_below:
        earlier = run.last(NEIGHBOURS.file)
        neighbours = similarity_edges.neighbour_lists(keys, vectors, settings.neighbours,
                                                      _previous_neighbours(earlier, signature), run.reporter.advance)
    else:
        centroids, info = _anchored_centroids(run, vectors.shape[1])
        signature |= {"probes": settings.probes, "seed": run.config.graph.seed}
        earlier = run.last(NEIGHBOURS.file) if centroids is not None else None
        previous = _previous_neighbours(earlier, _clustered(signature, centroids)) if centroids is not None else None
        spill = run.spill()
        neighbours = similarity_edges.clustered_lists(keys, vectors, settings.neighbours, run.config.graph.seed,
                                                      settings.probes, similarity_edges.ASSIGN, centroids, previous,
                                                      run.reporter.advance, spill)
        signature = _clustered(signature, neighbours.centroids)
        spill.close()
        if spill.spilled:
            info["spilled_mb"] = spill.spilled_mb
    pairs = similarity_edges.pairs(neighbours)
    edges = edge_rows(id_column.take(pairs[:, 0]), id_column.take(pairs[:, 1]), "similarity", hnsw=True)
    table = similarity_edges.to_table(keys, neighbours)
    run.write_all({EDGES: edges,
                   NEIGHBOURS.file: table.replace_schema_metadata({"noderag": json.dumps(signature, sort_keys=True)}),
                   SIMILARITY_CENTROIDS.file: anchor.centroids_table(neighbours.centroids, run.embedder.model_id)})
    return {"edges": edges.num_rows, "rows_searched": neighbours.searched, "rows_pruned": neighbours.pruned, **info}


def _anchored_centroids(run: StageRun, dim: int) -> tuple[np.ndarray | None, dict]:
    """The clustered index an incremental update keeps (the last full build's centroids), or None
    (the lists are a full build's: trained centroids), and what the stage reports about it."""
    kept_against, why = run.load_anchor()
    if kept_against is None:
        return None, {"update": f"full build ({why})"}
    centroids = kept_against.centroids(anchor.SIMILARITY_CENTROIDS, run.embedder.model_id, dim)
    if centroids is None:
        return None, {"update": "full build (the last full build has no clustered index for these vectors)"}
    return centroids, {"update": f"incremental ({why})"}


def _clustered(signature: dict, centroids: np.ndarray) -> dict:
    """The signature of lists drawn from the clustered index of `centroids`."""
    digest = hashlib.blake2b(np.ascontiguousarray(centroids, np.float32).tobytes(), digest_size=16).hexdigest()
    return {**signature, "clustered": True, "centroids": digest}


def _assemble(run: StageRun) -> dict:
    run.reporter.stage_started(run.stage.name, None)
    kept_against, _ = run.load_anchor()
    centroids = kept_against.centroids(anchor.VECTOR_SIDE_CENTROIDS, run.embedder.model_id, run.embedder.dim) \
        if kept_against else None
    return assemble.run(run, run.config, run.embedder, lambda: kill_point("assemble", "publish"), centroids)


def _previous_neighbours(table: pa.Table | None, signature: dict) -> pa.Table | None:
    """The neighbour lists of the last completed similarity stage, if made with these settings."""
    if table is None:
        return None
    metadata = table.schema.metadata or {}
    return table if metadata.get(b"noderag") == json.dumps(signature, sort_keys=True).encode() else None


ASSEMBLED = (CHUNKS, CHUNK_IDS, DOCUMENTS, *NODE_OUTPUTS, ASSIGNMENTS, ATTRIBUTE_SUMMARIES, ANCHOR_CHUNKS, COMMUNITY_SUMMARIES,
             SEMANTIC_CENTROIDS, VECTOR_IDS, VECTORS, SIMILARITY_CENTROIDS, *EDGE_OUTPUTS)
"""What assemble reads: the graph, its documents and vectors, and the anchor's files (anchor.FILES)."""


STAGES: tuple[Stage, ...] = (
    Stage("chunk", _chunk, settings=("chunk", "readers"), outputs=(DOCUMENTS, CHUNKS, CHUNK_IDS), reads_input=True,
          reads_back=(DOCUMENTS.file, CHUNKS.file), version=1),
    Stage("decompose", _decompose, inputs=(CHUNKS,), settings=("engine",), task="decompose",
          outputs=(DECOMPOSE_NODES, DECOMPOSE_EDGES, DECOMPOSE_FAILURES, OCCURRENCES, LINKS),
          reads_back=(OCCURRENCES.file, LINKS.file, NODES, EDGES)),
    Stage("attributes", _attributes, inputs=(DECOMPOSE_NODES, DECOMPOSE_EDGES, CHUNK_IDS),
          settings=("engine", "graph", "index"), task="attributes",
          outputs=(ATTRIBUTE_NODES, ATTRIBUTE_EDGES, ATTRIBUTE_FAILURES, ATTRIBUTE_SUMMARIES, ANCHOR_CHUNKS),
          reads_back=(NODES, FAILURES), anchored=True),
    Stage("communities", _communities,
          inputs=(DECOMPOSE_NODES, DECOMPOSE_EDGES, ATTRIBUTE_NODES, ATTRIBUTE_EDGES, CHUNK_IDS),
          settings=("engine", "graph", "embedding", "index"), task="community_elements",
          outputs=(COMMUNITY_NODES, COMMUNITY_EDGES, ASSIGNMENTS, COMMUNITY_FAILURES, COMMUNITY_SUMMARIES,
                   SEMANTIC_CENTROIDS), reads_back=(NODES,), anchored=True),
    Stage("text", _text, inputs=(CHUNKS, DECOMPOSE_NODES), outputs=(TEXT_NODES, TEXT_EDGES)),
    Stage("embed", _embed, inputs=NODE_OUTPUTS, settings=("embedding",), outputs=(VECTOR_IDS, VECTORS)),
    Stage("similarity", _similarity, inputs=(VECTOR_IDS, VECTORS, CHUNK_IDS),
          settings=("embedding", "similarity", "graph", "index"),
          outputs=(NEIGHBOURS, SIMILARITY_CENTROIDS, SIMILARITY_EDGES), reads_back=(NEIGHBOURS.file,), anchored=True),
    Stage("assemble", _assemble, inputs=ASSEMBLED, settings=("config",),
          version=(prepare.VERSION, GENERATION_VERSION), anchored=True),
)


STAGE_NAMES = tuple(s.name for s in STAGES)


BY_NAME = {s.name: s for s in STAGES}


def kill_point(stage: str, point: str) -> None:
    """The test hook described in the module docstring."""
    if os.environ.get(KILL_ENV) == f"{stage}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)
