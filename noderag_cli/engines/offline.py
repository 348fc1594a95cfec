"""The offline built-in engine: deterministic, extractive implementations of every LLM task.

No model, no key, no network. It aims at a graph worth searching:
- semantic units are sentences (headings dropped, fragments joined to the sentence
  before; a table's rows, each cell under its column's name), made self-contained by prefixing the document title when the sentence does
  not name it ("Korven Institute: It was founded in 1902."); every unit names the title,
  the title without its qualifier ("Hello Love" of "Hello Love (song)") and the name the
  document's first sentence opens with, when that is another (what the document is about,
  under the names other documents use);
- entities are the names, titles, dates and quantities spotted by `nlp.find_entities`; a
  one-word name that shortens one longer name of its chunk also names that one ("Snow",
  "Hank Snow");
- a relationship joins consecutive entities of a unit, the words between them being the relation;
- attributes and high-level elements are extractive summaries: central, diverse
  sentences (maximal marginal relevance over the bundled embeddings), with tf-idf
  keyword titles for the overviews.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

import numpy as np

from .. import nlp
from ..cache import OFFLINE, Cache
from ..config import LLMConfig
from ..embeddings import Embedder
from ..files import json_digest
from ..graph import normalize_name
from . import extractive
from .base import (
    Advance,
    AttributeInput,
    ChunkInput,
    CommunityInput,
    Element,
    Engine,
    EngineStats,
    Failure,
    Unit,
)
from .identity import identity

MAX_RELATION_WORDS = 8
MIN_UNIT_WORDS = 4
ATTRIBUTE_SENTENCES = 3
ELEMENT_SENTENCES = 2
TEXTS_PER_ELEMENT = 12
MAX_ELEMENTS = 4


def _distinct(texts) -> list[str]:
    """The non-blank texts, each once, in order."""
    return list(dict.fromkeys(t for t in texts if t.strip()))


def _mmr(vectors: np.ndarray, k: int, diversity: float = 0.5) -> list[int]:
    """Indices of k rows that are central (close to the mean) yet unlike each other."""
    if len(vectors) == 0:
        return []
    centre = vectors.mean(axis=0)
    relevance = vectors @ centre
    chosen = [int(np.argmax(relevance))]
    while len(chosen) < min(k, len(vectors)):
        redundancy = (vectors @ vectors[chosen].T).max(axis=1)
        score = (1 - diversity) * relevance - diversity * redundancy
        score[chosen] = -np.inf
        chosen.append(int(np.argmax(score)))
    return chosen


def decompose_chunk(chunk: ChunkInput) -> list[Unit]:
    """Sentences as units, with the names they mention and the words between two names as relations
    (a pure function of the chunk: indexing runs it on worker processes)."""
    title = chunk.title.strip()
    title_key = normalize_name(title) if title else ""
    sentences: list[str] = []
    body = chunk.text
    first, _, rest = body.lstrip().partition("\n")
    if title and nlp.strip_markdown(first.strip()) == title:
        body = rest
    for raw in re.split(r"\n\s*\n", body):
        rows = table_rows(raw)
        if rows:
            sentences += rows
            continue
        for block in nlp.paragraphs(raw):
            if re.match(r"^#{1,6}\s", block) or (title and nlp.strip_markdown(block) == title):
                continue
            for sentence in nlp.split_sentences(nlp.strip_markdown(block)):
                if sentences and len(sentence.split()) < MIN_UNIT_WORDS:
                    sentences[-1] = f"{sentences[-1]} {sentence}"
                else:
                    sentences.append(sentence)
    spotted = []
    for sentence in sentences:
        text = sentence
        spans = nlp.find_entities(text)
        if title_key and title_key not in normalize_name(sentence) and title_key not in sentence.casefold():
            text = f"{title}: {sentence}"
            shift = len(title) + 2
            spans = [(0, len(title), title)] + [(a + shift, b + shift, name) for a, b, name in spans]
        spotted.append((text, spans))
    subject = nlp.base_title(title)
    full_name = _full_names([span[2] for _, spans in spotted for span in spans] + [subject])
    full_name[title.casefold()] = subject  # a qualified title ("X (film)") also names its subject, X
    opens = bool(title) and nlp.strip_markdown(first.strip()) == title  # the chunk that starts the document
    lead = _lead_name(sentences[0], title) if opens and sentences else ""
    units = []
    for text, spans in spotted:
        names = [s[2] for s in spans if normalize_name(s[2])]
        entities = tuple(dict.fromkeys([n for name in names for n in (name, full_name.get(name.casefold())) if n]
                                       + ([lead] if lead else [])))
        relations = []
        for left, right in zip(spans, spans[1:], strict=False):
            between = text[left[1] : right[0]].strip(" ,;:()\"'\u201c\u201d-")
            words = between.split()
            if 1 <= len(words) <= MAX_RELATION_WORDS and any(w.isalpha() for w in words):
                if normalize_name(left[2]) != normalize_name(right[2]):
                    relations.append((left[2], between, right[2]))
        units.append(Unit(text=text, entities=entities, relations=tuple(dict.fromkeys(relations))))
    return units


_CELLS = re.compile(r"(?<!\\)\|")


def table_rows(block: str) -> list[str]:
    """A Markdown table's rows as statements, each cell under its column's name ("Ship: Gannet;
    Tonnage: 420."): a row is a unit of its own, and says what its numbers are. [] for a block
    that is not a table."""
    lines = [line.strip() for line in block.strip().splitlines()]
    if len(lines) < 3 or not all(line.startswith("|") for line in lines) or \
            not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", lines[1]):
        return []

    def cells(line: str) -> list[str]:
        return [cell.strip().replace("\\|", "|") for cell in _CELLS.split(line.strip().strip("|"))]

    header = cells(lines[0])
    statements = []
    for line in lines[2:]:
        pairs = [(name or f"column {n + 1}", value) for n, (name, value) in enumerate(zip(header, cells(line), strict=False))
                 if value]
        if pairs:
            statements.append("; ".join(f"{name}: {value}" for name, value in pairs) + ".")
    return statements


def _lead_name(sentence: str, title: str) -> str:
    """The name a document's first sentence opens with, when it is not the title: what the document
    is about under the name other documents use ("Josiah Penrake (1821-1896) and Amos Penrake were
    shipbuilders" under the title "Penrake brothers"). Every unit of the chunk names it, as every
    unit names the title. "" when the sentence opens otherwise, or with a date or a quantity."""
    spans = nlp.find_entities(sentence)
    if not spans or re.sub(r"^(?:the|a|an)\s+", "", sentence[: spans[0][0]].strip(), flags=re.IGNORECASE):
        return ""
    name = spans[0][2]
    if nlp.is_value(name) or normalize_name(name) in {normalize_name(title), normalize_name(nlp.base_title(title))}:
        return ""
    return name


def _full_names(names: list[str]) -> dict[str, str]:
    """One chunk's short names resolved to the one longer name they shorten: a single word that
    starts or ends exactly one multi-word name of the chunk ("Snow" -> "Hank Snow", "Gisvi" ->
    "Gisvi Isaque Andrade Antunes"), as a writer shortens a name already given in full. Keyed by
    the short name case-folded; a word that could shorten two names is left alone."""
    longer: dict[str, set[str]] = {}
    for name in dict.fromkeys(names):
        words = name.split()
        if len(words) > 1 and not any(c.isdigit() for c in name):
            for word in {words[0], words[-1]}:
                longer.setdefault(word.casefold(), set()).add(name)
    return {short: next(iter(full)) for short, full in longer.items() if len(full) == 1}


class OfflineEngine(Engine):
    identity = identity(LLMConfig(engine="offline"))
    name = identity["name"]
    pure_decompose = staticmethod(decompose_chunk)  # what indexing may run on worker processes
    failures_are_final = True  # its rules give the same result for the same input on every run

    def __init__(self, embedder: Embedder, cache: Cache | None = None):
        self.embedder = embedder
        self.stats = EngineStats()
        self.cache = cache  # attribute and community results by input, so an update redoes only changed items

    def _through_cache(self, task: str, payloads: list, compute, texts_of) -> list:
        """compute(payload) for each payload, from the cache where an earlier run stored it; the
        texts (texts_of(payload)) of the payloads to compute are embedded first, in one call.
        Values are JSON; a Failure is returned, never stored."""
        keys = [json_digest([self.name, self.embedder.vector_id, task, payload]) for payload in payloads]
        found = self.cache.get_many(OFFLINE, keys) if self.cache is not None else {}
        missing = [payload for key, payload in zip(keys, payloads, strict=True) if key not in found]
        self.embedder.embed_ahead(_distinct(t for payload in missing for t in texts_of(payload)))
        results, fresh = [], []
        for key, payload in zip(keys, payloads, strict=True):
            if key in found:
                results.append(json.loads(found[key]))
                continue
            value = compute(payload)
            results.append(value)
            if not isinstance(value, Failure):
                fresh.append((key, json.dumps(value).encode()))
        if self.cache is not None:
            self.cache.put_many(OFFLINE, fresh)
        return results

    # decompose -----------------------------------------------------------------
    def decompose(self, chunks: Sequence[ChunkInput], progress: Advance | None = None) -> list[list[Unit] | Failure]:
        results: list[list[Unit] | Failure] = []
        for chunk in chunks:
            results.append(decompose_chunk(chunk))
            if progress:
                progress(1)
        return results

    # attributes ----------------------------------------------------------------
    def attributes(self, items: Sequence[AttributeInput], progress: Advance | None = None) -> list[str | Failure]:
        def summary(payload: list) -> str | Failure:
            entity, item_texts = payload
            texts = _distinct(item_texts)
            if not texts:
                return Failure("entity has no connected text")
            chosen = _mmr(self.embedder.embed(texts), ATTRIBUTE_SENTENCES)
            prefix = f"{entity}: "
            return prefix + " ".join(texts[i].removeprefix(prefix) for i in sorted(chosen))

        results = self._through_cache("attributes", [[item.entity, list(item.texts)] for item in items], summary,
                                      lambda payload: payload[1])
        if progress:
            progress(len(items))
        return results

    # communities ---------------------------------------------------------------
    def community_elements(
        self, items: Sequence[CommunityInput], progress: Advance | None = None
    ) -> list[list[Element] | Failure]:
        """Per community: its texts grouped around diverse seeds, each group's central texts as the
        description (cached by the community's texts), titled by the group's tf-idf keywords
        against every community's texts (recomputed: they depend on the whole corpus)."""
        groups = self._through_cache("community_groups", [list(item.texts) for item in items], self._groups,
                                     lambda payload: payload)
        terms_of = {t: nlp.terms(t) for item in items for t in item.texts}
        idf = nlp.inverse_document_frequency([terms_of[t] for item in items for t in item.texts])
        results: list[list[Element] | Failure] = []
        for item, item_groups in zip(items, groups, strict=True):
            if isinstance(item_groups, Failure):
                results.append(item_groups)
                continue
            texts = _distinct(item.texts)
            elements = []
            for members, picked in item_groups:
                title = " ".join(nlp.keywords([terms_of[texts[i]] for i in members], idf, k=3))
                if title:
                    elements.append(Element(title=title, description=" ".join(texts[i] for i in picked)))
            results.append(elements or Failure("no keywords in community"))
        if progress:
            progress(len(items))
        return results

    def _groups(self, item_texts: list[str]) -> list[list[list[int]]] | Failure:
        """[member positions, description positions (sorted)] per element, over the distinct texts."""
        texts = _distinct(item_texts)
        if len(texts) < 2:
            return Failure("community too small for a high-level element")
        vectors = self.embedder.embed(texts)
        n_elements = min(MAX_ELEMENTS, math.ceil(len(texts) / TEXTS_PER_ELEMENT))
        seeds = _mmr(vectors, n_elements, diversity=0.7)
        nearest = np.argmax(vectors @ vectors[seeds].T, axis=1)
        groups = []
        for g in range(len(seeds)):
            members = np.flatnonzero(nearest == g)
            picked = members[_mmr(vectors[members], ELEMENT_SENTENCES)]
            groups.append([members.tolist(), sorted(picked.tolist())])
        return groups

    # search-time tasks -----------------------------------------------------------
    def query_entities(self, question: str) -> list[str]:
        return list(dict.fromkeys(span[2] for span in nlp.find_entities(question)))

    def answer(self, question: str, context: str) -> str:
        """Extractive, labelled as such: the value the question asks for, then the context sentences
        that complete the question's chain, each with its documents (engines/extractive.py)."""
        return self.answer_parts(question, context)[1]

    def answer_parts(self, question: str, context: str) -> tuple[str | None, str]:
        found = extractive.answer_parts(question, context, self.embedder.embed)
        return found.short, found.text()
