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

A choice question ("Which band was formed first, A or B?") is answered by one of its two things
(`choices`); a name the short answer gives in part is completed as the context writes it
(`_full_name`).

The short answer's sentence, then the best sentences up to `MAX_WORDS` words, are the answer,
each with its documents. The sentences after the first are ranked with the chain's features
weighed more (`SUPPORT_WEIGHTS`): they are the links that lead to the answer. A sentence from a
passage already quoted gives way to the best one from another passage, since a chain's links lie
in different passages (the first hop's passage names the bridge, another passage says what is
asked about it). When the context never names what the question names (or, for a question that
names nothing, no sentence holds two of its words), the answer says it was not found, instead of
printing sentences that do not answer.
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
"""Weights of the features against the cosine in choosing the short answer's sentence
(docs/benchmarks.md, "The offline answer")."""
SUPPORT_WEIGHTS = (0.3, 0.6, 0.3, 0.6)
SUPPORT_LEVEL = 2
"""The same four weights (words, asked kind, link, level) in choosing the sentences printed after
the short answer, with levels counted up to `SUPPORT_LEVEL`: the chain counts more against the
cosine there, since the sentences that complete a chain are less like the question than its first
hop's (a gain at every budget on both dev sets, docs/benchmarks.md); deeper than two links, a
shared name is more often chance than chain."""

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


_ASKS_PERSON = re.compile(r"^\W*(?:\w+\s+)?(?:who|whom)\b|\b(?:who|whom)\W*$")


def asks_person(question: str) -> bool:
    """Whether a question asks who: opened by "who" (or "to whom"), or ending with it ("... created
    by who?"); a "who" inside it opens a clause about something else."""
    return bool(_ASKS_PERSON.search(question.casefold()))


def _short_answer(question: str, kind: str, texts: list[str], names: list[set[str]], entity_level: dict[str, int],
                  score: np.ndarray, question_words: set[str], person: bool) -> tuple[str, int]:
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
            if person and text[max(0, start - 1):start] in ('"', "\u201c"):
                continue  # a quoted title names a work, not the person asked for
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


_YEAR = re.compile(r"\b(?:1\d|20)\d{2}\b")
EARLIER = frozenset("first earlier earliest older oldest before sooner".split())
LATER = frozenset("later latest younger youngest newer newest last".split())
"""Words by which a choice question asks for the earlier or the later of its two things."""


def choices(question: str) -> list[str]:
    """The two things a choice question ends with ("Which band was formed first, The Exies or
    Circus Diablo?", "... the forming of The Dandy Warhols or the birth of Robert Young?"), as the
    question writes them; [] for another question."""
    at = question.rfind(" or ")
    if at < 0:
        return []
    spans = [span for span in nlp.find_entities(question) if not nlp.is_value(span[2])]
    left = [span for span in spans if span[1] <= at and not question[span[1]:at].strip(" ,\"'")]
    right = [span for span in spans if span[0] > at and not question[span[1]:].strip(" ?\"'")
             and all(word.islower() or word == "The" for word in question[at + 4:span[0]].split())]
    if not left or not right:
        return []
    found = []
    for start, end, _ in (left[-1], right[0]):
        if question[max(0, start - 4):start] == "The ":  # "The Exies": the article is part of the name
            start -= 4
        found.append(question[start:end])
    return found


def _choose(question: str, options: list[str], texts: list[str], names: list[set[str]],
            score: np.ndarray) -> tuple[str, int]:
    """(the option a choice question asks for, its best sentence). A question that asks which came
    first or last ("formed first", "the oldest") compares where each began: the earliest year the
    sentences about it give (a thing is founded, born or first published before the rest of what
    is told of it). Another picks the option with a sentence that holds most of the question's
    other words ("Which singer is American"), then the best scored."""
    words = set(_WORDS.findall(question.casefold()))
    order = -1 if words & EARLIER else 1 if words & LATER else 0
    asked = _stems(question) - _stems(" ".join(options))  # what the question says of the one it asks for
    best = []
    for option in options:
        key = _key(option.removeprefix("The "))
        surname = key.split()[-1]
        tiers = ([i for i, own in enumerate(names) if key in own or f"the {key}" in own],  # named as asked
                 [i for i, own in enumerate(names) if any(f" {key} " in f" {name} " for name in own)],
                 [i for i, own in enumerate(names) if any(name.split()[-1] == surname for name in own)])
        about = next((tier for tier in tiers if tier), [])
        years = next((years for tier in tiers if (years := [int(y) for i in tier for y in _YEAR.findall(texts[i])])),
                     [])
        holder = max(about, key=lambda i: (len(_stems(texts[i]) & asked), score[i]), default=None)
        rank = (-1, 0.0) if holder is None else (len(_stems(texts[holder]) & asked), score[holder])
        best.append((option, holder, min(years, default=None), rank))
    if order and all(year is not None for _, _, year, _ in best):
        option, holder, _, _ = min(best, key=lambda each: -order * each[2])
    else:
        option, holder, _, _ = max(best, key=lambda each: each[3])
    return option, int(np.argmax(score)) if holder is None else holder


_NAME_WORD = r"(?:[A-Z\u00c0-\u00de][\w'\u2019\-]*\.?|\"[^\"]{1,30}\"|\u201c[^\u201d]{1,30}\u201d)"
_NAME_RUN = re.compile(rf"{_NAME_WORD}(?: (?:(?:von|van|de|der|da|di|del|du|la|le) )?{_NAME_WORD})*"
                       r"(?:,? (?:Jr|Sr)\.|(?: (?:II|III|IV)\b))?")


def _name_runs(text: str):
    """The runs of capitalised words, initials and quoted nicknames in a sentence, split at a
    possessive ("Frank Capra's"), without a function word that opens the sentence ("In", "The"),
    a full stop that ends it, or the quotes around a whole title."""
    for run in _NAME_RUN.finditer(text):
        opens = run.start() == 0 or text[:run.start()].rstrip().endswith(":")
        for part in re.split(r"['\u2019]s\b ?", run.group(0)):
            first, _, rest = part.partition(" ")
            if opens and first.casefold() in nlp.STOPWORDS:
                part = rest
            opens = False
            if part.endswith(".") and not re.search(r"(?:\b[A-Z]|Jr|Sr)\.$", part):
                part = part[:-1]
            if len(part) > 2 and part[0] in "\"\u201c" and part[-1] in "\"\u201d" and part.count("\"") <= 2:
                part = part[1:-1]
            if part.strip():
                yield part.strip()


def _full_name(short: str, holder: int, texts: list[str], sources: list[str], person: bool) -> str:
    """The fullest way the context writes a name the short answer gives in part: a surname
    ("Hall" -> "G. Stanley Hall"), a name without its nickname, middle name or suffix ("Nick
    Hexum" -> 'Nicholas Lofton "Nick" Hexum', "Waylon Smithers" -> "Waylon J. Smithers Jr.").
    Looked for in the sentence it was taken from, then in its passage, then in the context. The
    longer name ends as the short one does: a name that goes on past it ("The Nick Hexum Quintet")
    is another thing. One word is taken for a surname only when the question asks who ("Manila"
    is not short for "Metro Manila")."""
    words = _WORDS.findall(short.casefold())
    if not words or nlp.is_value(short) or (len(words) == 1 and not person):
        return short
    holds = re.compile(r"\b" + r"\b.*\b".join(re.escape(word) for word in words) + r"\b")
    ends = re.compile(rf"\b{re.escape(words[-1])}\W*(?:(?:jr|sr|ii|iii|iv)\W*)?$")

    def completes(run: str) -> bool:
        folded = run.casefold()
        return len(_WORDS.findall(folded)) > len(words) and bool(holds.search(folded)) and bool(ends.search(folded))

    for tier in ([holder], [i for i in range(len(texts)) if sources[i] == sources[holder]], range(len(texts))):
        runs = [run for i in tier for run in _name_runs(texts[i]) if len(run.split()) <= SHORT_WORDS and completes(run)]
        if runs:
            return max(runs, key=lambda run: (len(run.split()), run))
    return short


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
    cosine = vectors[:-1] @ vectors[-1]

    def weighed(weights: tuple[float, float, float, float], level_cap: int) -> np.ndarray:
        word, kind_weight, link_weight, level = weights
        return cosine + word * words + kind_weight * holds + link_weight * link + level * np.minimum(levels, level_cap)

    score = weighed((WORD_WEIGHT, TYPE_WEIGHT, LINK_WEIGHT, LEVEL_WEIGHT), MAX_LEVEL)
    ranked = np.argsort(-score, kind="stable").tolist()
    sources = [source for _, source, _ in found]
    options = choices(question)
    person = asks_person(question)
    if options:
        short, holder = _choose(question, options, texts, names, score)
        short = _full_name(short, holder, texts, sources, True)
    else:
        picked = _pick(ranked, texts, sources, [], MAX_WORDS)
        short, at = _short_answer(question, kind, [texts[i] for i in picked], [names[i] for i in picked],
                                  entity_level, score[picked], question_words, person)
        holder = picked[at]
        if kind not in ("date", "number"):
            short = _full_name(short, holder, texts, sources, person)
    # from the sentence the short answer is taken from, in what the answer's first words leave
    ranked = np.argsort(-weighed(SUPPORT_WEIGHTS, SUPPORT_LEVEL), kind="stable").tolist()
    picked = _pick(ranked, texts, sources, [holder], MAX_WORDS - len(short.split()) - HEADER_WORDS)
    return Answer(short, [(texts[i], found[i][1]) for i in picked])
