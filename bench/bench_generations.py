"""Opening a workspace in constant time: one `noderag query` process on MuSiQue and on a workspace
of more than 16,000 passages, against a process that only imports the query path's modules, and
MuSiQue's index time against the code before generations. Prints a Markdown section.

    python -m bench.bench_generations [--data ../shared/eval] [--work bench-out] [--copies 5]
                                           [--runs 7] [--baseline 84898c1]

The large corpus is MuSiQue's and HotpotQA's passages, then `--copies` renamed copies of them:
every capitalised word of a title and a text is replaced by a pseudo-word drawn from a hash of the
word and the copy's number, so each copy brings new texts, titles and entities (numbers and the
rest of the wording stay). Its workspace is built once and kept in `--work` (a later run finds
every stage unchanged).

Every measured run is a child process; wall time and peak RSS come from `os.wait4`. Runs are
interleaved (import-only, MuSiQue, large, in turn) and reported as medians, so the machine's drift
touches all three alike. The index-time baseline runs the code of `--baseline` (extracted with
`git archive`) in the same virtual environment, fresh builds alternating with the current code's.
Progress goes to stderr; without the data folder the section says so and the exit code is 0.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION_INDEX = 0  # MuSiQue's first question: its passages are in both workspaces
SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "xe", "zu", "ba", "de", "fi", "go", "hu", "ja"]
CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")


def log(message: str) -> None:
    print(f"[bench_generations] {message}", file=sys.stderr, flush=True)


def pseudo_word(word: str, copy: int) -> str:
    digest = hashlib.blake2b(f"{copy}\x1f{word}".encode(), digest_size=8).digest()
    return "".join(SYLLABLES[b % len(SYLLABLES)] for b in digest[: 2 + digest[7] % 3]).capitalize()


def renamed(text: str, copy: int) -> str:
    return text if copy == 0 else CAPITALISED.sub(lambda m: pseudo_word(m.group(0), copy), text)


def passages(data: Path) -> list[tuple[str, str]]:
    musique = json.loads((data / "musique" / "corpus.json").read_text(encoding="utf-8"))
    hotpot = json.loads((data / "hotpotqa" / "corpus.json").read_text(encoding="utf-8"))
    return [(p["title"], p["text"]) for p in musique] + [(t, "".join(s)) for t, s in hotpot.items()]


def write_large_corpus(data: Path, folder: Path, copies: int) -> int:
    """The corpus and its renamed copies, one passage per file (title on the first line)."""
    base = passages(data)
    count = 0
    for copy in range(copies + 1):
        part = folder / f"c{copy}"
        part.mkdir(parents=True, exist_ok=True)
        for position, (title, text) in enumerate(base):
            target = part / f"p{position:05d}.txt"
            body = f"{renamed(title, copy)}\n{renamed(text, copy)}\n"
            if not target.is_file() or target.read_text(encoding="utf-8") != body:
                target.write_text(body, encoding="utf-8")
            count += 1
    return count


def run_child(command: list[str], env: dict | None = None) -> tuple[float, float, int, str]:
    """(wall seconds, peak RSS MB, exit code, stdout) of one child process."""
    out = tempfile.TemporaryFile()
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL, cwd=ROOT, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - started
    out.seek(0)
    return wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), out.read().decode()


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "noderag_cli.cli", *args]


def query_modules(workspace: Path, question: str) -> list[str]:
    """Every module a `noderag query --context-only` process has imported once it has answered."""
    probe = ("import sys, runpy\n"
             "sys.argv = ['noderag', 'query', sys.argv[1], sys.argv[2], '--context-only']\n"
             "from noderag_cli import cli\n"
             "try:\n    cli.app()\nexcept SystemExit:\n    pass\n"
             "print('\\n'.join(sorted(m for m in sys.modules if not m.startswith('__'))), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, str(workspace), question], capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    return [m for m in done.stderr.splitlines() if m and " " not in m]


MEMORY_PROBE = """
import re, sys
from noderag_cli import api, cli  # what a query process imports
session = api.open_workspace(sys.argv[1], compiled=False)  # what `noderag query --context-only` does
session.ask(sys.argv[2], answer=False)
status = dict(line.split(':', 1) for line in open('/proc/self/status') if ':' in line)
mapped = 0
for entry in re.split(r'\\n(?=[0-9a-f]+-[0-9a-f]+ )', open('/proc/self/smaps').read()):
    if '/generations/' in entry.splitlines()[0]:
        mapped += int(re.search(r'^Rss:\\s+(\\d+)', entry, re.M).group(1))
print(int(status['RssAnon'].split()[0]) // 1024, int(status['RssFile'].split()[0]) // 1024, mapped // 1024,
      file=sys.stderr)
"""


def memory_split(workspace: Path, question: str) -> tuple[int, int, int]:
    """(private RSS, file-backed RSS, of which the build's mapped files) in MB once a question is
    answered, the build still open (as in a `noderag query` process before it exits)."""
    done = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(workspace), question], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)
    anon, file_backed, mapped = (int(x) for x in done.stderr.strip().splitlines()[-1].split())
    return anon, file_backed, mapped


def large_build_seconds(workspace: Path) -> float:
    """The build's cost as its manifest records it: each stage's seconds, from the last time it ran."""
    stages = json.loads((workspace / "manifest.json").read_text())["stages"]
    return sum(info.get("seconds", 0.0) for info in stages.values())


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def index_time_section(corpus: Path, work: Path, baseline: str, rounds: int) -> list[str]:
    """MuSiQue fresh builds, the current code against `baseline`'s, alternating."""
    old_code = work / f"code-{baseline}"
    if not (old_code / "noderag_cli").is_dir():
        old_code.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", baseline, "noderag_cli"], capture_output=True, cwd=ROOT)
        if archive.returncode != 0:
            return [f"- Index-time baseline skipped: `git archive {baseline}` failed ({archive.stderr.decode().strip()})."]
        subprocess.run(["tar", "-x", "-C", str(old_code)], input=archive.stdout, check=True)
    old_cli = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(old_code)!r}); "
               "sys.argv[0] = 'noderag'; from noderag_cli.cli import main; main()"]
    times: dict[str, list[float]] = {"current": [], baseline: []}
    for round_ in range(rounds):
        for name, command in (("current", cli()), (baseline, old_cli)):
            workspace = work / f"index-{name}"
            shutil.rmtree(workspace, ignore_errors=True)
            wall, _, code, _ = run_child([*command, "index", str(workspace), "--input", str(corpus), "--json"])
            if code != 0:
                return [f"- Index-time comparison failed: `{name}` exited {code}."]
            times[name].append(wall)
            log(f"index round {round_ + 1}: {name} {wall:.1f} s")
        shutil.rmtree(work / "index-current", ignore_errors=True)
        shutil.rmtree(work / f"index-{baseline}", ignore_errors=True)
    now, before = median(times["current"]), median(times[baseline])
    ratios = [a / b for a, b in zip(times["current"], times[baseline], strict=True)]
    return [f"- MuSiQue fresh build, `noderag index` wall time, median of {rounds} alternating rounds: current "
            f"**{now:.2f} s**, {baseline} (before generations) {before:.2f} s: **{now / before:.2f}x** "
            f"(per round: {', '.join(f'{r:.2f}' for r in ratios)}; target at most 1.1x)."]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "eval")
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out")
    parser.add_argument("--copies", type=int, default=5)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--index-rounds", type=int, default=3)
    parser.add_argument("--baseline", default="84898c1")
    args = parser.parse_args(argv)
    title = "## Opening a workspace: one query process at MuSiQue size and at 17,000 passages"
    if not (args.data / "musique" / "corpus.json").is_file() or not (args.data / "hotpotqa" / "corpus.json").is_file():
        print(f"{title}\n\nskipped: {args.data} holds no MuSiQue and HotpotQA corpora")
        return 0
    sys.path.insert(0, str(ROOT))
    from noderag_cli.evaluate.datasets import load_musique

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    questions = load_musique(args.data / "musique", work / "musique-corpus")
    question = questions[QUESTION_INDEX].question
    large_corpus = work / "large-corpus"
    passages_count = write_large_corpus(args.data, large_corpus, args.copies)
    workspaces = {"musique": work / "musique-ws", "large": work / "large-ws"}
    built = {}
    for name, corpus in (("musique", work / "musique-corpus"), ("large", large_corpus)):
        log(f"indexing {name} (kept in {workspaces[name]})")
        wall, rss, code, out = run_child(cli("index", str(workspaces[name]), "--input", str(corpus), "--json"))
        if code != 0:
            print(f"{title}\n\n`noderag index` of {name} exited {code}")
            return 1
        built[name] = (wall, rss, json.loads(out))
    modules = query_modules(workspaces["musique"], question)
    import_only = [sys.executable, "-c", "import importlib, sys\nfor m in sys.argv[1:]:\n"
                   "    try:\n        importlib.import_module(m)\n    except Exception:\n        pass", *modules]
    opener = ("import sys, time\nfrom noderag_cli import api\nt = time.perf_counter()\n"
              "session = api.open_workspace(sys.argv[1], compiled=False)\nprint(time.perf_counter() - t)")
    measured: dict[str, list[tuple[float, float]]] = {k: [] for k in ("import", "musique", "large")}
    opened: dict[str, list[float]] = {"musique": [], "large": []}
    for run in range(args.runs):
        wall, rss, code, _ = run_child(import_only)
        measured["import"].append((wall, rss))
        for name, workspace in workspaces.items():
            wall, rss, code, _ = run_child(cli("query", str(workspace), question, "--context-only"))
            if code != 0:
                print(f"{title}\n\n`noderag query` on {name} exited {code}")
                return 1
            measured[name].append((wall, rss))
            _, _, code, out = run_child([sys.executable, "-c", opener, str(workspace)])
            opened[name].append(float(out.strip().splitlines()[-1]))
        log(f"round {run + 1}: " + ", ".join(f"{k} {v[-1][0]:.2f} s" for k, v in measured.items()))
    split = {name: memory_split(workspace, question) for name, workspace in workspaces.items()}
    wall = {k: median([w for w, _ in v]) for k, v in measured.items()}
    rss = {k: median([r for _, r in v]) for k, v in measured.items()}
    open_s = {k: median(v) for k, v in opened.items()}
    counts = {name: sum(info[2].get("nodes", {}).values()) for name, info in built.items()}
    size_mb = {name: sum(p.stat().st_size for p in (workspaces[name] / "generations").rglob("*") if p.is_file()) / 1e6
               for name in workspaces}
    checks = [
        ("query process, large / MuSiQue", wall["large"] / wall["musique"], 1.2),
        ("query process on large / import-only process", wall["large"] / wall["import"], 1.3),
        ("`api.open_workspace`, large / MuSiQue", open_s["large"] / open_s["musique"], 1.5),
        ("query process peak RSS, large / MuSiQue", rss["large"] / rss["musique"], 1.3),
        ("query process private memory, large / MuSiQue", split["large"][0] / split["musique"][0], 1.3),
    ]
    lines = [title, "",
             f"Command: `python -m bench.bench_generations --copies {args.copies} --runs {args.runs}` (part of "
             "`make bench`). The large workspace: MuSiQue's and HotpotQA's corpora and "
             f"{args.copies} renamed copies, **{passages_count:,} passages**, {counts['large']:,} nodes "
             f"({counts['musique']:,} at MuSiQue size); its stages' recorded times add up to "
             f"{large_build_seconds(workspaces['large']):.0f} s (the last time each ran; `index` on it in this "
             f"run took {built['large'][0]:.0f} s, peak RSS {built['large'][1]:,.0f} MB). Current build on disk: "
             f"{size_mb['musique']:.0f} MB and {size_mb['large']:.0f} MB. Each process asks "
             f"MuSiQue's question {QUESTION_INDEX + 1} with `--context-only`; medians of {args.runs} interleaved "
             f"rounds. The import-only process imports the {len(modules)} modules a query process has loaded.", "",
             "| process | wall s | peak RSS MB | of it private (anonymous) MB | build files mapped MB | "
             "`api.open_workspace` s |", "|---|---:|---:|---:|---:|---:|",
             f"| import-only | {wall['import']:.3f} | {rss['import']:.0f} | - | - | - |",
             f"| query, MuSiQue | {wall['musique']:.3f} | {rss['musique']:.0f} | {split['musique'][0]} | "
             f"{split['musique'][2]} | {open_s['musique']:.4f} |",
             f"| query, large | {wall['large']:.3f} | {rss['large']:.0f} | {split['large'][0]} | "
             f"{split['large'][2]} | {open_s['large']:.4f} |", "",
             "Peak RSS counts the pages of the memory-mapped build that a question touched; the kernel maps them "
             "in blocks (fault-around), so a few hundred scattered reads map most of a small file. The private "
             "(anonymous) memory, what the process itself allocates, is the part that would grow if it loaded "
             "the workspace. Private and mapped figures: one extra process each, read from /proc at its end.", "",
             "| figure | measured | target | met |", "|---|---:|---:|---|"]
    lines += [f"| {name} | {value:.2f}x | at most {target}x | {'yes' if value <= target else 'no'} |"
              for name, value, target in checks]
    lines += ["", *index_time_section(work / "musique-corpus", work, args.baseline, args.index_rounds)]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
