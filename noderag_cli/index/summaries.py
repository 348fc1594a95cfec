"""Summaries written in parts (a summary tree), so that an update redoes only what changed.

An entity's attribute and a community's high-level elements are written from many texts. Here
those texts are split into leaves by a seeded hash of each text, so a text falls in the same leaf
whatever else the input holds: one text added or removed changes one leaf. Each leaf is
summarised on its own (the same texts make the same request, which the cache answers), then the
summary is written from the leaves' summaries, in as many levels as it takes. A fresh build makes
the same tree, so an update and a fresh build agree. An input that fits one leaf is one request,
as without a tree.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from ..engines.base import Failure


class _Up(NamedTuple):
    """A part passed up unasked (a single text)."""

    texts: tuple[str, ...]


def _leaf_count(total_tokens: int, leaf_tokens: int) -> int:
    """The smallest power of two that brings the mean leaf to `leaf_tokens`: it moves only when the
    input doubles or halves."""
    return 1 << math.ceil(math.log2(total_tokens / leaf_tokens)) if total_tokens > leaf_tokens else 1


def leaves(texts: Sequence[str], tokens: Sequence[int], leaf_tokens: int, seed: int) -> list[tuple[int, list[int]]]:
    """(slot, positions of `texts`) per leaf, in slot order: a text's slot is its seeded CRC-32
    modulo the leaf count, so it does not depend on the other texts. One leaf keeps the input's
    order (the caller's ranking, as without a tree); in several, each leaf is ordered by the texts'
    hashes, so that a leaf's request does not change when only the input's order did."""
    count = _leaf_count(int(sum(tokens)), leaf_tokens)
    if count == 1:
        return [(0, list(range(len(texts))))] if len(texts) else []
    hashes = [zlib.crc32(text.encode(), seed & 0xFFFFFFFF) for text in texts]
    slots: dict[int, list[int]] = {}
    for position in sorted(range(len(texts)), key=lambda p: (hashes[p], texts[p], p)):
        slots.setdefault(hashes[position] % count, []).append(position)
    return sorted(slots.items())


def in_parts(
    inputs: Sequence[Sequence[str]], tokens: Sequence[Sequence[int]],
    ask: Callable[[list[tuple[int, tuple[str, ...]]]], list[Any]],
    as_texts: Callable[[int, Any], list[str]], leaf_tokens: int, seed: int,
    count_tokens: Callable[[list[str]], list[int]], finished: Callable[[int], None] | None = None,
) -> list[Any]:
    """The summary of each input (a sequence of texts), or the Failure of one of its parts.
    `tokens` holds each input's token counts (the nodes' stored ones: counting again would cost
    more than the rest of the tree); `count_tokens` counts the summaries a level sends up.

    `ask([(input, texts), ...])` answers one batch of requests (the engine's task, every request of
    a level at once); `as_texts(input, result)` gives a part's summary as the texts the next level
    reads. Above the leaves, parts are grouped by slot in contiguous runs, with at most half as
    many groups as parts: a changed part stays in its group, so one changed leaf re-asks one
    request per level, and the tree ends. `finished(n)` hears of the inputs done after each level."""
    results: list[Any] = [None] * len(inputs)
    slots_below: dict[int, int] = {}  # per input: the slot count of the level its parts come from
    requests: list[tuple[int, int, tuple[str, ...]]] = []  # (input, slot, texts)
    for i, (texts, counts) in enumerate(zip(inputs, tokens, strict=True)):
        slots_below[i] = _leaf_count(int(sum(counts)), leaf_tokens)
        requests += [(i, slot, tuple(texts[p] for p in leaf)) for slot, leaf in leaves(texts, counts, leaf_tokens, seed)]
    while requests:
        parts_of: dict[int, int] = {}
        for i, _, _ in requests:
            parts_of[i] = parts_of.get(i, 0) + 1
        # one text among other parts goes up as it is: nothing to summarise, and no request to fail
        asked = [r for r in requests if len(r[2]) > 1 or parts_of[r[0]] == 1]
        answers = iter(ask([(i, texts) for i, _, texts in asked]) if asked else [])
        got: dict[int, list[tuple[int, Any]]] = {}
        for i, slot, texts in requests:
            got.setdefault(i, []).append((slot, next(answers) if len(texts) > 1 or parts_of[i] == 1 else _Up(texts)))
        requests = []
        done = 0
        for i, parts in got.items():
            failed = next((a for _, a in parts if isinstance(a, Failure)), None)
            texts_of = [(slot, list(a.texts) if isinstance(a, _Up) else as_texts(i, a)) for slot, a in parts] \
                if failed is None and len(parts) > 1 else []
            if failed is not None or len(parts) == 1 or not any(t for _, t in texts_of):
                results[i] = failed if failed is not None else parts[0][1]  # (all parts empty: so is the whole)
                done += 1
                continue
            total = sum(sum(count_tokens(t)) for _, t in texts_of if t)
            count = 1 << int(math.log2(min(_leaf_count(total, leaf_tokens), len(parts) // 2)))
            groups: dict[int, list[str]] = {}
            for slot, texts in texts_of:
                groups.setdefault(slot * count // slots_below[i], []).extend(texts)
            requests += [(i, g, tuple(texts)) for g, texts in sorted(groups.items()) if texts]
            slots_below[i] = count
        if finished is not None:
            finished(done)
    return results


def in_parts_or_kept(
    kept: Sequence[Any | None], inputs: Sequence[Sequence[str]], tokens: Sequence[Sequence[int]],
    ask: Callable[[list[tuple[int, tuple[str, ...]]]], list[Any]], as_texts: Callable[[int, Any], list[str]],
    leaf_tokens: int, seed: int, count_tokens: Callable[[list[str]], list[int]],
    finished: Callable[[int], None] | None = None,
) -> list[Any]:
    """`in_parts` for the inputs whose `kept` result is None (an incremental update keeps the
    others': anchor.py); `ask` and `as_texts` see the inputs' own positions."""
    todo = [k for k, result in enumerate(kept) if result is None]
    if finished is not None and len(todo) < len(kept):
        finished(len(kept) - len(todo))
    asked = in_parts([inputs[k] for k in todo], [tokens[k] for k in todo],
                     lambda requests: ask([(todo[i], texts) for i, texts in requests]),
                     lambda i, result: as_texts(todo[i], result), leaf_tokens, seed, count_tokens, finished)
    results = list(kept)
    for k, result in zip(todo, asked, strict=True):
        results[k] = result
    return results
