"""The clustered paths on the dev sets: how many of the exact 64 nearest neighbours the clustered
similarity candidates hold, and retrieval with the clustered similarity edges and vector side
forced on (they start at 60,000 nodes and 40,000 S, A and H vectors, above the dev sets), against the
exact paths, at equal budgets.

    python -m bench.bench_clustered [--data ../shared/eval] [--work bench-out/clustered]

Prints a Markdown section; without the data folder the section says so and the exit code is 0.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BUDGETS = (1000, 2000)
FORCED = {"similarity": {"exact_below": 0}, "search": {"clustered_from": 0}}


def log(message: str) -> None:
    print(f"[bench_clustered] {message}", file=sys.stderr, flush=True)


def candidate_recall(workspace: Path) -> float:
    """Over every embedded node: the share of its exact 64 nearest (the exact path's lists) among
    the clustered path's 64 candidates, both recomputed from the build's vectors."""

    from noderag_cli import ivf
    from noderag_cli.config import SimilarityConfig
    from noderag_cli.index import similarity_edges as se
    from noderag_cli.index.outputs import VECTOR_IDS, VECTORS
    from noderag_cli.workspace import Workspace

    ids = VECTOR_IDS.read(Workspace(workspace))["id"].to_pylist()
    vectors = ivf.read_flat(VECTORS.path(Workspace(workspace)))
    keys = se.keys(ids, vectors)
    exact = se.neighbour_lists(keys, vectors, 64).candidates[:, :64]
    clustered = se.clustered_lists(keys, vectors, 64, 42, SimilarityConfig().probes, se.ASSIGN).candidates[:, :64]
    return float(np.mean([len(set(a.tolist()) & set(b.tolist())) / 64 for a, b in zip(exact, clustered, strict=True)]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "clustered")
    args = parser.parse_args(argv)
    title = "## The clustered paths on the dev sets"
    if not (args.data / "musique" / "corpus.json").is_file():
        print(f"{title}\n\nskipped: {args.data} holds no MuSiQue corpus")
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.bench import LOADERS
    from noderag_cli import api
    from noderag_cli.config import Config
    from noderag_cli.evaluate.run import evaluate

    lines = [title, "", "Command: `python -m bench.bench_clustered` (part of `make bench`). Each dev set indexed "
             "twice, offline: with the defaults (at this size, every node scored against every other for the "
             "similarity edges, the int8 scan for the vector side) and with both clustered paths forced on "
             "(`similarity.exact_below: 0`, `search.clustered_from: 0`, default probes).", ""]
    table = ["| set | budget | paths | answer containment | support recall | mean context tokens |",
             "|---|---:|---|---:|---:|---:|"]
    for dataset, loader in LOADERS.items():
        if not (args.data / dataset / "corpus.json").is_file():
            continue
        corpus = args.work / f"{dataset}-corpus"
        questions = loader(args.data / dataset, corpus)
        for name, overrides in (("exact", {}), ("clustered", FORCED)):
            workspace = args.work / f"{dataset}-{name}"
            log(f"{dataset}: indexing with the {name} paths")
            api.index(workspace, corpus, config=Config.model_validate(overrides))
            if dataset == "musique" and name == "clustered":
                recall = candidate_recall(workspace)
                lines.append(f"- MuSiQue, {len(questions)} questions' corpus: the clustered similarity candidates hold "
                             f"**{recall:.3f}** of each node's exact 64 nearest neighbours (mean over every embedded "
                             "node; target at least 0.95).")
            with api.open_workspace(workspace) as session:
                retriever = session.retriever
                rows = evaluate({name: lambda q, b, r=retriever: r.retrieve(q, r.config.search.model_copy(
                    update={"budget_tokens": b}))}, questions, list(BUDGETS))
            for row in rows:
                table.append(f"| {dataset} | {row['budget']} | {name} | {row['answer_containment']:.3f} | "
                             f"{row['support_recall']:.3f} | {row['mean_context_tokens']:.0f} |")
    print("\n".join([*lines, "", *table]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
