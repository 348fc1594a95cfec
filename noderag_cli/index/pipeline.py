"""Runs the indexing stages in order, each checkpointed in the manifest.

A stage is skipped when its fingerprint (its settings, the engine, and the digests of
the upstream outputs it reads) matches the last committed run, its outputs are on disk
with the digest recorded, and it left no failed items; otherwise it runs, commits its
outputs atomically, and only then is marked done. Since every stage is a pure function
of its inputs (caches only save work: chunking, decompositions, token counts and vectors
are looked up by content), an interrupted, resumed or incremental run yields the same
tables as a fresh build of the same folder. Graph-wide steps (betweenness, Leiden,
K-means) always run on the whole updated graph; similarity edges reuse the neighbour lists
a change does not touch (see similarity_edges).

Test hook (documented here because it is not a feature): when the environment variable
`NODERAG_TEST_KILL_AT` is `<stage>:start`, `<stage>:<n>` or `<stage>:commit`, the run
SIGKILLs itself when that stage starts, after it reported n finished items, or after it
wrote its outputs but before the manifest records it done. Tests use it to crash a real
`noderag index` process at a chosen point.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .. import nlp
from ..config import Config, config_to_yaml
from ..embeddings import Embedder
from ..engines.base import Engine, EngineStats
from ..graph import NODE_COLUMNS, NODE_SCHEMA, NODE_TYPES, edge_rows, merge_edges
from ..workspace import Workspace, WorkspaceError, atomic_write_bytes, file_digest, json_digest, write_parquet
from . import attributes, chunk, communities, decompose, embed, similarity_edges, text

STAGES = ("chunk", "decompose", "attributes", "communities", "text", "embed", "similarity")
STAGE_VERSION = 4  # 4: betweenness pivots drawn by hashed id; a workspace of 3 re-derives its tables

# config sections (plus "engine") each stage's output depends on
STAGE_SETTINGS = {
    "chunk": ["chunk"],
    "decompose": ["engine"],
    "attributes": ["engine", "graph"],
    "communities": ["engine", "graph", "embedding"],
    "text": [],
    "embed": ["embedding"],
    "similarity": ["embedding", "similarity"],
}
UPSTREAM = {
    "chunk": [],
    "decompose": ["chunk"],
    "attributes": ["decompose"],
    "communities": ["decompose", "attributes"],
    "text": ["chunk", "decompose"],
    "embed": ["decompose", "attributes", "communities", "text"],
    "similarity": ["chunk", "decompose", "attributes", "communities", "text", "embed"],
}
ENGINE_TASK = {"decompose": "decompose", "attributes": "attributes", "communities": "community_elements"}
KILL_ENV = "NODERAG_TEST_KILL_AT"


class Reporter:
    """Progress hooks; the CLI shows them with Rich, the API default is silent."""

    def stage_started(self, stage: str, total: int | None) -> None: ...

    def advance(self, n: int = 1) -> None: ...

    def stage_finished(self, stage: str, seconds: float, skipped: bool) -> None: ...

    def warn(self, message: str) -> None: ...


@dataclass
class IndexResult:
    stages: dict[str, dict] = field(default_factory=dict)
    node_counts: dict[str, int] = field(default_factory=dict)
    edge_count: int = 0
    skipped_files: list[tuple[str, str]] = field(default_factory=list)
    failures: int = 0
    seconds: float = 0.0
    documents: dict[str, int] = field(default_factory=dict)  # new/changed/renamed/deleted/unchanged vs. last build


def stage_outputs(ws: Workspace, stage: str) -> list[Path]:
    if stage == "chunk":
        return [ws.path("documents.parquet"), ws.stage_path("chunk", "chunks.parquet")]
    if stage == "decompose":
        return [ws.stage_path(stage, n) for n in ("nodes.parquet", "edges.parquet", "failures.parquet",
                                                  "occurrences.parquet", "links.parquet")]
    if stage == "attributes":
        return [ws.stage_path(stage, n) for n in ("nodes.parquet", "edges.parquet", "failures.parquet")]
    if stage == "communities":
        return [ws.stage_path(stage, n) for n in ("nodes.parquet", "edges.parquet", "assignments.parquet", "failures.parquet")]
    if stage == "text":
        return [ws.stage_path(stage, n) for n in ("nodes.parquet", "edges.parquet")]
    if stage == "embed":
        return [ws.stage_path(stage, n) for n in ("ids.parquet", "vectors.npy")]
    return [ws.path("nodes.parquet"), ws.path("edges.parquet"), ws.path("vectors.faiss"),
            ws.stage_path("similarity", "documents.parquet"), ws.stage_path("similarity", "neighbours.parquet")]


def indexed_documents_path(ws: Workspace) -> Path:
    """The documents table of the last complete build: what nodes.parquet was built from."""
    return ws.stage_path("similarity", "documents.parquet")


def _failures_table(stage: str, failures: dict[str, str]) -> pa.Table:
    items = sorted(failures)
    return pa.table({"item": pa.array(items, pa.string()), "stage": pa.array([stage] * len(items), pa.string()),
                     "reason": pa.array([failures[i] for i in items], pa.string())})


def _write_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    atomic_write_bytes(path, buffer.getvalue())


def engine_settings(config: Config, engine_name: str) -> dict:
    """What decides an engine's output: its name (offline version or litellm model) and sampling settings."""
    return {"name": engine_name, **config.engine_signature()}


def _settings(config: Config, engine_name: str, stage: str) -> dict:
    sections = {}
    for name in STAGE_SETTINGS[stage]:
        sections[name] = engine_settings(config, engine_name) if name == "engine" else getattr(config, name).model_dump(mode="json")
    return sections


def settings_digest(config: Config, engine_name: str, stage: str) -> str:
    return json_digest({"version": STAGE_VERSION, "settings": _settings(config, engine_name, stage)})


def check_embedding_model(ws: Workspace, embedder: Embedder) -> None:
    manifest = ws.read_manifest()
    recorded = manifest.get("embedding")
    if recorded and (recorded["model"] != embedder.model_id or recorded["dim"] != embedder.dim):
        raise WorkspaceError(
            f"workspace {ws.root} holds vectors of {recorded['model']} (dim {recorded['dim']}), the config asks for "
            f"{embedder.model_id} (dim {embedder.dim}); use a new workspace for another embedding model"
        )


def _kill_point(stage: str, point: str) -> None:
    """The test hook described in the module docstring."""
    if os.environ.get(KILL_ENV) == f"{stage}:{point}":
        os.kill(os.getpid(), signal.SIGKILL)


class _StageProgress(Reporter):
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


def _outputs_intact(ws: Workspace, stage: str, entry: dict) -> bool:
    paths = stage_outputs(ws, stage)
    if not all(p.is_file() for p in paths):
        return False
    return json_digest([file_digest(p) for p in paths]) == entry.get("outputs")


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
    """{path: content hash} of the documents in the last complete build (empty when none, or
    when the final stage was interrupted and the final tables are not a complete build)."""
    path = indexed_documents_path(ws)
    if not path.is_file() or ws.read_manifest().get("stages", {}).get("similarity", {}).get("state") != "done":
        return {}
    table = pq.read_table(path, columns=["path", "content_hash", "status"])
    return {p: h for p, h, s in zip(table["path"].to_pylist(), table["content_hash"].to_pylist(),
                                    table["status"].to_pylist(), strict=True) if s == "indexed"}


def run_pipeline(
    ws: Workspace, input_folder: Path, config: Config, engine: Engine, embedder: Embedder,
    reporter: Reporter | None = None, stop_after: str | None = None,
) -> IndexResult:
    """Index input_folder into ws. Caller holds the workspace lock."""
    reporter = reporter or Reporter()
    log = ws.logger()
    started = time.perf_counter()
    check_embedding_model(ws, embedder)
    files = chunk.scan(input_folder, config.chunk.extensions, config.chunk.max_file_bytes)
    readable = [f for f in files if not f.reason]
    if not readable:
        detail = f" ({len(files)} skipped as unreadable)" if files else ""
        raise chunk.InputError(
            f"no readable {'/'.join(config.chunk.extensions)} files under {input_folder}{detail}; nothing was changed"
        )
    result = IndexResult(skipped_files=[(f.path, f.reason) for f in files if f.reason])
    for path, reason in result.skipped_files:
        reporter.warn(f"skipped {path}: {reason}")
        log.warning("skipped %s: %s", path, reason)
    changes = compare_documents(indexed_state(ws), {f.path: f.content_hash for f in readable})
    result.documents = {k: len(v) for k, v in changes.items()}
    scan_digest = json_digest([(f.path, f.content_hash) for f in files])
    log.info("run started: input %s, %s", Path(input_folder).resolve(), result.documents)

    manifest = ws.read_manifest()
    if manifest.get("embedding", {}).get("vectors") == embedder.vector_id and indexed_state(ws):
        _recall_vectors(ws, embedder)
    manifest["embedding"] = {"model": embedder.model_id, "dim": embedder.dim, "vectors": embedder.vector_id}
    manifest["input"] = str(Path(input_folder).resolve())
    ws.write_manifest(manifest)
    atomic_write_bytes(ws.config_path, config_to_yaml(config).encode())

    outputs_digest: dict[str, str] = {}
    for stage in STAGES:
        settings = settings_digest(config, engine.name, stage)
        fingerprint = json_digest(
            {"stage": stage, "settings": settings, "upstream": [outputs_digest[u] for u in UPSTREAM[stage]],
             "scan": scan_digest if stage == "chunk" else None}
        )
        entry = manifest["stages"].get(stage, {})
        if (entry.get("state") == "done" and entry.get("fingerprint") == fingerprint and not entry.get("failures")
                and _outputs_intact(ws, stage, entry)):
            outputs_digest[stage] = entry["outputs"]
            reporter.stage_finished(stage, 0.0, skipped=True)
            result.stages[stage] = {"skipped": True, "seconds": entry.get("seconds", 0.0)}
            log.info("stage %s unchanged, skipped", stage)
            if stage == stop_after:
                break
            continue
        manifest["stages"][stage] = {"state": "running", "fingerprint": fingerprint, "settings": settings}
        ws.write_manifest(manifest)
        log.info("stage %s started", stage)
        _kill_point(stage, "start")
        before = _snapshot(engine.stats)
        vectors_before = embedder.computed
        t0 = time.perf_counter()
        info = _run_stage(stage, ws, files, config, engine, embedder, _StageProgress(reporter, stage))
        seconds = time.perf_counter() - t0
        digest = json_digest([file_digest(p) for p in stage_outputs(ws, stage)])
        outputs_digest[stage] = digest
        _kill_point(stage, "commit")
        llm = _delta(before, engine.stats, ENGINE_TASK.get(stage))
        info["vectors_computed"] = embedder.computed - vectors_before
        manifest["stages"][stage] = {"state": "done", "fingerprint": fingerprint, "settings": settings,
                                     "outputs": digest, "seconds": round(seconds, 3), "llm": llm, **info}
        ws.write_manifest(manifest)
        reporter.stage_finished(stage, seconds, skipped=False)
        result.stages[stage] = {"skipped": False, "seconds": seconds, **info}
        log.info("stage %s done in %.2fs %s", stage, seconds, info)
        if stage == stop_after:
            break
    result.seconds = time.perf_counter() - started
    result.failures = sum(s.get("failures", 0) for s in manifest["stages"].values())
    if ws.path("nodes.parquet").is_file() and manifest["stages"].get("similarity", {}).get("state") == "done":
        types = ws.read_table(ws.path("nodes.parquet"), ["type"])["type"].to_pylist()
        result.node_counts = {t: types.count(t) for t in NODE_TYPES}
        result.edge_count = pq.ParquetFile(ws.path("edges.parquet")).metadata.num_rows
    log.info("run finished in %.2fs, %d failures", result.seconds, result.failures)
    return result


class TokenCounter:
    """`nlp.count_tokens` through the workspace cache (namespace "tokens", key: the text's digest):
    token counts of unchanged nodes are looked up, not re-tokenised, in an update."""

    def __init__(self, cache):
        self.cache = cache

    def __call__(self, texts: list[str]) -> list[int]:
        keys = [hashlib.blake2b(t.encode("utf-8"), digest_size=12).hexdigest() for t in texts]
        found = self.cache.get_many("tokens", keys)
        todo = list({k: t for k, t in zip(keys, texts, strict=True) if k not in found}.items())
        if todo:
            counts = nlp.count_tokens([t for _, t in todo])
            fresh = [(k, str(c).encode()) for (k, _), c in zip(todo, counts, strict=True)]
            self.cache.put_many("tokens", fresh)
            found.update(fresh)
        return [int(found[k]) for k in keys]


def _recall_vectors(ws: Workspace, embedder: Embedder) -> None:
    """The last complete build's vectors, by text, into the embedder's memory: an update's unchanged
    nodes then cost no cache look-up (9,000 of them took ~0.1 s on MuSiQue)."""
    try:
        nodes = ws.read_table(ws.path("nodes.parquet"), ["text", "vector_row"])
        index = faiss.read_index(str(ws.path("vectors.faiss")))
    except (OSError, RuntimeError, pa.ArrowInvalid, WorkspaceError):
        return  # a damaged earlier build: the cache still has every vector
    rows = nodes["vector_row"].to_numpy()
    embedded = np.flatnonzero(rows >= 0)
    if index.ntotal != len(embedded) or (len(embedded) and rows.max() >= index.ntotal):
        return
    vectors = index.reconstruct_n(0, index.ntotal) if index.ntotal else np.zeros((0, embedder.dim), np.float32)
    embedder.remember(nodes["text"].take(pa.array(embedded)).to_pylist(), vectors[rows[embedded]])


def _snapshot(stats: EngineStats) -> dict:
    return {k: dict(vars(v)) for k, v in stats.by_task.items()}


def _delta(before: dict, stats: EngineStats, task: str | None) -> dict:
    if task is None or task not in stats.by_task:
        return {}
    now = vars(stats.by_task[task])
    prior = before.get(task, {})
    return {k: round(v - prior.get(k, 0), 6) if isinstance(v, float) else v - prior.get(k, 0) for k, v in now.items()}


def _read(ws: Workspace, stage: str, name: str) -> pa.Table:
    return ws.read_table(ws.stage_path(stage, name))


def _run_stage(stage: str, ws: Workspace, files, config: Config, engine: Engine, embedder: Embedder,
               reporter: Reporter) -> dict:
    g = config.graph
    counter = TokenCounter(ws.cache)
    if stage == "chunk":
        reporter.stage_started(stage, None)
        documents, chunks = chunk.run(files, config.chunk.chunk_tokens, config.chunk.overlap_tokens, ws.cache)
        write_parquet(ws.path("documents.parquet"), documents)
        write_parquet(ws.stage_path("chunk", "chunks.parquet"), chunks)
        return {"documents": documents.num_rows, "chunks": chunks.num_rows}
    if stage == "decompose":
        chunks = _read(ws, "chunk", "chunks.parquet")
        reporter.stage_started(stage, chunks.num_rows)
        rows_paths = (ws.stage_path(stage, "occurrences.parquet"), ws.stage_path(stage, "links.parquet"))
        occurrences, links, failures, work = decompose.decompose_chunks(
            chunks, engine, ws.cache, reporter.advance, engine_settings(config, engine.name),
            decompose.read_rows(*rows_paths), counter,
        )
        nodes, edges = decompose.build_graph(occurrences, links)
        # every S and T vector now, while the units are at hand: K-means and the embed stage find them cached
        embedder.embed(nodes.filter(pc.equal(nodes["type"], "S"))["text"].to_pylist() + chunks["text"].to_pylist())
        _commit(ws, stage, nodes, edges, failures)
        for path, table in zip(rows_paths, (occurrences, links), strict=True):
            write_parquet(path, decompose.with_version(table))
        return {"nodes": nodes.num_rows, "edges": edges.num_rows, "failures": len(failures), **work}
    if stage == "attributes":
        nodes, edges = _read(ws, "decompose", "nodes.parquet"), _read(ws, "decompose", "edges.parquet")
        reporter.stage_started(stage, None)
        new_nodes, new_edges, failures = attributes.run(
            nodes, edges, engine, g.betweenness_pivots, g.seed, g.attribute_max_tokens, reporter.advance, counter
        )
        embedder.embed(new_nodes["text"].to_pylist())
        _commit(ws, stage, new_nodes, new_edges, failures)
        return {"nodes": new_nodes.num_rows, "edges": new_edges.num_rows, "failures": len(failures)}
    if stage == "communities":
        nodes = pa.concat_tables([_read(ws, "decompose", "nodes.parquet"), _read(ws, "attributes", "nodes.parquet")])
        edges = merge_edges([_read(ws, "decompose", "edges.parquet"), _read(ws, "attributes", "edges.parquet")])
        reporter.stage_started(stage, None)
        new_nodes, new_edges, assignments, failures = communities.run(
            nodes.sort_by("id"), edges, engine, embedder, g.seed, g.leiden_resolution, g.max_community_tokens,
            reporter.advance, counter,
        )
        _commit(ws, stage, new_nodes, new_edges, failures)
        write_parquet(ws.stage_path(stage, "assignments.parquet"), assignments.sort_by("id"))
        n_communities = len(set(assignments["community"].to_pylist()) - {-1})
        return {"nodes": new_nodes.num_rows, "edges": new_edges.num_rows, "communities": n_communities,
                "failures": len(failures)}
    if stage == "text":
        reporter.stage_started(stage, None)
        nodes, edges = text.run(_read(ws, "chunk", "chunks.parquet"), _read(ws, "decompose", "nodes.parquet"))
        write_parquet(ws.stage_path(stage, "nodes.parquet"), nodes)
        write_parquet(ws.stage_path(stage, "edges.parquet"), edges)
        return {"nodes": nodes.num_rows, "edges": edges.num_rows}
    if stage == "embed":
        nodes = _all_stage_nodes(ws)
        reporter.stage_started(stage, None)
        ids, vectors = embed.run(nodes, embedder)
        write_parquet(ws.stage_path(stage, "ids.parquet"), pa.table({"id": pa.array(ids, pa.string())}))
        _write_npy(ws.stage_path(stage, "vectors.npy"), vectors)
        return {"vectors": len(ids), "dim": int(vectors.shape[1]) if len(ids) else embedder.dim}
    if stage == "similarity":
        reporter.stage_started(stage, None)
        return _assemble(ws, config, embedder)
    raise ValueError(stage)


def _commit(ws: Workspace, stage: str, nodes: pa.Table, edges: pa.Table, failures: dict[str, str]) -> None:
    write_parquet(ws.stage_path(stage, "nodes.parquet"), nodes)
    write_parquet(ws.stage_path(stage, "edges.parquet"), edges)
    write_parquet(ws.stage_path(stage, "failures.parquet"), _failures_table(stage, failures))


def _all_stage_nodes(ws: Workspace) -> pa.Table:
    return pa.concat_tables([_read(ws, s, "nodes.parquet") for s in ("decompose", "attributes", "communities", "text")])


def _previous_neighbours(ws: Workspace, signature: dict) -> pa.Table | None:
    """The neighbour lists of the last completed similarity stage, if made with these settings."""
    path = ws.stage_path("similarity", "neighbours.parquet")
    try:
        table = pq.read_table(path)
    except (OSError, pa.ArrowInvalid):
        return None
    metadata = table.schema.metadata or {}
    return table if metadata.get(b"noderag") == json.dumps(signature, sort_keys=True).encode() else None


def _doc_ids(chunk_lists: pa.ListArray, chunks: pa.Table) -> pa.ListArray:
    """Each node's documents, distinct and sorted, through its chunks (a chunk text that two
    documents share is one chunk of both)."""
    pairs = chunks.select(["chunk_id", "doc_id"]).sort_by([("chunk_id", "ascending"), ("doc_id", "ascending")])
    chunk_of_pair = pairs["chunk_id"].to_numpy(zero_copy_only=False)
    docs, doc_code = np.unique(pairs["doc_id"].to_numpy(zero_copy_only=False), return_inverse=True)
    chunk_ids, first, count = np.unique(chunk_of_pair, return_index=True, return_counts=True)
    lengths = pc.fill_null(pc.list_value_length(chunk_lists), 0).to_numpy()
    owner = np.repeat(np.arange(len(lengths)), lengths)
    found = pc.index_in(pc.list_flatten(chunk_lists), value_set=pa.array(chunk_ids, pa.string()))
    known = pc.is_valid(found).to_numpy(zero_copy_only=False)
    chunk = pc.fill_null(found, 0).to_numpy()[known]
    owner = np.repeat(owner[known], count[chunk])
    pair = np.repeat(first[chunk] - np.cumsum(np.r_[0, count[chunk]])[:-1], count[chunk]) + np.arange(len(owner))
    codes = np.unique(owner.astype(np.int64) * len(docs) + doc_code[pair])
    offsets = np.r_[0, np.cumsum(np.bincount(codes // max(len(docs), 1), minlength=len(lengths)))].astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(docs[codes % max(len(docs), 1)], pa.string()))


def _final_nodes(ws: Workspace, ids: list[str], vectors: np.ndarray) -> pa.Table:
    """Write nodes.parquet (doc ids through chunk ids, vector rows, communities) and vectors.faiss."""
    nodes = _all_stage_nodes(ws).sort_by("id")
    doc_ids = _doc_ids(nodes["chunk_ids"].combine_chunks(), _read(ws, "chunk", "chunks.parquet"))
    assignments = _read(ws, "communities", "assignments.parquet")
    community = pc.take(assignments["community"], pc.index_in(nodes["id"], value_set=assignments["id"]))
    columns = {name: nodes[name] for name in NODE_COLUMNS}
    columns["doc_ids"] = doc_ids
    columns["community"] = pc.fill_null(community, -1).cast(pa.int32())
    columns["vector_row"] = pc.fill_null(pc.index_in(nodes["id"], value_set=pa.array(ids, pa.string())), -1).cast(pa.int32())
    final = pa.table(columns).cast(NODE_SCHEMA)
    write_parquet(ws.path("nodes.parquet"), final)
    index = similarity_edges.flat_index(vectors)
    atomic_write_bytes(ws.path("vectors.faiss"), faiss.serialize_index(index).tobytes())
    return final


def _assemble(ws: Workspace, config: Config, embedder: Embedder) -> dict:
    """Similarity edges, the vector index, and the final nodes/edges tables. The nodes table and the
    index do not depend on the similarity edges: they are written on a second thread meanwhile."""
    ids = _read(ws, "embed", "ids.parquet")["id"].to_pylist()
    vectors = np.load(ws.stage_path("embed", "vectors.npy"), allow_pickle=False)
    with ThreadPoolExecutor(1) as pool:
        final = pool.submit(_final_nodes, ws, ids, vectors)
        id_array = np.asarray(ids, dtype=object)
        signature = {"model": embedder.model_id, "neighbours": config.similarity.neighbours,
                     "version": similarity_edges.VERSION}
        keys = similarity_edges.keys(ids, vectors)
        neighbours = similarity_edges.neighbour_lists(keys, vectors, config.similarity.neighbours,
                                                      _previous_neighbours(ws, signature))
        pairs = similarity_edges.pairs(neighbours)
        similarity = edge_rows(pa.array(id_array[pairs[:, 0]].tolist(), pa.string()),
                               pa.array(id_array[pairs[:, 1]].tolist(), pa.string()), "similarity", hnsw=True)
        structural = [_read(ws, s, "edges.parquet") for s in ("decompose", "attributes", "communities", "text")]
        edges = merge_edges([*structural, similarity])
        write_parquet(ws.path("edges.parquet"), edges)
        table = similarity_edges.to_table(keys, neighbours)
        write_parquet(ws.stage_path("similarity", "neighbours.parquet"),
                      table.replace_schema_metadata({"noderag": json.dumps(signature, sort_keys=True)}))
        final_rows = final.result().num_rows
    write_parquet(indexed_documents_path(ws), ws.read_table(ws.path("documents.parquet")))
    hnsw_edges = int(pc.sum(edges["hnsw"]).as_py() or 0)
    return {"nodes": final_rows, "edges": edges.num_rows, "hnsw_edges": hnsw_edges,
            "structural_edges": int(pc.sum(pc.not_equal(edges["kind"], "similarity")).as_py() or 0),
            "rows_searched": neighbours.searched, "rows_pruned": neighbours.pruned}
