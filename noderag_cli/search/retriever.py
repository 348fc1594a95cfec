"""The steps of a question over an opened build (build.py: everything a question reads, derived
at index time and memory-mapped, and the whole-graph views only evaluation builds). A query costs
a few hash lookups, one int8 scan of the S, A and H vectors, a few sparse gathers (the walk reads
only the rows that carry mass) and partial sorts.

The steps of a question, in order: entry points (names, `entry.py`; vectors, `vectors.py`), the
walk (`ppr.py`), the selection and the budget (`context.py`), then an answer if asked; what it
returns is in `results.py`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from .. import nlp
from ..config import Config, SearchConfig
from ..embeddings import Embedder, check_embedding
from ..engines.base import Engine
from ..generation import Generation, damaged, repair_hint
from ..graph import distinct, row_entries
from ..index.chunk import place_of
from ..node_types import CONTEXT_ORDER, MAX_RETRIEVABLE_CODE, TYPE_CODE, TYPE_LETTERS
from . import QueryError, context, paths, rounds, steps
from .build import Build
from .ppr import WalkMatrix, shallow_ppr
from .prepare import (
    SCANNED,
    node_ids,
)
from .results import Retrieval, RetrievedNode
from .vectors import QuestionCosines

MAX_QUESTION_CHARS = 20_000
MAX_PLACES = 10  # places shown per node (a community summary can come from hundreds of chunks)
CONTEXT_RANK = np.array([CONTEXT_ORDER.index(t) if t in CONTEXT_ORDER else len(CONTEXT_ORDER) for t in TYPE_CODE],
                        dtype=np.int8)  # by type code


def _load_kernels() -> None:
    """Import the compiled kernels and load them from numba's cache (or compile them, once per
    installation): ~0.7 s, spent on a thread while the workspace loads."""
    from . import kernels

    kernels.warm_up()


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
    """Questions answered from a build (`self.build`). With `compiled`, the vector side scans its
    half-precision rows and int8 codes with numba kernels (search/kernels.py), for some load time
    when the workspace opens, worth it for many questions per process (api.COMPILED_FROM_QUESTIONS);
    the results are the same to the bit either way (tests/test_search_parts.py, tests/test_scale.py)."""

    def __init__(self, generation: Generation, config: Config, engine: Engine, embedder: Embedder,
                 compiled: bool = True):
        loading = threading.Thread(target=_load_kernels, name="noderag-kernels", daemon=True) if compiled else None
        if loading is not None:
            loading.start()
        check_embedding(generation.ws_root, (generation.manifest.get("embedding") or {}).get("model"), embedder.model_id)
        self.config = config
        self.engine = engine
        self.embedder = embedder
        self.build = Build(generation, config.search.vector_probes, embedder.dim)
        self._value_names: dict[int, bool] = {}  # per entity row: its name is a date or a quantity
        self.embedder.embed(["warm-up"])  # load the model now, not inside the first query's timing
        self.steps = steps.Steps(self.build)
        if loading is not None:
            loading.join()
            from . import kernels

            self.build.vector_side.kernels = kernels

    def close(self) -> None:
        """Let go of the build (an `index` run may then remove it once it is no longer current)."""
        self.build.close()

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
                exact.extend(self.build.names.match(entity))
            exact.extend(self.build.names.match(question, require_capital=True))
        exact_rows = np.asarray(list(dict.fromkeys(exact)), dtype=np.int64)
        timings["exact_ms"] = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        vector_rows = np.zeros(0, np.int64)
        if params.use_vector and params.vector_top_k > 0:
            if query_vector is None:
                query_vector = self.embed_question(question)
            vector_rows, similarity = self.build.vector_side.search(query_vector, params.vector_top_k, SCANNED, similarities,
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
            problems = self.build.generation.verify()
            if problems:
                path, _, detail = problems[0].partition(": ")
                raise damaged(Path(path), self.build.generation.ws_root, detail,
                              repair_hint(self.build.generation.ws_root, self.build.generation.manifest.get("input"))) from None
            raise

    def _retrieve(self, question: str, params: SearchConfig | None = None, explain: bool = False) -> Retrieval:
        params = params or self.config.search
        question = self.check_question(question)
        started = time.perf_counter()
        asked = nlp.asked_kind(question)
        query_vector = self.embed_question(question)
        exact_rows, vector_rows, entities, timings = self.entry_points(question, params, query_vector)
        entries = np.union1d(exact_rows, vector_rows).astype(np.int64)
        result = Retrieval(question=question, query_entities=entities, timings=timings)
        result.entry_points = {"exact": self.build.id_of(exact_rows), "vector": self.build.id_of(vector_rows), "bridge": []}
        if len(entries) == 0:
            result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
            return result

        t0 = time.perf_counter()
        walk = self.build.walk_matrix(params.similarity_weight)
        start = rounds.start_shares(walk, entries, exact_rows, params.exact_share)
        support, mass = self.walk(entries, start, params)
        result.timings["ppr_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        cosines = QuestionCosines(self.build.vector_side, query_vector)
        words = context.QuestionWords(question, self.build.text_column)
        rows, relevance = self.select(support, mass, entries, start, params, query_vector, cosines, asked,
                                      words)  # ascending
        result.timings["context_ms"] = (time.perf_counter() - t0) * 1000
        first_entries, bridges = entries, np.zeros(0, np.int64)
        if params.second_round_chunks > 0 and len(rows):
            t0 = time.perf_counter()
            bridges = rounds.without_values(self.bridge_candidates(walk, rows, relevance, exact_rows, params),
                                            self.build.text_column, self._value_names)
            if len(bridges):
                entries, start = rounds.with_bridges(walk, entries, start, bridges, params.second_round_share)
                support, mass = self.walk(entries, start, params)
                rows, relevance = self.select(support, mass, entries, start, params, query_vector, cosines, asked, words)
                result.entry_points["bridge"] = self.build.id_of(bridges)
            result.timings["second_round_ms"] = (time.perf_counter() - t0) * 1000

        t0 = time.perf_counter()
        kept, scores = self.context_rows(rows, relevance, params)
        result.nodes = self._nodes(kept, scores)
        if explain:
            self._explain(result, walk, support, mass, first_entries, entries, exact_rows, vector_rows, bridges, params)
        else:
            for node, how in zip(result.nodes, paths.via(self._rows_of(result.nodes), exact_rows, vector_rows, bridges),
                                 strict=True):
                node.via = how
        result.smallest_match_tokens = int(self.build.tokens[rows].min()) if len(rows) else 0
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
            node.path = self.build.id_of(np.array(back, dtype=np.int64))
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
        """The entities the second round may start from (`rounds.bridge_candidates`)."""
        best = rounds.best_units(self.build.type_codes, rows, relevance)
        return self.steps.bridge_candidates(walk, best, distinct(exact_rows).astype(np.int64), params.second_round_chunks)

    def fit_budget(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> np.ndarray:
        """The context's rows (`context.fit_budget`)."""
        return self.steps.fit_budget(rows, relevance, params)

    def context_rows(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
        """The context's rows and the score each is shown by, from the selection (`rows` ascending,
        their `relevance`): the budget filled (`fit_budget`), then the best documents' chunks shown
        whole where they are short (`context.whole_chunks`)."""
        kept = self.fit_budget(rows, relevance, params)
        scores = relevance[np.searchsorted(rows, kept)]
        if params.whole_chunks > 0 and len(kept):
            b = self.build
            kept, scores = context.whole_chunks(kept, scores, b.type_codes, b.tokens, b.unit_chunk, params.budget_tokens,
                                                params.whole_chunks, b.sentence_keys)
        return kept, scores

    def walk(self, entries: np.ndarray, start: np.ndarray, params: SearchConfig) -> tuple[np.ndarray, np.ndarray]:
        """Shallow PPR from `start` on the entry points (sorted, distinct): (support rows sorted,
        mass). The paper's walk by `steps`; the others (ablations) as numpy."""
        walk = self.build.walk_matrix(params.similarity_weight)
        if params.ppr_variant != "paper":
            return shallow_ppr(walk, entries, params.ppr_alpha, params.ppr_iterations, params.ppr_variant,
                               params.ppr_min_mass, start)
        return self.steps.walk(walk, entries, start, params)

    def select(self, support: np.ndarray, mass: np.ndarray, entries: np.ndarray, start: np.ndarray,
               params: SearchConfig, query_vector: np.ndarray, cosines: QuestionCosines | None = None,
               asked: str = "any", words: context.QuestionWords | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Entry points and cross nodes of retrievable types (paper §2.5 steps 3-4), with the score
        each is ranked by in the context. Works on the walk's support only, never the whole graph.

        rank "ppr" (the paper): cross nodes are the top PPR scores per type, ranked by PPR.
        rank "walk_similarity": a node's walk mass is its PPR score less its own teleport share
        (alpha x its share of the start for an entry point, which would otherwise outrank every
        cross node); every retrievable node the walk reached is scored by sqrt(walk) x similarity
        to the question (its cosine, computed for the reached nodes, through `cosines` where given:
        a question's second round reuses the first's) and the quota best of each type are kept.
        R nodes, never embedded, take the mean similarity of the reached embedded nodes at half
        weight, on one scale with the rest. Entity and overview nodes count for what they lead to: the A nodes of
        matched or top-scoring N nodes, the H nodes of matched O nodes. A unit holding a value of the
        kind the question asks for (`asked`: a date, a number) has its similarity weighed up
        (`context.weigh_asked_kind`), and the chosen units' and chunks' scores by the question's
        words each holds (`words`, `context.weigh_question_words`)."""
        codes = self.build.type_codes[support]
        if params.rank != "walk_similarity":
            is_entry, _, _ = steps.entry_mask(support, entries)
            retrievable_entries = np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE))
            quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
            quotas[TYPE_CODE["N"]] = params.cross_a  # top-scoring entities, for their attributes
            cross = context.top_per_group(mass, codes, ~is_entry, quotas)
            led = steps.led(self.build, support, codes, is_entry, cross[codes[cross] == TYPE_CODE["N"]])
            pool = distinct(np.concatenate([retrievable_entries, cross[codes[cross] <= MAX_RETRIEVABLE_CODE], led]))
            return support[pool], mass[pool]
        vectors = self.build.vector_side
        vector_rows = vectors.vector_of_node[support]
        embedded = vector_rows >= 0  # T, S, A and H nodes
        found = (cosines or QuestionCosines(vectors, query_vector))(vector_rows[embedded])
        similarity = np.zeros(len(support))
        similarity[embedded] = np.maximum(found, 0.0)
        relation_similarity = (similarity[embedded].mean() if embedded.any() else 0.0) * 0.5
        similarity = context.weigh_asked_kind(similarity, self.build.value_kinds[support], asked,
                                              params.asked_kind_weight)
        chosen, scores = self.steps.select_walk(support, mass, entries, start, params, codes, similarity,
                                                relation_similarity)
        rows = support[chosen]
        return rows, context.weigh_question_words(scores, rows, codes[chosen], words, params.question_words_weight)

    def nodes_for(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """The context's nodes grouped by type (H, A, S, R, T), each group by score, ties by id (= row
        order); `scores` holds a score per node of the graph."""
        rows = np.asarray(rows, dtype=np.int64)
        return self._nodes(rows, scores[rows])

    def _nodes(self, rows: np.ndarray, scores: np.ndarray) -> list[RetrievedNode]:
        """nodes_for with `scores` given per row of `rows`."""
        codes = self.build.type_codes[rows]
        order = np.lexsort((rows, -scores, CONTEXT_RANK[codes]))
        ordered = rows[order].astype(np.int64)
        taken = pa.array(ordered)
        counts = self.build.doc_indptr[ordered + 1] - self.build.doc_indptr[ordered]
        paths = self.build.document_paths(self.build.doc_codes[row_entries(self.build.doc_indptr, ordered)])
        ends = np.cumsum(counts).tolist()
        documents = [paths[end - count:end] for end, count in zip(ends, counts.tolist(), strict=True)]
        texts = self.build.text_column.take(taken).to_pylist()
        columns = (node_ids(self.build.id_hash[ordered], codes[order]), TYPE_LETTERS[codes[order]].tolist(), scores[order].tolist(),
                   texts, documents, self.build.tokens[ordered].tolist(), self._places_of(ordered, texts))
        return [RetrievedNode(*values) for values in zip(*columns, ordered.tolist(), strict=True)]

    def _places_of(self, rows: np.ndarray, texts: list[str]) -> list[list[dict]]:
        """Each node's places (at most `MAX_PLACES`; a place parsed from the mapped build once per
        session): its document, the document's content hash, the chunk's span and the pages,
        slides, sheets and sections it lies on. A unit found in its chunk's text lies on those its
        sentence spans, not on all of the chunk's."""
        starts, ends = self.build.place_indptr[rows], np.minimum(self.build.place_indptr[rows + 1], self.build.place_indptr[rows] + MAX_PLACES)
        wanted = [self.build.place_rows[a:b].tolist() for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
        missing = sorted({p for own in wanted for p in own if p not in self.build.shown_places})
        if missing:
            taken = self.build.places.take(pa.array(missing, pa.int64()))
            self.build.shown_places.update(zip(missing, zip(map(json.loads, taken["place"].to_pylist()),
                                                 taken["chunk_node"].to_pylist(), strict=True), strict=True))
        shown = []
        for row, text, own in zip(rows.tolist(), texts, wanted, strict=True):
            unit = self.build.type_codes[row] == TYPE_CODE["S"]
            shown.append([self._place(place, chunk_node, text if unit else None) for place, chunk_node in
                          (self.build.shown_places[p] for p in own)])
        return shown

    def _place(self, place: dict, chunk_node: int, unit: str | None) -> dict:
        marks = place["marks"]
        first, last = 0, 1 << 62
        if unit is not None and chunk_node >= 0 and marks:
            first, last = _found_in(unit, self.build.text_column[chunk_node].as_py()) or (first, last)
        return {"document": place["document"], "content_hash": place["content_hash"], "span": place["span"],
                **place_of(marks, first, last)}

    # lookups: a node by its id, its neighbours, a document's chunks (for agents, `mcp_server.py`) ----
    def row_of(self, node_id: str) -> int | None:
        """The row of the node with this id, or None (a scan of the id hashes: not on a query's path)."""
        letter, _, digits = node_id.partition("_")
        if letter not in TYPE_CODE or len(digits) != 16 or not re.fullmatch(r"[0-9a-f]{16}", digits):
            return None
        found = np.flatnonzero((self.build.id_hash == np.uint64(int(digits, 16))) & (self.build.type_codes == TYPE_CODE[letter]))
        return int(found[0]) if len(found) else None

    def node_at(self, row: int) -> RetrievedNode:
        return self._nodes(np.array([row], np.int64), np.zeros(1))[0]

    def neighbours(self, row: int, limit: int) -> list[RetrievedNode]:
        """Up to `limit` nodes joined to `row` by an edge, by edge weight then row."""
        walk = self.build.walk_matrix(self.config.search.similarity_weight)
        rows = walk.indices[walk.indptr[row]:walk.indptr[row + 1]].astype(np.int64)
        weights = walk.weights[walk.indptr[row]:walk.indptr[row + 1]].astype(np.float64)
        order = np.lexsort((rows, -weights))[:limit]
        return self._nodes(rows[order], weights[order])

    def document_chunks(self, path: str) -> list[RetrievedNode] | None:
        """The text chunks (T nodes) of the document at `path`, in the order of the document; None
        when the build holds no such document."""
        codes = np.flatnonzero(np.asarray(self.build.document_names.to_numpy(zero_copy_only=False) == path))
        if not len(codes):
            return None
        owners = np.repeat(np.arange(len(self.build.doc_indptr) - 1), np.diff(self.build.doc_indptr))
        rows = distinct(owners[self.build.doc_codes == codes[0]])
        rows = rows[self.build.type_codes[rows] == TYPE_CODE["T"]]
        nodes = self._nodes(rows, np.zeros(len(rows)))
        return sorted(nodes, key=lambda n: min((p["span"][0] for p in n.locations if p.get("span")), default=0))

    def answer(self, retrieval: Retrieval) -> Retrieval:
        """The engine's answer. An LLM reads the context numbered and cites it ([n]); the offline
        engine's extractive answer names each sentence's documents itself."""
        t0 = time.perf_counter()
        cites = self.engine.cites_context
        retrieval.short_answer, retrieval.answer = self.engine.answer_parts(retrieval.question,
                                                                            retrieval.context_text(numbered=cites))
        if cites:
            retrieval.cite()
        retrieval.timings["answer_ms"] = (time.perf_counter() - t0) * 1000
        return retrieval
