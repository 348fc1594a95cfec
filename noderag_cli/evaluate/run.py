"""Run retrieval strategies over a question set at several budgets and score them."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from ..questions import Question
from ..search.results import Retrieval
from .datasets import is_yes_no
from .metrics import answer_contained, support_recall

Strategy = Callable[[str, int], Retrieval]


def evaluate(strategies: dict[str, Strategy], questions: list[Question], budgets: list[int],
             progress: Callable[[int], None] | None = None, rounds: int = 1) -> list[dict]:
    """One row per strategy and budget: answer containment, support recall, tokens, latency.
    With rounds > 1 each question is retrieved that many times and its median latency kept
    (retrieval is deterministic, so the metrics do not change). The strategies take turns on each
    question, so a change in the machine's load during the run weighs on all of them alike."""
    names = list(strategies)
    found = {(name, budget): ([], [], [], []) for name in names for budget in budgets}
    for budget in budgets:
        for question in questions:
            for name in names:
                contained, recall, tokens, latency = found[(name, budget)]
                timings = []
                for _ in range(rounds):
                    result = strategies[name](question.question, budget)
                    timings.append(result.timings.get("retrieval_ms", 0.0))
                if not is_yes_no(question):
                    contained.append(answer_contained(result.context_text(), question.answers))
                r = support_recall(result, question.supporting_documents)
                if r is not None:
                    recall.append(r)
                tokens.append(result.context_tokens)
                latency.append(statistics.median(timings))
                if progress:
                    progress(1)
    rows = []
    for name in names:
        for budget in budgets:
            contained, recall, tokens, latency = found[(name, budget)]
            rows.append({
                "strategy": name, "budget": budget, "questions": len(questions),
                "answer_containment": round(float(np.mean(contained)), 4) if contained else None,
                "support_recall": round(float(np.mean(recall)), 4) if recall else None,
                "mean_context_tokens": round(float(np.mean(tokens)), 1),
                "latency_median_ms": round(statistics.median(latency), 3) if latency else 0.0,
                "latency_p95_ms": round(float(np.percentile(latency, 95)), 3) if latency else 0.0,
            })
    return rows
