"""Where multi-hop retrieval finds each hop, and whether the offline answer answers.

    python -m bench.bench_hops [--data ../shared/eval] [--work bench-out] [--set KEY=VALUE ...] [--sensitivity]

MuSiQue's `question_decomposition` names the passage of each hop: the share of questions whose
hop-k passage is in the context (as a chunk or as a node derived from it), per budget. HotpotQA:
the share whose gold passages are all in the context. On both: answer containment and support
recall of the context, retrieval latency (median over rounds per question, then the median over
questions), and at 1,000 tokens the share of offline extractive answers that hold the gold answer
(yes/no left out) and their median length in words. Each figure for the search with this
project's multi-hop settings and for the same search without them (`BEFORE`: one round, an even
start, the context by score alone), on the same workspace in the same run. `--sensitivity` adds
each new setting moved either side of its default; `--set` changes search settings (as
`SearchConfig` names them) for trying a mechanism without re-indexing. Prints Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from noderag_cli import api
from noderag_cli.evaluate.datasets import is_yes_no, load_hotpotqa, load_musique
from noderag_cli.evaluate.metrics import answer_contained, exact_match, support_recall, token_f1
from noderag_cli.mcp_server import reading
from noderag_cli.nlp import count_tokens

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (500, 1000, 2000)
ANSWER_BUDGET = 1000
ROUNDS = 3
BEFORE = {"exact_share": None, "second_round_chunks": 0, "document_diversity": 1.0, "whole_chunks": 0,
          "asked_kind_weight": 0.0, "question_words_weight": 0.0}
"""The search as it was before the multi-hop settings (issue 25), on the same graph."""
MULTIHOP = {"whole_chunks": 0, "asked_kind_weight": 0.0, "question_words_weight": 0.0}
"""The search as the multi-hop settings left it, before what a reader gets (issue 36)."""
SENSITIVITY = [("exact_share", (0.2, 0.5)), ("second_round_chunks", (1, 3)), ("second_round_share", (0.3, 0.7)),
               ("document_diversity", (0.25, 0.6)), ("whole_chunks", (1, 4)), ("asked_kind_weight", (0.25, 1.0)),
               ("question_words_weight", (0.75, 3.0))]


def musique_hops(data: Path, corpus: Path) -> tuple[list, list[list[str]]]:
    """The questions and, per question, the corpus file of each hop's passage in hop order."""
    questions = load_musique(data, corpus)
    records = json.loads((data / "questions.json").read_text(encoding="utf-8"))
    passages = json.loads((data / "corpus.json").read_text(encoding="utf-8"))
    where = {}
    for position, p in enumerate(passages):
        where.setdefault((p["title"], p["text"]), f"p{position:05d}.txt")
    hops = []
    for record in records:
        paragraphs = record["paragraphs"]
        hops.append([where[(paragraphs[step["paragraph_support_idx"]]["title"],
                            paragraphs[step["paragraph_support_idx"]]["paragraph_text"])]
                     for step in record["question_decomposition"]])
    return questions, hops


def _documents(retrieval) -> set[str]:
    return {d for node in retrieval.nodes if node.type in ("T", "S", "A", "R") for d in node.documents}


def measure(session, questions, hops, changes: dict, rounds: int = 1, budgets=BUDGETS) -> dict:
    """Per budget: hop hits, all-gold hits, containment, recall, latency; and the offline answer."""
    out = {}
    for budget in budgets:
        params = session.search_settings(**changes, budget_tokens=budget)
        per_hop: dict[int, list[bool]] = {}
        all_gold, contained, recall, latency, reading_ratio = [], [], [], [], []
        answers_in, answer_words, shorts_in, matches, f1s = [], [], [], [], []
        for question, question_hops in zip(questions, hops, strict=True):
            timings = []
            for _ in range(rounds):
                retrieval = session.retrieve(question.question, params)
                timings.append(retrieval.timings["retrieval_ms"])
            found = _documents(retrieval)
            for k, doc in enumerate(question_hops):
                per_hop.setdefault(k, []).append(doc in found)
            all_gold.append(all(d in found for d in question.supporting_documents))
            if not is_yes_no(question):
                contained.append(answer_contained(retrieval.context_text(), question.answers))
            recall.append(support_recall(retrieval, question.supporting_documents) or 0.0)
            if retrieval.context_tokens:
                reading_ratio.append(count_tokens([reading(retrieval)])[0] / retrieval.context_tokens)
            latency.append(statistics.median(timings))
            if budget == ANSWER_BUDGET and not is_yes_no(question):
                answered = session.retriever.answer(retrieval)
                body = answered.answer.replace("[offline extractive answer]", "")
                answers_in.append(answer_contained(body, question.answers))
                answer_words.append(len(body.split()))
                short = answered.short_answer or ""
                shorts_in.append(answer_contained(short, question.answers))
                matches.append(exact_match(short, question.answers))
                f1s.append(token_f1(short, question.answers))
        out[budget] = {
            "hops": [(sum(v), len(v)) for _, v in sorted(per_hop.items())],
            "all_gold": (sum(all_gold), len(all_gold)),
            "containment": sum(contained) / len(contained),
            "recall": statistics.mean(recall),
            "latency_p50": statistics.median(latency),
            "reading": statistics.median(reading_ratio) if reading_ratio else 0.0,
        }
        if answers_in:
            out[budget]["answer"] = (sum(answers_in), len(answers_in), statistics.median(answer_words))
            out[budget]["short"] = (sum(shorts_in), sum(matches), statistics.mean(f1s))
    return out


def _dataset(dataset: str, data: Path, work: Path):
    corpus = work / f"{dataset}-corpus"
    if dataset == "musique":
        questions, hops = musique_hops(data / dataset, corpus)
    else:
        questions = load_hotpotqa(data / dataset, corpus)
        hops = [[] for _ in questions]
    ws = work / f"{dataset}-ws"
    api.index(ws, corpus)
    return questions, hops, ws


def _row(dataset: str, name: str, budget: int, figures: dict) -> str:
    hops = " / ".join(f"{hit}" for hit, _ in figures["hops"]) if figures["hops"] else "-"
    answer, short = figures.get("answer"), figures.get("short")
    answer_text = f"{answer[0]}/{answer[1]} ({answer[2]:.0f} words)" if answer else ""
    short_text = f"{short[0]}/{answer[1]} (EM {short[1]}, F1 {short[2]:.3f})" if short and answer else ""
    return (f"| {dataset} | {budget} | {name} | {hops} | {figures['all_gold'][0]}/{figures['all_gold'][1]} | "
            f"{figures['containment']:.3f} | {figures['recall']:.3f} | {figures['latency_p50']:.2f} | {answer_text} | "
            f"{short_text} | {figures['reading']:.2f} |")


def report(data: Path, work: Path, changes: dict, sensitivity: bool, rounds: int) -> list[str]:
    lines = ["## Multi-hop retrieval and the offline answer", "",
             "Offline engine, default settings (`search.exact_share`, `second_round_chunks`, `second_round_share`, "
             "`document_diversity`, `whole_chunks`, `asked_kind_weight`, `question_words_weight`: search/rounds.py, "
             "search/context.py) against "
             f"the same search without them (`before`: {', '.join(f'{k}={v}' for k, v in BEFORE.items())}) and without "
             f"the last three (`multi-hop`: {', '.join(f'{k}={v}' for k, v in MULTIHOP.items())}), on the same "
             "workspaces, in the same run. "
             "Hops: questions whose hop-k passage is in the context (MuSiQue's question_decomposition; of 100, "
             "the third of 32, the fourth of 5). All gold: every supporting passage in the context. Answer: the "
             "offline extractive answer holds the gold answer (yes/no left out), its median length; short answer: "
             "the answer's short answer holds it, and its exact match and token F1 (SQuAD's). MCP text: the tokens of "
             "what an agent reads from `noderag mcp`'s search (mcp_server.reading) over the context's tokens, median "
             "over questions (target about 1.3 at most). Latency: "
             f"retrieval only, median of {rounds} rounds per question, then over questions, the API's default opening (the vector side's kernels loaded).", "",
             "| set | budget | search | hops 1 / 2 / 3 / 4 | all gold | answer containment | support recall | "
             "latency p50 ms | offline answer | short answer | MCP text |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ratios, spread = [], []
    for dataset in ("musique", "hotpotqa"):
        if not (data / dataset / "corpus.json").is_file():
            lines.append(f"| {dataset} | - | skipped: {data / dataset} not found | | | | | | | | |")
            continue
        questions, hops, ws = _dataset(dataset, data, work)
        with api.open_workspace(ws) as session:
            before = measure(session, questions, hops, BEFORE, rounds)
            multihop = measure(session, questions, hops, {**MULTIHOP, **changes}, rounds)
            now = measure(session, questions, hops, changes, rounds)
            for budget in BUDGETS:
                lines.append(_row(dataset, "before", budget, before[budget]))
                lines.append(_row(dataset, "multi-hop", budget, multihop[budget]))
                lines.append(_row(dataset, "noderag", budget, now[budget]))
                ratios.append((dataset, budget, now[budget]["latency_p50"] / before[budget]["latency_p50"]))
            if sensitivity:
                for setting, values in SENSITIVITY:
                    for value in values:
                        moved = measure(session, questions, hops, {**changes, setting: value}, 1, (ANSWER_BUDGET,))
                        spread.append(_row(dataset, f"{setting}={value}", ANSWER_BUDGET, moved[ANSWER_BUDGET]))
    lines += ["", "Latency of the multi-hop search against the search before, same run: " +
              ", ".join(f"{d} {b}: {r:.2f}x" for d, b, r in ratios) + " (target: at most 1.5x)."]
    if spread:
        lines += ["", "Each new setting moved either side of its default (1,000 tokens; latency of one round):", "",
                  "| set | budget | search | hops 1 / 2 / 3 / 4 | all gold | answer containment | support recall | "
                  "latency p50 ms | offline answer | short answer | MCP text |", "|---|---|---|---|---|---|---|---|---|---|---|",
                  *spread]
    return lines


def _parse(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--set", action="append", default=[], help="search setting KEY=VALUE")
    parser.add_argument("--sensitivity", action="store_true", help="each new setting either side of its default")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    changes = {k: _parse(v) for k, v in (item.split("=", 1) for item in args.set)}
    print("\n".join(report(args.data, args.work, changes, args.sensitivity, args.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
