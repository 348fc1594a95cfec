"""Indexing and search as the corpus grows: 2,000 to 100,000 passages, offline, on this machine.

    python -m bench.bench_scale [--sizes 2000,8000,32000,100000] [--data ../shared/eval]
                                     [--work bench-out/scale] [--runs 5] [--questions 50] [--out FILE]

Each size is a corpus from `bench.corpus` (the dev sets' passages, then renamed copies; a
smaller corpus is a prefix of a larger one) indexed from scratch by a `noderag index --json` child
process (or, with `--reuse-builds`, the builds and figures a previous run left). Per size: wall time, seconds and peak resident memory per stage (the stages' own report),
peak resident memory of the whole process tree (the indexing process and its workers, sampled
every 0.2 s from /proc), disk (files counted once however many names they have) against the raw
text, retrieval latency in-process (`api.open_workspace`, MuSiQue's questions: the median of
`--runs` rounds per question, then p50 and p95 over the questions), one `noderag query
--context-only` process (median of `--runs`), and how many of the exact 64 nearest neighbours the
similarity candidates hold (`--sample` nodes). Then growth exponents between sizes, per stage and
for the whole build. Prints a Markdown section; progress goes to stderr. Without the data folder
the section says so and the exit code is 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from bench.corpus import DEFAULT_DATA, available, write_corpus, write_small_files
from noderag_cli.executor import tree_resident_mb
from noderag_cli.index.outputs import NEIGHBOURS, VECTOR_IDS, VECTORS
from noderag_cli.index.stages import STAGE_NAMES
from noderag_cli.workspace import Workspace

ROOT = Path(__file__).resolve().parents[1]
STAGES = STAGE_NAMES


def log(message: str) -> None:
    print(f"[bench_scale] {message}", file=sys.stderr, flush=True)


def run_measured(command: list[str], stderr: Path | None = None) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS of the process tree in MB, exit code, stdout) of a child process;
    its stderr into the file `stderr`, if given."""
    out_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-scale-{os.getpid()}.out"
    with open(out_path, "wb") as out, open(stderr or os.devnull, "wb") as err:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=out, stderr=err, cwd=ROOT)
        peak, stop = [0.0], threading.Event()

        def sample() -> None:
            while not stop.wait(0.2):
                peak[0] = max(peak[0], tree_resident_mb(process.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        code = process.wait()
        wall = time.perf_counter() - started
        stop.set()
        sampler.join()
    text = out_path.read_text()
    out_path.unlink()
    return wall, peak[0], code, text


def file_sizes(folder: Path) -> dict[str, int]:
    """Bytes of each of a folder's files by path relative to it, each inode once (a hard link is
    not a second copy)."""
    seen, sizes = set(), {}
    for base, _, files in os.walk(folder):
        for name in files:
            info = os.lstat(os.path.join(base, name))
            if (info.st_dev, info.st_ino) not in seen:
                seen.add((info.st_dev, info.st_ino))
                sizes[os.path.relpath(os.path.join(base, name), folder)] = info.st_size
    return sizes


def disk_bytes(folder: Path) -> int:
    return sum(file_sizes(folder).values())


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "noderag_cli.cli", *args]


def retrieval_latency(workspaces: dict[int, Path], questions: list[str], rounds: int) -> dict[int, tuple[float, float]]:
    """Per size, p50 and p95 over the questions of each question's median retrieval time in ms. The
    sizes take turns, question by question, so that a busy spell of a shared machine falls on all
    of them alike and the ratios between sizes hold."""
    from contextlib import ExitStack

    from noderag_cli import api

    with ExitStack() as stack:
        sessions = {size: stack.enter_context(api.open_workspace(path)) for size, path in workspaces.items()}
        for session in sessions.values():
            for question in questions[:3]:
                session.retrieve(question)  # first touches of the mapped build
        times: dict[int, list[list[float]]] = {size: [[] for _ in questions] for size in sessions}
        for _ in range(rounds):
            for position, question in enumerate(questions):
                for size, session in sessions.items():
                    times[size][position].append(session.retrieve(question).timings["retrieval_ms"])
    medians = {size: [statistics.median(t) for t in per_question] for size, per_question in times.items()}
    return {size: (float(np.percentile(m, 50)), float(np.percentile(m, 95))) for size, m in medians.items()}


def candidate_recall(workspace: Path, sample: int, seed: int = 0) -> float | None:
    """The share of the exact 64 nearest neighbours (by the grid's exact cosine) that a node's
    stored similarity list holds (its first 64: exact below similarity.exact_below, else the best
    of its probed clusters' members, of centroids trained or kept by an incremental update), over
    `sample` nodes."""
    import pyarrow as pa

    from noderag_cli import ivf
    from noderag_cli.config import load_config
    from noderag_cli.index import similarity_edges as se

    config = load_config(workspace / "config.yaml")
    vectors = ivf.read_flat(VECTORS.path(Workspace(workspace)))
    lists = NEIGHBOURS.read(Workspace(workspace), ["candidates"])["candidates"]
    n, k = len(vectors), config.similarity.neighbours
    if lists.length() != n:
        return None
    grid = ivf.quantised(vectors)
    rows = np.sort(np.random.default_rng(seed).choice(n, min(sample, n), replace=False))
    exact, _ = se.top_k(se.scores_against(grid, rows), rows, k)
    stored = lists.combine_chunks().take(pa.array(rows))
    found = [len(set(stored[i].as_py()[:k]) & set(exact[i].tolist())) / k for i in range(len(rows))]
    return float(np.mean(found))


def crossover(workspace: Path, exact_sizes: list[int], clustered_sizes: list[int], scan_sizes: list[int],
              queries: int = 200) -> list[str]:
    """Where each path is faster, on prefixes of the largest build's vectors (rows are sorted by id,
    so a prefix is a random sample): the similarity lists exactly and from clusters (seconds, and
    the share of the exact 64 found on 300 sampled rows), and the vector side's top 10 by the int8
    scan and by probing clusters (ms per question, median of `queries` questions: the build's own
    vectors with a little noise), each as the query path runs it (one thread, compiled kernels)."""

    from noderag_cli import ivf
    from noderag_cli.config import SearchConfig, SimilarityConfig
    from noderag_cli.index import similarity_edges as se
    from noderag_cli.search import kernels
    from noderag_cli.search.prepare import int8_codes, scan8, vector_clusters
    from noderag_cli.search.vectors import inner_products_at, one_thread, probe_top, rounded_to_int8

    ids = VECTOR_IDS.read(Workspace(workspace))["id"].to_pylist()
    vectors = ivf.read_flat(VECTORS.path(Workspace(workspace)))
    lines = ["| embedded nodes | exact lists s | clustered lists s | clustered recall@64 |", "|---:|---:|---:|---:|"]
    probes = SimilarityConfig().probes
    for n in sorted(set(exact_sizes) | set(clustered_sizes)):
        keys = se.keys(ids[:n], vectors[:n])
        exact_s = clustered_s = recall = None
        if n in exact_sizes:
            started = time.perf_counter()
            exact = se.neighbour_lists(keys, vectors[:n], 64)
            exact_s = time.perf_counter() - started
        if n in clustered_sizes:
            started = time.perf_counter()
            clustered = se.clustered_lists(keys, vectors[:n], 64, 42, probes, se.ASSIGN)
            clustered_s = time.perf_counter() - started
            rows = np.sort(np.random.default_rng(0).choice(n, 300, replace=False))
            truth = exact.candidates[rows, :64] if exact_s is not None else \
                se.top_k(se.scores_against(ivf.quantised(vectors[:n]), rows), rows, 64)[0]
            recall = np.mean([len(set(clustered.candidates[r, :64].tolist()) & set(t.tolist())) / 64
                              for r, t in zip(rows, truth, strict=True)])
        lines.append(f"| {n:,} | {'-' if exact_s is None else f'{exact_s:.1f}'} | "
                     f"{'-' if clustered_s is None else f'{clustered_s:.1f}'} | {'-' if recall is None else f'{recall:.3f}'} |")
    lines += ["", "| S, A, H vectors | int8 scan ms | probing clusters ms | probed top 10 = exact top 10 |",
              "|---:|---:|---:|---:|"]
    rng = np.random.default_rng(1)
    search = SearchConfig()
    for n in scan_sizes:
        part = np.ascontiguousarray(vectors[:n])
        index, scale, _ = scan8(part)
        centroids, indptr, members = vector_clusters(part, [str(i) for i in range(n)], 42)
        codes = int8_codes(part[members])[0].astype(np.int8)
        picked = part[rng.choice(n, queries, replace=False)] + rng.normal(0, 0.02, (queries, part.shape[1])).astype(np.float32)
        picked /= np.linalg.norm(picked, axis=1, keepdims=True)
        scan_ms, probe_ms, same = [], [], 0
        for query in picked:
            started = time.perf_counter()
            rounded = rounded_to_int8(query)[0].astype(np.float32)
            with one_thread():  # as the query path scans
                _, found = index.search(rounded[None, :], 58)
            exact = inner_products_at(part, query, found[0])
            top_scan = found[0][np.lexsort((found[0], -exact))[:10]]
            scan_ms.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            top_probe = probe_top(centroids, indptr, members, codes, part, query, 10, search.vector_probes, kernels)[0]
            probe_ms.append((time.perf_counter() - started) * 1000)
            same += set(top_scan.tolist()) == set(top_probe.tolist())
        lines.append(f"| {n:,} | {statistics.median(scan_ms):.3f} | {statistics.median(probe_ms):.3f} | "
                     f"{same / queries:.2f} |")
    return lines


def exponent(small: float, large: float, n_small: int, n_large: int) -> float:
    if small <= 0 or large <= 0:
        return float("nan")
    return math.log(large / small) / math.log(n_large / n_small)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2000,8000,32000,100000")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "scale")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--sample", type=int, default=500)
    parser.add_argument("--out", type=Path, help="also write the section to this file")
    parser.add_argument("--small-files", type=int, default=200_000,
                        help="also index a folder of this many one-sentence files (0: skip)")
    parser.add_argument("--reuse-builds", action="store_true",
                        help="measure search on the builds a previous run left in --work (their index figures kept)")
    parser.add_argument("--no-crossover", dest="crossover", action="store_false",
                        help="skip measuring where the exact and the clustered paths cross")
    args = parser.parse_args(argv)
    title = "## Scale: indexing and search from 2,000 to 100,000 passages"
    if not available(args.data):
        print(f"{title}\n\nskipped: {args.data} holds no MuSiQue and HotpotQA corpora")
        return 0
    sys.path.insert(0, str(ROOT))
    sizes = [int(s) for s in args.sizes.split(",")]
    questions = [q["question"] for q in json.loads((args.data / "musique" / "questions.json").read_text())]
    questions = questions[: args.questions]
    rows = {}
    for size in sizes:
        corpus, workspace = args.work / f"corpus-{size}", args.work / f"ws-{size}"
        if args.reuse_builds and (args.work / f"build-{size}.json").is_file() and workspace.is_dir():
            rows[size] = json.loads((args.work / f"build-{size}.json").read_text())
            log(f"{size:,} passages: the build of {rows[size]['built']} reused")
            continue
        log(f"{size:,} passages: writing the corpus")
        raw = write_corpus(args.data, corpus, size)
        shutil.rmtree(workspace, ignore_errors=True)
        log(f"{size:,} passages: indexing")
        wall, peak, code, out = run_measured(cli("index", str(workspace), "--input", str(corpus), "--json"))
        if code != 0:
            print(f"{title}\n\n`noderag index` of {size:,} passages exited {code}")
            return 1
        stages = json.loads(out)["stages"]
        manifest = json.loads((workspace / "manifest.json").read_text())["stages"]
        log(f"{size:,} passages: {wall:.0f} s, peak {peak:,.0f} MB; candidate recall")
        rows[size] = {
            "wall": wall, "peak": peak, "raw": raw, "disk": disk_bytes(workspace),
            "seconds": {s: stages[s]["seconds"] for s in STAGES},
            "stage_peak": {s: manifest[s].get("peak_rss_mb") for s in STAGES},
            "recall": candidate_recall(workspace, args.sample),
            "nodes": sum(json.loads(out).get("nodes", {}).values()),
            "built": time.strftime("%Y-%m-%d %H:%M"),
        }
        (args.work / f"build-{size}.json").write_text(json.dumps(rows[size]))
    log("searching: the sizes in turn")
    for size, (p50, p95) in retrieval_latency({s: args.work / f"ws-{s}" for s in sizes}, questions, args.runs).items():
        rows[size].update(p50=p50, p95=p95)
    walls: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.runs):
        for size in sizes:
            walls[size].append(run_measured(cli("query", str(args.work / f"ws-{size}"), questions[0],
                                                "--context-only"))[0])
    for size in sizes:
        rows[size]["query_process"] = statistics.median(walls[size])
        log(f"{size:,} passages: p50 {rows[size]['p50']:.2f} ms, query process {rows[size]['query_process']:.2f} s")
    lines = report(rows, sizes, args)
    if args.small_files:
        lines += ["", *small_files(args)]
    if args.crossover:
        log("where each path is faster")
        lines += ["", "### Where each path is faster", "",
                  f"On prefixes of the {sizes[-1]:,}-passage build's vectors (a prefix of rows sorted by id is a random "
                  "sample). The similarity lists: all pairs scored (the exact path) against the clustered index at "
                  "its default probes; recall@64 on 300 sampled nodes. The vector side: the int8 scan with its exact "
                  "rescoring against probing the clusters (`vectors.probe_top`: int8 codes, then exact rescoring); queries are build vectors plus a little noise.", "",
                  *crossover(args.work / f"ws-{sizes[-1]}", [20_000, 40_000, 80_000], [20_000, 40_000, 80_000, 160_000],
                             [10_000, 30_000, 100_000, 300_000])]
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(text, encoding="utf-8")
    print(text)
    return 0


def small_files(args) -> list[str]:
    """The many-small-files case: wall time, peak RSS and the progress a user saw."""
    corpus, workspace = args.work / f"small-{args.small_files}", args.work / f"ws-small-{args.small_files}"
    log(f"{args.small_files:,} small files: writing them")
    raw = write_small_files(args.data, corpus, args.small_files)
    shutil.rmtree(workspace, ignore_errors=True)
    log(f"{args.small_files:,} small files: indexing")
    progress = args.work / "small-files.stderr"
    wall, peak, code, out = run_measured(cli("index", str(workspace), "--input", str(corpus), "--json"), progress)
    lines = progress.read_text(errors="replace").splitlines()
    verdict = (f"{json.loads(out).get('documents', {}).get('new', 0):,} documents indexed" if code == 0 else
               f"exited {code}: {lines[-1] if lines else 'no message'}")
    return ["### A folder of many small files", "",
            f"`noderag index` of {args.small_files:,} files of one sentence each ({raw / 1e6:.1f} MB, a thousand "
            f"files to a folder; `bench/corpus.py`'s `write_small_files`), stderr not a terminal: {verdict} in "
            f"**{wall / 60:.1f} min**, peak RSS of the process tree **{peak:,.0f} MB**, {len(lines):,} lines of "
            f"progress on stderr; disk {disk_bytes(workspace) / 1e6:,.0f} MB."]


def report(rows: dict, sizes: list[int], args) -> list[str]:
    lines = ["## Scale: indexing and search from 2,000 to 100,000 passages", "",
             f"Command: `python -m bench.bench_scale --sizes {args.sizes} --runs {args.runs} --questions "
             f"{args.questions}` (`make bench-scale`). Corpora from `bench/corpus.py`: the dev sets' passages, "
             "then copies with every capitalised word renamed; each size indexed from scratch, offline, by one "
             "`noderag index` process and its workers. Peak RSS: the whole process tree, sampled every 0.2 s. "
             f"Latency: MuSiQue's first {args.questions} questions, the median of {args.runs} rounds each, then p50 "
             "and p95 over the questions; the query process: `noderag query --context-only`, the median of "
             f"{args.runs} runs; the sizes take turns in both, so that the machine's busy spells fall on all "
             f"alike. Builds made {', '.join(sorted({rows[s]['built'] for s in sizes}))}.", "",
             "| passages | nodes | wall s | peak RSS MB | disk MB | disk / raw text | retrieval p50 ms | p95 ms | "
             "query process s | candidate recall@64 |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for size in sizes:
        r = rows[size]
        lines.append(f"| {size:,} | {r['nodes']:,} | {r['wall']:.1f} | {r['peak']:,.0f} | {r['disk'] / 1e6:,.0f} | "
                     f"{r['disk'] / r['raw']:.1f}x | {r['p50']:.2f} | {r['p95']:.2f} | {r['query_process']:.2f} | "
                     f"{r['recall']:.3f} |")
    lines += ["", "Seconds per stage (and the stage's own peak RSS in MB, the indexing process without its "
              "workers):", "", "| stage | " + " | ".join(f"{s:,}" for s in sizes) + " |",
              "|---|" + "---:|" * len(sizes)]
    for stage in STAGES:
        cells = [f"{rows[s]['seconds'][stage]:.1f} ({rows[s]['stage_peak'][stage] or 0:,})" for s in sizes]
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append("| **process wall time** | " + " | ".join(f"**{rows[s]['wall']:.1f}**" for s in sizes) + " |")
    if len(sizes) > 1:
        pairs = list(zip(sizes, sizes[1:], strict=False))
        lines += ["", "Growth exponents, log(time ratio) / log(size ratio):", "",
                  "| stage | " + " | ".join(f"{a:,} → {b:,}" for a, b in pairs) + " |", "|---|" + "---:|" * len(pairs)]
        for stage in STAGES:
            lines.append(f"| {stage} | " + " | ".join(
                f"{exponent(rows[a]['seconds'][stage], rows[b]['seconds'][stage], a, b):.2f}" for a, b in pairs) + " |")
        lines.append("| **whole build** | " + " | ".join(
            f"**{exponent(rows[a]['wall'], rows[b]['wall'], a, b):.2f}**" for a, b in pairs) + " |")
        lines.append("| retrieval p50 | " + " | ".join(
            f"{exponent(rows[a]['p50'], rows[b]['p50'], a, b):.2f}" for a, b in pairs) + " |")
    lines += ["", *goals(rows, sizes)]
    largest = args.work / f"ws-{sizes[-1]}"
    if largest.is_dir():
        raw = rows[sizes[-1]]["raw"]
        biggest = sorted(file_sizes(largest).items(), key=lambda item: -item[1])[:8]
        lines += ["", f"The largest files of the {sizes[-1]:,}-passage workspace (times the raw text): " + ", ".join(
            f"`{name}` {size / 1e6:,.0f} MB ({size / raw:.1f}x)" for name, size in biggest) + "."]
    return lines


BUILD_TARGETS = {  # passages: (minutes, peak RSS MB, retrieval p50 ms) of a build of that size, as the issues set them
    100_000: (15, 8_000, 10), 200_000: (12, 8_000, 10), 1_000_000: (60, 16_000, 15)}


def goals(rows: dict, sizes: list[int]) -> list[str]:
    """The issue's figures, where the sizes measured allow them."""
    out = []
    small, large = sizes[0], sizes[-1]

    def met(value: float, limit: float) -> str:
        return "" if value <= limit else " — **NOT met**"

    middle = next((s for s in sizes if s >= 8000), small)
    if large > middle:
        whole = exponent(rows[middle]["wall"], rows[large]["wall"], middle, large)
        out.append(f"- Whole-build exponent {middle:,} → {large:,}: **{whole:.2f}** (target at most 1.15){met(whole, 1.15)}.")
    r = rows[large]
    disk, p50, process = r["disk"] / r["raw"], r["p50"] / rows[small]["p50"], r["query_process"] / rows[small]["query_process"]
    minutes, peak, p50_ms = BUILD_TARGETS.get(large, BUILD_TARGETS[max(BUILD_TARGETS)])
    out.append(f"- {large:,} passages: **{r['wall'] / 60:.1f} min** (target at most {minutes}){met(r['wall'] / 60, minutes)}, "
               f"peak RSS **{r['peak']:,.0f} MB** (target at most {peak:,}){met(r['peak'], peak)}, disk **{disk:.1f}x** the "
               f"raw text (target at most 25x){met(disk, 25)}.")
    out.append(f"- Retrieval p50 at {large:,}: **{r['p50']:.2f} ms** (target at most {p50_ms}){met(r['p50'], p50_ms)}, "
               f"{p50:.2f}x its value at {small:,} (target at most 2x){met(p50, 2)}; one query process "
               f"{process:.2f}x (target at most 1.2x){met(process, 1.2)}.")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
