"""Retrieval strategies the paper's results are compared against, over the same workspace
(same chunks, embeddings and token counting), so that only the strategy differs.
"""

from __future__ import annotations

import time

import numpy as np

from ..search import context
from ..search.retriever import Retrieval, Retriever

NAIVE_CANDIDATES = 100


def naive_rag(retriever: Retriever, question: str, budget: int) -> Retrieval:
    """NaiveRAG: text chunks by vector similarity to the question, best first, until the budget is full."""
    question = retriever.check_question(question)
    started = time.perf_counter()
    rows, similarity = retriever.vector_search(retriever.embed_question(question), NAIVE_CANDIDATES, ("T",),
                                               max(retriever.config.hnsw.ef_search, NAIVE_CANDIDATES))
    scores = np.zeros(len(retriever.ids), dtype=np.float64)
    scores[rows] = similarity
    kept = context.fit_budget(rows, similarity.astype(np.float64), retriever.tokens, budget)
    result = Retrieval(question=question)
    result.nodes = retriever.nodes_for(kept, scores)
    result.timings["retrieval_ms"] = (time.perf_counter() - started) * 1000
    return result
