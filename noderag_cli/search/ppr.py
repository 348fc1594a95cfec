"""Shallow personalised PageRank as sparse matrix-vector products (paper §2.5).

paper: pi_t = alpha * p + (1 - alpha) * P^T pi_(t-1), pi_0 = p
lazy:  pi_t = alpha * P^T pi_(t-1) + (1 - alpha) * pi_(t-1)   (the reference code's walk)
P is the row-normalised weighted adjacency; `transition_transpose` builds P^T once per
workspace load. iterations=None runs to convergence (the "deep PPR" ablation).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp


def transition_transpose(adjacency: sp.csr_matrix) -> sp.csr_matrix:
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    inverse = np.divide(1.0, degree, out=np.zeros_like(degree), where=degree > 0)
    return (sp.diags(inverse) @ adjacency).T.tocsr()


def personalized_pagerank(
    transition_t: sp.csr_matrix, personalization: np.ndarray, alpha: float, iterations: int | None,
    variant: str = "paper", tolerance: float = 1e-8, max_iterations: int = 200,
) -> np.ndarray:
    p = personalization / personalization.sum() if personalization.sum() > 0 else personalization
    pi = p.copy()
    steps = max_iterations if iterations is None else iterations
    for _ in range(steps):
        walked = transition_t @ pi
        nxt = alpha * p + (1 - alpha) * walked if variant == "paper" else alpha * walked + (1 - alpha) * pi
        converged = np.abs(nxt - pi).sum() < tolerance
        pi = nxt
        if iterations is None and converged:
            break
    return pi
