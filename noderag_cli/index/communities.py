"""Stage 4: Leiden communities, high-level elements (H) and overviews (O), semantic matching
(paper §2.3 and appendix C.3).

Leiden runs (igraph's implementation, seeded, weighted, modularity) on the S/N/R/A graph. For each community the
engine reads its S and A member texts, cut to a token budget, and returns elements, each
a description (H) with a keyword title (O). Semantic matching then runs K-means (faiss,
seeded, K = ceil(sqrt(#S+#A+#H))) over the S, A and H vectors and links every H to the
S and A nodes that share both its community and its cluster.
"""

from __future__ import annotations

import math
import random
import sys
from collections import defaultdict
from collections.abc import Callable

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import nlp
from ..embeddings import Embedder
from ..engines.base import CommunityInput, Element, Engine, Failure
from ..graph import Graph, NodeSet, distinct, high_level_id, make_edges, merge_edges, overview_id, row_entries
from ..ivf import STORED_DTYPE
from ..node_types import COMMUNITY_CONTENT_TYPES
from . import summaries
from .anchor import SEMANTIC_CENTROIDS, Anchor, centroids_table, summaries_table, text_hash


def _igraph():
    """igraph, imported without its plotting layer.

    When matplotlib is installed, `import igraph` imports matplotlib.pyplot (0.75 s, half of
    a run's start-up time). We never plot, so matplotlib is hidden while igraph is imported
    (igraph then keeps a stub for plotting in this process); any later `import matplotlib`
    elsewhere works as usual.
    """
    if "igraph" in sys.modules:
        return sys.modules["igraph"]
    hide = "matplotlib" not in sys.modules
    if hide:
        sys.modules["matplotlib"] = None  # makes `import matplotlib` raise ImportError
    try:
        import igraph
    finally:
        if hide and sys.modules.get("matplotlib", 0) is None:
            del sys.modules["matplotlib"]
    return igraph


def leiden(graph: Graph, seed: int, resolution: float, iterations: int = 2) -> np.ndarray:
    """Community label per node (in the order of the graph's nodes): Leiden, modularity with resolution, weighted.

    Runs igraph's own C implementation of Leiden (`Graph.community_leiden`), seeded through a
    private `random.Random(seed)` handed to igraph for the call. The same algorithm and
    objective as `leidenalg.RBConfigurationVertexPartition` (the spec's wording), with the
    same quality on our graphs, and much faster, which matters because Leiden re-runs on the whole
    graph at every update.
    """
    return leiden_labels(len(graph.types), *graph.upper_edges(), seed, resolution, iterations)


def leiden_labels(n: int, rows: np.ndarray, cols: np.ndarray, weights: np.ndarray, seed: int, resolution: float,
                  iterations: int = 2) -> np.ndarray:
    """`leiden` on any weighted undirected graph of n nodes given as edge lists (each edge once)."""
    if n == 0:
        return np.zeros(0, dtype=np.int32)
    ig = _igraph()
    # the edges added to an empty graph, the weights handed to the call instead of kept as an edge
    # attribute: the constructor's conversion of an edge array and a Python float per edge are
    # the largest temporaries of the step, for the same graph and labels
    g = ig.Graph(n=n, directed=False)
    g.add_edges(np.column_stack([rows, cols]))
    ig.set_random_number_generator(random.Random(seed))
    try:
        clustering = g.community_leiden(
            objective_function="modularity", weights=np.asarray(weights, dtype=np.float64), resolution=resolution,
            n_iterations=iterations,
        )
    finally:
        ig.set_random_number_generator(random)
    return np.asarray(clustering.membership, dtype=np.int32)


def anchored(graph: Graph, anchor_ids: pa.Array, anchor_labels: np.ndarray, seed: int, resolution: float) -> np.ndarray:
    """Community label per node, the anchor's where the node was clustered then (`anchor_ids`,
    `anchor_labels`): a new node joins the community its edges weigh most to (ties: the lower
    label), a round at a time, so that a chain of new nodes joins through its first member; the new
    nodes no anchored node reaches are clustered among themselves (Leiden), under labels the anchor
    never used."""
    at = pc.index_in(graph.id_column, value_set=anchor_ids)
    found = pc.is_valid(at).to_numpy(zero_copy_only=False)
    labels = np.where(found, anchor_labels[pc.fill_null(at, 0).to_numpy()] if len(anchor_labels) else -1, -1)
    labels = labels.astype(np.int64)
    unused = int(anchor_labels.max()) + 1 if len(anchor_labels) else 0
    while True:
        free = np.flatnonzero(labels < 0)
        if not len(free):
            break
        entries = row_entries(graph.indptr, free)
        rows = np.repeat(np.arange(len(free)), graph.degree[free])
        joined = labels[graph.indices[entries]]
        known = joined >= 0
        if not known.any():
            break
        key, where = np.unique(rows[known] * unused + joined[known], return_inverse=True)
        total = np.bincount(where.ravel(), weights=graph.weights[entries][known])
        row, label = key // unused, key % unused
        order = np.lexsort((label, -total, row))  # per row: heaviest, then lowest label
        first = order[np.r_[True, row[order[1:]] != row[order[:-1]]]]
        labels[free[row[first]]] = label[first]
    rest = np.flatnonzero(labels < 0)
    if len(rest):
        position = np.full(len(labels), -1, np.int64)
        position[rest] = np.arange(len(rest))
        entries = row_entries(graph.indptr, rest)
        rows = np.repeat(np.arange(len(rest)), graph.degree[rest])
        cols = position[graph.indices[entries]]
        upper = rows < cols  # both ends free (a free node's neighbours are all free here), each edge once
        own = leiden_labels(len(rest), rows[upper], cols[upper], graph.weights[entries][upper], seed, resolution)
        labels[rest] = own + unused
    return labels.astype(np.int32)


KMEANS_SAMPLE = 256  # training points per centroid: faiss's default, which it samples itself beyond
ASSIGN_BLOCK = 65_536  # vectors widened to float32 and assigned at a time


def kmeans_labels(vectors: np.ndarray, seed: int, centroids: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray | None]:
    """Cluster of each vector, and the centroids: seeded spherical K-means, K = ceil(sqrt(n)). faiss
    splits each update's centroids among its threads, each summing its centroids' points in point
    order, so the clusters do not depend on the number of threads. Trained on at most 256 points
    per centroid: every point up to 65,536 vectors, where K x 256 reaches n; beyond, faiss's own
    seeded sample (`faiss.rand_perm`, as its training draws it: the same centroids), and training
    on all of them grew as n^1.5 for centroids no better. Only that sample and a block of vectors
    at a time are widened to float32 (`vectors` may be the half-precision rows the embedder holds:
    a float32 copy of every unit's vector would be the stage's largest array). With an anchor's
    `centroids` (an incremental update) nothing is trained: each vector joins its nearest, as the
    trained ones are assigned, so an unchanged vector keeps its cluster."""
    n = len(vectors)
    if centroids is None:
        k = max(1, math.ceil(math.sqrt(n)))
        if n <= k:
            return np.arange(n, dtype=np.int64), None
        km = faiss.Kmeans(vectors.shape[1], k, niter=20, seed=seed, spherical=True, min_points_per_centroid=1,
                          max_points_per_centroid=KMEANS_SAMPLE)
        sample = np.arange(n)
        if n > k * KMEANS_SAMPLE:
            order = np.empty(n, np.int32)
            faiss.rand_perm(faiss.swig_ptr(order), n, seed)
            sample = order[: k * KMEANS_SAMPLE]
        km.train(np.asarray(vectors[sample], np.float32))
        centroids = km.centroids
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(np.ascontiguousarray(centroids, dtype=np.float32))
    labels = [index.search(np.asarray(vectors[start : start + ASSIGN_BLOCK], np.float32), 1)[1].ravel()
              for start in range(0, n, ASSIGN_BLOCK)]
    return np.concatenate(labels) if labels else np.zeros(0, np.int64), centroids


def shown_members(graph: Graph, membership: np.ndarray, tokens: np.ndarray, max_tokens: int,
                  shown_before: np.ndarray | None = None) -> list[tuple[int, list[int]]]:
    """(community, the nodes its request shows) for every community with at least two S or A nodes
    within `max_tokens`: attributes first, then best-connected units, so the community's core fits
    the budget. `tokens` per node of the graph. With `shown_before` (per node, whether the anchor's
    request for its community showed its text: an incremental update) those come first, so a new
    node takes only the room that a node gone or changed left, instead of displacing the texts the
    kept elements were written from because it has more edges."""
    content = np.flatnonzero(np.isin(graph.types, COMMUNITY_CONTENT_TYPES))
    before = np.zeros(len(graph.types), bool) if shown_before is None else shown_before
    community = membership[content].astype(np.int64)
    # per community (ascending): shown before first, then attributes, then by degree (highest first), then id
    order = np.lexsort((graph.id_rank[content], -graph.degree[content], graph.types[content] != "A", ~before[content],
                        community))
    rows, community = content[order], community[order]
    starts = np.flatnonzero(np.r_[True, community[1:] != community[:-1]]) if len(rows) else np.zeros(0, np.int64)
    spent = np.cumsum(tokens[rows])
    spent -= np.repeat(spent[starts] - tokens[rows[starts]], np.diff(np.r_[starts, len(rows)]))  # within each
    keep = spent <= max_tokens
    shown = []
    for start, end in zip(starts.tolist(), np.r_[starts[1:], len(rows)].tolist(), strict=True):
        kept = rows[start:end][keep[start:end]]
        if len(kept) >= 2:
            shown.append((int(community[start]), kept.tolist()))
    return shown


def _shown_by_anchor(membership: np.ndarray, texts: list[str], content: np.ndarray, anchor: Anchor) -> np.ndarray:
    """Per node, whether its text is one its community's anchored elements were written from
    (`texts`: those of the `content` nodes, in that order)."""
    shown = np.zeros(len(membership), bool)
    for i, text in zip(content.tolist(), texts, strict=True):
        summary = anchor.communities.get(int(membership[i]))
        shown[i] = summary is not None and text_hash(text) in summary.inputs
    return shown


def membership(graph: Graph, anchor: Anchor | None, seed: int, resolution: float) -> np.ndarray:
    """Community label per node of `graph`: Leiden (`leiden`), or with an `anchor` its communities
    kept (`anchored`). Found from the graph alone, before the stage reads its nodes' texts: Leiden's
    copy of the graph is the stage's largest structure."""
    return anchored(graph, anchor.node_ids, anchor.node_labels, seed, resolution) if anchor else \
        leiden(graph, seed, resolution)


def run(
    nodes: pa.Table, graph: Graph, membership: np.ndarray, engine: Engine, embedder: Embedder, seed: int,
    max_tokens: int, leaf_tokens: int, progress: Callable[[int], None] | None = None,
    count_tokens: Callable[[list[str]], list[int]] = nlp.count_tokens, anchor: Anchor | None = None,
    resummarize_share: float = 0.0,
) -> tuple[pa.Table, pa.Table, pa.Table, dict[str, str], pa.Table, pa.Table]:
    """H and O nodes, H-O/H-S/H-A edges, the community of every input node, failures, the
    summaries record and the semantic matching's K-means centroids (`anchor.py`), from the S, N,
    R, A `nodes` (sorted by id; their texts, tokens and chunks are read), their `graph` and the
    community of each of its nodes (`membership()`). A community's elements are written in parts
    of about `leaf_tokens` (index/summaries.py). With an `anchor`, one whose shown texts changed by
    at most `resummarize_share` since its elements were written keeps them, and nothing is asked."""
    content = np.flatnonzero(np.isin(graph.types, COMMUNITY_CONTENT_TYPES))
    # the texts of the nodes a community may show (S and A) only, in `content` order, as Python
    # objects (those of every node were about a gigabyte at 200,000 passages); chunks, below, of
    # the nodes shown only
    at = np.full(len(graph.types), -1, np.int64)
    at[content] = np.arange(len(content))
    texts = nodes["text"].take(pa.array(content)).to_pylist()
    all_tokens = nodes["tokens"].to_numpy().astype(np.int64)
    items, shown, counts = [], [], []
    shown_before = _shown_by_anchor(membership, texts, content, anchor) if anchor else None
    for community, picked in shown_members(graph, membership, all_tokens, max_tokens, shown_before):
        items.append(CommunityInput(community=community, texts=tuple(texts[at[i]] for i in picked)))
        shown.append(picked)
        counts.append(all_tokens[picked].tolist())

    shown_rows = distinct(np.concatenate(shown)) if shown else np.zeros(0, np.int64)
    chunk_ids = dict(zip(shown_rows.tolist(), nodes["chunk_ids"].take(pa.array(shown_rows)).to_pylist(), strict=True))
    inputs = [[text_hash(t) for t in item.texts] for item in items]
    kept = [anchor.kept(anchor.communities, item.community, hashes, resummarize_share) if anchor else None
            for item, hashes in zip(items, inputs, strict=True)]

    def ask(requests: list[tuple[int, tuple[str, ...]]]) -> list:
        return engine.community_elements([CommunityInput(items[i].community, texts) for i, texts in requests])

    def as_texts(_: int, elements: list) -> list[str]:
        return [f"{e.title}: {e.description}" for e in elements]

    results = summaries.in_parts_or_kept(
        [[Element(t, d) for t, d in zip(summary.titles, summary.texts, strict=True)] if summary else None
         for summary in kept], [item.texts for item in items], counts, ask, as_texts, leaf_tokens, seed,
        count_tokens, progress)

    built = NodeSet()
    h_o, h_community, failures, records = [], {}, {}, []
    for item, picked, result, summary, hashes in zip(items, shown, results, kept, inputs, strict=True):
        if isinstance(result, Failure):
            failures[f"community {item.community}"] = result.reason
            continue
        key = str(item.community)
        if summary is None:
            records.append((key, hashes, [e.description for e in result], [e.title for e in result], False))
        else:
            records.append((key, summary.inputs, summary.texts, summary.titles, summary.inputs != set(hashes)))
        provenance = sorted({c for i in picked for c in chunk_ids[i]})
        for element in result:
            if not element.title.strip() or not element.description.strip():
                continue
            h = built.add(high_level_id(element.description), element.description, provenance, name=element.title)
            o = built.add(overview_id(element.title), element.title.strip(), provenance, name=element.title.strip())
            h_o.append((h, o))
            h_community.setdefault(h, item.community)
    new_nodes = built.table(count_tokens)

    # semantic matching within community
    h_ids = [i for i in new_nodes["id"].to_pylist() if i.startswith("H_")]
    h_texts = dict(zip(new_nodes["id"].to_pylist(), new_nodes["text"].to_pylist(), strict=True))
    pool_vectors = embedder.embed(texts + [h_texts[h] for h in h_ids], STORED_DTYPE)  # as held: half precision
    kept_centroids = anchor.centroids(SEMANTIC_CENTROIDS, embedder.model_id, embedder.dim) if anchor else None
    clusters, centroids = kmeans_labels(pool_vectors, seed, kept_centroids) if len(pool_vectors) else \
        (np.zeros(0, np.int64), None)
    pool_community = np.concatenate([membership[content], np.array([h_community[h] for h in h_ids], dtype=np.int32)])
    buckets: dict[tuple[int, int], list[int]] = defaultdict(list)  # the content rows of each (community, cluster)
    for row, community, cluster in zip(content.tolist(), pool_community[: len(content)].tolist(),
                                       clusters[: len(content)].tolist(), strict=True):
        buckets[(community, cluster)].append(row)
    matched = [(h, row) for h, community, cluster in zip(h_ids, pool_community[len(content) :].tolist(),
                                                          clusters[len(content) :].tolist(), strict=True)
               for row in buckets.get((community, cluster), [])]
    matched_ids = graph.id_column.take(pa.array([row for _, row in matched], pa.int64())).to_pylist()  # these only
    h_s, h_a = [], []
    for (h, _), node in zip(matched, matched_ids, strict=True):
        (h_s if node.startswith("S_") else h_a).append((h, node))
    new_edges = merge_edges([make_edges(h_o, "H-O"), make_edges(h_s, "H-S"), make_edges(h_a, "H-A")])

    new_ids = new_nodes["id"].to_pylist()
    labels = np.concatenate([membership, np.array([h_community.get(i, -1) for i in new_ids], np.int64)])
    assignments = pa.table({"id": pa.concat_arrays([graph.id_column.cast(pa.string()), pa.array(new_ids, pa.string())]),
                            "community": pa.array(labels.astype(np.int32))})
    return new_nodes, new_edges, assignments, failures, summaries_table(records), \
        centroids_table(centroids, embedder.model_id)
