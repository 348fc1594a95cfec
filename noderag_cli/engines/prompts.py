"""The five LLM task prompts, the JSON shapes their replies must have, and a tolerant reply parser.

Every task asks for one JSON object that validates against a pydantic model below. Where the
provider supports it, the engine also sends the model's JSON schema as `response_format`
(`response_format_for`), so constrained decoders produce the shape directly; the prompt
always shows the shape too, so providers without structured output still get it right.

Replies are parsed tolerantly (`parse_reply`): code fences, text before or after the JSON,
single quotes and Python literals (True/None), trailing commas, a bare list where an object
with one list field was asked, a bare string for a one-string object. A reply that still does
not validate raises `ReplyError`, whose message is written for the model: the engine shows it
back once (`correction_message`) before giving up on the item.

This module imports no LLM library, so it is cheap to import (the offline path may use the
schemas and the parser).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .base import AttributeInput, ChunkInput, CommunityInput, Element, Unit


# --------------------------------------------------------------------------- schemas
class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", str_strip_whitespace=True)


def _clean_names(value: Any) -> list[str]:
    """A list of names from a list, or a comma/semicolon separated string; empty and repeated dropped."""
    if value is None:
        return []
    if isinstance(value, str):
        value = re.split(r"[;,\n]", value)
    if not isinstance(value, (list, tuple)):
        raise ValueError("must be a list of strings")
    names: list[str] = []
    seen: set[str] = set()
    for item in value:
        if isinstance(item, dict):  # {"name": "..."} from models that wrap names
            item = item.get("name") or item.get("entity") or next(iter(item.values()), "")
        if not isinstance(item, (str, int, float)):
            raise ValueError("must be a list of strings")
        name = " ".join(str(item).split()).strip(" .\"'")
        if name and name.casefold() not in seen:
            seen.add(name.casefold())
            names.append(name)
    return names


_TRIPLE_ALIASES = {
    "source": ("source", "subject", "head", "from", "src"),
    "relation": ("relation", "predicate", "relationship", "rel", "verb"),
    "target": ("target", "object", "tail", "to", "dst"),
}


class Triple(_Reply):
    """One relationship stated in a unit: source entity, relation (a short phrase), target entity."""

    source: str = Field(min_length=1)
    relation: str = Field(min_length=1)
    target: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            if len(value) != 3:
                raise ValueError("a relation is [source, relation, target]")
            return dict(zip(("source", "relation", "target"), value, strict=True))
        if isinstance(value, dict):
            lowered = {str(k).lower(): v for k, v in value.items()}
            return {field: next((lowered[a] for a in aliases if a in lowered), None)
                    for field, aliases in _TRIPLE_ALIASES.items()}
        return value


class SemanticUnit(_Reply):
    text: str = Field(min_length=1, description="one self-contained statement, paraphrased")
    entities: list[str] = Field(default_factory=list, description="names of the entities it mentions")
    relations: list[Triple] = Field(default_factory=list, description="relationships it states")

    @model_validator(mode="before")
    @classmethod
    def _shapes(cls, value: Any) -> Any:
        if isinstance(value, str):
            return {"text": value}
        if isinstance(value, dict) and "text" not in value:
            for alias in ("unit", "semantic_unit", "statement", "event", "content", "description"):
                if alias in value:
                    return {**value, "text": value[alias]}
        return value

    @field_validator("entities", mode="before")
    @classmethod
    def _names(cls, value: Any) -> list[str]:
        return _clean_names(value)

    @field_validator("relations", mode="before")
    @classmethod
    def _relations(cls, value: Any) -> Any:
        return [] if value is None else value


class Decomposition(_Reply):
    """Reply of `decompose`: the chunk as semantic units."""

    units: list[SemanticUnit] = Field(min_length=1)


class AttributeSummary(_Reply):
    """Reply of `attributes`: a summary of one important entity."""

    summary: str = Field(min_length=1)


class HighLevelElement(_Reply):
    title: str = Field(min_length=1, description="a short keyword title, 2 to 6 words")
    description: str = Field(min_length=1, description="one to three sentences")

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, value: Any) -> Any:
        if isinstance(value, dict):
            value = dict(value)
            if "title" not in value:
                value["title"] = value.get("keyword") or value.get("keywords") or value.get("name")
            if "description" not in value:
                value["description"] = value.get("summary") or value.get("content") or value.get("text")
            if isinstance(value.get("title"), list):
                value["title"] = ", ".join(str(v) for v in value["title"])
        return value


class CommunitySummary(_Reply):
    """Reply of `community`: the high-level elements of one community."""

    elements: list[HighLevelElement] = Field(min_length=1)


class QueryEntities(_Reply):
    """Reply of `query_entities`: the entity names in a question (maybe none, but said so)."""

    entities: list[str]

    @field_validator("entities", mode="before")
    @classmethod
    def _names(cls, value: Any) -> list[str]:
        return _clean_names(value)


class Answer(_Reply):
    """Reply of `answer`."""

    answer: str = Field(min_length=1)


class Passage(_Reply):
    """Reply of `passage`: HyDE's hypothetical passage answering a question."""

    passage: str = Field(min_length=1)


# --------------------------------------------------------------------------- prompts
_JSON_RULES = (
    "Reply with exactly one JSON object in the shape shown, with double-quoted strings, "
    "and nothing before or after it."
)

DECOMPOSE_SYSTEM = f"""You decompose a text into semantic units for a knowledge graph.
A semantic unit is one self-contained event or fact from the text, paraphrased as a short
standalone statement that a reader understands without the rest of the text (replace pronouns
with names). Cover every fact of the text; do not add facts that are not in it.
For each unit, list the names of the entities it mentions (people, organisations, places,
products, concepts, dates; as written in the text) and the relationships it states as
(source entity, relation, target entity), with a short verb phrase as relation.
{_JSON_RULES}
Shape:
{{"units": [{{"text": "Marie Curie won the Nobel Prize in Physics in 1903.",
  "entities": ["Marie Curie", "Nobel Prize in Physics", "1903"],
  "relations": [{{"source": "Marie Curie", "relation": "won", "target": "Nobel Prize in Physics"}}]}}]}}"""

ATTRIBUTES_SYSTEM = f"""You write the attribute summary of one entity for a knowledge graph.
From the statements given, write a concise summary (at most about 150 words) of who or what
the entity is: its main properties, roles, relationships and the events it takes part in.
Use only the statements; do not add outside knowledge.
{_JSON_RULES}
Shape:
{{"summary": "..."}}"""

COMMUNITY_SYSTEM = f"""You summarise a group of related statements into high-level elements.
Each element is one important theme, finding or insight that the statements support together:
a short keyword title (2 to 6 words) and a description of one to three sentences.
Give between 1 and 5 elements. Use only the statements; do not add outside knowledge.
{_JSON_RULES}
Shape:
{{"elements": [{{"title": "keyword title", "description": "one to three sentences"}}]}}"""

QUERY_ENTITIES_SYSTEM = f"""You list the entities named in a question: people, organisations,
places, products, works, concepts and dates, each as written in the question. Do not answer
the question. If it names no entity, give an empty list.
{_JSON_RULES}
Shape:
{{"entities": ["..."]}}"""

ANSWER_SYSTEM = f"""You answer a question using only the context given.
Do not use outside knowledge. If the context does not hold enough information to answer,
say that the context is not enough to answer, and state what is missing instead of guessing.
{_JSON_RULES}
Shape:
{{"answer": "..."}}"""
"""The one answer prompt, the same for every retrieval method."""

PASSAGE_SYSTEM = f"""Please write a passage to answer the question.
{_JSON_RULES}
Shape:
{{"passage": "..."}}"""
"""HyDE's instruction for web search (Gao et al. 2022, §4.1), in the JSON shape of every task."""


CITE = "Cite the context lines your answer uses by their numbers in brackets, like [2] or [1][3]."
"""The answer's last paragraph when its context is numbered (`Retrieval.context_text(numbered=True)`)."""


def _bullets(texts: Sequence[str]) -> str:
    return "\n".join(f"- {' '.join(t.split())}" for t in texts if t.strip())


@dataclass(frozen=True)
class TaskSpec:
    """One LLM task, declared once: its reply schema, prompts, the variables of its user message,
    a sample input (to check a user's prompt file), and how a validated reply becomes the result an
    `Engine` method returns per item. Grounding the result in its input: grounding.py."""

    name: str
    schema: type[BaseModel]
    system: str
    user: str  # the user message: a str.format template over `variables`
    variables: Callable[[Any], dict[str, str]]
    sample: Any
    result: Callable[[Any], Any]
    identity: bool = True  # its prompts are part of the engine's identity (`PromptSet.digest`)


SPECS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    TaskSpec("decompose", Decomposition, DECOMPOSE_SYSTEM, "Title: {title}\n\nText:\n{text}",
             lambda c: {"title": c.title, "text": c.text.strip()}, ChunkInput("c", "t", "T"),
             lambda reply: to_units(reply)),
    TaskSpec("attributes", AttributeSummary, ATTRIBUTES_SYSTEM, "Entity: {entity}\n\nStatements about it:\n{statements}",
             lambda a: {"entity": a.entity, "statements": _bullets(a.texts)}, AttributeInput("e", ("s",)),
             lambda reply: reply.summary),
    TaskSpec("community_elements", CommunitySummary, COMMUNITY_SYSTEM, "Statements:\n{statements}",
             lambda c: {"statements": _bullets(c.texts)}, CommunityInput(0, ("s",)), lambda reply: to_elements(reply)),
    TaskSpec("query_entities", QueryEntities, QUERY_ENTITIES_SYSTEM, "Question: {question}",
             lambda q: {"question": q.strip()}, "q", lambda reply: list(reply.entities)),
    TaskSpec("answer", Answer, ANSWER_SYSTEM, "Context:\n{context}\n\nQuestion: {question}\n\n{cite}",
             lambda qc: {"context": qc[1].strip(), "question": qc[0].strip(),
                         "cite": CITE if qc[1].lstrip().startswith("[1] ") else ""}, ("q", "c"),
             lambda reply: reply.answer),
    # HyDE's passage (`noderag ablate`) shapes no table, and its replies are keyed by their whole request
    TaskSpec("passage", Passage, PASSAGE_SYSTEM, "Question: {question}", lambda q: {"question": q.strip()}, "q",
             lambda reply: reply.passage, identity=False),
)}
"""Inputs per task: ChunkInput, AttributeInput, CommunityInput, question str, (question, context)."""

TASKS = tuple(SPECS)
"""Task names, as used in `EngineStats.by_task` and in cache keys."""

IDENTITY_TASKS = tuple(name for name, spec in SPECS.items() if spec.identity)


PROMPTS_VERSION = 1
"""Bump when a variable's text changes what the model is shown (prompt texts and schemas are
digested automatically)."""

USER_MARKER = "--- user message ---"
"""In a prompt file, the line between the system prompt (as is) and the user message template."""


@dataclass(frozen=True)
class PromptSet:
    """Each task's system prompt and user message template: the built-ins, or a folder's files."""

    system: dict[str, str]
    user: dict[str, str]

    @functools.cached_property
    def digest(self) -> str:
        """Of every text the model is shown but the items: the built-ins' user templates are implied by
        PROMPTS_VERSION (so the built-in digest, and the caches keyed by it, stay as they were)."""
        parts = [PROMPTS_VERSION] + [[self.system[t], SPECS[t].schema.model_json_schema()]
                                     + ([self.user[t]] if self.user[t] != SPECS[t].user else [])
                                     for t in IDENTITY_TASKS]
        return hashlib.blake2b(json.dumps(parts, sort_keys=True).encode(), digest_size=4).hexdigest()

    def messages(self, task: str, item: Any) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system[task]},
                {"role": "user", "content": fill(self.user[task], SPECS[task].variables(item))}]


BUILT_IN = PromptSet({t: s.system for t, s in SPECS.items()}, {t: s.user for t, s in SPECS.items()})


def fill(template: str, values: dict[str, str]) -> str:
    """The template with its variables filled in; a paragraph (lines between blank lines) whose
    every variable is empty is left out ("Title: {title}" for a chunk without a title)."""
    kept = []
    for paragraph in template.split("\n\n"):
        names = [name for _, name, _, _ in string.Formatter().parse(paragraph) if name]
        if names and not any(values[name] for name in names):
            continue
        kept.append(paragraph.format(**values))
    return "\n\n".join(kept)


def prompt_file_text(task: str) -> str:
    return f"{SPECS[task].system}\n{USER_MARKER}\n{SPECS[task].user}\n"


def write_prompts(folder: Path) -> list[Path]:
    """The built-in prompts as files to start from: `<task>.txt` each."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for task in TASKS:
        path = folder / f"{task}.txt"
        path.write_text(prompt_file_text(task), encoding="utf-8")
        written.append(path)
    return written


def load_prompts(folder: str | Path) -> PromptSet:
    """A folder's prompt files (`<task>.txt`; a task without a file keeps its built-in): the system
    prompt, the line USER_MARKER, then the user message template with that task's variables. A
    file that cannot be used raises ValueError with a one-line reason."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"llm.prompts: {folder} is not a folder (`noderag init WS --prompts` writes one)")
    system, user = dict(BUILT_IN.system), dict(BUILT_IN.user)
    for task in TASKS:
        path = folder / f"{task}.txt"
        if not path.is_file():
            continue
        try:
            text = path.read_text(encoding="utf-8").rstrip("\n")
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"prompt file {path} cannot be read: {err}") from None
        head, marker, tail = text.partition(f"\n{USER_MARKER}\n")
        if not marker:
            raise ValueError(f"prompt file {path} has no line '{USER_MARKER}' before its user message template")
        wanted = set(SPECS[task].variables(SPECS[task].sample))
        try:
            used = {name for _, name, _, _ in string.Formatter().parse(tail) if name is not None}
        except ValueError as err:
            raise ValueError(f"prompt file {path}: {err} (write a literal brace as {{{{ or }}}})") from None
        if wanted - used:
            raise ValueError(f"prompt file {path} lacks the variable(s) {', '.join(sorted('{' + v + '}' for v in wanted - used))}")
        if used - wanted:
            raise ValueError(f"prompt file {path} uses unknown variable(s) {', '.join(sorted('{' + v + '}' for v in used - wanted))}; "
                             f"{task} has {', '.join(sorted('{' + v + '}' for v in wanted))}")
        system[task], user[task] = head.strip("\n"), tail
    return PromptSet(system, user)


def prompt_set(folder: str | None) -> PromptSet:
    """The prompts an LLM config names: its folder's files, else the built-ins."""
    return load_prompts(folder) if folder else BUILT_IN


def build_messages(task: str, item: Any, prompt_set: PromptSet = BUILT_IN) -> list[dict[str, str]]:
    """The chat messages of one task item: the system prompt and the item as user message."""
    return prompt_set.messages(task, item)


# --------------------------------------------------------------------------- structured output
_UNSUPPORTED_STRICT_KEYS = {"default", "minLength", "maxLength", "minItems", "maxItems", "title", "description"}


def _strict(node: Any) -> Any:
    """Make pydantic's JSON schema acceptable for OpenAI-style strict mode.

    Strict mode wants every property required, `additionalProperties: false` and no keywords it
    does not support; lengths are still checked by pydantic when the reply is parsed.
    """
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items() if k not in _UNSUPPORTED_STRICT_KEYS or k == "$defs"}
        if "properties" in node:
            out["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if out.get("type") == "object":
            out["additionalProperties"] = False
            out["required"] = list(out.get("properties", {}))
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def _schema_text(task: str) -> str:
    return json.dumps(_strict(SPECS[task].schema.model_json_schema()))


def json_schema_for(task: str) -> dict:
    """The task's reply schema in strict form (a fresh copy: callers may change it)."""
    return json.loads(_schema_text(task))


STRUCTURED_MODES = ("json_schema", "json_object_schema", "json_object", "none")
"""Structured-output modes, strongest first; the engine steps down when a server refuses one."""

WEAKER_FORMAT = dict(zip(STRUCTURED_MODES[:-1], STRUCTURED_MODES[1:], strict=True))


def response_format_for(task: str, mode: str) -> dict | None:
    """`response_format` for a structured-output mode (see `STRUCTURED_MODES`).

    json_schema: the OpenAI form (OpenAI, vLLM, llama.cpp's llama-server, Ollama through litellm);
    json_object_schema: JSON mode with a "schema" key, which llama-cpp-python's server turns into
    a grammar; json_object: plain JSON mode; none: the prompt alone.
    """
    if mode == "json_schema":
        schema = json_schema_for(task)
        return {"type": "json_schema",
                "json_schema": {"name": SPECS[task].schema.__name__, "schema": schema, "strict": True}}
    if mode == "json_object_schema":
        return {"type": "json_object", "schema": json_schema_for(task)}
    if mode == "json_object":
        return {"type": "json_object"}
    return None


# --------------------------------------------------------------------------- tolerant parsing
class ReplyError(ValueError):
    """A reply that cannot be used; the message is meant to be shown back to the model."""


_FENCE = re.compile(r"```[a-zA-Z0-9_-]*\s*\n?(.*?)(?:```|$)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_SMART_QUOTES = str.maketrans({"\u201c": '"', "\u201d": '"', "\u2018": "'", "\u2019": "'"})


def _balanced_end(text: str, start: int) -> int | None:
    """Index just past the bracket closing the one at `start`, honouring quoted strings."""
    stack: list[str] = []
    quote: str | None = None
    escaped = False
    pairs = {"{": "}", "[": "]"}
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
            continue
        if ch in "\"'":
            quote = ch
        elif ch in pairs:
            stack.append(pairs[ch])
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return None
            if not stack:
                return i + 1
    return None


def _loads_lenient(candidate: str) -> Any:
    """JSON, then JSON without trailing commas, then a Python literal (single quotes, True, None)."""
    attempts = [candidate, _TRAILING_COMMA.sub(r"\1", candidate)]
    for attempt in attempts:
        try:
            return json.loads(attempt)
        except json.JSONDecodeError:
            pass
    pythonish = re.sub(r"\btrue\b", "True", re.sub(r"\bfalse\b", "False", re.sub(r"\bnull\b", "None", attempts[1])))
    for attempt in (attempts[1], pythonish):
        try:
            value = ast.literal_eval(attempt)
        except (ValueError, SyntaxError, MemoryError, RecursionError, TypeError):
            continue
        if isinstance(value, (dict, list, str)):
            return value
    raise ValueError("not parseable")


def extract_json(text: str) -> Any:
    """The first JSON value (object or list) found in a model reply; `ReplyError` if there is none."""
    if not text or not text.strip():
        raise ReplyError("the reply was empty")
    if text.isascii() and "```" not in text:  # no smart quotes, no fences: the whole reply is the one candidate
        with contextlib.suppress(json.JSONDecodeError):
            return json.loads(text)
    text = text.translate(_SMART_QUOTES)
    candidates = [m.group(1) for m in _FENCE.finditer(text)] + [text]
    truncated = False
    for candidate in candidates:
        candidate = candidate.strip()
        try:
            return json.loads(candidate)
        except json.JSONDecodeError:
            pass
        start = 0
        while (match := re.search(r"[{\[]", candidate[start:])) is not None:
            start += match.start()
            end = _balanced_end(candidate, start)
            if end is None:
                truncated = True  # everything after an unclosed bracket is inside it: no fragments
                break
            try:
                return _loads_lenient(candidate[start:end])
            except ValueError:
                start += 1
    if truncated:
        raise ReplyError("the reply is not complete JSON (it looks cut off or has unbalanced brackets)")
    raise ReplyError("the reply holds no JSON object")


@functools.cache
def _only_field(schema: type[BaseModel]) -> str | None:
    fields = schema.model_fields
    return next(iter(fields)) if len(fields) == 1 else None


def _fit_top_level(schema: type[BaseModel], data: Any) -> Any:
    """A bare list or string where the schema is an object with one field of that kind."""
    name = _only_field(schema)
    if name is None:
        return data
    if not isinstance(data, dict):
        return {name: data}
    if len(data) == 1:
        (key, value), = data.items()
        if key != name and isinstance(value, (list, str)):
            # {"semantic_units": [...]} for {"units": [...]}: accept a key that merely differs in wording
            stem = name[:-3] + "y" if name.endswith("ies") else name.rstrip("s")
            if len(key) >= 3 and (stem in key.lower() or key.lower() in name):
                return {name: value}
    return data


def _describe(err: ValidationError) -> str:
    parts = []
    for item in err.errors()[:3]:
        where = ".".join(str(p) for p in item["loc"]) or "reply"
        parts.append(f"{where}: {item['msg']}")
    more = f" (and {err.error_count() - 3} more problems)" if err.error_count() > 3 else ""
    return "; ".join(parts) + more


def parse_reply(task: str, text: str, cut_off: bool = False) -> BaseModel:
    """The validated reply of `task`, or `ReplyError` saying what is wrong with it.

    `cut_off`: the reply stopped at the output token limit (finish_reason "length").
    """
    schema = SPECS[task].schema
    try:
        data = extract_json(text)
    except ReplyError as err:
        if task == "answer" and text and text.strip() and "{" not in text and not cut_off:
            return Answer(answer=text.strip())  # plain prose is a usable answer
        if cut_off:
            raise ReplyError("the reply was cut off at the output token limit before the JSON was complete; "
                             "write a shorter reply") from None
        raise err from None
    data = _fit_top_level(schema, data)
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ReplyError(f"the JSON does not have the required shape: {_describe(err)}") from None


def correction_message(error: str) -> str:
    """The one corrective turn shown to the model after an unusable reply."""
    return (f"Your reply could not be used: {error}. Reply again with only the JSON object, "
            "in exactly the shape shown in the instructions, and nothing else.")


# --------------------------------------------------------------------------- results
def to_units(reply: Decomposition) -> list[Unit]:
    """Units for the graph. Entities named in a relation are added to the unit's entities."""
    units = []
    for unit in reply.units:
        entities = list(unit.entities)
        seen = {e.casefold() for e in entities}
        relations = []
        for rel in unit.relations:
            triple = tuple(" ".join(part.split()) for part in (rel.source, rel.relation, rel.target))
            if not all(triple):
                continue
            relations.append(triple)
            for name in (triple[0], triple[2]):
                if name.casefold() not in seen:
                    seen.add(name.casefold())
                    entities.append(name)
        units.append(Unit(text=" ".join(unit.text.split()), entities=tuple(entities),
                          relations=tuple(dict.fromkeys(relations))))
    return units


def to_elements(reply: CommunitySummary) -> list[Element]:
    return [Element(title=" ".join(e.title.split()).strip(" .:"), description=" ".join(e.description.split()))
            for e in reply.elements]


def result_of(task: str, reply: BaseModel) -> Any:
    """The engine-level result of a validated reply (what `Engine` methods return per item)."""
    return SPECS[task].result(reply)
