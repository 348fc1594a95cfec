"""The last stage: the final node and edge tables, the vector index and every structure the search
reads, written as a new generation, then made current by one atomic rename of CURRENT.

A generation holds (see `workspace.py` for where it lives):
- the node and edge tables (`workspace.NODES`, `EDGES`): the heterograph (`graph.NODE_SCHEMA`, `graph.EDGE_SCHEMA`);
- documents.parquet: the documents table the build was made from (`chunk.DOCUMENT_SCHEMA`);
- attribute_summaries, community_summaries and anchor_chunks (.parquet): the anchor of the next
  incremental update (`anchor.py`), second names of the attributes and communities stages' files;
- vectors.faiss: the flat inner-product index, in half precision (`ivf.flat_index`); row i is the node whose `vector_row` is i (a second
  name, a hard link, for the embed stage's file: every vector is stored once); vector_ids.parquet,
  the embed stage's ids of those nodes and the digests of their texts (`embed.ID_SCHEMA`);
- config.yaml: the config of the build, which `query` and `stats` read;
- the search's structures (`search/prepare.py`), and manifest.json: each file's size and
  checksum, the counts `stats` shows, the embedding model and what the search needs beside the
  arrays.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import ivf
from ..config import Config, config_to_yaml
from ..embeddings import Embedder
from ..errors import WorkspaceError
from ..files import ROW_GROUP
from ..generation import Generation
from ..graph import (
    EDGE_KINDS,
    EDGE_SCHEMA,
    NODE_COLUMNS,
    NODE_SCHEMA,
    EdgeArrays,
    IdRows,
    distinct,
    node_rows,
)
from ..node_types import NODE_TYPES
from ..search.prepare import EarlierText, edge_parts_of, prepare
from ..workspace import VECTOR_DIGESTS, Workspace
from . import anchor
from .outputs import (
    ASSIGNMENTS,
    CHUNK_IDS,
    CHUNKS,
    DOCUMENTS,
    EDGE_OUTPUTS,
    NODE_OUTPUTS,
    VECTOR_IDS,
    VECTORS,
    Reads,
)


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
    codes = distinct(owner.astype(np.int64) * len(docs) + doc_code[pair])
    offsets = np.r_[0, np.cumsum(np.bincount(codes // max(len(docs), 1), minlength=len(lengths)))].astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(docs[codes % max(len(docs), 1)], pa.string()))


def final_nodes(run: Reads, ids: pa.Array) -> pa.Table:
    """The nodes of every stage that makes them, sorted by id, with their documents (through their
    chunks), their community and their row in the vector index (`ids`: the embedded nodes')."""
    nodes = run.nodes(*NODE_OUTPUTS).sort_by("id")
    doc_ids = _doc_ids(nodes["chunk_ids"].combine_chunks(), run.read(CHUNKS))
    assignments = run.read(ASSIGNMENTS)  # sorted by id
    among = assignments["id"].combine_chunks()
    at = node_rows(among, nodes["id"], IdRows.of(among))
    community = np.full(len(at), -1, np.int32)
    community[at >= 0] = assignments["community"].to_numpy()[at[at >= 0]]
    columns = {name: nodes[name] for name in NODE_COLUMNS}
    columns["doc_ids"] = doc_ids
    columns["community"] = pa.array(community)
    columns["vector_row"] = pa.array(node_rows(ids, nodes["id"], IdRows.of(ids)).astype(np.int32))
    return pa.table(columns).cast(NODE_SCHEMA)


def counts(nodes: pa.Table, edges: EdgeArrays) -> dict:
    """What `stats` shows of a build, computed once here."""
    by_type = {t: 0 for t in NODE_TYPES}
    by_type.update({row["type"]: row["type_count"] for row in nodes.group_by("type").aggregate([("type", "count")]).to_pylist()})
    by_kind = np.bincount(edges.kind, minlength=len(EDGE_KINDS))
    return {"nodes": by_type,
            "vectors": int(pc.sum(pc.greater_equal(nodes["vector_row"], 0)).as_py() or 0),
            "edges": {"by_kind": {kind: int(count) for kind, count in sorted(zip(EDGE_KINDS, by_kind, strict=True))
                                  if count},
                      "hnsw": int(edges.hnsw.sum()),
                      "non_hnsw": int(len(edges.kind) - by_kind[EDGE_KINDS.index("similarity")]),
                      "merged_total": len(edges.kind)}}


def anchor_counts(run: Reads) -> dict:
    """How far this build is from its anchor (anchor.py): the share of the chunks changed since the
    last full build, and the summaries kept although their texts changed since they were written."""
    chunks = run.read(CHUNK_IDS)["chunk_id"]
    since = run.read(anchor.FILES[anchor.ANCHOR_CHUNKS])["chunk_id"]
    stale = {name: int(pc.sum(run.read(anchor.FILES[file], ["stale"])["stale"]).as_py() or 0)
             for name, file in (("stale_attributes", anchor.ATTRIBUTE_SUMMARIES),
                                ("stale_communities", anchor.COMMUNITY_SUMMARIES))}
    return {"changed_share": round(anchor.changed_share(since.combine_chunks(), chunks.combine_chunks()), 4), **stale}


def run(run: Reads, config: Config, embedder: Embedder, before_publish: Callable[[], None],
        centroids: np.ndarray | None = None) -> dict:
    """Write the build of the stages that make nodes and edges as a new generation and make it
    current; then remove the generations and the files of the older layout that no reader holds.
    `centroids`: the search's vector-side clusters an incremental update keeps (anchor.py)."""
    ws = run.ws
    ids = run.read(VECTOR_IDS, ["id"])["id"].combine_chunks()
    vector_file = run.input_path(VECTORS)
    vectors = ivf.read_stored(vector_file)  # mapped, half precision: prepare widens what it reads
    documents = run.read(DOCUMENTS)
    writer = ws.new_generation()
    with ThreadPoolExecutor(1) as writing:
        written = []

        def store(name: str, value: np.ndarray | pa.Table | bytes) -> None:
            """A file of the generation, encoded, written and hashed on a writing thread while the
            rest is made; the value is let go once written."""
            write = writer.array if isinstance(value, np.ndarray) else \
                writer.arrow if isinstance(value, pa.Table) else writer.raw
            written.append(writing.submit(write, name, value))

        nodes = final_nodes(run, ids)
        node_ids = nodes["id"].combine_chunks()
        edges = EdgeArrays.union([run.read(output) for output in EDGE_OUTPUTS], node_ids)
        # the edge table made and written a row group at a time (on the writing thread), not whole
        written.append(writing.submit(writer.table_parts, "edges", EDGE_SCHEMA, edges.tables(node_ids, ROW_GROUP)))
        parts = edge_parts_of(nodes.num_rows, edges)  # all the search needs of the edges
        built = counts(nodes, edges)
        del edges
        for name, table in (("nodes", nodes), ("documents", documents)):
            written.append(writing.submit(writer.table, name, table))
        writer.link("vectors.faiss", vector_file)  # the embed stage's file: the vectors are stored once
        writer.link(VECTOR_DIGESTS, run.input_path(VECTOR_IDS))  # by which the next update takes them back
        for name, output in anchor.FILES.items():  # what the next incremental update keeps its work against
            writer.link(f"{name}.parquet", run.input_path(output))
        writer.raw("config.yaml", config_to_yaml(config, build=True).encode())
        chunks = run.read(CHUNKS, ["chunk_id", "doc_id", "start", "end", "location"])
        with open_current(ws) as current:  # a cache: the new build's bytes are the same without it
            search_meta = prepare(store, nodes, parts, documents, vectors, config.search.similarity_weight,
                                  config.graph.seed, config.search.clustered_from, chunks, centroids,
                                  EarlierText.read(current, embedder.vector_id) if current is not None else None)
        for job in written:
            job.result()
    built["anchor"] = anchor_counts(run)
    embedding = {"model": embedder.model_id, "dim": embedder.dim, "vectors": embedder.vector_id}
    contents = writer.commit({"embedding": embedding, "counts": built, "query": search_meta})
    before_publish()
    ws.publish(writer.name)
    ws.remove_legacy_final()
    ws.remove_unused_generations()
    return {"outputs_digest": contents, "generation": writer.name, "nodes": nodes.num_rows,
            "edges": built["edges"]["merged_total"],
            "hnsw_edges": built["edges"]["hnsw"], "structural_edges": built["edges"]["non_hnsw"]}


@contextlib.contextmanager
def open_current(ws: Workspace) -> Iterator[Generation | None]:
    """The current build, held while in use; None when there is none or it cannot be opened (a
    build of the layout from before generations: `legacy_documents`)."""
    try:
        generation = ws.open_generation()
    except WorkspaceError:
        yield None
        return
    try:
        yield generation
    finally:
        generation.close()


def current_manifest(ws: Workspace) -> dict | None:
    with open_current(ws) as generation:
        return None if generation is None else generation.manifest


def current_contents(ws: Workspace) -> str | None:
    """The contents digest of the current generation when every file matches its checksum, else
    None (no build, a build of the older layout, or a damaged file): the assemble stage's
    outputs digest."""
    with open_current(ws) as generation:
        if generation is None or generation.verify():
            return None
        return generation.manifest["contents"]


def built_documents(ws: Workspace, columns: list[str]) -> pa.Table | None:
    """The documents table of the last complete build, or None."""
    with open_current(ws) as generation:
        if generation is None:
            return legacy_documents(ws, columns) if ws.has_legacy_build() else None
        try:
            return generation.table("documents", columns)
        except WorkspaceError:
            return None


def legacy_documents(ws: Workspace, columns: list[str]) -> pa.Table | None:
    """The documents of a build of the layout from before generations (final tables at the top of
    the workspace): the one thing read of it, so that the `index` run that moves it to a generation
    compares the folder against what that build held. Nothing else reads that layout."""
    path = ws.root / "stages" / "similarity.documents.parquet"
    return ws.read_table(path, columns) if path.is_file() else None

