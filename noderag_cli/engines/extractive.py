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
from dataclasses import dataclass, field

import numpy as np

from .. import nlp

LABEL = "[offline extractive answer]"
TITLE_WORDS = 12  # a chunk's first line of at most this many words, with no full stop, is its title
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


def _key(name: str) -> str:
    return " ".join(_WORDS.findall(name.casefold()))


def _stems(text: str) -> set[str]:
    return {term[:5] for term in nlp.terms(text)}


def sentences_of(context: str) -> list[tuple[str, str, str]]:
    """(sentence, its documents, the subject it is prefixed with) for each sentence of the context's
    nodes (a node starts a line with "[T] ", "[S] "..., a chunk's text runs over several lines, the
    last ends with its sources). A chunk's sentences take its title (its first line, or its first
    heading) as their subject, as units carry theirs ("Subject: sentence"). Only units and chunks are quoted: a relationship ("[R] a relation b")
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
        title = ""
        if match.group(1) == "T":  # a chunk opens with its document's title: the subject of its sentences
            first, _, rest = body.partition("\n")
            heading = nlp.strip_markdown(first.strip())
            if rest.strip() and heading and len(heading.split()) <= TITLE_WORDS and not heading.endswith((".", "!", "?")):
                title, body = heading, rest
        for block in nlp.paragraphs(body):
            if block.startswith("#"):
                title = title or nlp.strip_markdown(block)
                continue  # a heading
            text = nlp.strip_markdown(block)
            subject = _SUBJECT.match(text)
            for sentence in nlp.split_sentences(text):
                if len(sentence.split()) >= 3:
                    found.append((f"{title}: {sentence}" if title and not subject else sentence, source,
                                  subject.group(1) if subject else title))
    return found


def _holds(kind: str, sentence: str, new_names: int) -> bool:
    """Whether a sentence holds what the question asks for (a name: one the question does not give)."""
    if kind in ("date", "number"):
        return bool(nlp.value_kinds(sentence) & nlp.VALUE_BITS[kind])
    if kind == "name":
        return new_names > 0
    return True


def _levels(question: str, names: list[set[str]]) -> tuple[np.ndarray, dict[str, int]]:
    """Per sentence, the deepest chain level of the entities it names (see the module docstring);
    and the level of each entity the chain reached."""
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
    return np.array([max((level.get(name, 0) for name in found), default=0) for found in names], float), level


def _about_the_question(question: str, texts: list[str], stems: list[set[str]], question_stems: set[str]) -> bool:
    """Whether the context is about what the question asks: it names one of the things the question
    names (a question about Paris is not answered from passages that never name Paris), or, for a
    question that names none, a sentence holds two of its words."""
    named = [_key(span[2]) for span in nlp.find_entities(question) if not nlp.is_value(span[2])]
    if named:
        words = f" {' '.join(_key(text) for text in texts)} "
        return any(f" {name} " in words for name in named if name)
    return max(len(each & question_stems) for each in stems) >= 2


_AUXILIARY = frozenset("is was are were be been did does do has had have can could will would may might shall should "
                       "the a an".split())
_HEAD_ENDS = frozenset("of in on at by for from to with that which who whom whose where when than as and or "
                       "is was are were did does do has had have can could will would".split())
_KIND_OF = frozenset("kind type sort form".split())
_NUMBER_SPAN = re.compile(r"\b\d[\d,]*(?:\.\d+)?(?:\s+(?!(?:in|of|and|or|the|a|to|at|on|by|for)\b)[a-z]+)?")
HEAD_WEIGHT = 0.4
"""Bonus of a candidate value that holds the question's head noun, half of it for one beside it
("which village" ... "Harlow Ferry, a village")."""
GENERIC_WEIGHT = 0.1  # per log of the sentences naming a candidate
MEASURES = frozenset("number amount population percentage percent total size height length area distance age count "
                     "depth width weight".split())
"""Head nouns that ask for a quantity ("what was the population of ...")."""
SHORT_WORDS = 8
HEADER_WORDS = 3  # "From the context:" between the short answer and its sentences


def head_noun(question: str) -> str:
    """The noun the question's wh-phrase asks about ("village" in "In which village was ...", "language"
    in "What is the native language of ..."), "" for none."""
    words = _WORDS.findall(question.casefold())
    for position, word in enumerate(words):
        if word not in ("which", "what", "whose"):
            continue
        phrase, kind_of = [], False
        for following in words[position + 1:]:
            if following in _KIND_OF and not phrase:
                kind_of = True
                continue
            if following == "of" and kind_of and not phrase:
                continue
            if following in _AUXILIARY and not phrase:
                continue
            if following in _HEAD_ENDS or (phrase and following.endswith(("ed", "s"))):  # a verb begins the rest
                break
            phrase.append(following)
            if len(phrase) == 2:
                break
        return phrase[-1] if phrase else ""
    return ""


def _candidates(kind: str, text: str, head: str) -> list[tuple[int, int, str]]:
    """(start, end, surface) of the values in a sentence of the kind asked for; for a question that
    asks "what kind of university", the words before the head noun too ("land-grant university")."""
    if kind == "date":
        return [(m.start(), m.end(), m.group(0)) for m in nlp._DATE.finditer(text)]
    if kind == "number":
        return [(m.start(), m.end(), m.group(0)) for m in _NUMBER_SPAN.finditer(text)]
    spans = [span for span in nlp.find_entities(text) if kind != "name" or not nlp.is_value(span[2])]
    if kind == "any" and head:
        for match in re.finditer(rf"((?:[\w'-]+\s+){{0,3}})({re.escape(head)}s?)\b", text, re.IGNORECASE):
            before = [w for w in match.group(1).split() if w.casefold() not in _AUXILIARY]
            if before:
                spans.append((match.start(2) - len(" ".join(before)) - 1, match.end(2), " ".join(before + [match.group(2)])))
    return spans


def _short_answer(question: str, kind: str, texts: list[str], names: list[set[str]], entity_level: dict[str, int],
                  score: np.ndarray, question_words: set[str]) -> tuple[str, int]:
    """(the value the question asks for, the sentence it is taken from). Each span of the asked kind
    that the question does not itself name scores its sentence's score, and more where it stands
    beside the question's head noun or holds it ("Avery County" for "what county"), where the chain
    reaches it further from the question's own entities, and less the more sentences name it (a
    name every passage mentions answers nothing in particular). The best sentence's first words
    when no sentence holds a candidate."""
    head = head_noun(question)
    if kind == "any" and head:  # "which town", "what population": a name, or a quantity
        kind = "number" if head in MEASURES else "name"
    mentions = Counter(name for own in names for name in own)
    best, best_value = None, -np.inf
    for i, text in enumerate(texts):
        for start, end, surface in _candidates(kind, text, head):
            surface = surface.strip(" ,.;:()\"'")
            span_words = set(_WORDS.findall(surface.casefold()))
            if not surface or not span_words or span_words <= question_words or len(surface.split()) > SHORT_WORDS:
                continue
            key = _key(surface)
            value = float(score[i]) + LEVEL_WEIGHT * entity_level.get(key, 0) - GENERIC_WEIGHT * math.log(mentions[key] or 1)
            if head and head in span_words:
                value += HEAD_WEIGHT
            elif head and re.search(rf"\b{re.escape(head)}", text[max(0, start - 60):end + 60], re.IGNORECASE):
                value += HEAD_WEIGHT / 2
            if value > best_value:
                best, best_value = (surface, i), value
    if best is not None:
        return best
    top = int(np.argmax(score))
    return " ".join(texts[top].split()[:SHORT_WORDS]), top


def _pick(ranked: list[int], texts: list[str], sources: list[str], picked: list[int], words: int) -> list[int]:
    """`picked`, then the best sentences (`ranked`) while they fit in `words` (the first always):
    a passage already quoted gives way to the next best from another, since a chain's next link
    is elsewhere."""
    picked = list(picked)
    used = sum(len(texts[i].split()) for i in picked)
    quoted = {sources[i] for i in picked}
    while len(picked) < MAX_SENTENCES:
        fits = [i for i in ranked if i not in picked and (not picked or used + len(texts[i].split()) <= words)]
        if not fits:
            break
        best = next((i for i in fits if sources[i] not in quoted), fits[0])
        picked.append(best)
        used += len(texts[best].split())
        quoted.add(sources[best])
    return picked


@dataclass
class Answer:
    """The offline answer: `short`, the value the question asks for (None: not found in the
    context), and the sentences that support it, each with its sources."""

    short: str | None
    sentences: list[tuple[str, str]] = field(default_factory=list)

    def text(self) -> str:
        if self.short is None:
            return NOT_FOUND
        quoted = " ".join(sentence + (f" [{source}]" if source else "") for sentence, source in self.sentences)
        return f"{LABEL} {self.short}. From the context: {quoted}"


def answer(question: str, context: str, embed) -> str:
    """The extractive answer to `question` from `context` (as `Retrieval.context_text` writes it),
    as printed: the short answer, then its sentences with their sources; `embed(texts)` gives
    unit vectors."""
    return answer_parts(question, context, embed).text()


def answer_parts(question: str, context: str, embed) -> Answer:
    """The short answer and the sentences that support it (module docstring)."""
    found = sentences_of(context)
    if not found:
        return Answer(None)
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
    levels, entity_level = _levels(question, names)
    question_words = set(_WORDS.findall(question.casefold()))
    given = {name for name in set().union(*names) if set(name.split()) <= question_words}
    if not _about_the_question(question, texts, stems, question_stems):
        return Answer(None)
    link = np.zeros(len(texts))
    for i, own in enumerate(names):
        for j, other in enumerate(names):
            if i != j and (own & other) - given:
                link[i] = max(link[i], words[j])
    kind = nlp.asked_kind(question)
    holds = np.array([_holds(kind, text, len(own - given)) for text, own in zip(texts, names, strict=True)], float)
    vectors = embed(texts + [question])
    score = (vectors[:-1] @ vectors[-1] + WORD_WEIGHT * words + TYPE_WEIGHT * holds + LINK_WEIGHT * link
             + LEVEL_WEIGHT * levels)
    ranked = np.argsort(-score, kind="stable").tolist()
    sources = [source for _, source, _ in found]
    picked = _pick(ranked, texts, sources, [], MAX_WORDS)
    short, holder = _short_answer(question, kind, [texts[i] for i in picked], [names[i] for i in picked], entity_level,
                                  score[picked], question_words)
    # again from the sentence the short answer is taken from, in what the answer's first words leave
    picked = _pick(ranked, texts, sources, [picked[holder]], MAX_WORDS - len(short.split()) - HEADER_WORDS)
    return Answer(short, [(texts[i], found[i][1]) for i in picked])
