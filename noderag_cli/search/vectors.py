"""The vector side of search: a build's vectors opened for cosine search at a cost that does not
grow with the build. The S, A and H rows are scanned as an int8 copy whose best candidates are
rescored exactly (`VectorSide._scan8_top`, which proves its answer or falls back to a flat scan);
in a large build they are probed by cluster instead (`probe_top`). The rows themselves stay
memory-mapped in half precision; only the rows a question rescores are read.
"""

from __future__ import annotations

import contextlib
import functools

import faiss
import numpy as np

from ..graph import row_entries
from ..node_types import TYPE_CODE
from .prepare import SCANNED

SCAN8_CANDIDATES = 48  # the int8 scan's best, rescored exactly: enough in every question of both dev sets
SCAN8_SLACK = 1e-5  # float32 rounding of an exact 256-term dot product, with room to spare


def inner_products(vectors: np.ndarray, query: np.ndarray) -> np.ndarray:
    """vectors @ query in one thread (faiss's SIMD kernel): BLAS would split a gemv this small
    over threads, and on a busy machine waiting for the second thread costs milliseconds."""
    query = np.ascontiguousarray(query, dtype=np.float32)
    out = np.empty(len(vectors), dtype=np.float32)
    if len(vectors):
        faiss.fvec_inner_products_ny(faiss.swig_ptr(out), faiss.swig_ptr(query), faiss.swig_ptr(vectors),
                                     vectors.shape[1], len(vectors))
    return out


@contextlib.contextmanager
def one_thread():
    """faiss's OpenMP team held to one thread for one question's scan: waking a team costs more
    than a scan of this size, and on a busy machine, where the second thread waits for a core,
    far more. Indexing, which searches many rows at once, keeps every core."""
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)


HALF_VALUES = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
"""Every half-precision value as float32, by its bits: numpy's own cast from float16 costs several
times more than gathering from this table."""


def widen(vectors: np.ndarray, rows: np.ndarray | slice) -> np.ndarray:
    """vectors[rows] as float32 (exact): stored half-precision rows through `HALF_VALUES`, float32
    rows (a build from before half precision) as they are."""
    if vectors.dtype == np.float16:
        return HALF_VALUES[vectors.view(np.uint16)[rows]]
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def inner_products_at(vectors: np.ndarray, query: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """vectors[rows] @ query, for stored (half-precision) or float32 rows: the rows widened to
    float32, then `inner_products`."""
    return inner_products(widen(vectors, np.asarray(rows, dtype=np.int64)), query)


class QuestionCosines:
    """One question's cosines to vector rows, each row computed once: a second round's walk reaches
    mostly what the first reached. The same bits as computing them again (each row's product is
    its own: `inner_products`)."""

    def __init__(self, side: VectorSide, query: np.ndarray):
        self.side, self.query = side, query
        self._parts: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted rows, their cosines) per call

    def __call__(self, vector_rows: np.ndarray) -> np.ndarray:
        """The cosine of each of `vector_rows` (distinct; a walk's support gives them ascending)."""
        rows = np.asarray(vector_rows, dtype=np.int64)
        if len(self._parts) > 1:  # merged only when a third call needs it: a question makes two
            merged = np.concatenate([p[0] for p in self._parts])
            order = np.argsort(merged, kind="stable")
            self._parts = [(merged[order], np.concatenate([p[1] for p in self._parts])[order])]
        out = np.empty(len(rows), np.float32)
        known = np.zeros(len(rows), bool)
        if self._parts:
            stored, values = self._parts[0]
            where = np.searchsorted(stored, rows)
            known = where < len(stored)
            known[known] = stored[where[known]] == rows[known]
            out[known] = values[where[known]]
        new = rows[~known]
        out[~known] = fresh = self.side.cosines(self.query, new)
        if len(new):
            if np.any(new[1:] <= new[:-1]):
                order = np.argsort(new, kind="stable")
                new, fresh = new[order], fresh[order]
            self._parts.append((new, fresh))
        return out


def rounded_to_int8(query: np.ndarray) -> tuple[np.ndarray, float]:
    """The query on the int8 grid the codes are compared against (integers in [-127, 127], as
    float64) and the scale that put it there; computed in float64, so both vector paths round alike."""
    query64 = query.astype(np.float64)
    scale = 127.0 / max(float(np.abs(query64).max(initial=0.0)), 1e-12)
    return np.rint(query64 * scale), scale


def probe_top(centroids: np.ndarray, indptr: np.ndarray, members: np.ndarray, codes: np.ndarray,
              vectors: np.ndarray, query: np.ndarray, k: int, probes: int, kernels=None) -> tuple[np.ndarray, np.ndarray]:
    """The k vector rows most similar to `query` among the members of its `probes` nearest
    clusters, with their exact cosines (best first, ties by row): a cost set by the probes, not by
    the size of the build. The members are scored by their int8 `codes`, stored cluster after
    cluster (a contiguous read per cluster, a quarter of the float32 bytes scattered over the
    vectors file), against the query rounded to int8 as well: every such product and sum is an
    integer below 2^24, exact in float32 in any order, so the compiled kernel (`kernels`, where the
    retriever loaded them) and numpy give the same estimates. The best SCAN8_CANDIDATES + k of
    them are rescored exactly."""
    nearness = inner_products(centroids, query)
    probes = min(probes, len(nearness))
    probed = np.argpartition(-nearness, probes - 1)[:probes] if probes < len(nearness) else np.arange(len(nearness))
    positions = row_entries(indptr, np.sort(probed))
    wanted = SCAN8_CANDIDATES + k
    if wanted < len(positions):
        rounded, _ = rounded_to_int8(query)
        if kernels is not None:
            estimates = np.empty(len(positions), np.float32)
            kernels.int8_scores(codes, positions, rounded.astype(np.int32), estimates)
        else:
            estimates = inner_products(codes[positions].astype(np.float32), rounded.astype(np.float32))
        positions = np.sort(positions[np.argpartition(-estimates, wanted - 1)[:wanted]])
    rows = members[positions]
    exact = inner_products_at(vectors, query, rows)
    if k < len(rows):  # only what ties with the k-th best or beats it is sorted
        keep = np.flatnonzero(exact >= np.partition(exact, len(rows) - k)[len(rows) - k])
        rows, exact = rows[keep], exact[keep]
    order = np.lexsort((rows, -exact))[:k]
    return rows[order], exact[order]


class VectorSide:
    """A build's vectors for search: `vectors` as stored (one row per embedded node), each node's
    row (`vector_of_node`, -1 for none) and back (`node_of_vector`), the scanned S, A and H rows,
    and either their int8 copy (`scan8`: index, scale, rounding error) or their clusters."""

    def __init__(self, vectors: np.ndarray, type_codes: np.ndarray, vector_of_node: np.ndarray,
                 node_of_vector: np.ndarray, scanned_rows: np.ndarray, scan8: tuple | None, clusters: tuple | None,
                 probes: int):
        self.vectors = vectors
        self.type_codes = type_codes
        self.vector_of_node = vector_of_node
        self.node_of_vector = node_of_vector
        self.scanned_rows = scanned_rows
        self._scan8_index, self.scan8_scale, self.scan8_error = scan8 or (None, 0.0, 0.0)
        self.clusters = clusters  # (unit centroids, indptr, vector rows, int8 codes) in a large build
        self.probes = probes
        self.kernels = None  # search/kernels.py, once the retriever has loaded it
        self._by_types: dict[tuple[str, ...], tuple[np.ndarray, np.ndarray]] = {}

    @functools.cached_property
    def float_vectors(self) -> np.ndarray:
        """Every vector row as float32, in memory (for evaluation strategies; never per question)."""
        return widen(self.vectors, slice(None))

    def cosines(self, query: np.ndarray, vector_rows: np.ndarray) -> np.ndarray:
        """The query's cosine to each given vector row: the rows widened to float32 (by the compiled
        kernel where the retriever loaded them, else by `widen`: the same values), then
        `inner_products`."""
        rows = np.asarray(vector_rows, dtype=np.int64)
        if self.kernels is not None and self.vectors.dtype == np.float16:
            wide = np.empty((len(rows), self.vectors.shape[1]), np.float32)
            self.kernels.widen_half(self.vectors.view(np.uint16), rows, wide)
            return inner_products(wide, query)
        return inner_products(widen(self.vectors, rows), query)

    def typed(self, types: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(vector rows, their vectors) of the given node types, gathered once per type set."""
        if types not in self._by_types:
            rows = np.flatnonzero(np.isin(self.type_codes[self.node_of_vector], [TYPE_CODE[t] for t in types]))
            self._by_types[types] = (rows, widen(self.vectors, rows))
        return self._by_types[types]

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
        rounded, scale = rounded_to_int8(query)
        query_error = float(np.linalg.norm(query64 - rounded / scale))
        wanted = min(SCAN8_CANDIDATES + k, len(self.scanned_rows))
        with one_thread():
            estimates, candidates = self._scan8_index.search(rounded.astype(np.float32)[None, :], wanted)
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
        """Cosine of the query to the S, A and H vectors, in the order of `typed(SCANNED)`:
        one exact float32 scan. The search itself scans the int8 copy (`_scan8_top`); this is the
        reference it is tested against, and the fallback."""
        return inner_products(self.typed(SCANNED)[1], query)

    def search(self, query: np.ndarray, k: int, types: tuple[str, ...],
                      similarities: np.ndarray | None = None, probes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(node rows, similarities) of the k nodes of the given types most similar to `query`, best
        first, ties by id: for SCANNED types from `similarities` already computed, else in a large
        build from its clusters (`probe_top`, `probes` of them), else exactly from the int8 scan
        (`_scan8_top`); otherwise (or when that cannot prove its answer) by a flat scan."""
        if types == SCANNED and similarities is None and 0 < k < len(self.scanned_rows):
            if self.clusters is not None:
                rows, exact = probe_top(*self.clusters, self.vectors, query, k, probes or self.probes, self.kernels)
                return self.node_of_vector[rows], exact
            found = self._scan8_top(query, k)
            if found is not None:
                return found
        rows, vectors = self.typed(types)
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
