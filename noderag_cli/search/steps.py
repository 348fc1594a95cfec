"""The graph steps of a question over a build's arrays: the paper's walk, the walk_similarity
selection, the second round's candidates and the budget. One implementation, in numpy: compiled
twins of these steps were within 3% of it at 100,000 passages (docs/benchmarks-scale.md), so they
cost every search change twice for nothing; only the vector side's scans keep compiled kernels
(search/kernels.py)."""

from __future__ import annotations

import numpy as np

from ..config import SearchConfig
from ..graph import distinct, row_entries
from ..node_types import MAX_RETRIEVABLE_CODE, TYPE_CODE
from . import context, rounds
from .build import Build
from .ppr import WalkMatrix, shallow_ppr

IS_LEADER = np.isin(np.arange(len(TYPE_CODE)), [TYPE_CODE["N"], TYPE_CODE["O"]])  # by type code


def entry_mask(support: np.ndarray, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(is_entry per support position, where each entry point sits in the support, whether it is
    there): an entry point the walk let go of is no longer an entry."""
    where = np.minimum(np.searchsorted(support, entries), len(support) - 1)
    present = support[where] == entries
    is_entry = np.zeros(len(support), dtype=bool)
    is_entry[where[present]] = True
    return is_entry, where, present


def led(build: Build, support: np.ndarray, codes: np.ndarray, is_entry: np.ndarray, entities: np.ndarray) -> np.ndarray:
    """Positions in the support of the A and H nodes next to the leaders: entry N and O nodes and
    the given top-scoring N nodes."""
    leaders = np.concatenate([np.flatnonzero(is_entry & IS_LEADER[codes]), entities])
    if not len(leaders):
        return np.zeros(0, np.int64)
    rows = support[leaders]
    at = np.minimum(np.searchsorted(build.leads_rows, rows), max(len(build.leads_rows) - 1, 0))
    leading = at[build.leads_rows[at] == rows] if len(build.leads_rows) else at[:0]
    reached = distinct(build.leads_indices[row_entries(build.leads_indptr, leading)])
    return np.searchsorted(support, reached)  # reached from a node with mass: always in the support


class Steps:
    def __init__(self, build: Build):
        self.build = build

    def walk(self, walk: WalkMatrix, entries: np.ndarray, start: np.ndarray, params: SearchConfig):
        return shallow_ppr(walk, entries, params.ppr_alpha, params.ppr_iterations, "paper", params.ppr_min_mass, start)

    def select_walk(self, support, mass, entries, start, params: SearchConfig, codes, similarity,
                    relation_similarity) -> tuple[np.ndarray, np.ndarray]:
        is_entry, where, present = entry_mask(support, entries)
        walk = mass.copy()
        walk[where[present]] = np.maximum(walk[where[present]] - params.ppr_alpha * start[present], 0.0)
        top_entities = context.top_rows(walk, np.flatnonzero(~is_entry & (codes == TYPE_CODE["N"])), params.cross_a)
        leads = led(self.build, support, codes, is_entry, top_entities)
        pool = np.flatnonzero(codes <= MAX_RETRIEVABLE_CODE)
        pool_codes = codes[pool]
        score = np.zeros(len(support))
        score[pool] = np.sqrt(walk[pool]) * np.where(pool_codes == TYPE_CODE["R"], relation_similarity, similarity[pool])
        score[pool[pool_codes == TYPE_CODE["T"]]] *= params.chunk_weight
        quotas = {TYPE_CODE[t]: q for t, q in params.quotas().items()}
        kept = pool[context.top_per_group(score[pool], pool_codes, ~is_entry[pool], quotas)]
        chosen = distinct(np.concatenate([np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE)), leads, kept]))
        return chosen, score[chosen]

    def bridge_candidates(self, walk: WalkMatrix, best: np.ndarray, exclude: np.ndarray, chunks: int) -> np.ndarray:
        b = self.build
        return rounds.bridge_candidates(walk, b.type_codes, b.doc_indptr, b.doc_codes, best, chunks, exclude)

    def fit_budget(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> np.ndarray:
        b = self.build
        return context.fit_budget(rows, relevance, b.tokens, params.budget_tokens, keys=b.sentence_keys,
                                  documents=(b.doc_indptr, b.doc_codes), diversity=params.document_diversity)
