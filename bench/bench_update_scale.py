"""What an update of 1% of the documents costs at scale, offline (issue 28's figure at 100,000).

    python -m bench.bench_update_scale [--passages 100000] [--runs 3] [--data ../shared/eval]
                                       [--work bench-out/update-scale] [--out FILE]

The corpus of `bench.corpus` (the dev sets' passages, then renamed copies) at `--passages` is the
base folder. The final folder changes 1% of it, as issue 28 defines the change: 0.5% of the files
changed (a sentence appended), 0.25% deleted (a seeded choice) and 0.25% added (the next passages
of the sequence). Three `noderag index --json` child processes, in turn: the base build of a
working folder holding the base, its update after the change is made in that folder (as a user's
folder changes, so the scan finds the untouched files by their size and times), and a fresh build
of the final folder; with `--runs N`, the update (from a copy of the base build, its folder put back
to the base in place) and the fresh build N times in turn, so that a slow spell of a shared machine
falls on both alike, each figure the median of its N runs. Reported: wall time, peak resident
memory of the process tree and seconds per stage of each, the update's share of the fresh build,
and whether the update's node and edge tables equal the fresh build's, byte for byte (required
with `--exact`; the update is incremental, the default mode, without it). Progress on stderr, the
Markdown section on stdout.
Without the data folder the section says so and the exit code is 0.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from bench.bench_scale import STAGES, candidate_recall, cli, run_measured
from bench.corpus import DEFAULT_DATA, available, sync_folder, write_corpus
from noderag_cli.index.scan import RECENT_NS

ROOT = Path(__file__).resolve().parents[1]
SEED = 20240501
RECALL_SAMPLE = 500


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def log(message: str) -> None:
    print(f"[bench_update_scale] {message}", file=sys.stderr, flush=True)


def folders(data: Path, work: Path, passages: int) -> dict[str, int]:
    """The base and final folders (see the module docstring); the counts of the change."""
    extra = max(1, passages // 400)  # 0.25% added, 0.25% deleted, 0.5% changed
    everything = work / "all"
    write_corpus(data, everything, passages + extra)
    names = sorted(p.relative_to(everything).as_posix() for p in everything.rglob("*.txt"))
    in_base, added = names[:passages], names[passages:]
    order = in_base[:]
    random.Random(SEED).shuffle(order)
    changed, deleted = set(order[: 2 * extra]), set(order[2 * extra : 3 * extra])
    base, final = work / "base", work / "final"
    for folder in (base, final):
        shutil.rmtree(folder, ignore_errors=True)
    for name in in_base + added:
        text = (everything / name).read_text(encoding="utf-8")
        if name in in_base:
            (base / name).parent.mkdir(parents=True, exist_ok=True)
            (base / name).write_text(text, encoding="utf-8")
        if name in deleted:
            continue
        if name in changed:
            text = text.rstrip("\n") + f" A revision note ({name}) records that this passage was checked again.\n"
        (final / name).parent.mkdir(parents=True, exist_ok=True)
        (final / name).write_text(text, encoding="utf-8")
    return {"base": len(in_base), "changed": len(changed), "deleted": len(deleted), "added": len(added)}


def restore_base(work: Path) -> None:
    """The working folder back to the base, in place: only the files the change touched are
    written again, so the others keep the inode and times the base build's scan saw, as a user's
    untouched files do. (A copy of the folder gives every file a new inode and change time: the
    update's scan then reads all of them again, 6.6 s against 2.4 s at 100,000 passages.)"""
    sync_folder(work / "base", work / "live")


def build_file(workspace: Path, name: str) -> Path:
    return workspace / "generations" / (workspace / "CURRENT").read_text().strip() / name


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over `runs` (the peak: the highest); the counts of the first."""
    return {**runs[0], "wall": statistics.median(run["wall"] for run in runs), "peak": max(run["peak"] for run in runs),
            "outside": statistics.median(run["outside"] for run in runs),
            "seconds": {s: statistics.median(run["seconds"][s] for run in runs) for s in STAGES}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3, help="updates and fresh builds, in turn; medians reported")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "update-scale")
    parser.add_argument("--out", type=Path, help="also write the section to this file")
    parser.add_argument("--exact", action="store_true", help="the update in exact mode (`index --exact`), whose "
                        "tables must then equal the fresh build's (default: incremental, the default mode)")
    args = parser.parse_args(argv)
    for name in ("passages", "runs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    title = f"## An update of 1% at {args.passages:,} passages (offline)"
    if not available(args.data):
        print(f"{title}\n\nskipped: {args.data} holds no MuSiQue and HotpotQA corpora")
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    log("writing the base and final folders")
    change = folders(args.data, args.work, args.passages)
    shutil.rmtree(args.work / "live", ignore_errors=True)
    shutil.copytree(args.work / "base", args.work / "live")
    time.sleep(RECENT_NS / 1e9 + 0.1)  # files as old as a user's, so the scan remembers them

    def measure(name: str, workspace: str, folder: str) -> dict | None:
        log(f"{name} ...")
        exact = ["--exact"] if args.exact and name.startswith("update") else []
        wall, peak, code, out = run_measured(cli("index", str(args.work / workspace), "--input", str(args.work / folder),
                                                 "--json", *exact))
        if code != 0:
            print(f"{title}\n\n`noderag index` ({name}) exited {code}")
            return None
        stages = json.loads(out)["stages"]
        log(f"  {wall:.0f} s, peak {peak:,.0f} MB")
        seconds = {s: stages[s].get("seconds", 0.0) for s in STAGES}
        return {"wall": wall, "peak": peak, "seconds": seconds, "outside": wall - sum(seconds.values()),
                "similarity": stages["similarity"], "decompose": stages["decompose"]}

    shutil.rmtree(args.work / "ws-update", ignore_errors=True)
    runs = {"base build": measure("base build", "ws-update", "live")}
    if runs["base build"] is None:
        return 1
    shutil.rmtree(args.work / "ws-update-base", ignore_errors=True)
    if args.runs > 1:  # the workspace each later update starts from
        shutil.copytree(args.work / "ws-update", args.work / "ws-update-base")
    updates, freshes = [], []
    for turn in range(args.runs):
        if turn:  # back to the base build, and the folder back to the base in place (`restore_base`)
            shutil.rmtree(args.work / "ws-update")
            shutil.copytree(args.work / "ws-update-base", args.work / "ws-update")
            restore_base(args.work)
        sync_folder(args.work / "final", args.work / "live")
        updates.append(measure(f"update ({turn + 1} of {args.runs})", "ws-update", "live"))
        if updates[-1] is None:
            return 1
        shutil.rmtree(args.work / "ws-fresh", ignore_errors=True)
        freshes.append(measure(f"fresh build (final, {turn + 1} of {args.runs})", "ws-fresh", "final"))
        if freshes[-1] is None:
            return 1
    runs["update"], runs["fresh build (final)"] = median_run(updates), median_run(freshes)
    equal = all(build_file(args.work / "ws-update", n).read_bytes() == build_file(args.work / "ws-fresh", n).read_bytes()
                for n in ("nodes.parquet", "edges.parquet"))
    update, fresh = runs["update"], runs["fresh build (final)"]
    log("similarity lists against exact ones ...")
    recall = {name: candidate_recall(args.work / workspace, RECALL_SAMPLE)
              for name, workspace in (("update", "ws-update"), ("fresh", "ws-fresh"))}
    lines = [title, "",
             f"Command: `python -m bench.bench_update_scale --passages {args.passages}`. Base: {change['base']:,} "
             f"passages; the update changes {change['changed']:,}, deletes {change['deleted']:,} and adds "
             f"{change['added']:,}, {'in exact mode (`--exact`)' if args.exact else 'incrementally (the default mode)'}. "
             "Each figure is one `noderag index` child process; peak RSS of its process tree"
             + (f"; the update and the fresh build {args.runs} times in turn, each figure the median of its runs "
                "(the peak: the highest)" if args.runs > 1 else "") + ".", "",
             "| stage | base build | update | fresh build (final) | update / fresh |", "|---|---:|---:|---:|---:|"]
    for stage in STAGES:
        u, f = update["seconds"][stage], fresh["seconds"][stage]
        lines.append(f"| {stage} | {runs['base build']['seconds'][stage]:.1f} | {u:.1f} | {f:.1f} | "
                     f"{u / f:.0%} |" if f else f"| {stage} | | {u:.1f} | {f:.1f} | |")
    outside = {name: run["outside"] for name, run in runs.items()}  # start-up, the scan and what no stage times
    lines.append(f"| start-up and scan | {outside['base build']:.1f} | {outside['update']:.1f} | "
                 f"{outside['fresh build (final)']:.1f} | {outside['update'] / outside['fresh build (final)']:.0%} |")
    lines += [f"| **process wall time** | **{runs['base build']['wall']:.0f}** | **{update['wall']:.0f}** | "
              f"**{fresh['wall']:.0f}** | **{update['wall'] / fresh['wall']:.1%}** |",
              f"| peak RSS (MB) | {runs['base build']['peak']:,.0f} | {update['peak']:,.0f} | {fresh['peak']:,.0f} | |", "",
              f"- Update / fresh build: **{update['wall'] / fresh['wall']:.1%} of the wall time** (issue 38's target: "
              "at most 20%)" + ("; turn by turn (update / fresh build): "
                               + ", ".join(f"{u['wall']:.0f} / {f['wall']:.0f} s" for u, f in zip(updates, freshes, strict=True))
                               if args.runs > 1 else "") + ".",
              f"- The update decomposed {update['decompose'].get('decomposed', '?'):,} chunks "
              f"({update['decompose'].get('cached', '?'):,} from the last run) and searched "
              f"{update['similarity'].get('rows_searched', '?'):,} similarity lists (the fresh build "
              f"{fresh['similarity'].get('rows_searched', '?'):,})"
              + f" ({update['similarity'].get('update', 'exact lists, below `similarity.exact_below`')}): only new "
              "rows and rows that lost more than their spare candidates are searched; in exact mode (or a full "
              "build) above `similarity.exact_below` every list is, against centroids trained afresh.",
              f"- Similarity lists' recall@64 against exact lists ({RECALL_SAMPLE} sampled nodes of each): update "
              f"{_share(recall['update'])}, fresh build {_share(recall['fresh'])}.",
              f"- Update's nodes.parquet and edges.parquet byte-identical to the fresh build: **{'yes' if equal else 'NO'}**"
              + (" (required in exact mode)." if args.exact else " (not expected of an incremental update).")]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0 if equal or not args.exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
