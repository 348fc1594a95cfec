"""Cross nodes, the retrievable filter, and the token-budgeted context (paper §2.5 steps 3-5).

Selection is vectorised: per type, the top scores among the nodes that are not entry
points (`np.argpartition`, ties broken by row = id order). The budget is filled in
one global order (score, then type rank, then id) so a cheap, relevant unit is not
crowded out by a long chunk that happens to come first in type order; the result is
then shown grouped by type.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

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
    best first within a group, ties by position; groups in the order of `quotas`. One stable sort
    by group, then per group a partial sort of its slice."""
    candidates = np.flatnonzero(eligible & (scores > 0))
    by_group = candidates[np.argsort(groups[candidates], kind="stable")]
    bounds = np.searchsorted(groups[by_group], [g for group in quotas for g in (group, group + 1)])
    picked = []
    for quota, lo, hi in zip(quotas.values(), bounds[0::2], bounds[1::2], strict=True):
        members = by_group[lo:hi]  # ascending positions
        if quota <= 0 or not len(members):
            continue
        values = scores[members]
        if len(members) > quota:
            threshold = values[np.argpartition(-values, quota - 1)[quota - 1]]
            chosen = values >= threshold  # ties at the threshold stay, then the cut keeps the first positions
            members, values = members[chosen], values[chosen]
        picked.append(members[np.argsort(-values, kind="stable")][:quota])
    return np.concatenate(picked) if picked else np.zeros(0, np.int64)


def fit_budget(rows: np.ndarray, priority: np.ndarray, tokens: np.ndarray, budget: int,
               keys: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Rows kept, in priority order (ties by row), whose tokens fit the budget; a node that would
    overflow is skipped, not the rest. With `keys`, each node's sentence keys as ids (CSR arrays
    `(indptr, ids)`, from `sentence_key_ids`), a node that repeats a sentence already in the
    context (a unit inside a chunk already shown, an extractive attribute repeating units) is
    skipped too: its tokens would buy a sentence twice, and what else it says is within reach as
    units of its own."""
    if len(rows) == 0:
        return rows
    order = np.lexsort((rows, -priority))
    rows, cost = rows[order], tokens[rows[order]].astype(np.int64)
    fits = cost <= budget
    rows, cost = rows[fits], cost[fits]
    kept, used, shown = [], 0, set()
    if keys is None:
        # no dedupe: a node is kept when it fits what the nodes before it left
        for row, size in zip(rows.tolist(), cost.tolist(), strict=True):
            if used + size <= budget:
                kept.append(row)
                used += size
        return np.asarray(kept, dtype=np.int64)
    indptr, ids = keys
    smallest = int(cost.min()) if len(cost) else 0
    for row, size in zip(rows.tolist(), cost.tolist(), strict=True):
        if used + size > budget:
            continue
        node_keys = ids[indptr[row]:indptr[row + 1]].tolist()
        if not shown.isdisjoint(node_keys):
            continue
        shown.update(node_keys)
        kept.append(row)
        used += size
        if budget - used < smallest:
            break
    return np.asarray(kept, dtype=np.int64)


def sentence_key_ids(texts: Sequence[str], keep: Sequence[bool]) -> tuple[np.ndarray, np.ndarray, int]:
    """Every node's sentence keys as ids, CSR (indptr, ids; int64), and the number of distinct
    keys: the nodes whose `keep` is false get none. Ids are given in first-seen order over the
    nodes, each node's keys sorted."""
    key_id: dict[str, int] = {}
    ids_of = [[key_id.setdefault(key, len(key_id)) for key in sorted(sentence_keys(text))] if wanted else []
              for text, wanted in zip(texts, keep, strict=True)]
    indptr = np.r_[0, np.cumsum([len(k) for k in ids_of], dtype=np.int64)].astype(np.int64)
    ids = np.fromiter((k for node in ids_of for k in node), np.int64, int(indptr[-1]))
    return indptr, ids, len(key_id)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_SUBJECT = re.compile(r"^(?:[^:.!?]{1,120}: )+")


def sentence_keys(text: str) -> frozenset[str]:
    """Each sentence of a node, without "Subject: " prefixes, case- and space-folded."""
    keys = set()
    for sentence in _SENTENCE_END.split(text):
        if ": " in sentence:  # no subject prefix without one
            sentence = _SUBJECT.sub("", sentence)
        key = " ".join(sentence.split()).casefold()
        if len(key) > 12:
            keys.add(key)
    return frozenset(keys)
