"""Question sets and their corpora: our JSONL, MuSiQue and HotpotQA (as in `shared/eval`).

A dataset corpus is written out as a folder of `.txt` passages (title on the first
line, so the chunk stage takes it as the document title), one file per passage, named
by position so that non-unique titles never collide.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..workspace import atomic_write_bytes


@dataclass
class Question:
    question: str
    answers: list[str]
    supporting_documents: list[str] = field(default_factory=list)  # document paths in the workspace
    line: int = 0


class QuestionFileError(ValueError):
    pass


def read_jsonl(path: Path) -> tuple[list[Question], list[str]]:
    """Questions of a JSONL file, and one warning per malformed line (which is skipped); a file
    without a single usable question is an error."""
    questions, problems = [], []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError as err:
        raise QuestionFileError(f"question file not found: {path}") from err
    except UnicodeDecodeError as err:
        raise QuestionFileError(f"question file {path} is not UTF-8") from err
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            text = record["question"]
            if not isinstance(text, str) or not text.strip():
                raise ValueError("empty question")
            answers = record.get("answers", record.get("answer", []))
            answers = [answers] if isinstance(answers, str) else list(answers)
            support = list(record.get("supporting_documents", []))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            problems.append(f"{path}:{number}: skipped malformed line ({type(err).__name__}: {err})")
            continue
        questions.append(Question(text, [str(a) for a in answers], support, number))
    if not questions:
        raise QuestionFileError(f"question file {path} holds no usable question"
                                + (f" ({len(problems)} malformed line(s))" if problems else ""))
    return questions, problems


def _passage_file(position: int) -> str:
    return f"p{position:05d}.txt"


def _write_corpus(folder: Path, passages: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Write passages once; returns (title, text) -> relative path."""
    folder.mkdir(parents=True, exist_ok=True)
    where = {}
    for position, (title, text) in enumerate(passages):
        name = _passage_file(position)
        target = folder / name
        body = f"{title}\n{text}\n".encode()
        if not target.is_file() or target.read_bytes() != body:
            atomic_write_bytes(target, body)
        where.setdefault((title, text), name)
    return where


def load_musique(data: Path, corpus_folder: Path) -> list[Question]:
    corpus = json.loads((data / "corpus.json").read_text(encoding="utf-8"))
    where = _write_corpus(corpus_folder, [(p["title"], p["text"]) for p in corpus])
    questions = []
    for number, record in enumerate(json.loads((data / "questions.json").read_text(encoding="utf-8")), 1):
        support = [where.get((p["title"], p["paragraph_text"])) for p in record["paragraphs"] if p["is_supporting"]]
        answers = [record["answer"], *record.get("answer_aliases", [])]
        questions.append(Question(record["question"], answers, [s for s in support if s], number))
    return questions


def load_hotpotqa(data: Path, corpus_folder: Path) -> list[Question]:
    corpus = json.loads((data / "corpus.json").read_text(encoding="utf-8"))
    titles = list(corpus)
    where = _write_corpus(corpus_folder, [(t, "".join(corpus[t])) for t in titles])
    by_title = {t: where[(t, "".join(corpus[t]))] for t in titles}
    questions = []
    for number, record in enumerate(json.loads((data / "questions.json").read_text(encoding="utf-8")), 1):
        support = sorted({by_title[t] for t, _ in record["supporting_facts"] if t in by_title})
        questions.append(Question(record["question"], [record["answer"]], support, number))
    return questions


def is_yes_no(question: Question) -> bool:
    return bool(question.answers) and question.answers[0].strip().lower() in ("yes", "no")
