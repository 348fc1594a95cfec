"""Cross nodes, the retrievable filter, and the token-budgeted context (paper §2.5 steps 3-5).

Selection is vectorised: per type, the top scores among the nodes that are not entry
points (`np.argpartition`, ties broken by row = id order). The budget is filled in
one global order (score, then type rank, then id) so a cheap, relevant unit is not
crowded out by a long chunk that happens to come first in type order; the result is
then shown grouped by type.
"""

from __future__ import annotations

import re

import numpy as np

TYPE_ORDER = ("H", "A", "S", "R", "T")


def top_rows(scores: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    """Rows of the k best-scoring candidates (positive scores only), best first, ties by row."""
    if k <= 0 or len(candidates) == 0:
        return np.zeros(0, dtype=np.int64)
    values = scores[candidates]
    keep = candidates[values > 0]
    values = values[values > 0]
    if len(keep) > k:
        part = np.argpartition(-values, k - 1)[:k]
        threshold = values[part].min()
        chosen = np.flatnonzero(values >= threshold)
        keep, values = keep[chosen], values[chosen]
    order = np.lexsort((keep, -values))
    return keep[order][:k]


def top_per_group(scores: np.ndarray, groups: np.ndarray, eligible: np.ndarray, quotas: dict[int, int]) -> np.ndarray:
    """Positions of the quota best-scoring eligible items of each group (positive scores only),
    ties by position: one sort for all groups."""
    candidates = np.flatnonzero(eligible & (scores > 0))
    order = candidates[np.lexsort((candidates, -scores[candidates], groups[candidates]))]
    sorted_groups = groups[order]
    picked = []
    for group, quota in quotas.items():
        lo, hi = np.searchsorted(sorted_groups, [group, group + 1])
        picked.append(order[lo : min(hi, lo + quota)])
    return np.concatenate(picked) if picked else np.zeros(0, np.int64)


def fit_budget(rows: np.ndarray, priority: np.ndarray, tokens: np.ndarray, budget: int,
               texts: np.ndarray | None = None) -> np.ndarray:
    """Rows kept, in priority order (ties by row), whose tokens fit the budget; a node that would
    overflow is skipped, not the rest. With texts, a node that is mostly already in the context
    (a unit inside its chunk, an extractive attribute repeating units) is skipped too: at least
    half of its sentences must be new."""
    if len(rows) == 0:
        return rows
    order = np.lexsort((rows, -priority))
    rows, cost = rows[order], tokens[rows[order]].astype(np.int64)
    kept, used, shown = [], 0, set()
    for row, size in zip(rows.tolist(), cost.tolist(), strict=True):
        if used + size > budget:
            continue
        if texts is not None:
            keys = sentence_keys(texts[row])
            if keys and 2 * len(keys - shown) < len(keys):
                continue
            shown |= keys
        kept.append(row)
        used += size
    return np.asarray(kept, dtype=np.int64)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_SUBJECT = re.compile(r"^(?:[^:.!?]{1,120}: )+")


def sentence_keys(text: str) -> set[str]:
    """Each sentence of a node, without "Subject: " prefixes, case- and space-folded."""
    keys = set()
    for sentence in _SENTENCE_END.split(text):
        key = " ".join(_SUBJECT.sub("", sentence).split()).casefold()
        if len(key) > 12:
            keys.add(key)
    return keys
