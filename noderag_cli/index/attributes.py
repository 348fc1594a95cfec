"""Stage 3: important entities and their attributes (paper appendix C.2).

On the S/N/R graph: K = entities with degree >= floor(ln|V| * sqrt(mean degree));
B = entities whose sampled betweenness (seeded pivots) exceeds mean betweenness *
floor(log10|V|). For each entity in K or B the engine writes an attribute from the
texts of its S and R neighbours (not raw chunks), bounded by a token budget.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import nlp
from ..engines.base import AttributeInput, Engine, Failure
from ..graph import Graph, NodeSet, attribute_id, make_edges, row_entries
from . import summaries
from .anchor import Anchor, summaries_table, text_hash


def pivot_nodes(ids: list[str], pivots: int, seed: int) -> list[int]:
    """The seeded sample of BFS sources: the `pivots` nodes whose ids hash lowest with the seed
    (CRC-32 started from the seed: ids are content hashes already, so this only needs to mix in
    the seed, which a cryptographic hash per id would do at many times the cost).

    A node is drawn for what it is, not for its position: an update that adds or removes
    other nodes keeps the sample, unless one of them hashes lower. A positional draw
    (`random.sample(range(n))`, as networkx does) changes every pivot when n changes, and with
    them which entities count as bridges: on MuSiQue, 70 of ~130 bridges were new after an update
    of 7% of the passages, against 20 with this draw, and each one is an attribute to rewrite.
    """
    rank = np.array([zlib.crc32(i.encode(), seed & 0xFFFFFFFF) for i in ids], dtype=np.uint32)
    return np.argsort(rank, kind="stable")[: min(pivots, len(ids))].tolist()


def bfs_levels(graph: Graph, source: int) -> np.ndarray:
    """Hops from source to every node (-1 where unreachable): a breadth-first search a level at a time."""
    level = np.full(len(graph.types), -1, np.int64)
    level[source] = 0
    frontier, depth = np.array([source]), 0
    fresh = np.zeros(len(graph.types), bool)
    while len(frontier):
        depth += 1
        reached = graph.neighbours(frontier)
        fresh[reached[level[reached] < 0]] = True
        frontier = np.flatnonzero(fresh)
        fresh[frontier] = False
        level[frontier] = depth
    return level


def sampled_betweenness(graph: Graph, sources: list[int]) -> np.ndarray:
    """Brandes' dependency accumulation from the given sources on the unweighted, undirected graph.

    Unnormalised (the caller compares against the mean, so any constant factor cancels).
    Each source costs one BFS and one pass over the shortest-path DAG's edges, level by level,
    as numpy segment sums: no Python loop over nodes or edges.
    """
    n = len(graph.types)
    between = np.zeros(n, dtype=np.float64)
    if n == 0 or not sources:
        return between
    rows = np.repeat(np.arange(n, dtype=np.int64), graph.degree)
    cols = graph.indices.astype(np.int64)
    for s in sources:
        level = bfs_levels(graph, s)
        finite = level >= 0
        level = np.where(finite, level, -2)
        on_dag = finite[rows] & (level[cols] == level[rows] + 1)
        u, v = rows[on_dag], cols[on_dag]
        order = np.argsort(level[v], kind="stable")
        u, v = u[order], v[order]
        edge_level = level[v]
        top = int(edge_level[-1]) if len(edge_level) else 0
        bounds = np.searchsorted(edge_level, np.arange(1, top + 2))
        sigma = np.zeros(n, dtype=np.float64)
        sigma[s] = 1.0
        for d in range(top):  # forward: paths counted level by level
            lo, hi = bounds[d], bounds[d + 1]
            if hi > lo:
                sigma += np.bincount(v[lo:hi], weights=sigma[u[lo:hi]], minlength=n)
        delta = np.zeros(n, dtype=np.float64)
        for d in range(top - 1, -1, -1):  # backward: dependencies flow from the deepest level up
            lo, hi = bounds[d], bounds[d + 1]
            if hi > lo:
                uu, vv = u[lo:hi], v[lo:hi]
                delta += np.bincount(uu, weights=sigma[uu] / sigma[vv] * (1.0 + delta[vv]), minlength=n)
        delta[s] = 0.0
        between += delta
    return between


def core_entities(graph: Graph) -> np.ndarray:
    """Per node, whether it is an entity of K(G): degree >= floor(ln|V| * sqrt(mean degree))."""
    degree = graph.degree.astype(np.float64)
    threshold = math.floor(math.log(len(degree)) * math.sqrt(degree.mean())) if degree.mean() > 0 else 0
    return (graph.types == "N") & (degree >= max(threshold, 1))


def important_entities(graph: Graph, pivots: int, seed: int) -> np.ndarray:
    """Indices of the entities in K(G) ∪ B(G)."""
    n = len(graph.types)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    b = sampled_betweenness(graph, pivot_nodes(graph.id_column.to_pylist(), pivots, seed))
    scale = math.floor(math.log10(n)) if n >= 10 else 1
    bridges = (graph.types == "N") & (b > b.mean() * scale)
    return np.flatnonzero(core_entities(graph) | bridges)


def anchored_entities(graph: Graph, kept: pa.Array) -> np.ndarray:
    """Indices of the entities in K(G), and of those named in `kept` (the anchor's, and those whose
    attribute failed in the last run, to be retried) that the graph still holds: an incremental
    update keeps the anchor's bridges instead of sampling betweenness over the whole graph again (the
    stage's largest cost once nothing is asked), so an entity that becomes a bridge is summarised
    when the next full build samples it, as its changed texts are."""
    if len(graph.types) == 0:
        return np.zeros(0, dtype=np.int64)
    named = pc.is_in(graph.id_column, value_set=kept).to_numpy(zero_copy_only=False)
    return np.flatnonzero(core_entities(graph) | (named & (graph.types == "N")))


def _picked_texts(graph: Graph, nodes: pa.Table, chosen: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Per chosen entity, the S and R neighbours its attribute is written from: S before R, then by
    id (deterministic, and statements before stubs), as many as fit `max_tokens` (at least one when
    it has any). Every entity's at once, on arrays."""
    counts = graph.degree[chosen]
    owner = np.repeat(np.arange(len(chosen)), counts)
    neighbour = graph.indices[row_entries(graph.indptr, chosen)].astype(np.int64)
    statement = graph.types[neighbour] == "S"
    usable = statement | (graph.types[neighbour] == "R")
    owner, neighbour, statement = owner[usable], neighbour[usable], statement[usable]
    if not len(neighbour):
        return [neighbour] * len(chosen)
    order = np.lexsort((graph.id_rank[neighbour], ~statement, owner))
    owner, neighbour = owner[order], neighbour[order]
    tokens = nodes["tokens"].to_numpy().astype(np.int64)[neighbour]
    starts = np.searchsorted(owner, np.arange(len(chosen) + 1))
    before = np.cumsum(tokens) - tokens
    within = before + tokens - np.repeat(before[np.minimum(starts[:-1], len(tokens) - 1)],
                                         np.diff(starts))  # each entity's running total
    first = np.zeros(len(owner), bool)
    first[starts[:-1][np.diff(starts) > 0]] = True
    keep = (within <= max_tokens) | first
    return np.split(neighbour[keep], np.searchsorted(owner[keep], np.arange(1, len(chosen))))


def run(
    nodes: pa.Table, edges: pa.Table, engine: Engine, pivots: int, seed: int, max_tokens: int, leaf_tokens: int,
    progress: Callable[[int], None] | None = None, count_tokens: Callable[[list[str]], list[int]] = nlp.count_tokens,
    anchor: Anchor | None = None, resummarize_share: float = 0.0, failed_before: pa.Array | None = None,
) -> tuple[pa.Table, pa.Table, dict[str, str], pa.Table]:
    """A nodes, A-N edges, failures per entity id, and the summaries record (`anchor.py`). Reads
    the `tokens` column of `nodes`. An attribute is written in parts of about `leaf_tokens`
    (index/summaries.py); with an `anchor`, the entities are K(G) and the anchor's
    (`anchored_entities`, with `failed_before`: the entities whose attribute the last run did not
    get), and one whose texts changed by at most `resummarize_share` since its attribute was
    written keeps it, and nothing is asked."""
    graph = Graph.from_tables(nodes, edges)
    if anchor is None:
        chosen = important_entities(graph, pivots, seed)
    else:
        retried = failed_before if failed_before is not None else pa.array([], pa.string())
        chosen = anchored_entities(graph, pa.concat_arrays([anchor.attribute_table["key"].combine_chunks(),
                                                            retried.cast(pa.string())]))
    picked_by = _picked_texts(graph, nodes, chosen, max_tokens)
    rows = np.concatenate([chosen, *picked_by]).astype(np.int64)  # only these nodes' columns become Python objects
    texts, names, chunk_ids = ({int(r): value for r, value in zip(rows.tolist(), nodes[column].take(pa.array(rows)).to_pylist(),
                                                                  strict=True)} for column in ("text", "name", "chunk_ids"))
    tokens = nodes["tokens"].to_numpy().astype(np.int64)
    items, sources, counts = [], [], []
    for i, picked in zip(chosen.tolist(), picked_by, strict=True):
        picked = picked.tolist()
        items.append(AttributeInput(entity=names[i] or texts[i], texts=tuple(texts[j] for j in picked)))
        sources.append((i, picked))
        counts.append(tokens[picked].tolist())
    inputs = [[text_hash(t) for t in item.texts] for item in items]
    entity_of = dict(zip(chosen.tolist(), graph.id_column.take(pa.array(chosen, pa.int64())).to_pylist(), strict=True))
    kept = [anchor.kept(anchor.attributes, entity_of[i], hashes, resummarize_share) if anchor else None
            for (i, _), hashes in zip(sources, inputs, strict=True)]

    def ask(requests: list[tuple[int, tuple[str, ...]]]) -> list:
        return engine.attributes([AttributeInput(entity=items[i].entity, texts=texts) for i, texts in requests])

    def as_texts(i: int, summary: str) -> list[str]:
        return nlp.split_sentences(summary.removeprefix(f"{items[i].entity}: "))

    results = summaries.in_parts_or_kept([summary.texts[0] if summary else None for summary in kept],
                                         [item.texts for item in items], counts, ask, as_texts, leaf_tokens, seed,
                                         count_tokens, progress)
    built = NodeSet()
    pairs, failures, records = [], {}, []
    for (i, picked), result, summary, hashes in zip(sources, results, kept, inputs, strict=True):
        if isinstance(result, Failure):
            failures[entity_of[i]] = result.reason
            continue
        if summary is None:
            records.append((entity_of[i], hashes, [result], [], False))
        else:
            records.append((entity_of[i], summary.inputs, summary.texts, [], summary.inputs != set(hashes)))
        if not result.strip():  # dropped as ungrounded: the entity gets no attribute
            continue
        provenance = sorted({c for j in picked for c in chunk_ids[j]})
        a = built.add(attribute_id(entity_of[i]), result, provenance, name=names[i])
        pairs.append((a, entity_of[i]))
    return built.table(count_tokens), make_edges(pairs, "A-N"), failures, summaries_table(records)
