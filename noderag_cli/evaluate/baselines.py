"""Retrieval strategies the paper's results are compared against, over the same workspace
(same chunks, embeddings and token counting), so that only the strategy differs.

Every strategy is `(retriever, question, budget) -> Retrieval`: its nodes are real workspace
nodes (T, S, A, H, R; never N or O), built with `Retriever.nodes_for` so they carry their
source documents, the context is cut with `search.context.fit_budget` to at most `budget`
tokens, and `timings["retrieval_ms"]` is the time of the query itself.

The graph-based baselines (LightRAG, GraphRAG, HippoRAG) are re-implementations of their
retrieval step on NodeRAG's heterograph, not the original systems: the entities are our N
nodes, the relationships our R nodes, entity descriptions our A nodes (or, for entities
without one, the units that mention them), community summaries our H nodes and chunks our
T nodes. What they need beyond the NodeRAG index (vectors of entity names and relationship
texts, which NodeRAG never embeds; typed incidence matrices) is built once per workspace by
`GraphSide`, before any question is timed, as those systems would at index time.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import scipy.sparse as sp

from ..cache import Cache
from ..embeddings import Embedder
from ..engines.base import Engine
from ..nlp import terms
from ..search import context
from ..search.results import Retrieval
from ..search.retriever import Retriever

NAIVE_CANDIDATES = 100
Strategy = Callable[[str, int], Retrieval]


class StrategySkipped(RuntimeError):
    """A strategy that cannot run with this setup (the message says why, in one line)."""


@dataclass
class Setup:
    """What a strategy is built from: the opened workspace and, optionally, its cache
    (used for the embeddings and LLM calls the baselines add, so a re-run pays nothing)."""

    retriever: Retriever
    workspace: Path
    cache: Cache | None = None
    notes: list[str] = field(default_factory=list)
    _graph_side: GraphSide | None = field(default=None, repr=False)
    engine: Engine | None = None  # for the LLM calls the evaluation adds (HyDE, answers, the judge); the
    # retriever's, or one with the workspace's writable cache so that a re-run pays nothing
    hierarchies: dict = field(default_factory=dict, repr=False)  # by kind, built once per run

    def __post_init__(self) -> None:
        self.engine = self.engine or self.retriever.engine

    def graph_side(self) -> GraphSide:
        if self._graph_side is None:
            self._graph_side = GraphSide(self)
        return self._graph_side

    def hierarchy(self, kind: str):
        """A community hierarchy of the seed systems ("graphrag", "archrag", "archrag-leiden"): built
        on first use, or read back from the workspace (evaluation/hierarchy.py)."""
        from . import hierarchy

        if kind not in self.hierarchies:
            build = {"graphrag": lambda: hierarchy.graphrag(self), "archrag": lambda: hierarchy.archrag(self),
                     "archrag-leiden": lambda: hierarchy.archrag(self, augment=False)}[kind]
            self.hierarchies[kind] = hierarchy.load_or_build(self, kind, build)
        return self.hierarchies[kind]

    @property
    def offline(self) -> bool:
        """No language model behind the engine: what only a model writes is skipped."""
        return not self.retriever.engine.asks_a_model


@dataclass(frozen=True)
class StrategySpec:
    name: str
    kind: str  # "noderag", "ablation" or "baseline"
    description: str
    build: Callable[[Setup], Strategy]


# --------------------------------------------------------------------------- shared pieces
def _finish(retriever: Retriever, question: str, rows: np.ndarray, scores: np.ndarray, started: float,
            entities: list[str] | None = None) -> Retrieval:
    result = Retrieval(question=question, query_entities=entities or [])
    result.nodes = retriever.nodes_for(np.asarray(rows, dtype=np.int64), scores)
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


def candidates_for(budget: int) -> int:
    """Vector candidates enough to fill a budget with short nodes (units are ~40 tokens)."""
    return max(NAIVE_CANDIDATES, budget // 8)


def vector_context(retriever: Retriever, question: str, budget: int, types: tuple[str, ...],
                   query_vector: np.ndarray | None = None, dedupe: bool = True) -> Retrieval:
    """Nodes of the given types by vector similarity to the question, best first, until the budget
    is full. With dedupe, a statement already in the context (a unit inside its chunk) is skipped."""
    question = retriever.check_question(question)
    started = time.perf_counter()
    if query_vector is None:
        query_vector = retriever.embed_question(question)
    k = candidates_for(budget)
    rows, similarity = retriever.build.vector_side.search(query_vector, k, types)
    scores = np.zeros(len(retriever.build.ids), dtype=np.float64)
    scores[rows] = similarity
    kept = context.fit_budget(rows, similarity.astype(np.float64), retriever.build.tokens, budget,
                              keys=retriever.build.sentence_keys if dedupe else None)
    return _finish(retriever, question, kept, scores, started)


def fill_sections(retriever: Retriever, sections: list[tuple[np.ndarray, np.ndarray, float]],
                  budget: int, carry: float = 0.0, used_total: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows for a context made of sections, each (candidate rows, their scores, share of the budget),
    filled in order; what a section leaves unused passes to the next (`carry`, `used_total`: what
    sections filled before these left and used). Returns kept rows and a score per node row (for
    display: a node's score within its section)."""
    scores = np.zeros(len(retriever.build.ids), dtype=np.float64)
    kept: list[np.ndarray] = []
    taken = np.zeros(len(retriever.build.ids), dtype=bool)
    for rows, values, share in sections:
        allowance = int(share * budget + carry)
        rows = np.asarray(rows, dtype=np.int64)
        values = np.asarray(values, dtype=np.float64)
        fresh = (~taken[rows]) & (values > 0)
        rows, values = rows[fresh], values[fresh]
        allowance = min(allowance, budget - used_total)
        chosen = context.fit_budget(rows, values, retriever.build.tokens, allowance, keys=retriever.build.sentence_keys)
        used = int(retriever.build.tokens[chosen].sum()) if len(chosen) else 0
        carry = allowance - used
        used_total += used
        taken[chosen] = True
        scores[rows] = values
        kept.append(chosen)
    return (np.concatenate(kept) if kept else np.zeros(0, np.int64)), scores


def _dot(matrix: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """matrix @ vector without BLAS: a multi-threaded gemv on a busy machine costs 10x more, and
    the latency column should measure the strategy, not thread contention."""
    return np.einsum("ij,j->i", matrix, vector.astype(matrix.dtype, copy=False))


def _top(values: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    return context.top_rows(values, candidates, k)


# --------------------------------------------------------------------------- what the graph baselines add
class GraphSide:
    """Per-workspace structures for the graph baselines, built once (about 1.5 s on MuSiQue):

    - `kind[k]`: symmetric 0/1 incidence of one structural edge kind ("S-N", "T-S", "R-N",
      "A-N", "S-R"), from the build's edge table (the retriever's adjacency merges kinds and HNSW edges);
    - `name_vectors` (entity names) and `relation_vectors` (relationship sentences), embedded with
      the workspace's model: LightRAG and HippoRAG match query keywords against them;
    - `entity_vectors`: an entity's name plus the mean of its units and attribute, GraphRAG's
      "entity description embedding";
    - `community`: Leiden community per node (H nodes carry their community's id).
    """

    def __init__(self, setup: Setup):
        retriever = self.retriever = setup.retriever
        n = len(retriever.build.ids)
        edges = retriever.build.generation.table("edges", ["source", "target", "kind"]).to_pydict()
        nodes = retriever.build.generation.table("nodes", ["id", "community"]).to_pydict()
        self.community = np.asarray(nodes["community"], dtype=np.int64)
        index_of = retriever.build.graph.index_of
        src = np.fromiter((index_of[s] for s in edges["source"]), np.int64, len(edges["source"]))
        dst = np.fromiter((index_of[t] for t in edges["target"]), np.int64, len(edges["target"]))
        kinds = np.asarray(edges["kind"], dtype=object)
        self.kind: dict[str, sp.csr_matrix] = {}
        for kind in ("S-N", "T-S", "R-N", "A-N", "S-R"):
            mask = kinds == kind
            a, b = src[mask], dst[mask]
            ones = np.ones(2 * len(a))
            self.kind[kind] = sp.csr_matrix((ones, (np.concatenate([a, b]), np.concatenate([b, a]))), shape=(n, n))
        self.kind["described"] = (self.kind["A-N"] + self.kind["S-N"]).tocsr()  # entity -> its A and S
        self.entities = retriever.build.rows_by_type["N"]
        self.relations = retriever.build.rows_by_type["R"]
        embedder = Embedder(retriever.embedder.config, setup.cache) if setup.cache else retriever.embedder
        self.embedder = embedder
        self.name_vectors = embedder.embed([str(t) for t in retriever.build.texts[self.entities]])
        self.relation_vectors = embedder.embed([str(t) for t in retriever.build.texts[self.relations]])
        # entity description vectors: name + mean of its units and attribute
        described = self.kind["described"][self.entities][:, retriever.build.vector_side.node_of_vector]
        mean = described @ retriever.build.vector_side.float_vectors
        mean /= np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)
        combined = self.name_vectors + mean
        combined /= np.maximum(np.linalg.norm(combined, axis=1, keepdims=True), 1e-12)
        self.entity_vectors = combined.astype(np.float32)
        self._hippo: tuple | None = None

    # query-side helpers -------------------------------------------------------------
    def similarity(self, query_vector: np.ndarray) -> np.ndarray:
        """Cosine of every embedded node to the query (0 for nodes without a vector)."""
        out = np.zeros(len(self.retriever.build.ids), dtype=np.float64)
        vectors = self.retriever.build.vector_side
        out[vectors.node_of_vector] = np.maximum(_dot(vectors.float_vectors, query_vector), 0.0)
        return out

    def keywords(self, question: str) -> tuple[list[str], str]:
        """LightRAG's two keyword levels. Low: the entities the engine finds in the question (the
        NodeRAG query-entities task). High: the question's remaining content words (LightRAG asks
        the LLM for themes; a deterministic stand-in, the same for every engine)."""
        low = list(dict.fromkeys(self.retriever.engine.query_entities(question)))
        inside = {t for k in low for t in terms(k)}
        high = " ".join(t for t in dict.fromkeys(terms(question)) if t not in inside)
        return low, high or question

    def match_entities(self, keywords: list[str], k: int) -> np.ndarray:
        """Entity scores (full-length array, nonzero on N rows): names found in a keyword by the
        name index score 1; otherwise each keyword's k nearest names by vector, with their cosine."""
        scores = np.zeros(len(self.retriever.build.ids), dtype=np.float64)
        if not keywords:
            return scores
        is_entity = self.retriever.build.types == "N"
        for keyword in keywords:
            rows = [r for r in self.retriever.build.names.match(keyword) if is_entity[r]]
            scores[rows] = 1.0
        similarity = np.einsum("ij,kj->ik", self.name_vectors, self.embedder.embed(keywords))  # (entities, keywords)
        for column in range(similarity.shape[1]):  # each keyword's k nearest names
            values = similarity[:, column]
            best = np.argsort(-values, kind="stable")[:k]
            rows = self.entities[best]
            scores[rows] = np.maximum(scores[rows], values[best])
        return scores

    def description_candidates(self, entity_scores: np.ndarray, similarity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Entity descriptions: the entity's attribute (A) where it has one, and the units (S) that
        mention it, each scored by the entity score it carries times its similarity to the question."""
        rows = np.concatenate([self.retriever.build.rows_by_type["A"], self.retriever.build.rows_by_type["S"]])
        mass = self.kind["described"] @ entity_scores
        return rows, mass[rows] * similarity[rows]

    def chunk_scores(self, unit_mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chunks = self.retriever.build.rows_by_type["T"]
        return chunks, (self.kind["T-S"] @ unit_mass)[chunks]

    def hippo(self) -> tuple[sp.csr_matrix, sp.csr_matrix, np.ndarray]:
        """HippoRAG's graph: entities linked when a relationship joins them (weights: how many), P^T of
        it, the 0/1 chunk x entity occurrence matrix and each entity's node specificity 1/|chunks|."""
        if self._hippo is None:
            b = self.kind["R-N"][self.relations][:, self.entities]
            graph = (b.T @ b).tocsr()
            graph.setdiag(0)
            graph.eliminate_zeros()
            chunks = self.retriever.build.rows_by_type["T"]
            occurs = (self.kind["T-S"][chunks][:, self.retriever.build.rows_by_type["S"]]
                      @ self.kind["S-N"][self.retriever.build.rows_by_type["S"]][:, self.entities])
            occurs = (occurs > 0).astype(np.float64).tocsr()
            per_entity = np.asarray(occurs.sum(axis=0)).ravel()
            specificity = np.divide(1.0, per_entity, out=np.zeros_like(per_entity), where=per_entity > 0)
            degree = np.asarray(graph.sum(axis=1)).ravel()
            inverse = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
            walk = (sp.diags(inverse) @ graph).T.tocsr()  # P^T of the row-normalised entity graph
            self._hippo = (walk, occurs, specificity)
        return self._hippo


# --------------------------------------------------------------------------- the baselines
def naive_rag(retriever: Retriever, question: str, budget: int) -> Retrieval:
    """NaiveRAG: text chunks by vector similarity to the question, best first, until the budget is full."""
    question = retriever.check_question(question)
    started = time.perf_counter()
    rows, similarity = retriever.build.vector_side.search(retriever.embed_question(question), NAIVE_CANDIDATES, ("T",))
    scores = np.zeros(len(retriever.build.ids), dtype=np.float64)
    scores[rows] = similarity
    kept = context.fit_budget(rows, similarity.astype(np.float64), retriever.build.tokens, budget)
    result = Retrieval(question=question)
    result.nodes = retriever.nodes_for(kept, scores)
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


def hyde(setup: Setup, question: str, budget: int) -> Retrieval:
    """HyDE (paper appendix B.2; Gao et al. 2022): the engine writes a hypothetical passage answering
    the question; the mean of its embedding and the question's searches the text chunks, as NaiveRAG
    does. Simplified: one hypothetical passage (the HyDE paper averages several)."""
    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    passage = hypothetical_passage(setup, question)
    vectors = retriever.embedder.embed([question, passage])
    query = vectors.mean(axis=0)
    query /= max(float(np.linalg.norm(query)), 1e-12)
    result = vector_context(retriever, question, budget, ("T",), query_vector=query, dedupe=False)
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


def _lightrag_sections(side: GraphSide, question: str, mode: str, budget: int) -> tuple[list, list[str]]:
    retriever = side.retriever
    low, high = side.keywords(question)
    query = retriever.embed_question(question)
    similarity = side.similarity(query)
    by_section: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"entities": [], "relations": [], "chunks": []}
    if mode in ("local", "hybrid"):
        entity = side.match_entities(low or [question], LIGHTRAG_PER_KEYWORD)
        kept = np.zeros(len(entity), dtype=bool)
        kept[_top(entity, side.entities, LIGHTRAG_TOP_ENTITIES)] = True
        entity = np.where(kept, entity, 0.0)
        relation_similarity = _dot(side.relation_vectors, query)
        relation = side.kind["R-N"] @ entity  # one hop: the relationships of the matched entities ...
        relation[side.relations] *= np.maximum(relation_similarity, 0.0)  # ... most relevant first
        neighbours = side.kind["R-N"] @ (side.kind["R-N"] @ entity)  # ... and the entities at their other end
        neighbours[entity > 0] = 0.0
        reach = entity + 0.25 * neighbours / max(float(neighbours.max()), 1e-12)
        by_section["entities"].append(side.description_candidates(entity, similarity))
        by_section["relations"].append((side.relations, relation[side.relations]))
        by_section["chunks"].append(side.chunk_scores(side.kind["S-N"] @ reach))
    if mode in ("global", "hybrid"):
        relation_similarity = _dot(side.relation_vectors, side.embedder.embed([high])[0])
        best = np.argsort(-relation_similarity, kind="stable")[:LIGHTRAG_TOP_RELATIONS]
        relation = np.zeros(len(retriever.build.ids), dtype=np.float64)
        relation[side.relations[best]] = np.maximum(relation_similarity[best], 1e-6)
        entity = side.kind["R-N"] @ relation  # the entities at both ends
        by_section["relations"].append((side.relations, relation[side.relations]))
        by_section["entities"].append(side.description_candidates(entity, similarity))
        by_section["chunks"].append(side.chunk_scores(side.kind["S-R"] @ relation))
    order = ("relations", "entities", "chunks") if mode == "global" else ("entities", "relations", "chunks")
    sections = []
    for name in order:
        parts = by_section[name]
        rows = parts[0][0]
        values = np.zeros(len(rows))
        for _rows, part_values in parts:  # hybrid: each side normalised, the better one counts
            top = part_values.max() if len(part_values) and part_values.max() > 0 else 1.0
            values = np.maximum(values, part_values / top)
        sections.append((rows, values, 1 / 3))
    return sections, low


LIGHTRAG_TOP_ENTITIES = 20
LIGHTRAG_PER_KEYWORD = 5
LIGHTRAG_TOP_RELATIONS = 20


def lightrag(setup: Setup, question: str, budget: int, mode: str) -> Retrieval:
    """LightRAG-style dual-level retrieval (paper appendix B.2; Guo et al. 2024 §3.2).

    local: low-level keywords (the question's entities) matched to entity names (name index, and the
    nearest names by vector), plus their one-hop relationships (most similar to the question first)
    and the chunks their units come from, and, at a quarter weight, those of their one-hop
    neighbour entities. global: high-level keywords matched by vector to relationship sentences,
    plus the entities at their ends and the chunks stating them. hybrid: both, merged. The context is
    LightRAG's three tables: entity descriptions, relationships and source chunks, a third of the
    budget each (unused room passes on). Simplified: keywords come from the query-entities task and
    the question's remaining words rather than a dedicated keyword prompt; entity descriptions are A
    nodes or the units mentioning the entity, not per-entity LLM summaries."""
    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    side = setup.graph_side()
    sections, low = _lightrag_sections(side, question, mode, budget)
    rows, scores = fill_sections(retriever, sections, budget)
    return _finish(retriever, question, rows, scores, started, low)


GRAPHRAG_TOP_ENTITIES = 10
GRAPHRAG_SHARES = {"communities": 0.15, "local": 0.35, "chunks": 0.5}
"""GraphRAG local search's default context proportions: community reports 15%, text units 50%,
entity and relationship tables the rest."""


def graphrag_local(setup: Setup, question: str, budget: int, level: int | None = None) -> Retrieval:
    """GraphRAG-style local search (paper appendix B.2; Edge et al. 2024, local search mode): the
    question's embedding selects the entities with the closest description embeddings; the context
    holds community summaries of their communities (ranked by how many selected entities the
    community holds), the entities' descriptions and relationships (those joining two selected
    entities first), and the chunks they come from, in GraphRAG's default proportions. Without a
    `level`: one community level, NodeRAG's own (Leiden), its summaries our H nodes; with one, the
    reports of that level of the hierarchy (`hierarchy.graphrag`, C0 the coarsest). Descriptions
    are A nodes or mentioning units."""
    from . import hierarchy

    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    side = setup.graph_side()
    query = retriever.embed_question(question)
    similarity = side.similarity(query)
    entity_similarity = _dot(side.entity_vectors, query)
    best = np.argsort(-entity_similarity, kind="stable")[:GRAPHRAG_TOP_ENTITIES]
    entity = np.zeros(len(retriever.build.ids), dtype=np.float64)
    entity[side.entities[best]] = np.maximum(entity_similarity[best], 1e-6)
    relation = side.kind["R-N"] @ (entity > 0).astype(np.float64)  # 2 = joins two selected entities
    relation[side.relations] += 0.5 * np.maximum(_dot(side.relation_vectors, query), 0.0) * (relation[side.relations] > 0)
    description_rows, description_values = side.description_candidates(entity, similarity)
    chunk_rows, chunk_values = side.chunk_scores(side.kind["S-N"] @ entity)
    sections = [(description_rows, description_values, GRAPHRAG_SHARES["local"] / 2),
                (side.relations, relation[side.relations], GRAPHRAG_SHARES["local"] / 2),
                (chunk_rows, chunk_values, GRAPHRAG_SHARES["chunks"])]
    allowance = int(GRAPHRAG_SHARES["communities"] * budget)
    if level is None:
        high = retriever.build.rows_by_type["H"]
        votes = Counter(side.community[side.entities[best]].tolist())
        community_votes = np.array([votes.get(c, 0) for c in side.community[high].tolist()], dtype=np.float64)
        community_scores = community_votes + similarity[high]  # ties: closer summary first
        community_scores[community_votes == 0] = 0.0
        rows, scores = fill_sections(retriever, [(high, community_scores, GRAPHRAG_SHARES["communities"]), *sections],
                                     budget)
        return _finish(retriever, question, rows, scores, started)
    h = setup.hierarchy("graphrag")
    labels = h.labels[min(level, h.levels - 1)]
    held = labels[np.searchsorted(h.base, side.entities[best])]
    votes = Counter(held[held >= 0].tolist())
    candidates = np.asarray(sorted(votes), dtype=np.int64)
    report_scores = np.array([votes[c] for c in candidates.tolist()], np.float64) + \
        np.maximum(h.vectors[candidates] @ query, 0.0) if len(candidates) else np.zeros(0)
    chosen, used = hierarchy.fill_reports(h, candidates, report_scores, allowance)
    rows, scores = fill_sections(retriever, sections, budget, carry=allowance - used, used_total=used)
    result = _finish(retriever, question, rows, scores, started)
    result.nodes = hierarchy.report_nodes(h, "C", chosen, dict(zip(candidates.tolist(), report_scores.tolist(),
                                                                        strict=True))) + result.nodes
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


def graphrag_global(setup: Setup, question: str, budget: int, level: int | None = None) -> Retrieval:
    """GraphRAG-style global search (paper appendix B.2, B.4; Edge et al. 2024 §3.1.6): community
    summaries only. GraphRAG has an LLM rate every community report of the level (map) and keeps
    the best (reduce); here the reports are rated by vector similarity to the question (offline,
    no LLM), and the best are kept within the budget. Without a `level`: NodeRAG's own H nodes; with
    one, that level's reports. Summaries cover whole communities, so support recall, which counts
    only nodes derived from a passage, is 0 by construction."""
    if level is None:
        return vector_context(setup.retriever, question, budget, ("H",), dedupe=False)
    from . import hierarchy

    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    h = setup.hierarchy("graphrag")
    candidates = h.at(min(level, h.levels - 1))
    scores = np.maximum(h.vectors[candidates] @ retriever.embed_question(question), 1e-9)
    chosen, _ = hierarchy.fill_reports(h, candidates, scores, budget)
    result = Retrieval(question=question)
    result.nodes = hierarchy.report_nodes(h, "C", chosen, dict(zip(candidates.tolist(), scores.tolist(), strict=True)))
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result


HIPPO_ALPHA = 0.5


def _pagerank(transition_t: sp.csr_matrix, personalization: np.ndarray, alpha: float,
              tolerance: float = 1e-8, max_iterations: int = 200) -> np.ndarray:
    """Personalised PageRank to convergence: pi = alpha * p + (1 - alpha) * P^T pi."""
    p = personalization / personalization.sum()
    pi = p.copy()
    for _ in range(max_iterations):
        nxt = alpha * p + (1 - alpha) * (transition_t @ pi)
        done = np.abs(nxt - pi).sum() < tolerance
        pi = nxt
        if done:
            break
    return pi


def hipporag(setup: Setup, question: str, budget: int) -> Retrieval:
    """HippoRAG-style retrieval (paper figure 1 and §5; Gutiérrez et al. 2024 §2): the query's
    entities are linked to graph entities (name index, else the nearest name by vector), weighted by
    node specificity (1 / chunks containing the entity), and personalised PageRank runs to
    convergence over the entity graph (entities joined by relationships, damping 0.5); chunks are
    ranked by the PPR mass of the entities they contain. Simplified: no synonymy edges; with no
    query entity, the three names nearest to the question seed the walk."""
    retriever = setup.retriever
    question = retriever.check_question(question)
    started = time.perf_counter()
    side = setup.graph_side()
    walk, occurs, specificity = side.hippo()
    entities = list(dict.fromkeys(retriever.engine.query_entities(question)))
    position = np.full(len(retriever.build.ids), -1, dtype=np.int64)
    position[side.entities] = np.arange(len(side.entities))
    seeds: list[int] = []
    for name in entities:
        found = [int(position[r]) for r in retriever.build.names.match(name) if position[r] >= 0]
        if not found:
            found = [int(np.argmax(_dot(side.name_vectors, side.embedder.embed([name])[0])))]
        seeds.extend(found)
    if not seeds:
        nearest = _dot(side.name_vectors, retriever.embed_question(question))
        seeds = np.argsort(-nearest, kind="stable")[:3].tolist()
    personalization = np.zeros(len(side.entities), dtype=np.float64)
    for seed in dict.fromkeys(seeds):
        personalization[seed] = specificity[seed] or 1.0
    mass = _pagerank(walk, personalization, HIPPO_ALPHA)
    chunks = retriever.build.rows_by_type["T"]
    chunk_mass = occurs @ mass
    scores = np.zeros(len(retriever.build.ids), dtype=np.float64)
    scores[chunks] = chunk_mass
    ranked = chunks[chunk_mass > 0]
    kept = context.fit_budget(ranked, scores[ranked], retriever.build.tokens, budget)
    return _finish(retriever, question, kept, scores, started, entities)


def hypothetical_passage(setup: Setup, question: str) -> str:
    """HyDE's passage, through the engine (its limiter, retries, cache and accounting)."""
    return setup.engine.passage(question)


def _hyde_build(setup: Setup) -> Strategy:
    if setup.offline:
        raise StrategySkipped("HyDE needs an LLM engine to write its hypothetical answer; the offline engine "
                              "cannot, so it is skipped (set llm.engine: litellm in the config)")
    return lambda q, b: hyde(setup, q, b)


def _prepared(setup: Setup, run) -> Strategy:
    setup.graph_side()  # built now, outside the timed questions
    return lambda q, b: run(setup, q, b)


BASELINES: dict[str, StrategySpec] = {spec.name: spec for spec in (
    StrategySpec("naive", "baseline", "NaiveRAG: text chunks by vector similarity (appendix B.2)",
                 lambda s: lambda q, b: naive_rag(s.retriever, q, b)),
    StrategySpec("hyde", "baseline", "HyDE: chunks by similarity to an LLM-written hypothetical answer (B.2)", _hyde_build),
    StrategySpec("lightrag-local", "baseline", "LightRAG local: query entities, their relations, neighbours, chunks (B.2)",
                 lambda s: _prepared(s, lambda st, q, b: lightrag(st, q, b, "local"))),
    StrategySpec("lightrag-global", "baseline", "LightRAG global: relationships by keyword vectors, their entities, chunks",
                 lambda s: _prepared(s, lambda st, q, b: lightrag(st, q, b, "global"))),
    StrategySpec("lightrag-hybrid", "baseline", "LightRAG hybrid: local and global merged",
                 lambda s: _prepared(s, lambda st, q, b: lightrag(st, q, b, "hybrid"))),
    StrategySpec("graphrag-local", "baseline", "GraphRAG local: entities, relations, community summaries, chunks (B.2)",
                 lambda s: _prepared(s, graphrag_local)),
    StrategySpec("graphrag-global", "baseline", "GraphRAG global: community summaries (H) by similarity (B.4)",
                 lambda s: lambda q, b: graphrag_global(s, q, b)),
    StrategySpec("hipporag", "baseline", "HippoRAG: PPR over entities from query entities, chunks by PPR mass (fig. 1)",
                 lambda s: _prepared(s, hipporag)),
)}
