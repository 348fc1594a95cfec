"""The offline engine's answer: the context sentences that complete the chain the question asks about.

A multi-hop question names its first entity ("the founder of the society that awards the Greyling
Medal") and asks for something at the end of a chain of passages. The sentence that answers is
rarely the one most like the question (that is the first hop's, which names the question's
entities); it is one that the chain reaches through an entity a nearer sentence names, and that
holds the kind of thing asked for. Each context sentence is scored by:

- its cosine to the question (the bundled embeddings);
- the question's words it holds, each weighted by how rare it is among the context's sentences;
- the chain: the question's entities are level 0, the other entities of a sentence that names a
  level-k entity are level k + 1; a sentence scores by the deepest level it names (capped). Dates
  and quantities are values, not links: two films of 1999 are not a chain;
- the best word cover among the other sentences it shares a non-question entity with (its link
  to the rest of the chain);
- whether it holds what the question's wh-word asks for (a date for "when", a number for "how
  many", a name not in the question for "who", "where", "which ...").

The best sentences up to `MAX_WORDS` words (at least one) are the answer, best first, each with
its documents; a sentence from a passage already quoted gives way to the best one from another
passage, since a chain's links lie in different passages (the first hop's passage names the bridge,
another passage says what is asked about it). When the context never names what the question names (or, for a question that names
nothing, no sentence holds two of its words), the answer says it was not found, instead of printing
sentences that do not answer.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

from .. import nlp

LABEL = "[offline extractive answer]"
NOT_FOUND = f"{LABEL} Not found in the context: it holds nothing on what the question asks."
MAX_SENTENCES = 3
MAX_WORDS = 60
MAX_LEVEL = 4
WORD_WEIGHT, TYPE_WEIGHT, LINK_WEIGHT, LEVEL_WEIGHT = 0.1, 0.2, 0.05, 0.2
"""Weights of the features against the cosine (docs/benchmarks.md, "The offline answer")."""

_START = re.compile(r"^(?:\[\d+\] )?\[[A-Z]\] ")
_NODE = re.compile(r"^(?:\[\d+\] )?\[([A-Z])\]\s*(.*?)(?:\s*\(from ([^()]*)\))?$", re.DOTALL)
_SUBJECT = re.compile(r"^([^:.!?]{1,120}): ")
_WORDS = re.compile(r"\w+")
_DIGIT = re.compile(r"\d")
_ASKS = (  # what a wh-phrase asks for; at the same place, the first pattern wins
    (re.compile(r"\b(?:when|what year|which year|what date|in what year)\b"), "date"),
    (re.compile(r"\bhow (?:many|much|long|old|far|tall|high|large|big)\b"), "number"),
    (re.compile(r"\b(?:who|whom|whose|where)\b"), "name"),
)


def _key(name: str) -> str:
    return " ".join(_WORDS.findall(name.casefold()))


def _stems(text: str) -> set[str]:
    return {term[:5] for term in nlp.terms(text)}


def sentences_of(context: str) -> list[tuple[str, str, str]]:
    """(sentence, its documents, the subject it is prefixed with) for each sentence of the context's
    nodes (a node starts a line with "[T] ", "[S] "..., a chunk's text runs over several lines, the
    last ends with its sources). Only units and chunks are quoted: a relationship ("[R] a relation b")
    is a fragment, and attributes and high-level elements ("[A]", "[H]") are summaries that join
    pieces of several passages under one list of sources."""
    nodes: list[list[str]] = []
    for line in context.splitlines():
        if _START.match(line) or not nodes:
            nodes.append([line])
        else:
            nodes[-1].append(line)
    found = []
    for lines in nodes:
        match = _NODE.match("\n".join(lines))
        if not match or match.group(1) not in "ST":
            continue
        body, source = match.group(2), match.group(3) or ""
        for block in nlp.paragraphs(body):
            if block.startswith("#"):
                continue  # a heading
            text = nlp.strip_markdown(block)
            subject = _SUBJECT.match(text)
            for sentence in nlp.split_sentences(text):
                if len(sentence.split()) >= 3:
                    found.append((sentence, source, subject.group(1) if subject else ""))
    return found


def asks_for(question: str) -> str:
    """"date", "number", "name" or "any": what the question's first wh-phrase asks for (a later one
    belongs to a clause inside it: "how many ... when he died")."""
    folded = question.casefold()
    found = [(match.start(), order, kind) for order, (pattern, kind) in enumerate(_ASKS)
             for match in [pattern.search(folded)] if match]
    return min(found)[2] if found else "any"


def _holds(kind: str, sentence: str, new_names: int) -> bool:
    """Whether a sentence holds what the question asks for (a name: one the question does not give)."""
    if kind == "date":
        return bool(nlp._DATE.search(sentence))
    if kind == "number":
        return bool(_DIGIT.search(sentence))
    if kind == "name":
        return new_names > 0
    return True


def _levels(question: str, names: list[set[str]]) -> np.ndarray:
    """Per sentence, the deepest chain level of the entities it names (see the module docstring)."""
    asked = _key(question)
    level = {name: 0 for name in {_key(span[2]) for span in nlp.find_entities(question)} if name}
    level.update({name: 0 for found in names for name in found if len(name) > 2 and f" {name} " in f" {asked} "})
    frontier, unseen = set(level), set(range(len(names)))
    for depth in range(MAX_LEVEL):
        reached = [i for i in unseen if names[i] & frontier]
        unseen.difference_update(reached)
        frontier = set()
        for i in reached:
            for name in names[i] - set(level):
                level[name] = depth + 1
                frontier.add(name)
    return np.array([max((level.get(name, 0) for name in found), default=0) for found in names], float)


def _about_the_question(question: str, texts: list[str], stems: list[set[str]], question_stems: set[str]) -> bool:
    """Whether the context is about what the question asks: it names one of the things the question
    names (a question about Paris is not answered from passages that never name Paris), or, for a
    question that names none, a sentence holds two of its words."""
    named = [_key(span[2]) for span in nlp.find_entities(question) if not nlp.is_value(span[2])]
    if named:
        words = f" {' '.join(_key(text) for text in texts)} "
        return any(f" {name} " in words for name in named if name)
    return max(len(each & question_stems) for each in stems) >= 2


def answer(question: str, context: str, embed) -> str:
    """The extractive answer to `question` from `context` (as `Retrieval.context_text` writes it);
    `embed(texts)` gives unit vectors."""
    found = sentences_of(context)
    if not found:
        return NOT_FOUND
    texts = [sentence for sentence, _, _ in found]
    question_stems = _stems(question)
    stems = [_stems(text) for text in texts]
    frequency = Counter(stem for each in stems for stem in each)
    rarity = {stem: math.log((len(texts) + 1) / (count + 0.5)) for stem, count in frequency.items()}
    words = np.array([sum(rarity[s] for s in each & question_stems) for each in stems])
    names = []  # per sentence, the things it names; values (dates, quantities) link nothing
    for sentence, _, subject in found:
        spotted = {_key(span[2]) for span in nlp.find_entities(sentence) if not nlp.is_value(span[2])}
        if subject:
            spotted |= {_key(subject), _key(nlp.base_title(subject))}
        names.append({name for name in spotted if name})
    levels = _levels(question, names)
    question_words = set(_WORDS.findall(question.casefold()))
    given = {name for name in set().union(*names) if set(name.split()) <= question_words}
    if not _about_the_question(question, texts, stems, question_stems):
        return NOT_FOUND
    link = np.zeros(len(texts))
    for i, own in enumerate(names):
        for j, other in enumerate(names):
            if i != j and (own & other) - given:
                link[i] = max(link[i], words[j])
    kind = asks_for(question)
    holds = np.array([_holds(kind, text, len(own - given)) for text, own in zip(texts, names, strict=True)], float)
    vectors = embed(texts + [question])
    score = (vectors[:-1] @ vectors[-1] + WORD_WEIGHT * words + TYPE_WEIGHT * holds + LINK_WEIGHT * link
             + LEVEL_WEIGHT * levels)
    picked, used, quoted = [], 0, set()
    ranked = np.argsort(-score, kind="stable").tolist()
    while len(picked) < MAX_SENTENCES:
        fits = [i for i in ranked if i not in picked and (not picked or used + len(texts[i].split()) <= MAX_WORDS)]
        if not fits:
            break
        # a passage already quoted gives way to the next best from another: the chain's next link is elsewhere
        best = next((i for i in fits if found[i][1] not in quoted), fits[0])
        picked.append(best)
        used += len(texts[best].split())
        quoted.add(found[best][1])
    return f"{LABEL} " + " ".join(texts[i] + (f" [{found[i][1]}]" if found[i][1] else "") for i in picked)
