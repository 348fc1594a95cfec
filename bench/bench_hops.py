"""Where multi-hop retrieval finds each hop, and whether the offline answer answers.

    python -m bench.bench_hops [--data ../shared/eval] [--work bench-out] [--set KEY=VALUE ...]

MuSiQue's `question_decomposition` names the passage of each hop: the share of questions whose
hop-k passage is in the context (as a chunk or as a node derived from it), per budget. HotpotQA:
the share whose gold passages are all in the context. On both: answer containment and support
recall of the context, and of the offline extractive answer the share that contains the gold
answer (yes/no left out) and its median length in words. `--set` changes search settings (as
`SearchConfig` names them) for trying a mechanism on and off without re-indexing.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from noderag_cli import api
from noderag_cli.evaluate.datasets import is_yes_no, load_hotpotqa, load_musique
from noderag_cli.evaluate.metrics import answer_contained, support_recall

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (500, 1000, 2000)
ANSWER_BUDGET = 1000


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


def measure(session, questions, hops, params_of) -> dict:
    """Per budget: hop hits, all-gold hits, containment, recall, latency; and the offline answer."""
    out = {}
    for budget in BUDGETS:
        params = params_of(budget)
        per_hop: dict[int, list[bool]] = {}
        all_gold, contained, recall, latency = [], [], [], []
        answers_in, answer_words = [], []
        for question, question_hops in zip(questions, hops, strict=True):
            retrieval = session.retrieve(question.question, params)
            found = _documents(retrieval)
            for k, doc in enumerate(question_hops):
                per_hop.setdefault(k, []).append(doc in found)
            all_gold.append(all(d in found for d in question.supporting_documents))
            if not is_yes_no(question):
                contained.append(answer_contained(retrieval.context_text(), question.answers))
            recall.append(support_recall(retrieval, question.supporting_documents) or 0.0)
            latency.append(retrieval.timings["retrieval_ms"])
            if budget == ANSWER_BUDGET and not is_yes_no(question):
                answered = session.retriever.answer(retrieval).answer
                body = answered.replace("[offline extractive answer]", "")
                answers_in.append(answer_contained(body, question.answers))
                answer_words.append(len(body.split()))
        out[budget] = {
            "hops": {k: (sum(v), len(v)) for k, v in sorted(per_hop.items())},
            "all_gold": (sum(all_gold), len(all_gold)),
            "containment": sum(contained) / len(contained),
            "recall": statistics.mean(recall),
            "latency_p50": statistics.median(latency),
        }
        if answers_in:
            out[budget]["answer"] = (sum(answers_in), len(answers_in), statistics.median(answer_words))
    return out


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
    parser.add_argument("--sets", default="musique,hotpotqa")
    parser.add_argument("--numpy", action="store_true", help="search without the compiled kernels (same results)")
    args = parser.parse_args(argv)
    changes = {k: _parse(v) for k, v in (item.split("=", 1) for item in args.set)}
    for dataset in args.sets.split(","):
        data = args.data / dataset
        if not (data / "corpus.json").is_file():
            print(f"{dataset}: skipped, {data} not found")
            continue
        corpus = args.work / f"{dataset}-corpus"
        if dataset == "musique":
            questions, hops = musique_hops(data, corpus)
        else:
            questions = load_hotpotqa(data, corpus)
            hops = [[] for _ in questions]
        ws = args.work / f"{dataset}-ws"
        api.index(ws, corpus)
        with api.open_workspace(ws, compiled=not args.numpy) as session:
            figures = measure(session, questions, hops,
                              lambda b, s=session: s.search_settings(**changes, budget_tokens=b))
        for budget, row in figures.items():
            hop_text = " ".join(f"h{k + 1} {hit}/{n}" for k, (hit, n) in row["hops"].items())
            answer = row.get("answer")
            answer_text = f" answer {answer[0]}/{answer[1]} ({answer[2]:.0f} words)" if answer else ""
            print(f"{dataset} {budget}: {hop_text} all {row['all_gold'][0]}/{row['all_gold'][1]} "
                  f"cont {row['containment']:.3f} rec {row['recall']:.3f} p50 {row['latency_p50']:.2f}ms{answer_text}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
