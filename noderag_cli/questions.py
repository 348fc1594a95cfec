"""Question files: the JSONL that `query --questions` and `ablate --questions` read, one question
per line, each line's problem said in words."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .errors import QuestionFileError


@dataclass
class Question:
    question: str
    answers: list[str]
    supporting_documents: list[str] = field(default_factory=list)  # document paths in the workspace
    line: int = 0


BLANK_LINE = "blank line, no question"


def _type_name(value) -> str:
    return {str: "text", bool: "true/false", int: "a number", float: "a number", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def parse_question_line(line: str, number: int) -> Question:
    """One JSONL line as a Question; ValueError saying in words what is wrong with it."""
    if not line.strip():
        raise ValueError(BLANK_LINE)
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f'not a JSON object with a "question" field (got {_type_name(record)})')
    if "question" not in record:
        raise ValueError('no "question" field')
    text = record["question"]
    if not isinstance(text, str):
        raise ValueError(f'"question" must be text, got {_type_name(text)}')
    if not text.strip():
        raise ValueError('"question" is empty')
    answers = record.get("answers", record.get("answer", []))
    answers = [answers] if isinstance(answers, str) else answers
    if not isinstance(answers, list):
        raise ValueError(f'"answers" must be a list of text, got {_type_name(answers)}')
    support = record.get("supporting_documents", [])
    if not isinstance(support, list):
        raise ValueError(f'"supporting_documents" must be a list of paths, got {_type_name(support)}')
    return Question(text, [str(a) for a in answers], [str(s) for s in support], number)


def read_question_lines(path: Path) -> list[tuple[int, Question | str]]:
    """Every line of a JSONL question file, in order: (line number, the Question, or what is wrong
    with the line in words). Lines end at "\n" (or "\r\n") only, as JSON Lines says: a U+2028 or a
    form feed inside a line is text; a leading byte-order mark is not. A trailing newline ends the
    last line; it is not a line of its own. A file without a single usable question is an error."""
    try:
        text = Path(path).read_text(encoding="utf-8-sig")
        lines = [line.removesuffix("\r") for line in text.split("\n")]
        if text.endswith("\n"):
            lines.pop()
    except FileNotFoundError as err:
        raise QuestionFileError(f"question file not found: {path}") from err
    except IsADirectoryError as err:
        raise QuestionFileError(f"question file {path} is a folder") from err
    except UnicodeDecodeError as err:
        raise QuestionFileError(f"question file {path} is not UTF-8") from err
    except OSError as err:
        raise QuestionFileError(f"cannot read question file {path}: {err.strerror or err}") from err
    items: list[tuple[int, Question | str]] = []
    for number, line in enumerate(lines, 1):
        try:
            items.append((number, parse_question_line(line, number)))
        except ValueError as err:
            items.append((number, str(err)))
    usable = sum(isinstance(item, Question) for _, item in items)
    if not usable:
        bad = sum(1 for _, item in items if isinstance(item, str) and item != BLANK_LINE)
        raise QuestionFileError(f"question file {path} holds no usable question"
                                + (f" ({bad} malformed line(s))" if bad else ""))
    return items


def read_jsonl(path: Path) -> tuple[list[Question], list[str]]:
    """The usable questions of a JSONL file, and one warning per malformed line (blank lines are
    passed over); a file without a single usable question is an error."""
    questions, problems = [], []
    for number, item in read_question_lines(path):
        if isinstance(item, Question):
            questions.append(item)
        elif item != BLANK_LINE:
            problems.append(f"{path}:{number}: skipped: {item}")
    return questions, problems
