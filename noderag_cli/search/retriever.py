"""The loaded workspace for search: node arrays, P^T in CSR, the name index and the faiss
index are read once when a workspace is opened; a query then costs a few dictionary
lookups, one HNSW search, two sparse mat-vecs and a partial sort.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np
import pyarrow.compute as pc

from ..config import Config, SearchConfig
from ..embeddings import Embedder
from ..engines.base import Engine
from ..graph import Graph
from ..index.pipeline import check_embedding_model
from ..workspace import Workspace, WorkspaceError
from . import context
from .entry import NameIndex
from .ppr import shallow_ppr, transition

MAX_QUESTION_CHARS = 20_000


class QueryError(ValueError):
    """A question that cannot be searched (empty, too long)."""


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
        self.transition = transition(self.graph.adjacency)
        self.transition_t = self.transition.T.tocsr()
        self.adjacency = self.graph.adjacency

        vector_row = nodes["vector_row"].to_numpy()
        embedded = np.flatnonzero(vector_row >= 0)
        self.node_of_vector = np.empty(len(embedded), dtype=np.int64)
        self.node_of_vector[vector_row[embedded]] = embedded
        self.vector_of_node = vector_row
        self.index = faiss.deserialize_index(np.fromfile(ws.path("vectors.faiss"), dtype=np.uint8))
        if self.index.d != embedder.dim:
            raise WorkspaceError(f"workspace vectors have dimension {self.index.d}, the embedder gives {embedder.dim}")
        self._selectors = {}
        self.vectors = self.index.reconstruct_n(0, self.index.ntotal) if self.index.ntotal else np.zeros((0, embedder.dim), np.float32)

        names = np.flatnonzero(np.isin(self.types, ["N", "O"]))
        name_texts = pc.if_else(pc.equal(nodes["name"], ""), nodes["text"], nodes["name"]).to_pylist()
        self.names = NameIndex([name_texts[i] for i in names.tolist()], names)
        self.rows_by_type = {t: np.flatnonzero(self.types == t) for t in "TSNRAHO"}
        self.embedder.embed(["warm-up"])  # load the model now, not inside the first query's timing

    # vector side ---------------------------------------------------------------
    def _selector(self, types: tuple[str, ...]):
        """An HNSW search restricted to some node types, via a bitmap over vector rows."""
        if types not in self._selectors:
            allowed = np.isin(self.types[self.node_of_vector], list(types))
            bits = np.packbits(allowed, bitorder="little")
            selector = faiss.IDSelectorBitmap(len(allowed), faiss.swig_ptr(bits))
            params = faiss.SearchParametersHNSW()
            params.sel = selector
            self._selectors[types] = (bits, selector, params)
        return self._selectors[types]

    def vector_search(self, query: np.ndarray, k: int, types: tuple[str, ...], ef_search: int) -> tuple[np.ndarray, np.ndarray]:
        """(node rows, similarities) of the k nearest nodes of the given types."""
        if k <= 0 or self.index.ntotal == 0:
            return np.zeros(0, np.int64), np.zeros(0, np.float32)
        bits, selector, params = self._selector(types)
        params.efSearch = max(ef_search, k)
        scores, rows = self.index.search(query.reshape(1, -1).astype(np.float32), k, params=params)
        keep = rows[0] >= 0
        return self.node_of_vector[rows[0][keep]], scores[0][keep]

    def embed_question(self, question: str) -> np.ndarray:
        return self.embedder.embed([question])[0]

    # the search ------------------------------------------------------------------
    def check_question(self, question: str) -> str:
        question = (question or "").strip()
        if not question:
            raise QueryError("the question is empty")
        if len(question) > MAX_QUESTION_CHARS:
            raise QueryError(f"the question is {len(question):,} characters long; the limit is {MAX_QUESTION_CHARS:,}")
        return question

    def entry_points(self, question: str, params: SearchConfig, ef_search: int,
                     query_vector: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, list[str], dict]:
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
            vector_rows, similarity = self.vector_search(query_vector, params.vector_top_k, ("S", "A", "H"), ef_search)
            vector_rows = vector_rows[similarity >= params.min_similarity]
        timings["vector_ms"] = (time.perf_counter() - t0) * 1000
        return exact_rows, vector_rows, entities, timings

    def retrieve(self, question: str, params: SearchConfig | None = None) -> Retrieval:
        params = params or self.config.search
        question = self.check_question(question)
        started = time.perf_counter()
        query_vector = self.embed_question(question)
        exact_rows, vector_rows, entities, timings = self.entry_points(question, params, self.config.hnsw.ef_search,
                                                                       query_vector)
        entries = np.union1d(exact_rows, vector_rows).astype(np.int64)
        result = Retrieval(question=question, query_entities=entities, timings=timings)
        result.entry_points = {"exact": self.ids[exact_rows].tolist(), "vector": self.ids[vector_rows].tolist()}
        if len(entries) == 0:
            result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
            return result

        t0 = time.perf_counter()
        personalization = np.zeros(len(self.ids), dtype=np.float64)
        personalization[entries] = 1.0
        scores = shallow_ppr(self.transition, personalization, params.ppr_alpha, params.ppr_iterations,
                             params.ppr_variant)
        if params.rank == "walk_similarity":
            scores = self.walk_similarity(scores, personalization, params.ppr_alpha, query_vector)
        result.timings["ppr_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        rows = self.select(scores, entries, params)
        kept = context.fit_budget(rows, scores[rows], self.tokens, params.budget_tokens, self.texts)
        result.nodes = self.nodes_for(kept, scores)
        result.timings["context_ms"] = (time.perf_counter() - t0) * 1000
        result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
        return result

    def walk_similarity(self, ppr: np.ndarray, personalization: np.ndarray, alpha: float,
                        query_vector: np.ndarray) -> np.ndarray:
        """Graph evidence times relevance: the PPR mass that arrived by walking (the teleport
        share alpha*p removed, else every entry point outranks every cross node), times the
        node's similarity to the question. R nodes, never embedded, keep their walk mass
        scaled by the mean similarity of the candidates, so they rank on one scale with the rest."""
        walk = np.maximum(ppr - alpha * personalization / personalization.sum(), 0.0)
        similarity = np.zeros(len(self.ids), dtype=np.float64)
        reached = np.flatnonzero((walk > 0) & (self.vector_of_node >= 0))
        similarity[reached] = np.maximum(np.einsum("ij,j->i", self.vectors[self.vector_of_node[reached]], query_vector), 0.0)
        relevance = np.sqrt(walk) * similarity
        not_embedded = self.vector_of_node < 0
        typical = similarity[reached].mean() if len(reached) else 0.0
        relevance[not_embedded] = np.sqrt(walk[not_embedded]) * typical * 0.5
        return relevance

    def select(self, scores: np.ndarray, entries: np.ndarray, params: SearchConfig) -> np.ndarray:
        """Entry points and cross nodes, restricted to retrievable types (paper §2.5 steps 3-4)."""
        not_entry = np.ones(len(self.ids), dtype=bool)
        not_entry[entries] = False
        picked = [entries]
        for node_type, quota in params.quotas().items():
            candidates = self.rows_by_type[node_type]
            picked.append(context.top_rows(scores, candidates[not_entry[candidates]], quota))
        # entity and overview nodes count for what they lead to: A of N, H of O
        leaders = np.concatenate([entries[np.isin(self.types[entries], ["N", "O"])],
                                  context.top_rows(scores, self.rows_by_type["N"], params.cross_a)])
        if len(leaders):
            reached = self.adjacency[leaders].indices
            picked.append(reached[np.isin(self.types[reached], ["A", "H"])])
        rows = np.unique(np.concatenate(picked))
        return rows[np.isin(self.types[rows], ["T", "S", "A", "H", "R"])]

    def nodes_for(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        rank = {t: i for i, t in enumerate(context.TYPE_ORDER)}
        ordered = sorted(rows.tolist(), key=lambda r: (rank[self.types[r]], -scores[r], self.ids[r]))
        return [
            RetrievedNode(self.ids[r], self.types[r], float(scores[r]), self.texts[r],
                          sorted(self.doc_path.get(d, d) for d in self.doc_ids[r]), int(self.tokens[r]))
            for r in ordered
        ]

    def answer(self, retrieval: Retrieval) -> Retrieval:
        t0 = time.perf_counter()
        retrieval.answer = self.engine.answer(retrieval.question, retrieval.context_text())
        retrieval.timings["answer_ms"] = (time.perf_counter() - t0) * 1000
        return retrieval


def open_retriever(workspace: Path, config: Config, engine: Engine, embedder: Embedder) -> Retriever:
    return Retriever(Workspace(workspace), config, engine, embedder)
