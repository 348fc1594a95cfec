"""What an LLM reply may put into the graph: only what its input supports.

A model that validates can still say things its input does not: the prompt's few-shot example
("Marie Curie won the Nobel Prize in Physics"), the reply schema's field descriptions ("one to
three sentences") or names it knows from elsewhere. The rule (`llm.grounding`, on by default):

- a name occurs in a text when its words occur there in order, both sides compared as words
  folded to lower case, without punctuation, possessives ("Penrake's" is "Penrake") or plural
  endings ("brothers" is "brother"), whitespace collapsed;
- decompose: an entity is kept when its name occurs in the chunk (title included); a relationship
  when both of its ends are kept; a semantic unit when it shares a content word with the chunk;
- attributes: the summary is kept when it names its entity (a content word of the entity's name);
- community elements: an element is kept when it shares a content word with its statements;
- query entities: a name is kept when it occurs in the question.

A reply that repeats a string of the prompt's example or of the schema's descriptions that its
input does not hold is an echo, not an extraction: `echo_of` names it, and the engine treats it
as an unusable reply (one corrective retry, then a counted failure).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from pydantic import BaseModel

from ..nlp import STOPWORDS
from .base import Unit

_WORD = re.compile(r"[^\W_]+(?:['\u2019]s\b)?")


def _fold(word: str) -> str:
    """One word, compared: lower case, no possessive, no plural ending."""
    word = re.sub(r"['\u2019]s$", "", word.casefold())
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 4 and word.endswith(("ches", "shes", "sses", "xes", "zes")):
        return word[:-2]
    if len(word) > 3 and word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def words(text: str) -> list[str]:
    return [_fold(w) for w in _WORD.findall(text)]


def folded(text: str) -> str:
    """The text as its folded words between spaces, for `occurs`."""
    return " " + " ".join(words(text)) + " "


def occurs(name: str, haystack: str) -> bool:
    """Whether a name occurs in a text already `folded`."""
    needle = " ".join(words(name))
    return bool(needle) and f" {needle} " in haystack


def content_words(text: str) -> set[str]:
    return {w for w in words(text) if (len(w) > 2 and w not in STOPWORDS) or w.isdigit()}


# --------------------------------------------------------------------------- echoes
def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _descriptions(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["description"]] if isinstance(node.get("description"), str) and "properties" not in node else []
        return own + [d for key, v in node.items() if key != "description" for d in _descriptions(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descriptions(v)]
    return []


@functools.cache
def example_strings(system: str, schema: type[BaseModel]) -> frozenset[str]:
    """The folded strings of a prompt's example shape and of its schema's field descriptions."""
    strings: list[str] = []
    _, _, shape = system.partition("Shape:\n")
    try:
        strings += _strings(json.loads(shape))
    except ValueError:
        pass
    strings += _descriptions(schema.model_json_schema())
    return frozenset(f for f in (" ".join(words(s)) for s in strings) if f and f != "...")


def echo_of(reply: BaseModel, system: str, source: str) -> str | None:
    """The first string of the reply that repeats the prompt's example or a schema description
    absent from the input (`source`, the item's own text), or None."""
    examples = example_strings(system, type(reply))
    haystack = folded(source)
    for text in _strings(reply.model_dump(mode="json")):
        key = " ".join(words(text))
        if key in examples and f" {key} " not in haystack:
            return text
    return None


# --------------------------------------------------------------------------- grounding
def ground(task: str, result: Any, variables: dict[str, str]) -> tuple[Any, int]:
    """The engine-level result of a reply, without what its input (the item's prompt variables,
    whatever template the request was written from) does not support, and how many items
    (entities, relationships, units, summaries, elements, names) were dropped."""
    source = "\n".join(variables.values())
    if task == "decompose":
        return _ground_units(result, source)
    if task == "attributes":
        entity = variables["entity"]
        named = content_words(entity) & content_words(result) or occurs(entity, folded(result))
        return (result, 0) if named else ("", 1)
    if task == "community_elements":
        statements = content_words(source)
        kept = [e for e in result if content_words(f"{e.title} {e.description}") & statements]
        return kept, len(result) - len(kept)
    if task == "query_entities":
        haystack = folded(source)
        kept = [name for name in result if occurs(name, haystack)]
        return kept, len(result) - len(kept)
    return result, 0


def _ground_units(units: list[Unit], source: str) -> tuple[list[Unit], int]:
    haystack, vocabulary = folded(source), content_words(source)
    kept_units, dropped = [], 0
    for unit in units:
        if not content_words(unit.text) & vocabulary:
            dropped += 1 + len(unit.entities) + len(unit.relations)
            continue
        entities = tuple(name for name in unit.entities if occurs(name, haystack))
        present = {name.casefold() for name in entities}
        relations = tuple(r for r in unit.relations if r[0].casefold() in present and r[2].casefold() in present)
        dropped += len(unit.entities) - len(entities) + len(unit.relations) - len(relations)
        kept_units.append(Unit(text=unit.text, entities=entities, relations=relations))
    return kept_units, dropped

