"""A build opened for search. Everything a question reads was derived at index time
(search/prepare.py) and is memory-mapped from the build's generation, so opening costs the same
at any size; a query then costs a few hash lookups, one int8 scan of the S, A and H vectors, a
few sparse gathers (the walk reads only the rows that carry mass) and partial sorts. The full
tables and the scipy graph are loaded only if an evaluation strategy asks for them.

The steps of a question, in order: entry points (names, `entry.py`; vectors, `vectors.py`), the
walk (`ppr.py`), the selection and the budget (`context.py`), then an answer if asked; what it
returns is in `results.py`.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time
from pathlib import Path

import faiss
import numpy as np
import pyarrow as pa

from .. import ivf
from ..config import Config, SearchConfig
from ..embeddings import Embedder, check_embedding
from ..engines.base import Engine
from ..errors import WorkspaceError
from ..generation import Generation, damaged, repair_hint
from ..graph import Graph, row_entries
from ..index.chunk import place_of
from ..node_types import MAX_RETRIEVABLE_CODE, TYPE_CODE, TYPE_LETTERS
from . import QueryError, context, paths, rounds
from .entry import NameIndex
from .ppr import WalkMatrix, shallow_ppr
from .prepare import (
    SCANNED,
    WALK_ARRAYS,
    node_ids,
    split_adjacency,
    walk_matrix,
)
from .prepare import (
    VERSION as PREPARED_VERSION,
)
from .results import Retrieval, RetrievedNode
from .vectors import QuestionCosines, VectorSide

MAX_QUESTION_CHARS = 20_000
MAX_PLACES = 10  # places shown per node (a community summary can come from hundreds of chunks)
IS_LEADER = np.isin(np.arange(len(TYPE_CODE)), [TYPE_CODE["N"], TYPE_CODE["O"]])  # by type code
CONTEXT_RANK = np.array([context.TYPE_ORDER.index(t) if t in context.TYPE_ORDER else len(context.TYPE_ORDER)
                         for t in TYPE_CODE], dtype=np.int8)  # by type code


def _load_kernels() -> None:
    """Import the compiled kernels and load them from numba's cache (or compile them, once per
    installation): ~0.7 s, spent on a thread while the workspace loads."""
    from . import kernels

    kernels.warm_up()


def _mapped(array: np.ndarray) -> np.ndarray:
    """A plain ndarray over a memory-mapped one (the kernels are compiled for plain arrays)."""
    return np.asarray(array)


def _found_in(unit: str, chunk_text: str) -> tuple[int, int] | None:
    """Where a unit lies in its chunk's text: its sentence (without a "Subject: " prefix), else the
    first of its pieces (a table row's cells, "Name: Ada; Role: Pilot") that the text holds."""
    body = unit.split(": ", 1)[1] if ": " in unit and not unit.startswith(": ") else unit
    at = chunk_text.find(body[:60]) if body else -1
    if at >= 0:
        return at, at + len(body)
    for piece in re.split(r"[;:]\s+", body):
        piece = piece.strip(" .")
        if len(piece) >= 3 and (at := chunk_text.find(piece)) >= 0:
            return at, at + len(piece)
    return None


class Retriever:
    """A build opened for search. With `compiled`, the walk, the selection and the budget run as
    numba kernels (search/kernels.py): a third less time per question (~0.5 ms) for ~0.7 s more to
    open the workspace, worth it from about a thousand questions per process
    (api.COMPILED_FROM_QUESTIONS); without, as numpy and Python. Both give the same results to the
    bit (tests/test_search_parts.py, tests/test_query.py)."""

    def __init__(self, generation: Generation, config: Config, engine: Engine, embedder: Embedder,
                 compiled: bool = True):
        loading = threading.Thread(target=_load_kernels, name="noderag-kernels", daemon=True) if compiled else None
        if loading is not None:
            loading.start()
        check_embedding(generation.ws_root, (generation.manifest.get("embedding") or {}).get("model"), embedder.model_id)
        self.generation = generation
        self.config = config
        self.engine = engine
        self.embedder = embedder
        meta = generation.meta
        if meta.get("version") != PREPARED_VERSION:
            raise generation.damaged("manifest.json", f"its search structures are of version {meta.get('version')}, "
                                                      f"this noderag reads {PREPARED_VERSION}")
        vector_index = self._read_index("vectors.faiss")
        scan8_index = self._read_index("scan8.faiss") if "scan8" in meta else None
        if vector_index.d != embedder.dim:
            raise WorkspaceError(f"workspace vectors have dimension {vector_index.d}, the embedder gives {embedder.dim}")
        vectors = ivf.stored_vectors(vector_index)
        self._text_column = generation.arrow("node_text")["text"]
        self.type_codes = _mapped(generation.array("type_codes"))
        self.id_hash = _mapped(generation.array("id_hash"))
        self.tokens = _mapped(generation.array("tokens"))
        scan8 = (scan8_index, meta["scan8"]["scale"], meta["scan8"]["error"]) if "scan8" in meta else None
        clusters = tuple(_mapped(generation.array(name)) for name in ("cluster_centroids", "cluster_indptr", "cluster_rows",
                                                                 "cluster_codes")) if "clusters" in meta else None
        self.vector_side = VectorSide(vectors, self.type_codes, _mapped(generation.array("vector_of_node")),
                                      _mapped(generation.array("node_of_vector")), _mapped(generation.array("scanned_rows")),
                                      scan8, clusters, config.search.vector_probes)
        self._walks = {float(meta["walk_similarity_weight"]): WalkMatrix(*(_mapped(generation.array(n)) for n in WALK_ARRAYS))}
        self.leads_indptr, self.leads_indices = _mapped(generation.array("leads_indptr")), _mapped(generation.array("leads_indices"))
        self.key_indptr, self.key_ids = _mapped(generation.array("key_indptr")), _mapped(generation.array("key_ids"))
        self.key_count = int(meta["sentence_keys"])
        self.doc_indptr, self.doc_codes = _mapped(generation.array("doc_indptr")), _mapped(generation.array("doc_codes"))
        self.document_names = generation.arrow("document_names")["path"]
        self._paths: dict[int, str] = {}  # filled as paths are shown
        self.place_indptr, self.place_rows = _mapped(generation.array("place_indptr")), _mapped(generation.array("place_rows"))
        self.places = generation.arrow("places")
        self._places: dict[int, tuple[dict, int]] = {}  # (place, its chunk's T row), filled as places are shown
        self.names = NameIndex({name: _mapped(generation.array(name)) for name in NameIndex.ARRAYS},
                               generation.arrow("name_keys")["key"])
        self._scratches: dict[tuple[str, int, int], np.ndarray] = {}
        self._value_names: dict[int, bool] = {}  # per entity row: its name is a date or a quantity
        self.embedder.embed(["warm-up"])  # load the model now, not inside the first query's timing
        self.kernels = None
        if loading is not None:
            loading.join()
            from . import kernels

            self.kernels = self.vector_side.kernels = kernels

    def _scratch(self, name: str, size: int, dtype) -> np.ndarray:
        """A zeroed array the kernels use and leave zeroed, made once per session and thread (its
        pages are the operating system's zero pages until written), never per question."""
        key = (name, size, threading.get_ident())
        if key not in self._scratches:
            self._scratches[key] = np.zeros(size, dtype)
        return self._scratches[key]

    def _read_index(self, file: str) -> faiss.Index:
        path = self.generation.path(file)
        try:
            return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
        except RuntimeError as err:
            raise self.generation.damaged(file, f"unreadable: {str(err).splitlines()[0][:120]}") from None

    def close(self) -> None:
        """Let go of the build (an `index` run may then remove it once it is no longer current)."""
        self.generation.close()

    # whole-graph views, for evaluation strategies and tests; the query path never builds them
    @functools.cached_property
    def ids(self) -> np.ndarray:
        return np.asarray(node_ids(self.id_hash, self.type_codes), dtype=object)

    @functools.cached_property
    def types(self) -> np.ndarray:
        return TYPE_LETTERS[self.type_codes]

    @functools.cached_property
    def texts(self) -> np.ndarray:
        return np.asarray(self._text_column.to_pylist(), dtype=object)

    @functools.cached_property
    def rows_by_type(self) -> dict[str, np.ndarray]:
        return {t: np.flatnonzero(self.type_codes == TYPE_CODE[t]) for t in "TSNRAHO"}

    @property
    def sentence_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """Each node's sentence keys as ids, for `context.fit_budget`."""
        return self.key_indptr, self.key_ids

    @functools.cached_property
    def _tables(self) -> tuple[pa.Table, pa.Table]:
        return (self.generation.table("nodes", ["id", "type"]), self.generation.table("edges"))

    @functools.cached_property
    def graph(self) -> Graph:
        return Graph.from_tables(*self._tables)

    @functools.cached_property
    def _split(self):
        return split_adjacency(*self._tables)

    @property
    def structural(self):
        """The structural edges' adjacency (`prepare.Adjacency`)."""
        return self._split[0]

    @property
    def similar(self):
        """The similarity (HNSW) share of each pair (`prepare.Adjacency`)."""
        return self._split[1]

    def id_of(self, rows: np.ndarray) -> list[str]:
        rows = np.asarray(rows, dtype=np.int64)
        return node_ids(self.id_hash[rows], self.type_codes[rows])

    def walk_matrix(self, similarity_weight: float) -> WalkMatrix:
        """P of structural edges + similarity_weight x similarity edges: the build's own for its
        configured weight, any other built once per weight from the tables."""
        weight = float(similarity_weight)
        if weight not in self._walks:
            self._walks[weight] = walk_matrix(self.structural, self.similar, weight)
        return self._walks[weight]

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
            vector_rows, similarity = self.vector_side.search(query_vector, params.vector_top_k, SCANNED, similarities,
                                                              params.vector_probes)
            vector_rows = vector_rows[similarity >= params.min_similarity]
        timings["vector_ms"] = (time.perf_counter() - t0) * 1000
        return exact_rows, vector_rows, entities, timings

    def retrieve(self, question: str, params: SearchConfig | None = None, explain: bool = False) -> Retrieval:
        """The context for a question (`_retrieve`); `explain`: each node also carries the path the
        walk took to it (search/paths.py). A build is opened by its sizes only (hashing it
        would cost what opening must not); when a search fails on what it read, the build's files
        are checked, and a damaged one is named with its repair instead of a traceback."""
        try:
            return self._retrieve(question, params, explain)
        except (IndexError, ValueError, KeyError, OverflowError, RuntimeError, pa.ArrowException):
            problems = self.generation.verify()
            if problems:
                path, _, detail = problems[0].partition(": ")
                raise damaged(Path(path), self.generation.ws_root, detail,
                              repair_hint(self.generation.ws_root, self.generation.manifest.get("input"))) from None
            raise

    def _retrieve(self, question: str, params: SearchConfig | None = None, explain: bool = False) -> Retrieval:
        params = params or self.config.search
        question = self.check_question(question)
        started = time.perf_counter()
        query_vector = self.embed_question(question)
        exact_rows, vector_rows, entities, timings = self.entry_points(question, params, query_vector)
        entries = np.union1d(exact_rows, vector_rows).astype(np.int64)
        result = Retrieval(question=question, query_entities=entities, timings=timings)
        result.entry_points = {"exact": self.id_of(exact_rows), "vector": self.id_of(vector_rows), "bridge": []}
        if len(entries) == 0:
            result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
            return result

        t0 = time.perf_counter()
        walk = self.walk_matrix(params.similarity_weight)
        start = rounds.start_shares(walk, entries, exact_rows, params.exact_share)
        support, mass = self.walk(entries, start, params)
        result.timings["ppr_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        cosines = QuestionCosines(self.vector_side, query_vector)
        rows, relevance = self.select(support, mass, entries, start, params, query_vector, cosines)  # rows ascending
        result.timings["context_ms"] = (time.perf_counter() - t0) * 1000
        first_entries, bridges = entries, np.zeros(0, np.int64)
        if params.second_round_chunks > 0 and len(rows):
            t0 = time.perf_counter()
            bridges = rounds.without_values(self.bridge_candidates(walk, rows, relevance, exact_rows, params),
                                            self._text_column, self._value_names)
            if len(bridges):
                entries, start = rounds.with_bridges(walk, entries, start, bridges, params.second_round_share)
                support, mass = self.walk(entries, start, params)
                rows, relevance = self.select(support, mass, entries, start, params, query_vector, cosines)
                result.entry_points["bridge"] = self.id_of(bridges)
            result.timings["second_round_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        kept = self.fit_budget(rows, relevance, params)
        result.nodes = self._nodes(kept, relevance[np.searchsorted(rows, kept)])
        if explain:
            self._explain(result, walk, support, mass, first_entries, entries, exact_rows, vector_rows, bridges, params)
        else:
            for node, how in zip(result.nodes, paths.via(self._rows_of(result.nodes), exact_rows, vector_rows, bridges),
                                 strict=True):
                node.via = how
        result.smallest_match_tokens = int(self.tokens[rows].min()) if len(rows) else 0
        result.timings["context_ms"] += (time.perf_counter() - t0) * 1000
        result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
        return result

    def _rows_of(self, nodes: list[RetrievedNode]) -> np.ndarray:
        return np.array([n.row for n in nodes], dtype=np.int64)

    def _explain(self, result: Retrieval, walk: WalkMatrix, support: np.ndarray, mass: np.ndarray,
                 first_entries: np.ndarray, entries: np.ndarray, exact_rows: np.ndarray, vector_rows: np.ndarray,
                 bridges: np.ndarray, params: SearchConfig) -> None:
        """Each node's `via` and `path`, and the nodes on the paths that the context left out."""
        rows = self._rows_of(result.nodes)
        hows = paths.via(rows, exact_rows, vector_rows, bridges)
        steps = params.ppr_iterations + 2
        bridge_paths: dict[int, list[int]] = {}  # a bridge's own path, from the first round's entry points
        second_only = set(bridges.tolist()) - set(first_entries.tolist())
        on_paths: set[int] = set()
        for node, row, how in zip(result.nodes, rows.tolist(), hows, strict=True):
            node.via = how
            if how in ("exact", "vector"):
                node.path = [node.id]
                continue
            back = paths.path_back(walk, support, mass, first_entries if how == "bridge" else entries, row, steps)
            start = back[0]
            if how != "bridge" and start in second_only:
                if start not in bridge_paths:
                    bridge_paths[start] = paths.path_back(walk, support, mass, first_entries, start, steps)
                back = bridge_paths[start][:-1] + back  # every path starts at a first-round entry point
            node.path = self.id_of(np.array(back, dtype=np.int64))
            on_paths.update(back[:-1])
        kept = set(rows.tolist())
        extra = np.array(sorted(on_paths - kept), dtype=np.int64)
        if len(extra):
            scores = mass[np.searchsorted(support, extra)]
            result.path_nodes = self._nodes(extra, scores)
            for node, how in zip(result.path_nodes, paths.via(self._rows_of(result.path_nodes), exact_rows, vector_rows,
                                                              bridges), strict=True):
                node.via = how

    def bridge_candidates(self, walk: WalkMatrix, rows: np.ndarray, relevance: np.ndarray, exact_rows: np.ndarray,
                          params: SearchConfig) -> np.ndarray:
        """The entities the second round may start from (`rounds.bridge_candidates`, or its kernel
        when compiled)."""
        best = rounds.best_units(self.type_codes, rows, relevance)
        exclude = np.unique(exact_rows).astype(np.int64)
        if self.kernels is None:
            return rounds.bridge_candidates(walk, self.type_codes, self.doc_indptr, self.doc_codes, best,
                                            params.second_round_chunks, exclude)
        return self.kernels.bridge_candidates(walk.indptr, walk.indices, self.type_codes, self.doc_indptr, self.doc_codes,
                                              best, params.second_round_chunks, exclude, rounds.CROWDED,
                                              self._scratch("marks", walk.n, np.int8))

    def fit_budget(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> np.ndarray:
        """The context's rows (`context.fit_budget`, or its kernel when compiled)."""
        if self.kernels is None:
            return context.fit_budget(rows, relevance, self.tokens, params.budget_tokens, keys=self.sentence_keys,
                                      documents=(self.doc_indptr, self.doc_codes), diversity=params.document_diversity)
        return self.kernels.fit_budget(rows, relevance, self.tokens, params.budget_tokens, self.key_indptr, self.key_ids,
                                       self._scratch("keys", self.key_count, bool), self.doc_indptr, self.doc_codes,
                                       self._scratch("documents", len(self.document_names), np.int64),
                                       context.diversity_powers(params.document_diversity, len(rows)))

    def walk(self, entries: np.ndarray, start: np.ndarray, params: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
        """Shallow PPR from `start` on the entry points (sorted, distinct): (support rows sorted,
        mass); the paper's walk runs as a kernel when compiled."""
        walk = self.walk_matrix(params.similarity_weight)
        if self.kernels is None or params.ppr_variant != "paper":
            return shallow_ppr(walk, entries, params.ppr_alpha, params.ppr_iterations, params.ppr_variant,
                               params.ppr_min_mass, start)
        return self.kernels.ppr_paper(walk.indptr, walk.indices, walk.weights, walk.inverse, entries, start,
                                      params.ppr_alpha, params.ppr_iterations, self._scratch("walk", walk.n, np.float64),
                                      params.ppr_min_mass)

    def select(self, support: np.ndarray, mass: np.ndarray, entries: np.ndarray, start: np.ndarray,
               params: SearchConfig, query_vector: np.ndarray, cosines: QuestionCosines | None = None,
               ) -> tuple[np.ndarray, np.ndarray]:
        """Entry points and cross nodes of retrievable types (paper §2.5 steps 3-4), with the score
        each is ranked by in the context. Works on the walk's support only, never the whole graph.

        rank "ppr" (the paper): cross nodes are the top PPR scores per type, ranked by PPR.
        rank "walk_similarity": a node's walk mass is its PPR score less its own teleport share
        (alpha x its share of the start for an entry point, which would otherwise outrank every
        cross node); every retrievable node the walk reached is scored by sqrt(walk) x similarity
        to the question (its cosine, computed for the reached nodes, through `cosines` where given:
        a question's second round reuses the first's) and the quota best of each type are
        kept (the same rule as numpy here or as kernels.select_walk when compiled). R nodes, never
        embedded, take the mean similarity of the reached embedded nodes at half weight, on one
        scale with the rest. Entity and overview nodes count for what they lead to: the A nodes of
        matched or top-scoring N nodes, the H nodes of matched O nodes."""
        codes = self.type_codes[support]
        if self.kernels is None or params.rank != "walk_similarity":
            where = np.minimum(np.searchsorted(support, entries), len(support) - 1)
            present = support[where] == entries  # an entry point the walk let go of is no longer an entry
            is_entry = np.zeros(len(support), dtype=bool)
            is_entry[where[present]] = True
        if params.rank != "walk_similarity":
            retrievable_entries = np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE))
            quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
            quotas[TYPE_CODE["N"]] = params.cross_a  # top-scoring entities, for their attributes
            cross = context.top_per_group(mass, codes, ~is_entry, quotas)
            led = self._led(support, codes, is_entry, cross[codes[cross] == TYPE_CODE["N"]])
            pool = np.unique(np.concatenate([retrievable_entries, cross[codes[cross] <= MAX_RETRIEVABLE_CODE], led]))
            return support[pool], mass[pool]

        vectors = self.vector_side
        vector_rows = vectors.vector_of_node[support]
        embedded = vector_rows >= 0  # T, S, A and H nodes
        found = (cosines or QuestionCosines(vectors, query_vector))(vector_rows[embedded])
        similarity = np.zeros(len(support))
        similarity[embedded] = np.maximum(found, 0.0)
        relation_similarity = (similarity[embedded].mean() if embedded.any() else 0.0) * 0.5
        if self.kernels is not None:
            quotas = np.array([params.cross_t, params.cross_s, params.cross_a, params.cross_h, params.cross_r], np.int64)
            chosen, scores = self.kernels.select_walk(support, mass, entries, start, params.ppr_alpha, codes, similarity,
                                                      relation_similarity, self.leads_indptr, self.leads_indices,
                                                      quotas, params.cross_a, params.chunk_weight)
            return support[chosen], scores
        walk = mass.copy()
        walk[where[present]] = np.maximum(walk[where[present]] - params.ppr_alpha * start[present], 0.0)
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
        reached = np.unique(self.leads_indices[row_entries(self.leads_indptr, support[leaders])])
        return np.searchsorted(support, reached)  # reached from a node with mass: always in the support

    def nodes_for(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """The context's nodes grouped by type (H, A, S, R, T), each group by score, ties by id (= row
        order); `scores` holds a score per node of the graph."""
        rows = np.asarray(rows, dtype=np.int64)
        return self._nodes(rows, scores[rows])

    def _document_paths(self, codes: np.ndarray) -> list[str]:
        """Document paths by code, each read from the mapped build once per session: a context
        lists hundreds of paths, mostly the same few, and Python strings made afresh cost more
        than the search."""
        paths = self._paths
        codes = codes.tolist()
        missing = sorted({c for c in codes if c not in paths})
        if missing:
            paths.update(zip(missing, self.document_names.take(pa.array(missing, pa.int64())).to_pylist(), strict=True))
        return [paths[c] for c in codes]

    def _nodes(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """nodes_for with `scores` given per row of `rows`."""
        codes = self.type_codes[rows]
        order = np.lexsort((rows, -scores, CONTEXT_RANK[codes]))
        ordered = rows[order].astype(np.int64)
        taken = pa.array(ordered)
        counts = self.doc_indptr[ordered + 1] - self.doc_indptr[ordered]
        paths = self._document_paths(self.doc_codes[row_entries(self.doc_indptr, ordered)])
        ends = np.cumsum(counts).tolist()
        documents = [paths[end - count:end] for end, count in zip(ends, counts.tolist(), strict=True)]
        texts = self._text_column.take(taken).to_pylist()
        columns = (node_ids(self.id_hash[ordered], codes[order]), TYPE_LETTERS[codes[order]].tolist(), scores[order].tolist(),
                   texts, documents, self.tokens[ordered].tolist(), self._places_of(ordered, texts))
        return [RetrievedNode(*values) for values in zip(*columns, ordered.tolist(), strict=True)]

    def _places_of(self, rows: np.ndarray, texts: list[str]) -> list[list[dict]]:
        """Each node's places (at most `MAX_PLACES`; a place parsed from the mapped build once per
        session): its document, the document's content hash, the chunk's span and the pages,
        slides, sheets and sections it lies on. A unit found in its chunk's text lies on those its
        sentence spans, not on all of the chunk's."""
        starts, ends = self.place_indptr[rows], np.minimum(self.place_indptr[rows + 1], self.place_indptr[rows] + MAX_PLACES)
        wanted = [self.place_rows[a:b].tolist() for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        missing = sorted({p for own in wanted for p in own if p not in self._places})
        if missing:
            taken = self.places.take(pa.array(missing, pa.int64()))
            self._places.update(zip(missing, zip(map(json.loads, taken["place"].to_pylist()),
                                                 taken["chunk_node"].to_pylist(), strict=True), strict=True))
        shown = []
        for row, text, own in zip(rows.tolist(), texts, wanted, strict=True):
            unit = self.type_codes[row] == TYPE_CODE["S"]
            shown.append([self._place(place, chunk_node, text if unit else None) for place, chunk_node in
                          (self._places[p] for p in own)])
        return shown

    def _place(self, place: dict, chunk_node: int, unit: str | None) -> dict:
        marks = place["marks"]
        first, last = 0, 1 << 62
        if unit is not None and chunk_node >= 0 and marks:
            first, last = _found_in(unit, self._text_column[chunk_node].as_py()) or (first, last)
        return {"document": place["document"], "content_hash": place["content_hash"], "span": place["span"],
                **place_of(marks, first, last)}

    # lookups: a node by its id, its neighbours, a document's chunks (for agents, `mcp_server.py`) ----
    def row_of(self, node_id: str) -> int | None:
        """The row of the node with this id, or None (a scan of the id hashes: not on a query's path)."""
        letter, _, digits = node_id.partition("_")
        if letter not in TYPE_CODE or len(digits) != 16 or not re.fullmatch(r"[0-9a-f]{16}", digits):
            return None
        found = np.flatnonzero((self.id_hash == np.uint64(int(digits, 16))) & (self.type_codes == TYPE_CODE[letter]))
        return int(found[0]) if len(found) else None

    def node_at(self, row: int) -> RetrievedNode:
        return self._nodes(np.array([row], np.int64), np.zeros(1))[0]

    def neighbours(self, row: int, limit: int) -> list[RetrievedNode]:
        """Up to `limit` nodes joined to `row` by an edge, by edge weight then row."""
        walk = self.walk_matrix(self.config.search.similarity_weight)
        rows = walk.indices[walk.indptr[row]:walk.indptr[row + 1]].astype(np.int64)
        weights = walk.weights[walk.indptr[row]:walk.indptr[row + 1]].astype(np.float64)
        order = np.lexsort((rows, -weights))[:limit]
        return self._nodes(rows[order], weights[order])

    def document_chunks(self, path: str) -> list[RetrievedNode] | None:
        """The text chunks (T nodes) of the document at `path`, in the order of the document; None
        when the build holds no such document."""
        codes = np.flatnonzero(np.asarray(self.document_names.to_numpy(zero_copy_only=False) == path))
        if not len(codes):
            return None
        owners = np.repeat(np.arange(len(self.doc_indptr) - 1), np.diff(self.doc_indptr))
        rows = np.unique(owners[self.doc_codes == codes[0]])
        rows = rows[self.type_codes[rows] == TYPE_CODE["T"]]
        nodes = self._nodes(rows, np.zeros(len(rows)))
        return sorted(nodes, key=lambda n: min((p["span"][0] for p in n.locations if p.get("span")), default=0))

    def answer(self, retrieval: Retrieval) -> Retrieval:
        """The engine's answer. An LLM reads the context numbered and cites it ([n]); the offline
        engine's extractive answer names each sentence's documents itself."""
        t0 = time.perf_counter()
        cites = self.config.llm.engine != "offline"
        retrieval.answer = self.engine.answer(retrieval.question, retrieval.context_text(numbered=cites))
        if cites:
            retrieval.cite()
        retrieval.timings["answer_ms"] = (time.perf_counter() - t0) * 1000
        return retrieval
