"""The loaded workspace for search: node arrays, the transition matrices, the name index, the
vectors and each node's sentence keys and source documents are read once when a workspace is
opened; a query then costs a few dictionary lookups, one exact scan of the S, A and H vectors,
a few sparse gathers (the walk reads only the rows that carry mass) and partial sorts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import scipy.sparse as sp

from ..config import Config, SearchConfig
from ..embeddings import Embedder
from ..engines.base import Engine
from ..graph import Graph
from ..index.pipeline import check_embedding_model
from ..workspace import Workspace, WorkspaceError
from . import QueryError, context
from .entry import NameIndex
from .ppr import shallow_ppr, transition

MAX_QUESTION_CHARS = 20_000
TYPE_CODE = {t: i for i, t in enumerate("TSAHRNO")}  # retrievable types first
MAX_RETRIEVABLE_CODE = TYPE_CODE["R"]
SCANNED = ("S", "A", "H")  # the vector side of dual search (spec §3.1)
IS_LEADER = np.isin(np.arange(len(TYPE_CODE)), [TYPE_CODE["N"], TYPE_CODE["O"]])  # by type code
IS_LED = np.isin(np.arange(len(TYPE_CODE)), [TYPE_CODE["A"], TYPE_CODE["H"]])


def inner_products(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """vectors @ query in one thread (faiss's SIMD kernel): BLAS would split a gemv this small
    over threads, and on a busy machine waiting for the second thread costs milliseconds."""
    query = np.ascontiguousarray(query, dtype=np.float32)
    out = np.empty(len(vectors), dtype=np.float32)
    if len(vectors):
        faiss.fvec_inner_products_ny(faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(vectors),
                                     vectors.shape[1], len(vectors))
    return out


def neighbours(adjacency: sp.csr_matrix, rows: np.ndarray) -> np.ndarray:
    """Column indices of the given CSR rows, concatenated (with repeats), without building a sub-matrix."""
    starts, stops = adjacency.indptr[rows], adjacency.indptr[rows + 1]
    counts = stops - starts
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(counts.sum())
    return adjacency.indices[offsets]


def similarity_share(edges: pa.Table) -> pa.Table:
    """The similarity part of each edge: weight 1 on every pair the similarity stage added (a row of
    kind "similarity", or a structural pair it also found, whose weight it raised by 1), none elsewhere."""
    hnsw = edges["hnsw"]
    table = edges.filter(hnsw)
    return table.set_column(table.schema.get_field_index("weight"), "weight",
                            pa.array(np.ones(table.num_rows, np.float32)))


@dataclass
class RetrievedNode:
    id: str
    type: str
    score: float
    text: str
    documents: list[str]
    tokens: int

    def as_dict(self) -> dict:
        return {"id": self.id, "type": self.type, "score": round(self.score, 8), "text": self.text,
                "documents": self.documents, "tokens": self.tokens}


@dataclass
class Retrieval:
    question: str
    nodes: list[RetrievedNode] = field(default_factory=list)
    entry_points: dict[str, list[str]] = field(default_factory=lambda: {"exact": [], "vector": []})
    query_entities: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    answer: str | None = None

    @property
    def context_tokens(self) -> int:
        return sum(n.tokens for n in self.nodes)

    def context_text(self) -> str:
        """What the answer step reads: nodes grouped by type, each with its sources."""
        lines = []
        for node in self.nodes:
            source = f" (from {', '.join(node.documents)})" if node.documents else ""
            lines.append(f"[{node.type}] {node.text}{source}")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {"question": self.question, "answer": self.answer, "context_tokens": self.context_tokens,
                "query_entities": self.query_entities, "nodes": [n.as_dict() for n in self.nodes],
                "entry_points": self.entry_points, "timings": {k: round(v, 3) for k, v in self.timings.items()}}


class Retriever:
    def __init__(self, ws: Workspace, config: Config, engine: Engine, embedder: Embedder):
        manifest = ws.read_manifest()
        if manifest.get("stages", {}).get("similarity", {}).get("state") != "done" or not ws.path("nodes.parquet").is_file():
            if not ws.exists():
                raise WorkspaceError(f"{ws.root} is not an indexed workspace; run `noderag index {ws.root} --input FOLDER` first")
            raise WorkspaceError(f"indexing of {ws.root} did not finish; run `noderag index` on it again to complete it")
        check_embedding_model(ws, embedder)
        self.config = config
        self.engine = engine
        self.embedder = embedder
        nodes = ws.read_table(ws.path("nodes.parquet"), ["id", "type", "text", "name", "doc_ids", "tokens", "vector_row"])
        edges = ws.read_table(ws.path("edges.parquet"))
        self.graph = Graph.from_tables(nodes, edges)
        self.ids = self.graph.ids
        self.types = self.graph.types
        self.texts = np.asarray(nodes["text"].to_pylist(), dtype=object)
        self.tokens = nodes["tokens"].to_numpy()
        self.doc_ids = nodes["doc_ids"].to_pylist()
        documents = ws.read_table(ws.path("documents.parquet"), ["doc_id", "path"])
        self.doc_path = dict(zip(documents["doc_id"].to_pylist(), documents["path"].to_pylist(), strict=True))
        # the adjacency split in two: structural edges, and the similarity (HNSW) share of each pair,
        # so the walk can weigh similarity edges by search.similarity_weight without re-indexing
        similar = Graph.from_tables(nodes, similarity_share(edges)).adjacency
        self.structural = (self.graph.adjacency - similar).tocsr()
        self.structural.eliminate_zeros()
        self.similar = similar
        self._transitions: dict[float, sp.csr_matrix] = {}

        vector_row = nodes["vector_row"].to_numpy()
        embedded = np.flatnonzero(vector_row >= 0)
        self.node_of_vector = np.empty(len(embedded), dtype=np.int64)
        self.node_of_vector[vector_row[embedded]] = embedded
        self.vector_of_node = vector_row
        index = faiss.deserialize_index(np.fromfile(ws.path("vectors.faiss"), dtype=np.uint8))
        if index.d != embedder.dim:
            raise WorkspaceError(f"workspace vectors have dimension {index.d}, the embedder gives {embedder.dim}")
        self.vectors = index.reconstruct_n(0, index.ntotal) if index.ntotal else np.zeros((0, embedder.dim), np.float32)
        self._by_types: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.scanned_position = np.full(len(self.vectors), -1, dtype=np.int64)  # vector row -> place in the scan
        scanned_rows = self._typed_vectors(SCANNED)[0]
        self.scanned_position[scanned_rows] = np.arange(len(scanned_rows))

        names = np.flatnonzero(np.isin(self.types, ["N", "O"]))
        name_texts = pc.if_else(pc.equal(nodes["name"], ""), nodes["text"], nodes["name"]).to_pylist()
        self.names = NameIndex([name_texts[i] for i in names.tolist()], names)
        # per node, computed once: the sentences the budget dedupes on, and the source documents shown
        retrievable = np.isin(self.types, list(context.TYPE_ORDER))
        self.sentence_keys = [context.sentence_keys(t) if keep else frozenset()
                              for t, keep in zip(self.texts.tolist(), retrievable.tolist(), strict=True)]
        self.documents = [sorted(self.doc_path.get(d, d) for d in docs) for docs in self.doc_ids]
        self.rows_by_type = {t: np.flatnonzero(self.types == t) for t in "TSNRAHO"}
        self.context_rank = np.full(len(self.ids), len(context.TYPE_ORDER), dtype=np.int8)
        for rank, node_type in enumerate(context.TYPE_ORDER):
            self.context_rank[self.rows_by_type[node_type]] = rank
        self.type_codes = np.zeros(len(self.ids), dtype=np.int8)
        for node_type, code in TYPE_CODE.items():
            self.type_codes[self.rows_by_type[node_type]] = code
        # the structural edges that end in an A or H node: what an entity or overview leads to
        ends_led = IS_LED[self.type_codes[self.structural.indices]]
        starts = np.repeat(np.arange(len(self.ids)), np.diff(self.structural.indptr))
        self.leads_to = sp.csr_matrix((self.structural.data[ends_led], (starts[ends_led], self.structural.indices[ends_led])),
                                      shape=self.structural.shape)
        self.embedder.embed(["warm-up"])  # load the model now, not inside the first query's timing

    # vector side ---------------------------------------------------------------
    def _typed_vectors(self, types: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(vector rows, their vectors) of the given node types, gathered once per type set."""
        if types not in self._by_types:
            rows = np.flatnonzero(np.isin(self.types[self.node_of_vector], list(types)))
            self._by_types[types] = (rows, np.ascontiguousarray(self.vectors[rows]))
        return self._by_types[types]

    def similarities(self, query: np.ndarray) -> np.ndarray:
        """Cosine of the query to the S, A and H vectors, in the order of `_typed_vectors(SCANNED)`:
        one exact scan, the vector side's candidates. Chunks are scored only when the walk reaches
        them, which spares reading a fifth of the vectors per query (the scan is memory-bound)."""
        return inner_products(self._typed_vectors(SCANNED)[1], query)

    def vector_search(self, query: np.ndarray, k: int, types: tuple[str, ...],
                      similarities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(node rows, similarities) of the k nodes of the given types most similar to `query`,
        exactly (a flat scan, or, for SCANNED types, `similarities` already computed), best first,
        ties by id."""
        rows, vectors = self._typed_vectors(types)
        k = min(k, len(rows))
        if k <= 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        scores = similarities if similarities is not None and types == SCANNED else inner_products(vectors, query)
        if k < len(rows):  # every score tied with the k-th best competes; the cut below keeps the lower ids
            top = np.flatnonzero(scores >= scores[np.argpartition(scores, len(rows) - k)[len(rows) - k]])
        else:
            top = np.arange(len(rows))
        top = top[np.lexsort((top, -scores[top]))][:k]
        return self.node_of_vector[rows[top]], scores[top]

    def transition(self, similarity_weight: float) -> sp.csr_matrix:
        """P (row-normalised) of structural edges + similarity_weight x similarity edges, built once per weight."""
        weight = float(similarity_weight)
        if weight not in self._transitions:
            adjacency = self.structural + weight * self.similar if weight else self.structural
            self._transitions[weight] = transition(adjacency.tocsr())
        return self._transitions[weight]

    def embed_question(self, question: str) -> np.ndarray:
        return self.embedder.embed_query(question)

    # the search ------------------------------------------------------------------
    def check_question(self, question: str) -> str:
        question = (question or "").strip()
        if not question:
            raise QueryError("the question is empty")
        if len(question) > MAX_QUESTION_CHARS:
            raise QueryError(f"the question is {len(question):,} characters long; the limit is {MAX_QUESTION_CHARS:,}")
        return question

    def entry_points(self, question: str, params: SearchConfig, query_vector: np.ndarray | None = None,
                     similarities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
        timings = {}
        t0 = time.perf_counter()
        entities = self.engine.query_entities(question) if params.use_exact else []
        timings["query_entities_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        exact: list[int] = []
        if params.use_exact:
            for entity in entities:
                exact.extend(self.names.match(entity))
            exact.extend(self.names.match(question, require_capital=True))
        exact_rows = np.asarray(list(dict.fromkeys(exact)), dtype=np.int64)
        timings["exact_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        vector_rows = np.zeros(0, np.int64)
        if params.use_vector and params.vector_top_k > 0:
            if query_vector is None:
                query_vector = self.embed_question(question)
            vector_rows, similarity = self.vector_search(query_vector, params.vector_top_k, SCANNED, similarities)
            vector_rows = vector_rows[similarity >= params.min_similarity]
        timings["vector_ms"] = (time.perf_counter() - t0) * 1000
        return exact_rows, vector_rows, entities, timings

    def retrieve(self, question: str, params: SearchConfig | None = None) -> Retrieval:
        params = params or self.config.search
        question = self.check_question(question)
        started = time.perf_counter()
        query_vector = self.embed_question(question)
        t0 = time.perf_counter()
        similarities = self.similarities(query_vector)
        scan_ms = (time.perf_counter() - t0) * 1000
        exact_rows, vector_rows, entities, timings = self.entry_points(question, params, query_vector, similarities)
        timings["vector_ms"] += scan_ms
        entries = np.union1d(exact_rows, vector_rows).astype(np.int64)
        result = Retrieval(question=question, query_entities=entities, timings=timings)
        result.entry_points = {"exact": self.ids[exact_rows].tolist(), "vector": self.ids[vector_rows].tolist()}
        if len(entries) == 0:
            result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
            return result

        t0 = time.perf_counter()
        support, mass = shallow_ppr(self.transition(params.similarity_weight), entries, params.ppr_alpha, params.ppr_iterations,
                                    params.ppr_variant)
        result.timings["ppr_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        rows, relevance = self.select(support, mass, entries, params, query_vector, similarities)
        kept = context.fit_budget(rows, relevance, self.tokens, params.budget_tokens, keys=self.sentence_keys)
        scores = np.zeros(len(self.ids), dtype=np.float64)
        scores[rows] = relevance
        result.nodes = self.nodes_for(kept, scores)
        result.timings["context_ms"] = (time.perf_counter() - t0) * 1000
        result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
        return result

    def select(self, support: np.ndarray, mass: np.ndarray, entries: np.ndarray, params: SearchConfig,
               query_vector: np.ndarray, similarities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Entry points and cross nodes of retrievable types (paper §2.5 steps 3-4), with the score
        each is ranked by in the context. Works on the walk's support only, never the whole graph.

        rank "ppr" (the paper): cross nodes are the top PPR scores per type, ranked by PPR.
        rank "walk_similarity": a node's walk mass is its PPR score less its own teleport share
        (alpha/|entries| for an entry point, which would otherwise outrank every cross node);
        every retrievable node the walk reached is scored by sqrt(walk) x similarity to the
        question (`similarities`: the query's cosine to the S, A and H vectors, from the scan that
        also found the vector entry points; chunks are scored here) and the quota best of each type are kept. R nodes, never
        embedded, take the mean similarity of the reached embedded nodes at half weight, on one
        scale with the rest. Entity and overview nodes count for what they lead to: the A nodes of
        matched or top-scoring N nodes, the H nodes of matched O nodes."""
        codes = self.type_codes[support]
        is_entry = np.zeros(len(support), dtype=bool)
        is_entry[np.searchsorted(support, entries)] = True
        retrievable_entries = np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE))
        if params.rank != "walk_similarity":
            quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
            quotas[TYPE_CODE["N"]] = params.cross_a  # top-scoring entities, for their attributes
            cross = context.top_per_group(mass, codes, ~is_entry, quotas)
            led = self._led(support, codes, is_entry, cross[codes[cross] == TYPE_CODE["N"]])
            pool = np.unique(np.concatenate([retrievable_entries, cross[codes[cross] <= MAX_RETRIEVABLE_CODE], led]))
            return support[pool], mass[pool]

        walk = mass.copy()
        walk[is_entry] = np.maximum(walk[is_entry] - params.ppr_alpha / len(entries), 0.0)
        entities = context.top_rows(walk, np.flatnonzero(~is_entry & (codes == TYPE_CODE["N"])), params.cross_a)
        led = self._led(support, codes, is_entry, entities)
        pool = np.flatnonzero(codes <= MAX_RETRIEVABLE_CODE)
        if similarities is None:
            similarities = self.similarities(query_vector)
        vector_rows = self.vector_of_node[support[pool]]
        embedded = vector_rows >= 0
        similarity = np.zeros(len(pool))
        position = self.scanned_position[vector_rows[embedded]]
        found = similarities[position]
        unscanned = position < 0  # chunks: scored here, only those the walk reached
        if unscanned.any():
            found[unscanned] = inner_products(self.vectors[vector_rows[embedded][unscanned]], query_vector)
        similarity[embedded] = np.maximum(found, 0.0)
        similarity[~embedded] = (similarity[embedded].mean() if embedded.any() else 0.0) * 0.5
        pool_codes = codes[pool]
        score = np.sqrt(walk[pool]) * similarity
        score[pool_codes == TYPE_CODE["T"]] *= params.chunk_weight
        quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
        kept = context.top_per_group(score, pool_codes, ~is_entry[pool], quotas)
        chosen = np.unique(np.concatenate([np.searchsorted(pool, retrievable_entries), np.searchsorted(pool, led), kept]))
        return support[pool[chosen]], score[chosen]

    def _led(self, support: np.ndarray, codes: np.ndarray, is_entry: np.ndarray, entities: np.ndarray) -> np.ndarray:
        """Positions in the support of the A and H nodes next to the leaders: entry N and O nodes and
        the given top-scoring N nodes."""
        leaders = np.concatenate([np.flatnonzero(is_entry & IS_LEADER[codes]), entities])
        if not len(leaders):
            return np.zeros(0, np.int64)
        reached = np.unique(neighbours(self.leads_to, support[leaders]))
        return np.searchsorted(support, reached)  # reached from a node with mass: always in the support

    def nodes_for(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """The context's nodes grouped by type (H, A, S, R, T), each group by score, ties by id (= row order)."""
        rows = np.asarray(rows, dtype=np.int64)
        ordered = rows[np.lexsort((rows, -scores[rows], self.context_rank[rows]))]
        columns = (self.ids[ordered].tolist(), self.types[ordered].tolist(), scores[ordered].tolist(),
                   self.texts[ordered].tolist(), ordered.tolist(), self.tokens[ordered].tolist())
        return [RetrievedNode(node, kind, score, text, list(self.documents[r]), tokens)
                for node, kind, score, text, r, tokens in zip(*columns, strict=True)]

    def answer(self, retrieval: Retrieval) -> Retrieval:
        t0 = time.perf_counter()
        retrieval.answer = self.engine.answer(retrieval.question, retrieval.context_text())
        retrieval.timings["answer_ms"] = (time.perf_counter() - t0) * 1000
        return retrieval
