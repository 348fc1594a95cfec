"""The offline built-in engine: deterministic, extractive implementations of every LLM task.

No model, no key, no network. It aims at a graph worth searching:
- semantic units are sentences (headings dropped, fragments joined to the sentence
  before), made self-contained by prefixing the document title when the sentence does
  not name it ("Korven Institute: It was founded in 1902.");
- entities are the names, titles, dates and quantities spotted by `nlp.find_entities`;
- a relationship joins consecutive entities of a unit, the words between them being the relation;
- attributes and high-level elements are extractive summaries: central, diverse
  sentences (maximal marginal relevance over the bundled embeddings), with tf-idf
  keyword titles for the overviews.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import numpy as np

from .. import nlp
from ..embeddings import Embedder
from ..graph import normalize_name
from .base import AttributeInput, ChunkInput, CommunityInput, Element, EngineStats, Failure, Progress, Unit

MAX_RELATION_WORDS = 8
MIN_UNIT_WORDS = 4
ATTRIBUTE_SENTENCES = 3
ELEMENT_SENTENCES = 2
TEXTS_PER_ELEMENT = 12
MAX_ELEMENTS = 4


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


class OfflineEngine:
    name = "offline-v1"

    def __init__(self, embedder: Embedder):
        self.embedder = embedder
        self.stats = EngineStats()

    # decompose -----------------------------------------------------------------
    def decompose(self, chunks: Sequence[ChunkInput], progress: Progress | None = None) -> list[list[Unit] | Failure]:
        results: list[list[Unit] | Failure] = []
        for chunk in chunks:
            results.append(self._decompose_one(chunk))
            if progress:
                progress(1)
        return results

    def _decompose_one(self, chunk: ChunkInput) -> list[Unit]:
        title = chunk.title.strip()
        title_key = normalize_name(title) if title else ""
        sentences: list[str] = []
        body = chunk.text
        first, _, rest = body.lstrip().partition("\n")
        if title and nlp.strip_markdown(first.strip()) == title:
            body = rest
        for block in nlp.paragraphs(body):
            if re.match(r"^#{1,6}\s", block) or (title and nlp.strip_markdown(block) == title):
                continue
            for sentence in nlp.split_sentences(nlp.strip_markdown(block)):
                if sentences and len(sentence.split()) < MIN_UNIT_WORDS:
                    sentences[-1] = f"{sentences[-1]} {sentence}"
                else:
                    sentences.append(sentence)
        units = []
        for sentence in sentences:
            text = sentence
            spans = nlp.find_entities(text)
            if title_key and title_key not in normalize_name(sentence) and title_key not in sentence.casefold():
                text = f"{title}: {sentence}"
                shift = len(title) + 2
                spans = [(0, len(title), title)] + [(a + shift, b + shift, name) for a, b, name in spans]
            entities = tuple(dict.fromkeys(s[2] for s in spans if normalize_name(s[2])))
            relations = []
            for left, right in zip(spans, spans[1:], strict=False):
                between = text[left[1] : right[0]].strip(" ,;:()\"'\u201c\u201d-")
                words = between.split()
                if 1 <= len(words) <= MAX_RELATION_WORDS and any(w.isalpha() for w in words):
                    if normalize_name(left[2]) != normalize_name(right[2]):
                        relations.append((left[2], between, right[2]))
            units.append(Unit(text=text, entities=entities, relations=tuple(dict.fromkeys(relations))))
        return units

    # attributes ----------------------------------------------------------------
    def attributes(self, items: Sequence[AttributeInput], progress: Progress | None = None) -> list[str | Failure]:
        self._embed_all(item.texts for item in items)
        results: list[str | Failure] = []
        for item in items:
            texts = list(dict.fromkeys(t for t in item.texts if t.strip()))
            if not texts:
                results.append(Failure("entity has no connected text"))
            else:
                chosen = _mmr(self.embedder.embed(texts), ATTRIBUTE_SENTENCES)
                results.append(f"{item.entity}: " + " ".join(texts[i] for i in sorted(chosen)))
            if progress:
                progress(1)
        return results

    def _embed_all(self, groups) -> None:
        """Every text of a batch embedded in one call (one cache look-up, one pooling pass); the
        items then find their vectors in the embedder's memory."""
        self.embedder.embed(list(dict.fromkeys(t for texts in groups for t in texts if t.strip())))

    # communities ---------------------------------------------------------------
    def community_elements(
        self, items: Sequence[CommunityInput], progress: Progress | None = None
    ) -> list[list[Element] | Failure]:
        self._embed_all(item.texts for item in items)
        terms_of = {t: nlp.terms(t) for item in items for t in item.texts}
        document_frequency: Counter = Counter()
        for item in items:
            for text in item.texts:
                document_frequency.update(set(terms_of[text]))
        n_texts = sum(len(item.texts) for item in items)
        results: list[list[Element] | Failure] = []
        for item in items:
            results.append(self._elements(item, document_frequency, n_texts, terms_of))
            if progress:
                progress(1)
        return results

    def _elements(self, item: CommunityInput, document_frequency: Counter, n_texts: int,
                  terms_of: dict[str, list[str]]) -> list[Element] | Failure:
        texts = list(dict.fromkeys(t for t in item.texts if t.strip()))
        if len(texts) < 2:
            return Failure("community too small for a high-level element")
        vectors = self.embedder.embed(texts)
        n_elements = min(MAX_ELEMENTS, math.ceil(len(texts) / TEXTS_PER_ELEMENT))
        seeds = _mmr(vectors, n_elements, diversity=0.7)
        groups = np.argmax(vectors @ vectors[seeds].T, axis=1)
        elements = []
        for g in range(len(seeds)):
            members = np.flatnonzero(groups == g)
            picked = members[_mmr(vectors[members], ELEMENT_SENTENCES)]
            title = " ".join(nlp.keywords([terms_of[texts[i]] for i in members], document_frequency, n_texts, k=3))
            description = " ".join(texts[i] for i in sorted(picked.tolist()))
            if title:
                elements.append(Element(title=title, description=description))
        return elements or Failure("no keywords in community")

    # search-time tasks -----------------------------------------------------------
    def query_entities(self, question: str) -> list[str]:
        return list(dict.fromkeys(span[2] for span in nlp.find_entities(question)))

    def answer(self, question: str, context: str) -> str:
        """Extractive: the context sentences closest to the question, each with its source, labelled as such."""
        sentences, sources = [], []
        for line in context.splitlines():
            match = re.match(r"^\[[A-Z]\]\s*(.*?)(?:\s*\(from ([^()]*)\))?$", line)
            body, source = (match.group(1), match.group(2) or "") if match else (line, "")
            for sentence in nlp.split_sentences(body):
                if len(sentence.split()) >= 3:
                    sentences.append(sentence)
                    sources.append(source)
        if not sentences:
            return "[offline extractive answer] The retrieved context holds nothing to answer from."
        vectors = self.embedder.embed(sentences)
        query = self.embedder.embed([question])[0]
        stems = {t[:5] for t in nlp.terms(question)}
        overlap = np.array([len(stems & {t[:5] for t in nlp.terms(s)}) for s in sentences], dtype=np.float32)
        score = vectors @ query + 0.1 * overlap
        top = sorted(dict.fromkeys(np.argsort(-score, kind="stable")[:3].tolist()))
        picked = [f"{sentences[i]}" + (f" [{sources[i]}]" if sources[i] else "") for i in top]
        return "[offline extractive answer] " + " ".join(picked)
