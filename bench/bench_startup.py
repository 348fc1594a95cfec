"""How long the CLI takes to answer before any work: `noderag --help`, `--version` and a
subcommand's `--help`, against a process that only imports Typer (the floor any Typer CLI pays);
an `index` with nothing to do, with the LLM engine (a workspace built through the fault
server of devtools, which is then stopped) against the offline engine; and `make demo`'s query
on its workspace, start-up included.

Every command runs ROUNDS times, interleaved so the machine's drift hits all alike; medians.

    python -m bench.bench_startup [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROUNDS = 15
HELP_TARGET_S = 0.3
LLM_INDEX_TARGET = 1.5
DEMO_QUERY_TARGET_S = 1.0
CLI = [sys.executable, "-c", "import sys; sys.argv[0] = 'noderag'; from noderag_cli.cli import main; main()"]
COMMANDS = {
    "import typer only": [sys.executable, "-c", "import typer"],
    "noderag --help": [*CLI, "--help"],
    "noderag --version": [*CLI, "--version"],
    "noderag query --help": [*CLI, "query", "--help"],
}


def wall(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, capture_output=True)
    return time.perf_counter() - started


def demo_question() -> str:
    """The question `make demo` asks (the Makefile's DEMO_Q)."""
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text(encoding="utf-8")
    return next(line.split("=", 1)[1].strip() for line in makefile.splitlines() if line.startswith("DEMO_Q"))


def nothing_to_do_commands(work: Path) -> dict[str, list[str]]:
    """`noderag index` of sample_corpus into a workspace already up to date: offline, and with
    an LLM engine whose server is gone (nothing to ask, so nothing may reach for it)."""
    from devtools.fault_server import FaultServer

    corpus = Path(__file__).resolve().parents[1] / "sample_corpus"
    offline, llm = work / "offline-ws", work / "llm-ws"
    subprocess.run([*CLI, "index", str(offline), "--input", str(corpus)], check=True, capture_output=True)
    with FaultServer(default="rich") as server:
        config = work / "llm.yaml"
        config.write_text(f"llm: {{engine: litellm, model: openai/fault-model, api_base: '{server.url}'}}\n")
        subprocess.run([*CLI, "index", str(llm), "--input", str(corpus), "--config", str(config)], check=True,
                       capture_output=True)
    return {"index, nothing to do, offline": [*CLI, "index", str(offline), "--input", str(corpus)],
            "index, nothing to do, LLM engine": [*CLI, "index", str(llm), "--input", str(corpus)],
            "make demo's query": [*CLI, "query", str(offline), demo_question(), "--show-context", "--budget", "1000"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    scratch = tempfile.TemporaryDirectory(prefix="noderag-startup-")
    COMMANDS.update(nothing_to_do_commands(Path(scratch.name)))
    for command in COMMANDS.values():  # warm the file cache and Python's bytecode cache
        wall(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            times[name].append(wall(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor = medians["import typer only"]
    help_s = medians["noderag --help"]
    demo_s = medians["make demo's query"]
    lines = ["## Start-up", "", f"`python -m bench.bench_startup --rounds {args.rounds}`: wall time of a whole "
             f"process, median of {args.rounds} interleaved rounds.", "",
             "| command | median s | × import-typer-only |", "|---|---:|---:|"]
    lines += [f"| {name} | {value:.3f} | {value / floor:.2f} |" for name, value in medians.items()]
    verdict = "met" if help_s <= HELP_TARGET_S else "NOT met"
    llm_ratio = medians["index, nothing to do, LLM engine"] / medians["index, nothing to do, offline"]
    llm_verdict = "met" if llm_ratio <= LLM_INDEX_TARGET else "NOT met"
    lines += ["", f"`noderag --help` {help_s:.3f} s against a target of at most {HELP_TARGET_S} s: {verdict} "
              f"(the Typer-only floor is {floor:.3f} s).",
              f"`noderag index` with nothing to do, LLM engine / offline: {llm_ratio:.2f}x against a target of at "
              f"most {LLM_INDEX_TARGET}x: {llm_verdict}.",
              f"`noderag query` on the demo workspace (make demo's question, its context shown): "
              f"{demo_s:.3f} s against a target of at most {DEMO_QUERY_TARGET_S} s: "
              f"{'met' if demo_s <= DEMO_QUERY_TARGET_S else 'NOT met'}."]
    print("\n".join(lines))
    scratch.cleanup()
    return 0 if help_s <= HELP_TARGET_S and llm_ratio <= LLM_INDEX_TARGET and demo_s <= DEMO_QUERY_TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
