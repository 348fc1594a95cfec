"""Shallow personalised PageRank as sparse matrix-vector products (paper §2.5).

paper: pi_t = alpha * p + (1 - alpha) * P^T pi_(t-1), pi_0 = p
lazy:  pi_t = alpha * P^T pi_(t-1) + (1 - alpha) * pi_(t-1)   (the reference code's walk)
P is the row-normalised weighted adjacency; `transition` builds it once per workspace load. iterations=None runs to convergence (the "deep PPR" ablation).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def transition(adjacency: sp.csr_matrix) -> sp.csr_matrix:
    """P, row-normalised, CSR. x^T P (= (P^T x)^T) is what a walk step computes."""
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    inverse = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    return (sp.diags(inverse) @ adjacency).tocsr()


def personalized_pagerank(
    transition_p: sp.csr_matrix, personalization: np.ndarray, alpha: float, iterations: int | None,
    variant: str = "paper", tolerance: float = 1e-8, max_iterations: int = 200,
) -> np.ndarray:
    """Shallow runs stay sparse: a step reads only the rows of P that carry mass (row vector
    times CSR), so two iterations from a few entry points never touch the whole graph."""
    p = personalization / personalization.sum() if personalization.sum() > 0 else personalization
    if iterations is not None:
        p_row = sp.csr_matrix(p.reshape(1, -1))
        pi = p_row
        for _ in range(iterations):
            walked = pi @ transition_p
            pi = alpha * p_row + (1 - alpha) * walked if variant == "paper" else alpha * walked + (1 - alpha) * pi
        return pi.toarray().ravel()
    transition_t = transition_p.T.tocsr()
    pi = p.copy()
    for _ in range(max_iterations):
        walked = transition_t @ pi
        nxt = alpha * p + (1 - alpha) * walked if variant == "paper" else alpha * walked + (1 - alpha) * pi
        converged = np.abs(nxt - pi).sum() < tolerance
        pi = nxt
        if converged:
            break
    return pi
