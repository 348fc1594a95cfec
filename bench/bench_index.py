"""Indexing benchmark on MuSiQue's corpus: prints a Markdown section for docs/benchmarks.md.

    python -m bench.bench_index [--quick] [--data ../shared/eval] [--work DIR] [--runs N]

Every measured run is a real `noderag index` child process (`python -m noderag_cli.cli
index WS --input FOLDER --json`) with the offline engine; its wall time includes start-up,
its peak RSS comes from `os.wait4`. Measured:

1. From scratch on the final folder, N runs (median), with per-stage times; the N runs'
   nodes.parquet / edges.parquet / vectors.faiss are compared byte for byte (determinism).
2. Updates: index a folder of 95% of the passages (seeded split), then change that folder in
   place into the final one, adding the other 5%, changing 1% and deleting 1% of the first set
   (the files that stay are not touched, as in a user's folder or an rsync'd copy), and update,
   once incrementally (the default) and once with `index.update: exact` on a copy of the base. Each update's time against
   the from-scratch time of the same final folder, and the exact update's tables against the
   from-scratch tables (byte-identical or not). N repetitions, median.
3. Kill and resume: a fresh build is SIGKILLed from outside while decompose, communities and
   similarity are running (watching manifest.json), resumed each time, and its tables are
   compared with the uninterrupted build.

Progress goes to stderr; stdout carries only the Markdown. Without the data folder the
section says so and the exit code is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.corpus import sync_folder
from noderag_cli.index.scan import RECENT_NS
from noderag_cli.index.stages import STAGE_NAMES

ROOT = Path(__file__).resolve().parents[1]
STAGES = STAGE_NAMES
COMPARED = ("nodes.parquet", "edges.parquet")
SEED = 20240501


def log(message: str) -> None:
    print(f"[bench_index] {message}", file=sys.stderr, flush=True)


@dataclass
class Run:
    wall: float
    rss_mb: float
    returncode: int
    summary: dict = field(default_factory=dict)

    def stage_seconds(self) -> dict[str, float]:
        stages = self.summary.get("stages", {})
        return {s: (0.0 if stages.get(s, {}).get("skipped") else stages.get(s, {}).get("seconds", 0.0)) for s in STAGES}


def run_index(workspace: Path, folder: Path, kill: tuple[str, float] | None = None, config: Path | None = None) -> Run:
    """One `noderag index` child process; with kill=(stage, delay), SIGKILL it `delay` seconds after
    the manifest shows that stage running."""
    out = tempfile.TemporaryFile()
    command = [sys.executable, "-m", "noderag_cli.cli", "index", str(workspace), "--input", str(folder), "--json",
               *(["--config", str(config)] if config else [])]
    env = {k: v for k, v in os.environ.items() if k != "NODERAG_TEST_KILL_AT"}
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    if kill is not None:
        stage, delay = kill
        manifest = workspace / "manifest.json"
        while process.poll() is None:
            try:
                state = json.loads(manifest.read_text()).get("stages", {}).get(stage, {}).get("state")
            except (OSError, ValueError):
                state = None
            if state == "running":
                time.sleep(delay)
                if process.poll() is None:
                    os.kill(process.pid, signal.SIGKILL)
                break
            time.sleep(0.01)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    process.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    text = out.read().decode("utf-8", "replace")
    summary = {}
    if process.returncode == 0:
        summary = json.loads(text)
    return Run(wall, usage.ru_maxrss / 1024, process.returncode, summary)


def build_file(workspace: Path, name: str) -> Path:
    """A file of the workspace's current build (the generation CURRENT names)."""
    return workspace / "generations" / (workspace / "CURRENT").read_text().strip() / name


def same_files(a: Path, b: Path, names=COMPARED) -> bool:
    """The two workspaces' current builds hold the same bytes under these names."""
    return all(build_file(a, n).read_bytes() == build_file(b, n).read_bytes() for n in names)


def prepare(data: Path, work: Path) -> tuple[Path, Path, dict[str, int]]:
    """The base folder (95% of the passages) and the final folder (+5%, 1% changed, 1% deleted)."""
    from noderag_cli.evaluate.datasets import load_musique

    everything = work / "musique-all"
    load_musique(data, everything)
    files = sorted(p.name for p in everything.glob("*.txt"))
    rng = random.Random(SEED)
    order = files[:]
    rng.shuffle(order)
    n_added = round(len(files) * 0.05)
    added, kept = sorted(order[:n_added]), order[n_added:]
    n_one = round(len(kept) * 0.01)
    changed, deleted = sorted(kept[:n_one]), sorted(kept[n_one : 2 * n_one])
    base, final = work / "musique-base", work / "musique-final"
    for folder in (base, final):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    for name in kept:
        shutil.copyfile(everything / name, base / name)
    for name in kept + added:
        if name in deleted:
            continue
        text = (everything / name).read_text(encoding="utf-8")
        if name in changed:
            text = text.rstrip("\n") + f" A revision note ({name}) records that this passage was checked again.\n"
        (final / name).write_text(text, encoding="utf-8")
    counts = {"all": len(files), "base": len(kept), "added": len(added), "changed": len(changed),
              "deleted": len(deleted), "final": len(kept) + len(added) - len(deleted)}
    return base, final, counts


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def stage_table(columns: dict[str, list[Run]]) -> list[str]:
    names = list(columns)
    lines = ["| stage | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for stage in STAGES:
        cells = [f"{median([r.stage_seconds()[stage] for r in runs]):.2f}" for runs in columns.values()]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| **pipeline total** | " + " | ".join(
        f"**{median([r.summary.get('seconds', 0.0) for r in runs]):.2f}**" for runs in columns.values()) + " |")
    lines.append("| **process wall time** | " + " | ".join(
        f"**{median([r.wall for r in runs]):.2f}**" for runs in columns.values()) + " |")
    lines.append("| peak RSS (MB) | " + " | ".join(f"{max(r.rss_mb for r in runs):.0f}" for runs in columns.values()) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval",
                        help="folder holding musique/corpus.json (default ../shared/eval)")
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    parser.add_argument("--runs", type=int, default=None, help="repetitions per measurement (default 3, --quick 1)")
    parser.add_argument("--quick", action="store_true", help="one repetition, and no kill-and-resume section")
    args = parser.parse_args(argv)
    runs = args.runs or (1 if args.quick else 3)
    data = args.data / "musique" if (args.data / "musique").is_dir() else args.data
    lines = ["## Indexing (MuSiQue corpus, offline engine)", ""]
    if not (data / "corpus.json").is_file():
        lines.append(f"skipped: no MuSiQue corpus at {data / 'corpus.json'}")
        print("\n".join(lines))
        return 0
    temporary = args.work is None
    work = Path(tempfile.mkdtemp(prefix="noderag-bench-index-")) if temporary else args.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        lines += measure(data, work, runs, with_kill=not args.quick)
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)
    print("\n".join(lines))
    return 0


def measure(data: Path, work: Path, runs: int, with_kill: bool) -> list[str]:
    base, final, counts = prepare(data, work)
    log(f"corpus: {counts}")

    # interleaved, so that the machine's drift over the benchmark (shared and noisy) weighs on both sides
    scratch: list[Run] = []
    bases: list[Run] = []
    updates: list[Run] = []  # incremental, the default
    exact: list[Run] = []  # `index --exact` (index.update: exact), on a copy of the same base
    unchanged: list[Run] = []  # the same folder once more: what every run pays whatever it has to do
    reference = work / "scratch-0"
    exact_config = work / "exact.yaml"
    exact_config.write_text("index: {update: exact}\n")
    for i in range(runs):
        live = work / f"live-{i}"  # the folder the base build indexes and the update changes in place
        shutil.rmtree(live, ignore_errors=True)
        sync_folder(base, live)
        copied = time.monotonic()
        workspace = work / f"scratch-{i}"
        shutil.rmtree(workspace, ignore_errors=True)
        log(f"round {i + 1}/{runs}: from scratch ...")
        scratch.append(run_index(workspace, final))
        assert scratch[-1].returncode == 0, f"from-scratch run failed ({scratch[-1].returncode})"
        log(f"  {scratch[-1].wall:.1f} s, {scratch[-1].rss_mb:.0f} MB; base build ...")
        workspace = work / f"incremental-{i}"
        shutil.rmtree(workspace, ignore_errors=True)
        time.sleep(max(0.0, copied + RECENT_NS / 1e9 + 0.1 - time.monotonic()))  # its files as old as a user's
        bases.append(run_index(workspace, live))
        copy = work / f"exact-{i}"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(workspace, copy, ignore=shutil.ignore_patterns(".lock"))
        log(f"  base {bases[-1].wall:.1f} s; update ...")
        sync_folder(final, live)
        updates.append(run_index(workspace, live))
        assert updates[-1].returncode == 0, f"incremental run failed ({updates[-1].returncode})"
        exact.append(run_index(copy, live, config=exact_config))
        assert exact[-1].returncode == 0, f"exact update failed ({exact[-1].returncode})"
        log(f"  update {updates[-1].wall:.1f} s, exact {exact[-1].wall:.1f} s")
        unchanged.append(run_index(workspace, live))
    deterministic = all(same_files(reference, work / f"scratch-{i}", (*COMPARED, "vectors.faiss")) for i in range(runs))
    identical = [same_files(reference, work / f"exact-{i}") for i in range(runs)]
    exact_ratio = median([u.wall for u in exact]) / median([s.wall for s in scratch])

    summary = scratch[0].summary
    nodes = summary.get("nodes", {})
    wall_ratio = median([u.wall for u in updates]) / median([s.wall for s in scratch])
    pipeline_ratio = median([u.summary["seconds"] for u in updates]) / median([s.summary["seconds"] for s in scratch])
    changes = updates[0].summary.get("documents", {})
    decompose = updates[0].summary["stages"]["decompose"]
    vectors = sum(s.get("vectors_computed", 0) for s in updates[0].summary["stages"].values())
    startup = median([u.wall - u.summary["seconds"] for u in updates])
    similarity = updates[0].summary["stages"]["similarity"]
    embedded = sum(nodes.get(t, 0) for t in "TSAH")
    lines = [
        f"Command: `python -m bench.bench_index{' --quick' if runs == 1 and not with_kill else ''}`; "
        f"{platform.machine()}, Python {platform.python_version()}, {os.cpu_count()} cores. Each figure is a "
        f"`noderag index` child process; times are medians of {runs} run(s), RSS the peak (`wait4`); each round "
        f"runs a from-scratch build, then a base build, its update and a run with nothing to do.",
        "",
        f"Graph of the final folder ({counts['final']:,} passages): "
        + ", ".join(f"{t} {n:,}" for t, n in nodes.items()) + f"; {summary.get('edges', 0):,} edges.",
        "",
        "### From scratch and incremental",
        "",
        f"Base: {counts['base']:,} passages (95%, seeded split). The update changes that folder in place into "
        f"the final one (the files that stay untouched): {counts['added']} added (the other 5%), "
        f"{counts['changed']} changed, {counts['deleted']} deleted (1% each). The update reported {changes}.",
        "",
        *stage_table({"from scratch (final)": scratch, "base build (95%)": bases, "incremental update": updates,
                      "exact update": exact}),
        "",
        f"- **Incremental update (the default) / from scratch: {wall_ratio:.1%} of the process wall time, "
        f"{pipeline_ratio:.1%} of the pipeline time** (target at this size: at most 40% of the wall time: "
        f"**{'met' if wall_ratio <= 0.40 else 'NOT met'}**); per round, "
        + ", ".join(f"{u.wall / s.wall:.1%}" for u, s in zip(updates, scratch, strict=True)) + " of the wall time. "
        f"Its attributes stage: {updates[0].summary['stages']['attributes'].get('update', '?')}.",
        f"- Exact update (`index --exact`) / from scratch: {exact_ratio:.1%} of the wall time.",
        f"- The update decomposed {decompose.get('decomposed', '?')} chunks ({decompose.get('cached', '?')} from the "
        f"cache) and computed {vectors:,} vectors; every other vector came from the last build or the embedding cache.",
        f"- Exact update's nodes.parquet and edges.parquet byte-identical to the from-scratch build: "
        f"**{'yes' if all(identical) else 'NO'}** ({sum(identical)}/{len(identical)}).",
        f"- {runs} from-scratch runs byte-identical (nodes, edges, vectors.faiss): **{'yes' if deterministic else 'NO'}**.",
        f"- From scratch: {median([s.wall for s in scratch]):.1f} s wall (target under 30 s), "
        f"peak RSS {max(s.rss_mb for s in scratch):,.0f} MB (target under 2,048 MB).",
        f"- Similarity edges in the update: {similarity.get('rows_searched', '?'):,} of "
        f"{embedded:,} "
        f"embedded nodes searched against every node (new ones, and old ones that lost more than 16 of their "
        f"80 stored candidates); {similarity.get('rows_pruned', '?'):,} had a change that can move what the heuristic "
        f"keeps (a new row it keeps, a kept candidate deleted) and were pruned again from there.",
        f"- Process start-up, paid by every run: {startup:.2f} s (wall minus pipeline time), "
        f"{startup / median([s.wall for s in scratch]):.0%} of the from-scratch time. A run with nothing to do "
        f"(the same folder again: start-up, scan, checks) takes {median([u.wall for u in unchanged]):.2f} s, "
        f"{median([u.wall for u in unchanged]) / median([s.wall for s in scratch]):.0%} of the from-scratch time.",
    ]
    if with_kill:
        lines += ["", *kill_section(final, work, reference)]
    return lines


def kill_section(final: Path, work: Path, reference: Path) -> list[str]:
    workspace = work / "killed"
    shutil.rmtree(workspace, ignore_errors=True)
    points = [("decompose", 1.0), ("attributes", 0.2), ("communities", 0.3), ("embed", 0.02), ("similarity", 0.5),
              ("assemble", 0.3)]
    rows = ["### Kill and resume", "",
            "One fresh build, SIGKILLed from outside the given time after the manifest shows the stage running, "
            "then run again until it completes.", "",
            "| killed during | after (s) | exit | stage states when killed |", "|---|---:|---:|---|"]
    for stage, delay in points:
        log(f"kill during {stage} ...")
        run = run_index(workspace, final, kill=(stage, delay))
        states = json.loads((workspace / "manifest.json").read_text())["stages"]
        shown = ", ".join(f"{s} {states[s]['state']}" for s in STAGES if s in states)
        rows.append(f"| {stage} | {delay} | {run.returncode} | {shown} |")
    log("resume ...")
    resumed = run_index(workspace, final)
    same = resumed.returncode == 0 and same_files(reference, workspace)
    skipped = [s for s, info in resumed.summary.get("stages", {}).items() if info.get("skipped")]
    rows += ["", f"Resumed run: exit {resumed.returncode}, {resumed.wall:.1f} s, skipped {', '.join(skipped) or 'nothing'}; "
                 f"nodes.parquet and edges.parquet byte-identical to the uninterrupted build: **{'yes' if same else 'NO'}**."]
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
