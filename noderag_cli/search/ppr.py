"""Personalised PageRank over the walk matrix P (paper §2.5).

paper: pi_t = alpha * p + (1 - alpha) * P^T pi_(t-1), pi_0 = p
lazy:  pi_t = alpha * P^T pi_(t-1) + (1 - alpha) * pi_(t-1)   (the reference code's walk)
P is the row-normalised weighted adjacency. A fixed, small number of steps from a few entry
points reads only the rows of P that carry mass. "Deep" PPR (the ablation) is the same walk
with enough steps to converge (evaluate/variants.py).

P is kept as `WalkMatrix`: the adjacency's CSR layout with byte weights, built at index time for
the configured similarity weight (search/prepare.py) and read by memory mapping; a row's inverse
degree is summed from the weights it gathers anyway. Neither building nor walking it needs scipy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..graph import distinct, row_entries


@dataclass(frozen=True)
class WalkMatrix:
    """P as the walk reads it: (indptr, indices, weights), where P's entry is weight / the row's
    weighted degree. The entry order is part of the walk's bits (it is the order of its sums). Edge
    weights are whole numbers, mostly small: they fit a byte (an eighth of P's float64 values), or
    two bytes where a pair's edges add up past 255 (a large corpus has some). A sum of whole numbers
    has the same bits in any order, so a row's degree is summed from its weights when they are read
    rather than stored (a float64 per node). P's own values are the fallback when a weight is not
    such a number (`whole` is then False and a row's inverse degree 1)."""

    indptr: np.ndarray  # int32
    indices: np.ndarray  # int32
    weights: np.ndarray  # uint8 or uint16, or float64 (the fallback)

    @property
    def n(self) -> int:
        return len(self.indptr) - 1

    @property
    def whole(self) -> bool:
        return self.weights.dtype.kind == "u"

    @classmethod
    def from_csr(cls, indptr: np.ndarray, indices: np.ndarray, data: np.ndarray) -> WalkMatrix:
        """P of a symmetric adjacency given as canonical CSR arrays (columns sorted within a row, no
        zeros). Within a row, P lists the columns in reverse order: the order scipy's product
        diag(1 / degree) @ A gives, whose sums the walk has always followed (tested against scipy)."""
        n = len(indptr) - 1
        counts = np.diff(indptr)
        index_type = np.int32 if len(indices) < 2**31 else np.int64
        # entry k of row r is read from indptr[r] + indptr[r + 1] - 1 - k: a per-row number repeated,
        # less k, in the narrowest type (at a million passages these are hundreds of millions of entries)
        position_type = np.int32 if 2 * len(indices) < 2**31 else np.int64  # holds indptr[r] + indptr[r + 1]
        reverse = np.repeat((indptr[:-1] + indptr[1:] - 1).astype(position_type), counts)
        reverse -= np.arange(len(reverse), dtype=position_type)
        weights = np.asarray(data, np.float64)[reverse]
        columns = indices[reverse].astype(index_type, copy=False)
        del reverse
        for whole in (np.uint8, np.uint16):
            small = weights.astype(whole)
            if np.array_equal(small, weights):
                return cls(indptr.astype(index_type), columns, small)
        degree = np.zeros(n)
        filled = counts > 0
        if filled.any():  # np.add.reduceat: the bits of scipy's row sums, for any weights
            degree[filled] = np.add.reduceat(np.asarray(data, np.float64), indptr[:-1][filled])
        return cls(indptr.astype(index_type), columns, np.repeat(_inverse(degree), counts) * weights)

    @classmethod
    def from_adjacency(cls, adjacency) -> WalkMatrix:
        """P of a scipy CSR adjacency."""
        adjacency = adjacency.tocsr()
        adjacency.sum_duplicates()
        adjacency.eliminate_zeros()
        return cls.from_csr(adjacency.indptr, adjacency.indices, adjacency.data)

    def _values(self, weights: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """P's values of whole rows whose gathered `weights` come `counts` to a row, in order."""
        if not self.whole:
            return weights.astype(np.float64, copy=False)
        owner = np.repeat(np.arange(len(counts)), counts)
        return _inverse(np.bincount(owner, weights=weights, minlength=len(counts)))[owner] * weights  # sums of whole numbers: exact

    def inverse_degrees(self, rows: np.ndarray) -> np.ndarray:
        """1 / the weighted degree of each of `rows` (0 for a row without edges; 1 for the fallback)."""
        if not self.whole:
            return np.ones(len(rows))
        counts = self.indptr[rows + 1] - self.indptr[rows]
        return _inverse(np.bincount(np.repeat(np.arange(len(rows)), counts),
                                    weights=self.weights[row_entries(self.indptr, rows)], minlength=len(rows)))

    def as_csr(self):
        """P as a scipy CSR matrix, entries in the same order and with the same bits."""
        import scipy.sparse as sp

        values = self._values(self.weights, np.diff(self.indptr))
        return sp.csr_matrix((values, self.indices, self.indptr), shape=(self.n, self.n))

    def entries(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(columns, P's values) of every entry of the given rows, row after row."""
        offsets = row_entries(self.indptr, rows)
        return self.indices[offsets], self._values(self.weights[offsets], self.indptr[rows + 1] - self.indptr[rows])


def _inverse(degree: np.ndarray) -> np.ndarray:
    """1 / degree, 0 for a row without edges."""
    return np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)


def _walk(walk: WalkMatrix, rows: np.ndarray, mass: np.ndarray, also: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """mass^T P for mass on `rows` only, as (the columns it reaches and the rows `also`, sorted;
    their sums): gathers those rows of P and sums each column's entries in order (the bits of a
    dense np.bincount), in arrays the size of what was gathered, not of the graph."""
    columns, values = walk.entries(rows)
    weights = values * np.repeat(mass, walk.indptr[rows + 1] - walk.indptr[rows])
    reached, at = np.unique(np.concatenate([columns, also]), return_inverse=True)
    sums = np.bincount(at[: len(columns)], weights=weights, minlength=len(reached))
    return reached, sums.astype(np.float64, copy=False)  # no entries at all: bincount gives integers


def uniform_start(entries: np.ndarray) -> np.ndarray:
    """The paper's personalisation: the same share on every entry point."""
    return np.full(len(entries), 1.0 / max(len(entries), 1))


def shallow_ppr(walk: WalkMatrix, entries: np.ndarray, alpha: float, iterations: int,
                variant: str = "paper", min_mass: float = 0.0, start: np.ndarray | None = None,
                ) -> tuple[np.ndarray, np.ndarray]:
    """PPR from `start` (one share per entry point of the sorted, distinct `entries`, summing to 1;
    uniform when not given, as the paper), as (support rows sorted, scores). A step reads only the
    rows of P that carry mass (x^T P = (P^T x)^T), so its cost follows the mass, not the graph: the
    frontier is sparse, no array of the graph's size is made; the teleport term is added on the
    entries alone. With `min_mass`, the walk is the approximate PPR of push methods: a node spreads
    its mass only when its edges would carry more than `min_mass` each on average, and after each
    step nodes with `min_mass` or less are let go. A hub's mass spread over thousands of neighbours
    would otherwise carry the walk over much of a large graph for scores too small to rank."""
    if start is None:
        entries = distinct(entries)
        start = uniform_start(entries)
    support, mass = entries, start.copy()
    for _ in range(iterations):
        spreads = mass > min_mass * (walk.indptr[support + 1] - walk.indptr[support])
        if variant == "paper":  # alpha p + (1 - alpha) P^T pi
            reached, pi = _walk(walk, support[spreads], mass[spreads], entries)
            pi *= 1 - alpha
            pi[np.searchsorted(reached, entries)] += alpha * start
        else:  # lazy: alpha P^T pi + (1 - alpha) pi
            reached, pi = _walk(walk, support[spreads], mass[spreads], support)
            pi *= alpha
            pi[np.searchsorted(reached, support)] += (1 - alpha) * mass
        kept = pi > min_mass
        support, mass = reached[kept], pi[kept]
    return support, mass
