"""Dual search entry points: exact name matching on N and O nodes, vector top-k on S, A, H.

Exact side: names are indexed once, as their normalised word sequences. A query entity
matches every name that occurs in it as a whole-word phrase, case-insensitively: each
of the entity's word n-grams is one dictionary lookup, so the cost per query does not
grow with the number of names.
"""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict

import numpy as np

from ..graph import normalize_name
from ..nlp import STOPWORDS

_WORDS = re.compile(r"[\w\u00c0-\u024f]+(?:['\u2019.\-][\w\u00c0-\u024f]+)*")
MAX_NAME_WORDS = 12
_POSSESSIVE = re.compile(r"['\u2019]s\b")


def name_words(name: str) -> tuple[str, ...]:
    """Normalised words, possessives dropped and diacritics folded: "Aschenbrodel's" finds "Aschenbrödel"."""
    folded = unicodedata.normalize("NFKD", _POSSESSIVE.sub("", normalize_name(name)))
    return tuple(_WORDS.findall("".join(c for c in folded if not unicodedata.combining(c))))


class NameIndex:
    def __init__(self, names: list[str], rows: np.ndarray):
        self._rows: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for name, row in zip(names, rows.tolist(), strict=True):
            words = name_words(name)
            if words and len(words) <= MAX_NAME_WORDS:
                self._rows[words].append(row)
        self._longest: dict[str, int] = {}  # first word -> words of the longest name it starts
        for words in self._rows:
            self._longest[words[0]] = max(self._longest.get(words[0], 0), len(words))

    def match(self, phrase: str, require_capital: bool = False) -> list[int]:
        """Rows of the names occurring in phrase on word boundaries, longest first: a word inside a
        matched name does not match again on its own ("Summer Olympics", not also "Summer"). With require_capital
        (for raw question n-grams), a one-word n-gram must be capitalised or a number."""
        raw = _WORDS.findall(phrase)
        words = name_words(phrase)
        found: list[int] = []
        covered = [False] * len(words)
        reach = [self._longest.get(word, 0) for word in words]  # no longer n-gram can start here
        for size in range(min(len(words), max(reach, default=0)), 0, -1):
            for start in range(len(words) - size + 1):
                if reach[start] < size:
                    continue
                gram = words[start : start + size]
                rows = self._rows.get(gram)
                if not rows or any(covered[start : start + size]):
                    continue
                if size == 1 and (gram[0] in STOPWORDS or len(gram[0]) < 2):
                    continue
                if require_capital and size == 1 and not _looks_like_name(gram[0], raw):
                    continue
                found.extend(rows)
                covered[start : start + size] = [True] * size
        return list(dict.fromkeys(found))


def _looks_like_name(word: str, raw_words: list[str]) -> bool:
    return any(w.casefold() == word and (w[:1].isupper() or w[:1].isdigit()) for w in raw_words)
