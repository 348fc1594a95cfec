"""The steps of a question that exist twice, as numpy and as compiled kernels (search/kernels.py),
equal to the bit (tests/test_search_parts.py, tests/test_query.py): the paper's walk, the
walk_similarity selection, the second round's candidates and the budget. A `Retriever` picks one
set when it opens: `NumpySteps`, or `CompiledSteps` once the kernels are loaded (~0.7 s, worth it
from about a thousand questions per process). Everything else a question does is shared."""

from __future__ import annotations

import numpy as np

from ..config import SearchConfig
from ..graph import row_entries
from ..node_types import MAX_RETRIEVABLE_CODE, QUOTA_SETTINGS, TYPE_CODE
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
    reached = np.unique(build.leads_indices[row_entries(build.leads_indptr, support[leaders])])
    return np.searchsorted(support, reached)  # reached from a node with mass: always in the support


class NumpySteps:
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
        chosen = np.unique(np.concatenate([np.flatnonzero(is_entry & (codes <= MAX_RETRIEVABLE_CODE)), leads, kept]))
        return chosen, score[chosen]

    def bridge_candidates(self, walk: WalkMatrix, best: np.ndarray, exclude: np.ndarray, chunks: int) -> np.ndarray:
        b = self.build
        return rounds.bridge_candidates(walk, b.type_codes, b.doc_indptr, b.doc_codes, best, chunks, exclude)

    def fit_budget(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> np.ndarray:
        b = self.build
        return context.fit_budget(rows, relevance, b.tokens, params.budget_tokens, keys=b.sentence_keys,
                                  documents=(b.doc_indptr, b.doc_codes), diversity=params.document_diversity)


class CompiledSteps:
    def __init__(self, build: Build, kernels):
        self.build, self.kernels = build, kernels

    def walk(self, walk: WalkMatrix, entries: np.ndarray, start: np.ndarray, params: SearchConfig):
        return self.kernels.ppr_paper(walk.indptr, walk.indices, walk.weights, walk.inverse, entries, start,
                                      params.ppr_alpha, params.ppr_iterations,
                                      self.build.scratch("walk", walk.n, np.float64), params.ppr_min_mass)

    def select_walk(self, support, mass, entries, start, params: SearchConfig, codes, similarity,
                    relation_similarity) -> tuple[np.ndarray, np.ndarray]:
        quotas = np.array([getattr(params, setting) for setting in QUOTA_SETTINGS], np.int64)  # by type code
        return self.kernels.select_walk(support, mass, entries, start, params.ppr_alpha, codes, similarity,
                                        relation_similarity, self.build.leads_indptr, self.build.leads_indices,
                                        quotas, params.cross_a, params.chunk_weight)

    def bridge_candidates(self, walk: WalkMatrix, best: np.ndarray, exclude: np.ndarray, chunks: int) -> np.ndarray:
        b = self.build
        return self.kernels.bridge_candidates(walk.indptr, walk.indices, b.type_codes, b.doc_indptr, b.doc_codes,
                                              best, chunks, exclude, rounds.CROWDED, b.scratch("marks", walk.n, np.int8))

    def fit_budget(self, rows: np.ndarray, relevance: np.ndarray, params: SearchConfig) -> np.ndarray:
        b = self.build
        return self.kernels.fit_budget(rows, relevance, b.tokens, params.budget_tokens, b.key_indptr, b.key_ids,
                                       b.scratch("keys", b.key_count, bool), b.doc_indptr, b.doc_codes,
                                       b.scratch("documents", len(b.document_names), np.int64),
                                       context.diversity_powers(params.document_diversity, len(rows)))
