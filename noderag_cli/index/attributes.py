"""Stage 3: important entities and their attributes (paper appendix C.2).

On the S/N/R graph: K = entities with degree >= floor(ln|V| * sqrt(mean degree));
B = entities whose sampled betweenness (seeded pivots) exceeds mean betweenness *
floor(log10|V|). For each entity in K or B the engine writes an attribute from the
texts of its S and R neighbours (not raw chunks), bounded by a token budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import networkx as nx
import numpy as np
import pyarrow as pa

from .. import nlp
from ..engines.base import AttributeInput, Engine, Failure
from ..graph import Graph, NodeSet, attribute_id, make_edges


def important_entities(graph: Graph, pivots: int, seed: int) -> np.ndarray:
    """Indices of the entities in K(G) ∪ B(G)."""
    n = len(graph.ids)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    structure = graph.adjacency.copy()
    structure.data[:] = 1
    degree = np.asarray(structure.sum(axis=1)).ravel()
    threshold = math.floor(math.log(n) * math.sqrt(degree.mean())) if degree.mean() > 0 else 0
    is_entity = graph.types == "N"
    core = is_entity & (degree >= max(threshold, 1))

    nx_graph = nx.from_scipy_sparse_array(structure)
    between = nx.betweenness_centrality(nx_graph, k=min(pivots, n), seed=seed, normalized=True)
    b = np.fromiter((between[i] for i in range(n)), dtype=np.float64, count=n)
    scale = math.floor(math.log10(n)) if n >= 10 else 1
    bridges = is_entity & (b > b.mean() * scale)
    return np.flatnonzero(core | bridges)


def run(
    nodes: pa.Table, edges: pa.Table, engine: Engine, pivots: int, seed: int, max_tokens: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[pa.Table, pa.Table, dict[str, str]]:
    graph = Graph.from_tables(nodes, edges)
    chosen = important_entities(graph, pivots, seed)
    texts = nodes["text"].to_pylist()
    names = nodes["name"].to_pylist()
    chunk_ids = nodes["chunk_ids"].to_pylist()
    tokens = np.asarray(nlp.count_tokens(texts), dtype=np.int64) if texts else np.zeros(0, np.int64)
    adjacency = graph.adjacency
    items, sources = [], []
    for i in chosen.tolist():
        neighbours = adjacency.indices[adjacency.indptr[i] : adjacency.indptr[i + 1]]
        neighbours = neighbours[np.isin(graph.types[neighbours], ["S", "R"])]
        # S before R, then by id: deterministic, and statements before stubs
        neighbours = sorted(neighbours.tolist(), key=lambda j: (graph.types[j] != "S", graph.ids[j]))
        keep = np.cumsum(tokens[neighbours]) <= max_tokens if neighbours else np.zeros(0, bool)
        picked = [j for j, k in zip(neighbours, keep, strict=True) if k] or neighbours[:1]
        items.append(AttributeInput(entity=names[i] or texts[i], texts=tuple(texts[j] for j in picked)))
        sources.append((i, picked))
    results = engine.attributes(items, progress) if items else []
    built = NodeSet()
    pairs, failures = [], {}
    for (i, picked), result in zip(sources, results, strict=True):
        if isinstance(result, Failure):
            failures[graph.ids[i]] = result.reason
            continue
        provenance = sorted({c for j in picked for c in chunk_ids[j]})
        a = built.add(attribute_id(graph.ids[i]), result, provenance, name=names[i])
        pairs.append((a, graph.ids[i]))
    return built.table(), make_edges(pairs, "A-N"), failures
