"""The seed systems beyond the paper's baselines, as `noderag ablate` strategies: ArchRAG (its
attributed communities, hierarchical search and adaptive filtering, and three of its own
ablations) and GraphRAG's local and global search at each community level C0-C3. Re-implementations
on our graph, like the baselines: what they build is in `hierarchy.py`, built only when one of
these variants is requested.

ArchRAG's search (its C-HNSW, a layered nearest-neighbour index over the community layers and the
entities): from the top layer down, the ARCHRAG_TOP reports nearest to the question among the
members of the reports chosen one layer up and their nearest reports in the layer (all reports of
the top layer); at the bottom, the entities among the members of the chosen first-layer
communities and the entities nearest to the question. Adaptive filtering (ArchRAG has the LLM
judge each retrieved element's relevance, layer by layer) keeps, in every layer, what comes within
ARCHRAG_FILTER of the layer's best cosine: a deterministic stand-in, the same for every engine.
The context: the kept reports, then the kept entities' descriptions and the relationships among
them, then the chunks they come from.
"""

from __future__ import annotations

import time

import numpy as np

from ..graph import distinct
from ..search.results import Retrieval
from . import hierarchy
from .baselines import (
    Setup,
    StrategySpec,
    _dot,
    _finish,
    _prepared,
    fill_sections,
    graphrag_global,
    graphrag_local,
)

ARCHRAG_TOP = 10  # nearest per layer (as many entities as the GraphRAG re-implementation selects)
ARCHRAG_FILTER = 0.8  # of a layer's best cosine, to be kept
ARCHRAG_SHARES = {"communities": 0.4, "entities": 0.3, "chunks": 0.3}


def archrag(setup: Setup, question: str, budget: int, kind: str = "archrag", layers: int | None = None) -> Retrieval:
    """ArchRAG's retrieval (see the module docstring). `layers`: how many community layers to
    search from the bottom (None: all; 0: entities only)."""
    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    side = setup.graph_side()
    query = retriever.embed_question(question)
    h = setup.hierarchy(kind) if layers != 0 else None
    kept: dict[int, float] = {}  # report -> cosine
    members = np.zeros(0, np.int64)  # base positions under the chosen first-layer communities
    if h is not None and len(h.level):
        top = int(h.level.max()) if layers is None else min(int(h.level.max()), layers - 1)
        chosen = np.zeros(0, np.int64)
        for depth in range(top, -1, -1):
            if depth == top:
                pool = h.at(depth)
            else:
                below = np.concatenate([h.children(r) for r in chosen.tolist()] or [np.zeros(0, np.int64)])
                pool = distinct(np.concatenate([below, *(h.within[r] for r in below.tolist())]).astype(np.int64))
                pool = pool if len(pool) else h.at(depth)
            pool = pool[h.tokens[pool] > 0]
            if not len(pool):
                chosen = pool
                continue
            cosine = h.vectors[pool] @ query
            order = np.lexsort((pool, -cosine))[:ARCHRAG_TOP]
            chosen = pool[order]
            best = float(cosine[order[0]])
            kept |= {int(r): float(c) for r, c in zip(pool[order].tolist(), cosine[order].tolist(), strict=True)
                     if c >= ARCHRAG_FILTER * best}
        members = np.concatenate([h.children(r) for r in chosen.tolist()] or [np.zeros(0, np.int64)])
    cosine = _dot(side.entity_vectors, query)
    pool = distinct(np.concatenate([members, np.argsort(-cosine, kind="stable")[:ARCHRAG_TOP]]).astype(np.int64))
    order = np.lexsort((pool, -cosine[pool]))[:ARCHRAG_TOP]
    picked = pool[order]
    picked = picked[cosine[picked] >= ARCHRAG_FILTER * cosine[picked[0]]] if len(picked) else picked
    entity = np.zeros(len(retriever.build.ids), dtype=np.float64)
    entity[side.entities[picked]] = np.maximum(cosine[picked], 1e-6)
    similarity = side.similarity(query)
    description_rows, description_values = side.description_candidates(entity, similarity)
    relation = side.kind["R-N"] @ (entity > 0).astype(np.float64)
    chunk_rows, chunk_values = side.chunk_scores(side.kind["S-N"] @ entity)
    allowance = int(ARCHRAG_SHARES["communities"] * budget)
    reports, used = hierarchy.fill_reports(h, np.asarray(list(kept), np.int64), np.asarray(list(kept.values())),
                                           allowance) if kept else ([], 0)
    sections = [(description_rows, description_values, ARCHRAG_SHARES["entities"] / 2),
                (side.relations, relation[side.relations], ARCHRAG_SHARES["entities"] / 2),
                (chunk_rows, chunk_values, ARCHRAG_SHARES["chunks"])]
    rows, scores = fill_sections(retriever, sections, budget, carry=allowance - used, used_total=used)
    result = _finish(retriever, question, rows, scores, started)
    if reports:
        result.nodes = hierarchy.report_nodes(h, "L", reports, kept) + result.nodes
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


def _graphrag_level(level: int, search):
    def build(setup: Setup):
        h = setup.hierarchy("graphrag")
        if search is graphrag_global:
            reports = h.at(min(level, h.levels - 1))
            reports = reports[h.tokens[reports] > 0]
            setup.notes.append(f"graphrag-global-c{level}: {len(reports)} community reports of "
                               f"{int(h.tokens[reports].sum()):,} tokens, what GraphRAG's map step would read per question")
        return lambda q, b: search(setup, q, b, level)
    return build


def _archrag(kind: str = "archrag", layers: int | None = None):
    def build(setup: Setup):
        if layers != 0:
            setup.hierarchy(kind)  # built now, outside the timed questions
        return _prepared(setup, lambda s, q, b: archrag(s, q, b, kind, layers))
    return build


SEEDS: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("archrag", "baseline", "ArchRAG (re-implemented on our graph): similarity-weighted Leiden communities "
                 "layer by layer, searched top-down over every layer, filtered, with entities and chunks", _archrag()),
    StrategySpec("archrag-single-layer", "baseline", "ArchRAG ablation: only the first community layer (and the entities)",
                 _archrag(layers=1)),
    StrategySpec("archrag-leiden", "baseline", "ArchRAG ablation: plain Leiden on the entity graph (no similarity "
                 "edges, unweighted) instead of its attributed clustering", _archrag("archrag-leiden")),
    StrategySpec("archrag-entity-only", "baseline", "ArchRAG ablation: entities only, no communities", _archrag(layers=0)),
    *(StrategySpec(f"graphrag-local-c{level}", "baseline", f"GraphRAG local search with the community reports of level "
                   f"C{level} (hierarchical Leiden; re-implemented on our graph)", _graphrag_level(level, graphrag_local))
      for level in range(hierarchy.GRAPHRAG_LEVELS)),
    *(StrategySpec(f"graphrag-global-c{level}", "baseline", f"GraphRAG global search over the community reports of level "
                   f"C{level}, rated by similarity (hierarchical Leiden; re-implemented)", _graphrag_level(level, graphrag_global))
      for level in range(hierarchy.GRAPHRAG_LEVELS)),
)}
