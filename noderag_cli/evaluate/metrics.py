"""The metrics of `shared/eval/README.md`, computed on the context handed to the answer step."""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter

from ..search.results import Retrieval

SUPPORT_TYPES = ("T", "S", "A", "R")
"""Node types that count as carrying a passage: the chunk itself, or what was derived from it
(high-level elements summarise whole communities, so they do not)."""


def _fold(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().casefold()


def answer_contained(context: str, answers: list[str]) -> bool:
    """The gold answer or one of its aliases occurs in the context, case-insensitively."""
    folded = _fold(context)
    return any(_fold(a) and _fold(a) in folded for a in answers)


def support_recall(retrieval: Retrieval, supporting_documents: list[str]) -> float | None:
    """Share of the gold documents that some retrieved T, S, A or R node came from."""
    if not supporting_documents:
        return None
    reached = {d for node in retrieval.nodes if node.type in SUPPORT_TYPES for d in node.documents}
    return sum(1 for d in supporting_documents if d in reached) / len(supporting_documents)


def _normalised(text: str) -> list[str]:
    """SQuAD's answer normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in unicodedata.normalize("NFKC", text).casefold() if ch not in string.punctuation)
    return re.sub(r"\b(?:a|an|the)\b", " ", text).split()


def exact_match(prediction: str, answers: list[str]) -> bool:
    """The prediction equals the gold answer or an alias after SQuAD's normalisation."""
    return any(_normalised(prediction) == _normalised(answer) for answer in answers)


def token_f1(prediction: str, answers: list[str]) -> float:
    """SQuAD's token F1 of the prediction against the best-matching gold answer or alias."""
    best = 0.0
    for answer in answers:
        shared = sum((Counter(_normalised(prediction)) & Counter(_normalised(answer))).values())
        if shared:
            best = max(best, 2 * shared / (len(_normalised(prediction)) + len(_normalised(answer))))
    return best
