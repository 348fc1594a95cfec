"""Cross nodes, the retrievable filter, and the token-budgeted context (paper §2.5 steps 3-5).

Selection is vectorised: per type, the top scores among the nodes that are not entry
points (`np.argpartition`, ties broken by row = id order). The budget is filled in
one global order (score, then type rank, then id) so a cheap, relevant unit is not
crowded out by a long chunk that happens to come first in type order; the result is
then shown grouped by type.

Three steps make the context read as answers need (docs/search.md, "What a reader gets"):
- **What the question asks** (`weigh_asked_kind`): "when" asks for a date, "how many" for a number;
  a unit that holds such a value is worth more than its likeness to the question says, since the
  sentence that answers rarely repeats the question's words.
- **The question's own words** (`QuestionWords`): a node that holds the question's rarer words
  ("average snowfall" of "the average snowfall in the city where ...") is worth more than its
  vector says: the bundled embeddings blur one sentence of a passage into its neighbours, and the
  words tell the sentence that answers from the one beside it (hybrid lexical and vector ranking).
- **Depth before breadth** (`whole_chunks`): a document whose best unit ranks among the first is
  shown as its chunk, where the chunk is short, rather than as one or two of its sentences: the
  sentence that gives a subject's dates is often beside the one that matched.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import re
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from ..nlp import TERM_CHAR, VALUE_BITS, terms
from ..node_types import RESTATING_CODES, TYPE_CODE

WHOLE_CHUNK_RATIO = 3
"""A chunk is shown whole in place of its units (`whole_chunks`) when it costs at most this many
times what they do: a long chunk would spend the budget of several documents on one."""


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
               keys: tuple[np.ndarray, np.ndarray] | None = None,
               documents: tuple[np.ndarray, np.ndarray] | None = None, diversity: float = 1.0) -> np.ndarray:
    """Rows kept, in priority order (ties by row), whose tokens fit the budget; a node that would
    overflow is skipped, not the rest. With `keys`, each node's sentence keys as ids (CSR arrays
    `(indptr, ids)`, from `sentence_key_ids`), a node that repeats a sentence already in the
    context (a unit inside a chunk already shown, an extractive attribute repeating units) is
    skipped too: its tokens would buy a sentence twice, and what else it says is within reach as
    units of its own.

    With `documents` (each node's source documents, CSR `(indptr, codes)`) and `diversity` below
    1, a node's priority is multiplied by `diversity` once for every node already kept from its
    documents (the most of any of its documents: a summary of passages already shown adds little),
    and the best node by that priority is kept next: a question that needs two passages is not
    answered by the fifth sentence of the first."""
    if len(rows) == 0:
        return rows
    if documents is not None and diversity < 1.0:
        return _fit_diverse(rows, priority, tokens, budget, keys, documents, diversity_powers(diversity, len(rows)))
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


def diversity_powers(diversity: float, count: int) -> np.ndarray:
    """diversity^k for k = 0..count: the factor on a node whose documents already gave k kept nodes
    (one table, so the kernel and numpy multiply by the same bits)."""
    return np.power(float(diversity), np.arange(count + 1, dtype=np.float64))


def _fit_diverse(rows: np.ndarray, priority: np.ndarray, tokens: np.ndarray, budget: int,
                 keys: tuple[np.ndarray, np.ndarray] | None, documents: tuple[np.ndarray, np.ndarray],
                 powers: np.ndarray) -> np.ndarray:
    """`fit_budget` with the diversity factor: greedy on the current priority (priorities only fall,
    so a heap re-checked on every pop gives the best node each time; ties by row)."""
    doc_indptr, doc_codes = documents
    cost = tokens[rows].astype(np.int64)
    fitting = cost[cost <= budget]
    smallest = int(fitting.min()) if len(fitting) else 0
    sources = [doc_codes[doc_indptr[row]:doc_indptr[row + 1]].tolist() for row in rows.tolist()]
    heap = [(-value, row, i) for i, (value, row) in enumerate(zip(priority.tolist(), rows.tolist(), strict=True))]
    heapq.heapify(heap)
    taken: dict[int, int] = {}
    kept, used, shown = [], 0, set()
    while heap:
        negative, row, i = heapq.heappop(heap)
        seen = max((taken.get(d, 0) for d in sources[i]), default=0)
        current = priority[i] * powers[seen]
        if current < -negative:
            heapq.heappush(heap, (-current, row, i))
            continue
        size = int(cost[i])
        if size > budget or used + size > budget:
            continue
        if keys is not None:
            node_keys = keys[1][keys[0][row]:keys[0][row + 1]].tolist()
            if not shown.isdisjoint(node_keys):
                continue
            shown.update(node_keys)
        kept.append(row)
        used += size
        for d in sources[i]:
            taken[d] = taken.get(d, 0) + 1
        if budget - used < smallest:
            break
    return np.asarray(kept, dtype=np.int64)


def sentence_key_ids(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Every node's sentence keys as ids (`sentence_key_hash`), CSR (indptr, ids; int64), each
    node's ids sorted. A node's list depends on its text alone, so an earlier build's lists serve
    the nodes whose text is unchanged."""
    ids_of = [sorted(sentence_key_hash(key) for key in sentence_keys(text)) for text in texts]
    indptr = np.r_[0, np.cumsum([len(k) for k in ids_of], dtype=np.int64)].astype(np.int64)
    ids = np.fromiter((k for node in ids_of for k in node), np.int64, int(indptr[-1]))
    return indptr, ids


def sentence_key_hash(key: str) -> int:
    """A sentence key as a signed 64-bit id: two nodes share a sentence when they share an id (among
    10^7 keys a chance collision has odds of about 3 in a million, and would only drop one node as a
    repeat)."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest(), "little", signed=True)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")
_SUBJECT = re.compile(r"^(?:[^:.!?]{1,120}: )+")
_TERM_CHAR = re.compile(TERM_CHAR)


def without_subject(text: str) -> str:
    """`text` without its "Subject: " prefixes (a unit's document name, a summary's entity)."""
    return _SUBJECT.sub("", text) if ": " in text else text  # no subject prefix without one


def sentence_keys(text: str) -> frozenset[str]:
    """Each sentence of a node, without "Subject: " prefixes, case- and space-folded."""
    keys = set()
    for sentence in _SENTENCE_END.split(text):
        key = " ".join(without_subject(sentence).split()).casefold()
        if len(key) > 12:
            keys.add(key)
    return frozenset(keys)


def weigh_asked_kind(similarity: np.ndarray, kinds: np.ndarray, asked: str, weight: float) -> np.ndarray:
    """`similarity` (per support row) times 1 + `weight` where the row holds a value of the kind
    `asked` (`nlp.asked_kind`; `kinds` per row as `nlp.VALUE_BITS`); unchanged for a question that
    asks for no value."""
    bit = VALUE_BITS.get(asked, 0)
    if not bit or weight <= 0:
        return similarity
    return similarity * np.where(kinds & bit, 1.0 + weight, 1.0)


class QuestionWords:
    """How much of a question's words each candidate node holds, for `weigh_question_words`. A
    word counts by how rare it is among the candidates scored together (log((n + 1) / (df + 1)),
    plus a floor): the question's entity is named by most of them, the word that says what is
    asked ("snowfall", "population") by few. A node's words are read once per question (its
    second round scores mostly the same nodes), without "Subject: " prefixes, which repeat the
    document's name on every unit of it."""

    FLOOR = 0.1
    """Weight of a word every candidate holds: it still tells them from nodes without it."""

    def __init__(self, question: str, texts: pa.Array):
        self.words = sorted(set(terms(question)))
        self.texts = texts
        self._held: dict[int, np.ndarray] = {}  # per row: which of the words it holds

    def shares(self, rows: np.ndarray) -> np.ndarray:
        """Per row of `rows`, the weight of the question's words it holds over the weight of all of
        them, in [0, 1]; zeros when the question has no words."""
        if not self.words or not len(rows):
            return np.zeros(len(rows))
        missing = [row for row in rows.tolist() if row not in self._held]
        if missing:
            texts = self.texts.take(pa.array(missing, pa.int64())).to_pylist()
            found = _held_words([without_subject(text).casefold() for text in texts], self.words)
            self._held.update(zip(missing, found, strict=True))
        held = np.array([self._held[row] for row in rows.tolist()], dtype=bool)
        weight = np.log((len(held) + 1.0) / (held.sum(axis=0) + 1.0)) + self.FLOOR
        return (held * weight).sum(axis=1) / weight.sum()


def _held_words(folded: list[str], words: list[str]) -> np.ndarray:
    """Per text of `folded` (casefolded), which of `words` (casefolded) it holds as a whole term, as
    `nlp.terms` splits a text (no term character on either side), or with a possessive ("town's"
    holds "town"). The texts are searched joined, a substring search per word: most hold none of
    the words, and a Python step per hit is cheaper than one per text."""
    held = np.zeros((len(folded), len(words)), bool)
    joined = "\n".join(folded)  # a line break is no term character: no term runs across two texts
    ends = np.cumsum([len(text) + 1 for text in folded]).tolist()  # where each text's line ends, plus one
    for column, word in enumerate(words):
        at = joined.find(word)
        while at >= 0:
            end = at + len(word)
            if joined.startswith("'s", end):
                end += 2
            if (at == 0 or not _TERM_CHAR.match(joined, at - 1)) and not _TERM_CHAR.match(joined, end):
                text = bisect.bisect_right(ends, at)
                held[text, column] = True
                at = joined.find(word, ends[text])  # the next text
            else:
                at = joined.find(word, at + 1)
    return held


OWN_TEXT_CODES = np.array([TYPE_CODE["S"], TYPE_CODE["T"]], np.int8)
"""Units and chunks: the passages' own text (`weigh_question_words`)."""


def weigh_question_words(scores: np.ndarray, rows: np.ndarray, codes: np.ndarray, words: QuestionWords | None,
                         weight: float) -> np.ndarray:
    """`scores` (per row of `rows`, of type `codes`) times 1 + `weight` x the share of the question's
    words each holds (`QuestionWords.shares`, among them), for units and chunks: the passages' own
    text, which a reader quotes. A summary restating a unit would otherwise outrank it by the same
    words and push it out as a repeat. Unchanged without `words` or at weight 0."""
    if words is None or weight <= 0:
        return scores
    own = np.isin(codes, OWN_TEXT_CODES)
    factor = np.ones(len(scores))
    factor[own] += weight * words.shares(rows[own])
    return scores * factor


def whole_chunks(kept: np.ndarray, scores: np.ndarray, codes: np.ndarray, tokens: np.ndarray, unit_chunk: np.ndarray,
                 budget: int, documents: int, keys: tuple[np.ndarray, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The context (`kept` rows, their `scores`) with the chunks of its best `documents` shown whole:
    of the first `documents` chunks whose units the context holds (in the order of their best unit),
    each replaces its units when it
    costs at most `WHOLE_CHUNK_RATIO` times what they do and the budget allows it, funded by the
    least summaries and relationships (H, A, R), then the least units of chunks that keep another,
    never by a chunk's only unit (the context still touches every passage it touched). With `keys`
    (each node's sentence keys, CSR, as `fit_budget` takes them), a node that repeats a sentence of
    the chunk goes with its units, and a chunk that repeats one the context shows is not shown: no
    sentence is shown twice. The chunk is shown with its best unit's score. Rows ascending."""
    unit_code, chunk_code = TYPE_CODE["S"], TYPE_CODE["T"]
    held = dict(zip(kept.tolist(), scores.tolist(), strict=True))
    used = int(tokens[kept].sum())
    units_of: dict[int, list[int]] = {}
    for row in kept.tolist():
        if codes[row] == unit_code and unit_chunk[row] >= 0:
            units_of.setdefault(int(unit_chunk[row]), []).append(row)
    best = sorted(units_of, key=lambda chunk: (-max(held[u] for u in units_of[chunk]), chunk))
    for chunk in best[:documents]:
        units = [u for u in units_of[chunk] if u in held]
        if not units or chunk in held:
            continue
        cost, replaced = int(tokens[chunk]), int(tokens[units].sum())
        if cost > WHOLE_CHUNK_RATIO * replaced:
            continue
        if keys is not None:
            said = set(keys[1][keys[0][chunk]:keys[0][chunk + 1]].tolist())
            repeats = [r for r in held if r not in units and not said.isdisjoint(keys[1][keys[0][r]:keys[0][r + 1]].tolist())]
            if any(codes[r] == chunk_code for r in repeats):
                continue  # a chunk shown already says part of it: it would not be shown twice
            units += [r for r in repeats if codes[r] != unit_code or _others_held(held, codes, unit_chunk, r)]
            replaced = int(tokens[units].sum())
        need = used + cost - replaced - budget
        score = max(held[u] for u in units if codes[u] == unit_code)
        below = {r: v for r, v in held.items() if r not in units and v < score}  # a better node never pays for it
        funds = _funds(below, codes, tokens, unit_chunk, chunk, need) if need > 0 else []
        if funds is None:
            continue
        for row in (*units, *funds):
            del held[row]
        held[chunk] = score
        used += cost - replaced - sum(int(tokens[row]) for row in funds)
    rows = np.array(sorted(held), dtype=np.int64)
    return rows, np.array([held[r] for r in rows.tolist()], dtype=np.float64)


def _others_held(held: dict[int, float], codes: np.ndarray, unit_chunk: np.ndarray, unit: int) -> bool:
    """Whether a unit's chunk has another unit in the context (so dropping it leaves the passage in)."""
    return any(r != unit and codes[r] == codes[unit] and unit_chunk[r] == unit_chunk[unit] for r in held)


def _funds(held: dict[int, float], codes: np.ndarray, tokens: np.ndarray, unit_chunk: np.ndarray, chunk: int,
           need: int) -> list[int] | None:
    """The rows to drop to free `need` tokens for `chunk` (`whole_chunks`): the least H, A and R rows,
    then the least units of other chunks that keep another unit; None when they do not free enough."""
    unit_code = TYPE_CODE["S"]
    summaries = sorted((r for r in held if codes[r] in RESTATING_CODES), key=lambda r: (held[r], -r))
    per_chunk: dict[int, int] = {}
    for row in held:
        if codes[row] == unit_code:
            per_chunk[int(unit_chunk[row])] = per_chunk.get(int(unit_chunk[row]), 0) + 1
    units = sorted((r for r in held if codes[r] == unit_code and int(unit_chunk[r]) != chunk),
                   key=lambda r: (held[r], -r))
    dropped, freed = [], 0
    for row in (*summaries, *units):
        if freed >= need:
            break
        if codes[row] == unit_code:
            if per_chunk[int(unit_chunk[row])] <= 1:
                continue
            per_chunk[int(unit_chunk[row])] -= 1
        dropped.append(row)
        freed += int(tokens[row])
    return dropped if freed >= need else None
