"""The loaded workspace for search: node arrays, the transition matrices, the name index, the
vectors and each node's sentence keys and source documents are read once when a workspace is
opened; a query then costs a few dictionary lookups, one exact scan of the S, A and H vectors,
a few sparse gathers (the walk reads only the rows that carry mass) and partial sorts.
"""

from __future__ import annotations

import threading
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
from ..graph import Graph, row_entries
from ..index.pipeline import check_embedding_model
from ..workspace import Workspace, WorkspaceError
from . import QueryError, context
from .entry import NameIndex
from .ppr import inverse_degree, shallow_ppr, transition

MAX_QUESTION_CHARS = 20_000
SCAN8_CANDIDATES = 48  # the int8 scan's best, rescored exactly: enough in every question of both dev sets
SCAN8_SLACK = 1e-5  # float32 rounding of an exact 256-term dot product, with room to spare
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


def inner_products_at(vectors: np.ndarray, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """vectors[rows] @ query without gathering the rows first (faiss's kernel: the same bits as
    `inner_products` on the gathered rows)."""
    query = np.ascontiguousarray(query, dtype=np.float32)
    rows = np.ascontiguousarray(rows, dtype=np.int64)  # referenced until the call returns: swig_ptr does not hold it
    out = np.empty(len(rows), dtype=np.float32)
    if len(rows):
        faiss.fvec_inner_products_by_idx(faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(vectors),
                                         faiss.swig_ptr(rows), vectors.shape[1], 1, len(rows))
    return out


def compact_transition(adjacency: sp.csr_matrix, transition_p: sp.csr_matrix) -> tuple:
    """P as the walk kernel reads it: (indptr, indices, weights, inverse degree per row), in P's own
    entry order (scipy's product leaves a row's columns unsorted, and the order of a sum is part of
    its bits), where P's entry is inverse[row] x weight exactly as scipy computed it. Edge weights
    are small whole numbers, so they fit a byte: a third of P's float64 memory. P's own values are
    the fallback when a weight does not fit."""
    inverse = inverse_degree(adjacency)
    rows = np.repeat(np.arange(adjacency.shape[0]), np.diff(transition_p.indptr))
    sorted_order = np.lexsort((transition_p.indices, rows))  # P's entries in the adjacency's sorted layout
    weights = np.empty(len(rows), adjacency.data.dtype)
    if adjacency.has_sorted_indices and np.array_equal(transition_p.indices[sorted_order], adjacency.indices):
        weights[sorted_order] = adjacency.data
        small = weights.astype(np.uint8)
        if np.array_equal(small, weights) and np.array_equal(inverse[rows] * small, transition_p.data):
            return transition_p.indptr, transition_p.indices, small, inverse
    return transition_p.indptr, transition_p.indices, transition_p.data, np.ones(adjacency.shape[0])


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


def _load_kernels() -> None:
    """Import the compiled kernels and load them from numba's cache (or compile them, once per
    installation): ~0.7 s, spent on a thread while the workspace loads."""
    from . import kernels

    kernels.warm_up()


class Retriever:
    """A workspace loaded for search. With `compiled`, the walk, the selection and the budget run as
    numba kernels (search/kernels.py): a third less time per question (~0.5 ms) for ~0.7 s more to
    open the workspace, worth it from about a thousand questions per process
    (api.COMPILED_FROM_QUESTIONS); without, as numpy and Python. Both give the same results to the
    bit (tests/test_search_parts.py, tests/test_query.py)."""

    def __init__(self, ws: Workspace, config: Config, engine: Engine, embedder: Embedder, compiled: bool = True):
        loading = threading.Thread(target=_load_kernels, name="noderag-kernels", daemon=True) if compiled else None
        if loading is not None:
            loading.start()
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
        self._compact: dict[float, tuple] = {}  # per weight: P for the walk kernel (compact_transition)

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
        self.scanned_rows = np.flatnonzero(np.isin(self.types[self.node_of_vector], list(SCANNED)))
        self.scanned_position[self.scanned_rows] = np.arange(len(self.scanned_rows))
        self._build_scan8()

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
        self.kernels = None
        if loading is not None:
            # the budget kernel reads each node's sentence keys as ids
            key_id: dict[str, int] = {}
            ids_of = [[key_id.setdefault(key, len(key_id)) for key in sorted(keys)] for keys in self.sentence_keys]
            self.key_indptr = np.r_[0, np.cumsum([len(k) for k in ids_of])].astype(np.int64)
            self.key_ids = np.fromiter((k for keys in ids_of for k in keys), np.int64, int(self.key_indptr[-1]))
            self.key_count = len(key_id)
            loading.join()
            from . import kernels

            self.kernels = kernels

    # vector side ---------------------------------------------------------------
    def _typed_vectors(self, types: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(vector rows, their vectors) of the given node types, gathered once per type set."""
        if types not in self._by_types:
            rows = np.flatnonzero(np.isin(self.types[self.node_of_vector], list(types)))
            self._by_types[types] = (rows, np.ascontiguousarray(self.vectors[rows]))
        return self._by_types[types]

    def _build_scan8(self) -> None:
        """An int8 copy of the S, A and H vectors for the vector side's scan: a quarter of the float32
        scan's memory traffic, which set its cost. Codes are round(v x scale), one scale for all."""
        scanned = self.vectors[self.scanned_rows]
        self.scan8_scale = 127.0 / max(float(np.abs(scanned).max(initial=0.0)), 1e-12)
        codes = np.rint(scanned * np.float32(self.scan8_scale))  # whole numbers in [-127, 127], exact in float32
        residual = scanned - codes * np.float32(1 / self.scan8_scale)
        # float32 rounding of the residual is ~1e-7 of a vector's norm: SCAN8_SLACK covers it
        self.scan8_error = float(np.sqrt(np.einsum("ij,ij->i", residual, residual).max(initial=0.0)))
        self.scan8 = faiss.IndexScalarQuantizer(self.vectors.shape[1], faiss.ScalarQuantizer.QT_8bit_direct_signed,
                                                faiss.METRIC_INNER_PRODUCT)
        self.scan8.train(codes)
        self.scan8.add(codes)

    def _scan8_top(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
        """The exact top k of the S, A and H vectors by cosine, ties by id, from the int8 scan's best
        candidates rescored exactly; None when the candidates cannot be shown to hold it.

        With the query rounded as the vectors are (q = qc/sq + dq, v = vc/sv + dv, one scale sv for
        all vectors), a cosine differs from its int8 estimate qc.vc/(sq sv) by at most
        (1 + |dq|)|dv| + |dq|(1 + |dv|) + |dq||dv| (Cauchy-Schwarz on each cross term, |q| = |v| = 1),
        with |dv| at most the largest vector's rounding error. A vector outside the candidates is
        estimated no higher than the last candidate, so it scores at most that estimate plus the
        bound; when that is below the exact k-th best among the candidates, it cannot be in the top k."""
        query64 = query.astype(np.float64)
        scale = 127.0 / max(float(np.abs(query64).max(initial=0.0)), 1e-12)
        rounded = np.rint(query64 * scale)
        query_error = float(np.linalg.norm(query64 - rounded / scale))
        wanted = min(SCAN8_CANDIDATES + k, len(self.scanned_rows))
        estimates, candidates = self.scan8.search(rounded.astype(np.float32)[None, :], wanted)
        candidates = candidates[0]
        exact = inner_products_at(self.vectors, query, self.scanned_rows[candidates])
        order = np.lexsort((candidates, -exact))[:k]
        if wanted < len(self.scanned_rows):
            bound = (1 + query_error) * self.scan8_error + query_error * (1 + self.scan8_error) + \
                query_error * self.scan8_error + SCAN8_SLACK
            if not estimates[0, -1] / (scale * self.scan8_scale) + bound < exact[order[-1]]:
                return None
        return self.node_of_vector[self.scanned_rows[candidates[order]]], exact[order]

    def similarities(self, query: np.ndarray) -> np.ndarray:
        """Cosine of the query to the S, A and H vectors, in the order of `_typed_vectors(SCANNED)`:
        one exact float32 scan. The search itself scans the int8 copy (`_scan8_top`); this is the
        reference it is tested against, and the fallback."""
        return inner_products(self._typed_vectors(SCANNED)[1], query)

    def vector_search(self, query: np.ndarray, k: int, types: tuple[str, ...],
                      similarities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(node rows, similarities) of the k nodes of the given types most similar to `query`,
        exactly, best first, ties by id: for SCANNED types from `similarities` already computed, else
        from the int8 scan (`_scan8_top`); otherwise (or when that cannot prove its answer) by a flat
        scan."""
        if types == SCANNED and similarities is None and 0 < k < len(self.scanned_rows):
            found = self._scan8_top(query, k)
            if found is not None:
                return found
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
            adjacency = (self.structural + weight * self.similar if weight else self.structural).tocsr()
            self._transitions[weight] = transition(adjacency)
            self._compact[weight] = compact_transition(adjacency, self._transitions[weight])
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
        exact_rows, vector_rows, entities, timings = self.entry_points(question, params, query_vector)
        entries = np.union1d(exact_rows, vector_rows).astype(np.int64)
        result = Retrieval(question=question, query_entities=entities, timings=timings)
        result.entry_points = {"exact": self.ids[exact_rows].tolist(), "vector": self.ids[vector_rows].tolist()}
        if len(entries) == 0:
            result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
            return result

        t0 = time.perf_counter()
        support, mass = self.walk(entries, params)
        result.timings["ppr_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        rows, relevance = self.select(support, mass, entries, params, query_vector)  # rows ascending
        if self.kernels is not None:
            kept = self.kernels.fit_budget(rows[np.lexsort((rows, -relevance))], self.tokens, params.budget_tokens,
                                           self.key_indptr, self.key_ids, np.zeros(self.key_count, bool))
        else:
            kept = context.fit_budget(rows, relevance, self.tokens, params.budget_tokens, keys=self.sentence_keys)
        result.nodes = self._nodes(kept, relevance[np.searchsorted(rows, kept)])
        result.timings["context_ms"] = (time.perf_counter() - t0) * 1000
        result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
        return result

    def walk(self, entries: np.ndarray, params: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
        """Shallow PPR from the entry points: (support rows sorted, mass); the paper's walk runs as a
        kernel when compiled."""
        transition_p = self.transition(params.similarity_weight)
        if self.kernels is None or params.ppr_variant != "paper":
            return shallow_ppr(transition_p, entries, params.ppr_alpha, params.ppr_iterations, params.ppr_variant)
        indptr, indices, weights, inverse_degree = self._compact[float(params.similarity_weight)]
        return self.kernels.ppr_paper(indptr, indices, weights, inverse_degree, np.unique(entries), params.ppr_alpha,
                                      params.ppr_iterations, np.zeros(transition_p.shape[0]))

    def select(self, support: np.ndarray, mass: np.ndarray, entries: np.ndarray, params: SearchConfig,
               query_vector: np.ndarray, similarities: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Entry points and cross nodes of retrievable types (paper §2.5 steps 3-4), with the score
        each is ranked by in the context. Works on the walk's support only, never the whole graph.

        rank "ppr" (the paper): cross nodes are the top PPR scores per type, ranked by PPR.
        rank "walk_similarity": a node's walk mass is its PPR score less its own teleport share
        (alpha/|entries| for an entry point, which would otherwise outrank every cross node);
        every retrievable node the walk reached is scored by sqrt(walk) x similarity to the
        question (its cosine, computed for the reached nodes, or taken from `similarities`, a full
        scan of the S, A and H vectors, where given) and the quota best of each type are kept (the
        same rule as numpy here or as kernels.select_walk when compiled). R nodes, never
        embedded, take the mean similarity of the reached embedded nodes at half weight, on one
        scale with the rest. Entity and overview nodes count for what they lead to: the A nodes of
        matched or top-scoring N nodes, the H nodes of matched O nodes."""
        codes = self.type_codes[support]
        if params.rank != "walk_similarity":
            is_entry = np.zeros(len(support), dtype=bool)
            is_entry[np.searchsorted(support, entries)] = True
            retrievable_entries = np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE))
            quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
            quotas[TYPE_CODE["N"]] = params.cross_a  # top-scoring entities, for their attributes
            cross = context.top_per_group(mass, codes, ~is_entry, quotas)
            led = self._led(support, codes, is_entry, cross[codes[cross] == TYPE_CODE["N"]])
            pool = np.unique(np.concatenate([retrievable_entries, cross[codes[cross] <= MAX_RETRIEVABLE_CODE], led]))
            return support[pool], mass[pool]

        vector_rows = self.vector_of_node[support]
        embedded = vector_rows >= 0  # T, S, A and H nodes
        if similarities is None:
            found = inner_products_at(self.vectors, query_vector, vector_rows[embedded])
        else:
            position = self.scanned_position[vector_rows[embedded]]
            found = similarities[position]
            unscanned = position < 0  # chunks
            found[unscanned] = inner_products_at(self.vectors, query_vector, vector_rows[embedded][unscanned])
        similarity = np.zeros(len(support))
        similarity[embedded] = np.maximum(found, 0.0)
        relation_similarity = (similarity[embedded].mean() if embedded.any() else 0.0) * 0.5
        entries = np.unique(entries)
        if self.kernels is not None:
            quotas = np.array([params.cross_t, params.cross_s, params.cross_a, params.cross_h, params.cross_r], np.int64)
            chosen, scores = self.kernels.select_walk(support, mass, entries, params.ppr_alpha, codes, similarity,
                                                      relation_similarity, self.leads_to.indptr, self.leads_to.indices,
                                                      quotas, params.cross_a, params.chunk_weight)
            return support[chosen], scores
        is_entry = np.zeros(len(support), dtype=bool)
        is_entry[np.searchsorted(support, entries)] = True
        walk = mass.copy()
        walk[is_entry] = np.maximum(walk[is_entry] - params.ppr_alpha / len(entries), 0.0)
        top_entities = context.top_rows(walk, np.flatnonzero(~is_entry & (codes == TYPE_CODE["N"])), params.cross_a)
        led = self._led(support, codes, is_entry, top_entities)
        pool = np.flatnonzero(codes <= MAX_RETRIEVABLE_CODE)
        pool_codes = codes[pool]
        score = np.zeros(len(support))
        score[pool] = np.sqrt(walk[pool]) * np.where(pool_codes == TYPE_CODE["R"], relation_similarity, similarity[pool])
        score[pool[pool_codes == TYPE_CODE["T"]]] *= params.chunk_weight
        quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
        kept = pool[context.top_per_group(score[pool], pool_codes, ~is_entry[pool], quotas)]
        chosen = np.unique(np.concatenate([np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE)), led, kept]))
        return support[chosen], score[chosen]

    def _led(self, support: np.ndarray, codes: np.ndarray, is_entry: np.ndarray, entities: np.ndarray) -> np.ndarray:
        """Positions in the support of the A and H nodes next to the leaders: entry N and O nodes and
        the given top-scoring N nodes."""
        leaders = np.concatenate([np.flatnonzero(is_entry & IS_LEADER[codes]), entities])
        if not len(leaders):
            return np.zeros(0, np.int64)
        reached = np.unique(self.leads_to.indices[row_entries(self.leads_to.indptr, support[leaders])])
        return np.searchsorted(support, reached)  # reached from a node with mass: always in the support

    def nodes_for(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """The context's nodes grouped by type (H, A, S, R, T), each group by score, ties by id (= row
        order); `scores` holds a score per node of the graph."""
        rows = np.asarray(rows, dtype=np.int64)
        return self._nodes(rows, scores[rows])

    def _nodes(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """nodes_for with `scores` given per row of `rows`."""
        order = np.lexsort((rows, -scores, self.context_rank[rows]))
        ordered = rows[order]
        columns = (self.ids[ordered].tolist(), self.types[ordered].tolist(), scores[order].tolist(),
                   self.texts[ordered].tolist(), ordered.tolist(), self.tokens[ordered].tolist())
        return [RetrievedNode(node, kind, score, text, list(self.documents[r]), tokens)
                for node, kind, score, text, r, tokens in zip(*columns, strict=True)]

    def answer(self, retrieval: Retrieval) -> Retrieval:
        t0 = time.perf_counter()
        retrieval.answer = self.engine.answer(retrieval.question, retrieval.context_text())
        retrieval.timings["answer_ms"] = (time.perf_counter() - t0) * 1000
        return retrieval
