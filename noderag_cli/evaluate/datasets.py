"""Dataset question sets and their corpora: MuSiQue and HotpotQA (as in `shared/eval`).

A dataset corpus is written out as a folder of `.txt` passages (title on the first
line, so the chunk stage takes it as the document title), one file per passage, named
by position so that non-unique titles never collide.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import atomic_write_bytes
from ..questions import Question


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
