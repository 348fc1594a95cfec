"""Incremental indexing with an LLM engine on MuSiQue's corpus (`make bench`): what an update asks.

    python -m bench.bench_llm_incremental [--data ../shared/eval] [--work DIR]

The engine is litellm against the fault server in its deterministic "rich" mode (one unit per
sentence, capitalised words as entities; the same request always gets the same reply), which
stands in for a recorded LLM: a real model on this machine would take hours for 1,872 passages.
Same split as the offline indexing benchmark (`bench_index.prepare`): a base build of 95% of the
passages, then an update that adds 5%, changes 1% and deletes 1%, once in each mode (exact and
incremental, each on a copy of the base); and a fresh build of the final folder. Every run is a
`noderag index` child process; the server records each request.

Checked, of the exact update: its requests are exactly the fresh build's requests that the base build did not
make (nothing re-sent, nothing stale, nothing missing), its decompose calls are the chunks of the new
and changed documents, and its tables equal the fresh build's. Reported: calls and tokens by task,
and wall times (the server answers at once, so a real model's latency would only widen the gap).
Exits non-zero when a check fails; without the corpus the section says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import yaml

from bench.bench_index import ROOT, prepare, run_index, same_files
from devtools.fault_server import MODEL, FaultServer, task_of
from noderag_cli.index.outputs import ASSIGNMENTS
from noderag_cli.index.stages import BY_NAME, STAGES
from noderag_cli.workspace import EDGES, NODES, Workspace

TASKS = tuple(stage.task for stage in STAGES if stage.task)


def _requests(server: FaultServer) -> list[tuple[str, str, int, int, int]]:
    """(task, messages, tokens as the server bills them, then its prompt and reply tokens as the
    dry run counts them) of every task request the server answered since the last reset. The
    server bills words; the dry run's estimate is in litellm's count for the model, so it is
    compared with the requests counted the same way."""
    from noderag_cli.engines.pricing import count_tokens, load_litellm

    def reply_tokens(text: str) -> int:
        return int(load_litellm().token_counter(model=MODEL, text=text)) if text else 0

    return [(task_of(r.body), json.dumps(r.body["messages"], sort_keys=True), int(r.usage.get("total_tokens", 0)),
             count_tokens(MODEL, r.body["messages"]), reply_tokens(r.reply))
            for r in server.completions() if task_of(r.body) and r.status == 200]


def _memberships(workspace: Path) -> set[frozenset[str]]:
    """The member set (S and A node ids) of every community of a workspace's last communities stage."""

    rows = ASSIGNMENTS.read(Workspace(workspace)).to_pylist()
    members: dict[int, set[str]] = {}
    for row in rows:
        if row["community"] >= 0 and row["id"][:2] in ("S_", "A_"):
            members.setdefault(row["community"], set()).add(row["id"])
    return {frozenset(m) for m in members.values()}


def _stage_graph(workspace: Path):
    """The S/N/R/A graph the communities stage read, and its nodes table."""
    import pyarrow as pa

    from noderag_cli.graph import Graph

    ws = Workspace(workspace)
    nodes = pa.concat_tables([o.read(ws) for o in BY_NAME["communities"].inputs if o.file == NODES])
    edges = pa.concat_tables([o.read(ws) for o in BY_NAME["communities"].inputs if o.file == EDGES])
    return Graph.from_tables(nodes, edges), nodes


def _unit_texts(workspace: Path) -> set[str]:
    """The text of every S and A node the communities stage read."""
    graph, nodes = _stage_graph(workspace)
    texts = nodes["text"].to_pylist()
    return {texts[i] for i in range(len(texts)) if graph.types[i] in ("S", "A")}


def _communities_with_new_texts(workspace: Path, known: set[str], max_tokens: int) -> tuple[int, int, float]:
    """(communities asked, those that show a text not in `known`, their share of the shown tokens):
    requests no clustering can avoid, since each holds a text the base build never summarised."""
    import numpy as np

    from noderag_cli.index.communities import shown_members

    graph, nodes = _stage_graph(workspace)
    assigned = ASSIGNMENTS.read(Workspace(workspace)).to_pydict()
    community = dict(zip(assigned["id"], assigned["community"], strict=True))
    membership = np.array([community[i] for i in graph.ids.tolist()])
    tokens = nodes["tokens"].to_numpy()
    texts = nodes["text"].to_pylist()
    shown = [picked for _, picked in shown_members(graph, membership, tokens, max_tokens)]
    new = [picked for picked in shown if any(texts[i] not in known for i in picked)]
    total = sum(int(tokens[p].sum()) for p in shown)
    return len(shown), len(new), sum(int(tokens[p].sum()) for p in new) / max(total, 1)


def _dry_run(workspace: Path, folder: Path, config: Path) -> dict:
    """`noderag index --dry-run --json`'s LLM estimate."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "noderag_cli.cli", "index", str(workspace), "--input", str(folder),
                           "--config", str(config), "--dry-run", "--json"], capture_output=True, text=True, cwd=ROOT)
    return json.loads(done.stdout)["llm"]


def measure(data: Path, work: Path, graph: dict | None = None, share: float | None = None) -> tuple[list[str], bool]:
    base, final, counts = prepare(data, work)
    with FaultServer(default="rich") as server:
        configs = {}
        for mode in ("exact", "incremental"):
            configs[mode] = work / f"llm-{mode}.yaml"
            configs[mode].write_text(yaml.safe_dump({
                "llm": {"engine": "litellm", "model": MODEL, "api_base": server.url,
                        "timeout_seconds": 30, "retries": 2, "concurrency": 8},
                "index": {"update": mode, **({"resummarize_share": share} if share is not None else {})},
                **({"graph": graph} if graph else {})}))
        runs, seen, planned = {}, {}, {}
        steps = (("fresh", final, work / "llm-fresh"), ("base", base, work / "llm-base"),
                 ("update", final, work / "llm-exact"), ("incremental", final, work / "llm-incremental"))
        for name, folder, workspace in steps:
            shutil.rmtree(workspace, ignore_errors=True)
            config = configs["incremental" if name == "incremental" else "exact"]
            if name in ("update", "incremental"):
                shutil.copytree(work / "llm-base", workspace, ignore=shutil.ignore_patterns(".lock"))
                planned[name] = _dry_run(workspace, folder, config)
            if name == "update":
                base_members = _memberships(workspace)
                base_texts = _unit_texts(workspace)
            server.reset()
            print(f"[bench_llm_incremental] {name} build ...", file=sys.stderr, flush=True)
            runs[name] = run_index(workspace, folder, config=config)
            if runs[name].returncode != 0:
                return [f"{name} build failed with exit code {runs[name].returncode}"], False
            seen[name] = _requests(server)
    fresh, base_calls, update = ({(x[0], x[1]) for x in seen[k]} for k in ("fresh", "base", "update"))
    expected = fresh - base_calls
    stale, repeated, missing = update - fresh, update & base_calls, expected - update
    decompose = runs["update"].summary["stages"]["decompose"]
    identical = same_files(work / "llm-fresh", work / "llm-exact")
    duplicates = len(seen["update"]) - len(update)
    ok = not (stale or repeated or missing or duplicates) and identical and \
        decompose.get("decomposed") == sum(x[0] == "decompose" for x in seen["update"])

    def row(label: str, pick) -> str:
        cells = [pick(seen[k]) for k in ("fresh", "base", "update", "incremental")]
        shares = " | ".join(f"{c / cells[0]:.1%}" if cells[0] else "-" for c in cells[2:])
        return f"| {label} | {cells[0]:,} | {cells[1]:,} | {cells[2]:,} | {cells[3]:,} | {shares} |"

    walls = {k: r.wall for k, r in runs.items()}
    update_members = _memberships(work / "llm-exact")
    kept = len(set(base_members) & set(update_members))
    from noderag_cli.config import GraphConfig

    budget = (graph or {}).get("max_community_tokens", GraphConfig().max_community_tokens)
    asked, with_new, new_share = _communities_with_new_texts(work / "llm-fresh", base_texts, budget)
    def estimated(mode: str) -> str:
        estimate = planned[mode]["total"]
        calls, tokens = len(seen[mode]), sum(x[3] + x[4] for x in seen[mode])
        per_task = []
        for task, row in sorted(planned[mode]["tasks"].items()):
            made = [x for x in seen[mode] if x[0] == task]
            per_task.append(f"{task} {row['calls']:,} / {len(made):,} calls, prompt {row['input_tokens']:,} / "
                            f"{sum(x[3] for x in made):,}, reply {row['output_tokens']:,} / {sum(x[4] for x in made):,} tokens")
        return (f"{estimate['calls']:,} calls and {estimate['input_tokens'] + estimate['output_tokens']:,} tokens; the "
                f"update made {calls:,} calls (estimate {estimate['calls'] / max(calls, 1):.0%} of them) and "
                f"{tokens:,} tokens counted as the dry run counts them "
                f"(estimate {(estimate['input_tokens'] + estimate['output_tokens']) / max(tokens, 1):.0%}; "
                f"estimated / made: {'; '.join(per_task)})")

    incremental = runs["incremental"].summary["stages"]
    share = {k: sum(x[2] for x in seen[k]) / max(sum(x[2] for x in seen["fresh"]), 1) for k in ("update", "incremental")}
    calls = {k: len(seen[k]) / max(len(seen["fresh"]), 1) for k in ("update", "incremental")}
    lines = [
        "### Incremental update with an LLM engine",
        "",
        "Command: `python -m bench.bench_llm_incremental`. litellm against the fault server's "
        "deterministic *rich* replies (a stand-in for a recorded model; it answers at once), concurrency 8, "
        f"same split as above: base {counts['base']:,} passages, update +{counts['added']} / "
        f"{counts['changed']} changed / {counts['deleted']} deleted.",
        "",
        "| measure | fresh build (final) | base build (95%) | exact update | incremental update | exact / fresh | "
        "incremental / fresh |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *(row(f"{task} calls", lambda s, t=task: sum(x[0] == t for x in s)) for task in TASKS),
        row("all LLM calls", len),
        *(row(f"{task} tokens", lambda s, t=task: sum(x[2] for x in s if x[0] == t)) for task in TASKS),
        row("tokens (prompt + completion)", lambda s: sum(x[2] for x in s)),
        f"| process wall time (s) | {walls['fresh']:.1f} | {walls['base']:.1f} | {walls['update']:.1f} | "
        f"{walls['incremental']:.1f} | {walls['update'] / walls['fresh']:.1%} | {walls['incremental'] / walls['fresh']:.1%} |",
        "",
        f"- **Incremental update** (the default, `index.update: incremental`): {calls['incremental']:.1%} of a fresh "
        f"build's calls and {share['incremental']:.1%} of its tokens (targets: at most 12% each: "
        f"**{'met' if max(calls['incremental'], share['incremental']) <= 0.12 else 'NOT met'}**); "
        f"{incremental['attributes'].get('stale', 0)} attributes and {incremental['communities'].get('stale', 0)} "
        f"communities kept although their texts changed (stale); "
        f"{incremental['attributes'].get('update', '?')}.",
        f"- **Exact update** (`index --exact`): {calls['update']:.1%} of the calls, {share['update']:.1%} of the tokens; "
        "what follows checks it.",
        f"- The update's requests are exactly the fresh build's requests that the base build did not make: "
        f"**{'yes' if not (stale or repeated or missing or duplicates) else 'NO'}** "
        f"({len(stale)} not in the fresh build, {len(repeated)} already made by the base build, {len(missing)} "
        f"missing, {duplicates} sent twice).",
        f"- Decompose calls in the update = chunks of the new and changed documents: "
        f"{decompose.get('decomposed', '?')} chunks decomposed, {decompose.get('cached', '?')} from the cache.",
        f"- Update's nodes.parquet and edges.parquet byte-identical to the fresh build: "
        f"**{'yes' if identical else 'NO'}**.",
        f"- Communities that keep their exact membership (their S and A nodes) through the update: {kept} of "
        f"{len(base_members)} (the update has {len(update_members)}).",
        f"- Communities whose request shows a text the base build never held (a new unit or a rewritten "
        f"attribute), which the update must ask whatever the clustering: {with_new} of {asked}, "
        f"{new_share:.1%} of the community texts shown. The update's decompose and attribute requests alone "
        f"(a chunk that changed, an important entity that is new or gained or lost a text) are "
        f"{sum(x[0] != 'community_elements' for x in seen['update']) / len(seen['fresh']):.1%} of the fresh "
        f"build's calls.",
        f"- `index --dry-run` before the exact update estimated {estimated('update')}; before the incremental "
        f"update, {estimated('incremental')}.",
    ]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--leaf-tokens", type=int, default=None, help="graph.summary_leaf_tokens (default: the config's)")
    parser.add_argument("--resummarize-share", type=float, default=None,
                        help="index.resummarize_share (default: the config's)")
    args = parser.parse_args(argv)
    data = args.data / "musique" if (args.data / "musique").is_dir() else args.data
    if not (data / "corpus.json").is_file():
        print(f"### Incremental update with an LLM engine\n\nskipped: no MuSiQue corpus at {data / 'corpus.json'}")
        return 0
    work = Path(tempfile.mkdtemp(prefix="noderag-bench-llm-inc-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        lines, ok = measure(data, work, {"summary_leaf_tokens": args.leaf_tokens} if args.leaf_tokens else None,
                            args.resummarize_share)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
