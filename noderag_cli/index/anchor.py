"""The anchor of an incremental update: what the last full build summarised, and from which texts.

An incremental update (`index.update: incremental`, the default) keeps an entity's attribute and a
community's elements while the texts they were written from changed by at most
`index.resummarize_share`, and keeps the communities of the last full build, new nodes joining
them (communities.py). What it keeps them against is the anchor: each summary's result and the
hashes of the texts it was written from, the community of every node, and the chunks of the last
full build (to tell how much of the corpus changed since), and the centroids its global
clusterings trained (the similarity lists' clustered index at scale, similarity_edges.py; the
K-means of the communities' semantic matching, communities.py; the search's vector side,
search/prepare.py): an update keeps them, each new vector joining its nearest centroid, so the
groups of unchanged vectors stay and nothing is trained.

The anchor is read from the published generation, never from a stage's own files: CURRENT only
changes when a run publishes, so an update killed anywhere resumes against the same anchor and
ends in the same bytes. A summary kept keeps the hashes it was written from, so a run of small
updates adds up until the share is passed, rather than each small change resetting it.

A run is a full build (no anchor) in exact mode, on `index --rebuild`, on a workspace without
one, and once more than `index.rebuild_after` of the chunks changed since the last full build.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..config import IndexConfig
from ..errors import WorkspaceError
from ..generation import Generation
from ..workspace import Workspace
from . import outputs

SUMMARIES_SCHEMA = pa.schema([
    ("key", pa.string()),  # the entity's node id, or the community's label
    ("inputs", pa.list_(pa.string())),  # the hashes of the texts it was written from (sorted)
    ("texts", pa.list_(pa.string())),  # its result: an attribute's one text, a community's element descriptions
    ("titles", pa.list_(pa.string())),  # a community's element titles (an attribute: none)
    ("stale", pa.bool_()),  # kept although its texts changed since it was written
])
CHUNKS_SCHEMA = pa.schema([("chunk_id", pa.string())])
CENTROIDS_SCHEMA = pa.schema([("centroid", pa.list_(pa.float32()))])  # none where nothing was trained

# the anchor's files in a generation, written by assemble from the stages' outputs of the same names
ATTRIBUTE_SUMMARIES = "attribute_summaries"
COMMUNITY_SUMMARIES = "community_summaries"
ANCHOR_CHUNKS = "anchor_chunks"
SIMILARITY_CENTROIDS = "similarity_centroids"
SEMANTIC_CENTROIDS = "semantic_centroids"
FILES = {ATTRIBUTE_SUMMARIES: outputs.ATTRIBUTE_SUMMARIES, COMMUNITY_SUMMARIES: outputs.COMMUNITY_SUMMARIES,
         ANCHOR_CHUNKS: outputs.ANCHOR_CHUNKS, SIMILARITY_CENTROIDS: outputs.SIMILARITY_CENTROIDS,
         SEMANTIC_CENTROIDS: outputs.SEMANTIC_CENTROIDS}
VECTOR_SIDE_CENTROIDS = "cluster_centroids"  # the search's own (search/prepare.py), unit length, not a link


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True)
class Summary:
    inputs: frozenset[str]
    texts: tuple[str, ...]
    titles: tuple[str, ...]


@dataclass
class Anchor:
    """What an incremental update keeps its summaries, communities and similarity lists against.
    The summaries are read into dicts when a stage first asks for them."""

    chunks: pa.Array  # the chunk ids of the last full build
    attribute_table: pa.Table  # SUMMARIES_SCHEMA
    community_table: pa.Table
    node_ids: pa.Array  # the nodes the last build clustered,
    node_labels: np.ndarray  # and their communities
    trained: dict[str, tuple[np.ndarray, str]]  # centroids (clusters, dim) and the embedding model, by name
    changed_share: float

    def centroids(self, name: str, model: str, dim: int) -> np.ndarray | None:
        """The centroids of `name` (SIMILARITY_CENTROIDS, ...) if the last full build trained them on
        vectors of this `model` and `dim`: vectors of another model are not near them."""
        centroids, trained_on = self.trained.get(name, (None, None))
        return centroids if centroids is not None and trained_on == model and centroids.shape[1] == dim else None

    @cached_property
    def attributes(self) -> dict[str, Summary]:
        """By entity node id."""
        return _summaries(self.attribute_table, str)

    @cached_property
    def communities(self) -> dict[int, Summary]:
        """By community label."""
        return _summaries(self.community_table, int)

    def kept(self, summaries: dict, key, inputs: list[str], share: float) -> Summary | None:
        """The anchor's summary for `key` if its texts changed by at most `share` of them."""
        summary = summaries.get(key)
        if summary is None:
            return None
        now = set(inputs)
        return summary if len(summary.inputs ^ now) <= share * max(len(summary.inputs), 1) else None


def changed_share(anchor_chunks: pa.Array, chunk_ids: pa.Array) -> float:
    """The share of chunks added or removed since the anchor, over the chunks of either (a changed
    chunk counts once removed and once added): 1 - |A ∩ B| / |A ∪ B|."""
    a, b = pc.unique(anchor_chunks), pc.unique(chunk_ids)
    common = int(pc.sum(pc.is_in(a, value_set=b)).as_py() or 0)
    union = len(a) + len(b) - common
    return 0.0 if union == 0 else 1.0 - common / union


def full_build_reason(config: IndexConfig, rebuild: bool) -> str | None:
    if config.update == "exact":
        return "exact mode"
    if rebuild:
        return "--rebuild"
    return None


def load(source: Workspace, config: IndexConfig, chunk_ids: pa.Array, rebuild: bool) -> tuple[Anchor | None, str]:
    """The anchor this run keeps its summaries against, or None and why the run builds them in full."""
    reason = full_build_reason(config, rebuild)
    if reason is not None:
        return None, reason
    try:
        generation = source.open_generation()
    except WorkspaceError:
        return None, "no earlier build"
    try:
        files = tuple(f"{name}.parquet" for name in FILES)
        if not all(file in generation.manifest.get("files", {}) for file in files):
            return None, "the earlier build has no anchor"
        # a flipped bit would keep summaries against the wrong texts
        damaged = generation.verify((*files, f"{VECTOR_SIDE_CENTROIDS}.npy"))
        if damaged:
            return None, f"workspace file {damaged[0]}"
        anchor = _read(generation, chunk_ids)
    except WorkspaceError:  # a damaged anchor file: `index` checks the generation's files before it runs
        return None, "the earlier build's anchor cannot be read"
    finally:
        generation.close()
    if anchor.changed_share > config.rebuild_after:
        return None, (f"{anchor.changed_share:.0%} of the chunks changed since the last full build "
                      f"(over index.rebuild_after, {config.rebuild_after:.0%})")
    return anchor, f"{anchor.changed_share:.0%} of the chunks changed since the last full build"


def _read(generation: Generation, chunk_ids: pa.Array) -> Anchor:
    chunks = generation.table(ANCHOR_CHUNKS)["chunk_id"]
    nodes = generation.table("nodes", ["id", "community"])
    nodes = nodes.filter(pc.greater_equal(nodes["community"], 0))
    trained = {name: centroids_of(generation.table(name)) for name in (SIMILARITY_CENTROIDS, SEMANTIC_CENTROIDS)}
    if f"{VECTOR_SIDE_CENTROIDS}.npy" in generation.manifest.get("files", {}):
        trained[VECTOR_SIDE_CENTROIDS] = (np.array(generation.array(VECTOR_SIDE_CENTROIDS), np.float32),
                                          generation.manifest.get("embedding", {}).get("model"))
    return Anchor(chunks, generation.table(ATTRIBUTE_SUMMARIES), generation.table(COMMUNITY_SUMMARIES),
                  nodes["id"].combine_chunks(), nodes["community"].to_numpy().astype(np.int64),
                  {name: value for name, value in trained.items() if value[0] is not None},
                  changed_share(chunks, chunk_ids))


def _summaries(table: pa.Table, key_type) -> dict:
    return {key_type(row["key"]): Summary(frozenset(row["inputs"]), tuple(row["texts"]), tuple(row["titles"]))
            for row in table.to_pylist()}


def summaries_table(rows: list[tuple[str, list[str], list[str], list[str], bool]]) -> pa.Table:
    """(key, input hashes, texts, titles, stale) per summary, sorted by key."""
    rows = sorted(rows, key=lambda r: r[0])
    return pa.table({"key": [r[0] for r in rows], "inputs": [sorted(r[1]) for r in rows],
                     "texts": [list(r[2]) for r in rows], "titles": [list(r[3]) for r in rows],
                     "stale": [r[4] for r in rows]}, schema=SUMMARIES_SCHEMA)


def centroids_table(centroids: np.ndarray | None, model: str) -> pa.Table:
    """Trained centroids, one row each (none when nothing was trained), and the embedding model of
    the vectors they were trained on."""
    metadata = {"model": model}
    if centroids is None:
        return CENTROIDS_SCHEMA.empty_table().replace_schema_metadata(metadata)
    flat = pa.array(np.ascontiguousarray(centroids, np.float32).ravel())
    offsets = pa.array(np.arange(0, len(flat) + 1, centroids.shape[1], dtype=np.int32))
    return pa.table({"centroid": pa.ListArray.from_arrays(offsets, flat)},
                    schema=CENTROIDS_SCHEMA.with_metadata(metadata))


def centroids_of(table: pa.Table) -> tuple[np.ndarray | None, str | None]:
    """(centroids, model) of `centroids_table`."""
    model = (table.schema.metadata or {}).get(b"model")
    if table.num_rows == 0:
        return None, None
    flat = pc.list_flatten(table["centroid"].combine_chunks()).to_numpy().astype(np.float32)
    return flat.reshape(table.num_rows, -1), model.decode() if model else None


def chunks_table(chunk_ids) -> pa.Table:
    ids = sorted(set(chunk_ids.to_pylist() if isinstance(chunk_ids, pa.Array | pa.ChunkedArray) else chunk_ids))
    return pa.table({"chunk_id": pa.array(ids, pa.string())}, schema=CHUNKS_SCHEMA)
