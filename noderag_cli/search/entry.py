"""Dual search entry points: exact name matching on N and O nodes, vector top-k on S, A, H.

Exact side: names are indexed once, at index time, as their normalised word sequences. A
query entity matches every name that occurs in it as a whole-word phrase, case-insensitively:
each of the entity's word n-grams is one lookup in a sorted hash array, so the cost per query
hardly grows with the number of names.
"""

from __future__ import annotations

import re
import unicodedata
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..graph import normalize_name
from ..nlp import STOPWORDS

_WORDS = re.compile(r"[\w\u00c0-\u024f]+(?:['\u2019.\-][\w\u00c0-\u024f]+)*")
MAX_NAME_WORDS = 12
KEY_SEPARATOR = "\x1f"  # between the words of a name's key string
_POSSESSIVE = re.compile(r"['\u2019]s\b")


def name_words(name: str) -> tuple[str, ...]:
    """Normalised words, possessives dropped and diacritics folded: "Aschenbrodel's" finds "Aschenbrödel"."""
    folded = unicodedata.normalize("NFKD", _POSSESSIVE.sub("", normalize_name(name)))
    return tuple(_WORDS.findall("".join(c for c in folded if not unicodedata.combining(c))))


def _key_hash(words) -> int:
    """64 bits from CRC-32 and Adler-32 of the joined words: two C calls, a fifth of a
    cryptographic hash's cost per lookup. Matches are confirmed on the words themselves, so a
    collision only costs a comparison."""
    return _joined_hash(KEY_SEPARATOR.join(words))


def _joined_hash(key: str) -> int:
    data = key.encode("utf-8")
    return zlib.crc32(data) << 32 | zlib.adler32(data)


def name_key(words: tuple[str, ...]) -> str:
    """What the index stores of a name: its words joined by `KEY_SEPARATOR`; "" for a name it
    leaves out (no words, or more than `MAX_NAME_WORDS`)."""
    return KEY_SEPARATOR.join(words) if 0 < len(words) <= MAX_NAME_WORDS else ""


def key_hashes(keys: list[str]) -> np.ndarray:
    """The hash of each joined key (`name_key`), as the index sorts and looks them up."""
    return np.fromiter((_joined_hash(key) for key in keys), np.uint64, len(keys))


def _hashes(items) -> np.ndarray:
    """Hashes of word sequences (a single word stands for the sequence of it alone)."""
    return np.fromiter((_key_hash((t,)) if isinstance(t, str) else _key_hash(t) for t in items), np.uint64, len(items))


class NameIndex:
    """Names as sorted 64-bit hashes of their word sequences, with each name's rows (CSR) and the
    sequence itself to confirm a hash match; and per first word, the words of the longest name it
    starts. Built once at index time (`arrays`), opened by memory mapping: a lookup is a binary
    search, whatever the number of names."""

    ARRAYS = ("name_hash", "name_indptr", "name_rows", "first_hash", "first_longest")

    def __init__(self, arrays: dict[str, np.ndarray], keys: pa.Array):
        self._hash, self._indptr, self._rows = arrays["name_hash"], arrays["name_indptr"], arrays["name_rows"]
        self._first, self._longest = arrays["first_hash"], arrays["first_longest"]
        self._keys = keys  # "\x1f"-joined word sequences, in hash order

    @staticmethod
    def arrays(keys: pa.Array, hashes: np.ndarray, rows: np.ndarray) -> tuple[dict[str, np.ndarray], pa.Array]:
        """The index of names given as their `name_key`s, one per row of `rows` (ascending), with
        their `key_hashes`: its arrays and its key strings. A key of "" is left out. Grouped on
        Arrow's dictionary encoding (distinct keys in the order they first occur), so only the
        first words' hashes are computed here: a build's half a million names, and an update's
        names taken from the earlier build with their hashes, cost no Python loop per name."""
        keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
        present = np.flatnonzero(pc.fill_null(pc.not_equal(keys, ""), False).to_numpy(zero_copy_only=False))
        encoded = pc.dictionary_encode(keys.take(pa.array(present, pa.int64())))
        codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        distinct_keys = encoded.dictionary
        count = len(distinct_keys)
        first_seen = np.unique(codes, return_index=True)[1]  # every code occurs: the dictionary's order
        hashes = np.asarray(hashes, np.uint64)[present][first_seen]
        order = np.lexsort((np.arange(count), hashes))  # by hash; a collision by first occurrence
        rank = np.empty(count, np.int64)
        rank[order] = np.arange(count)
        members = np.argsort(rank[codes], kind="stable")  # each name's rows ascending, as given
        firsts = pc.list_element(pc.split_pattern(distinct_keys, KEY_SEPARATOR, max_splits=1), 0)
        words = pc.count_substring(distinct_keys, KEY_SEPARATOR).to_numpy(zero_copy_only=False) + 1
        first = pc.dictionary_encode(firsts)
        longest = np.zeros(len(first.dictionary), np.int64)
        np.maximum.at(longest, first.indices.to_numpy(zero_copy_only=False), words)
        first_hash = key_hashes(first.dictionary.to_pylist())
        first_order = np.argsort(first_hash, kind="stable")
        return {
            "name_hash": hashes[order],
            "name_indptr": np.r_[0, np.cumsum(np.bincount(codes, minlength=count)[order])].astype(np.int64),
            "name_rows": np.asarray(rows, np.int64)[present][members],
            "first_hash": first_hash[first_order],
            "first_longest": longest[first_order].astype(np.int16),
        }, distinct_keys.take(pa.array(order, pa.int64())).cast(pa.string())

    @classmethod
    def build(cls, names: list[str], rows: np.ndarray) -> NameIndex:
        keys = [name_key(name_words(name)) for name in names]
        return cls(*cls.arrays(pa.array(keys, pa.string()), key_hashes(keys), rows))

    def _lookup(self, grams: list[tuple[str, ...]]) -> dict[tuple[str, ...], list[int]]:
        """Rows of every gram that is a name, in one binary search of the hash array for all."""
        if not grams:
            return {}
        codes = _hashes(grams)
        low = np.searchsorted(self._hash, codes, side="left").tolist()
        high = np.searchsorted(self._hash, codes, side="right").tolist()
        found = {}
        for gram, start, stop in zip(grams, low, high, strict=True):
            joined = KEY_SEPARATOR.join(gram)
            for position in range(start, stop):  # more than one only where hashes collide
                if self._keys[position].as_py() == joined:
                    found[gram] = self._rows[self._indptr[position]:self._indptr[position + 1]].tolist()
                    break
        return found

    def _reach(self, words: tuple[str, ...]) -> list[int]:
        """Per word, the words of the longest name it starts (0: none), for all words at once; a
        colliding hash only widens the search."""
        codes = _hashes(words)
        low = np.searchsorted(self._first, codes, side="left").tolist()
        high = np.searchsorted(self._first, codes, side="right").tolist()
        return [int(self._longest[a:b].max()) if b > a + 1 else (int(self._longest[a]) if b > a else 0)
                for a, b in zip(low, high, strict=True)]

    def match(self, phrase: str, require_capital: bool = False) -> list[int]:
        """Rows of the names occurring in phrase on word boundaries, longest first: a word inside a
        matched name does not match again on its own ("Summer Olympics", not also "Summer"). With require_capital
        (for raw question n-grams), a one-word n-gram must be capitalised or a number."""
        raw = _WORDS.findall(phrase)
        words = name_words(phrase)
        if not words:
            return []
        reach = self._reach(words)  # no longer n-gram can start here
        longest = min(len(words), max(reach))
        candidates = [words[start:start + size] for size in range(longest, 0, -1)
                      for start in range(len(words) - size + 1) if reach[start] >= size]
        rows_of = self._lookup(list(dict.fromkeys(candidates)))
        found: list[int] = []
        covered = [False] * len(words)
        for size in range(longest, 0, -1):
            for start in range(len(words) - size + 1):
                if reach[start] < size:
                    continue
                gram = words[start : start + size]
                rows = rows_of.get(gram)
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
