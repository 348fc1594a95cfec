"""Personalised PageRank as sparse matrix-vector products (paper §2.5).

paper: pi_t = alpha * p + (1 - alpha) * P^T pi_(t-1), pi_0 = p
lazy:  pi_t = alpha * P^T pi_(t-1) + (1 - alpha) * pi_(t-1)   (the reference code's walk)
P is the row-normalised weighted adjacency, built once per workspace load. A fixed, small
number of steps from a few entry points reads only the rows of P that carry mass. "Deep"
PPR (the ablation) is the same walk with enough steps to converge (evaluate/variants.py).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp

from ..graph import row_entries


def inverse_degree(adjacency: sp.csr_matrix) -> np.ndarray:
    """1 / weighted degree per row (0 for a row without edges)."""
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    return np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)


def transition(adjacency: sp.csr_matrix) -> sp.csr_matrix:
    """P, row-normalised, CSR."""
    return (sp.diags(inverse_degree(adjacency)) @ adjacency).tocsr()


def _walk(transition_p: sp.csr_matrix, rows: np.ndarray, mass: np.ndarray) -> np.ndarray:
    """mass^T P for mass on `rows` only: gathers those rows of P and sums them into a dense vector."""
    offsets = row_entries(transition_p.indptr, rows)
    weights = transition_p.data[offsets] * np.repeat(mass, np.diff(transition_p.indptr)[rows])
    # astype: with no entries at all (entry points without edges) bincount returns integers
    return np.bincount(transition_p.indices[offsets], weights=weights,
                       minlength=transition_p.shape[0]).astype(np.float64, copy=False)


def shallow_ppr(transition_p: sp.csr_matrix, entries: np.ndarray, alpha: float, iterations: int,
                variant: str = "paper") -> tuple[np.ndarray, np.ndarray]:
    """PPR from a uniform start on `entries`, as (support rows sorted, scores). A step reads only the
    rows of P that carry mass (x^T P = (P^T x)^T), so its cost follows the mass, not the graph; the
    teleport term is added on the entries alone, in place."""
    entries = np.unique(entries)
    start = 1.0 / len(entries)
    support, mass = entries, np.full(len(entries), start)
    for _ in range(iterations):
        pi = _walk(transition_p, support, mass)
        if variant == "paper":  # alpha p + (1 - alpha) P^T pi
            pi *= 1 - alpha
            pi[entries] += alpha * start
        else:  # lazy: alpha P^T pi + (1 - alpha) pi
            pi *= alpha
            pi[support] += (1 - alpha) * mass
        support = np.flatnonzero(pi > 0)  # on a boolean mask: several times faster than on floats
        mass = pi[support]
    return support, mass
