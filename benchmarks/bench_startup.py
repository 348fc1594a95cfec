"""How long the CLI takes to answer before any work: `noderag --help`, `--version` and a
subcommand's `--help`, against a process that only imports Typer (the floor any Typer CLI pays).

Every command runs ROUNDS times, interleaved so the machine's drift hits all alike; medians.

    python -m benchmarks.bench_startup [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

ROUNDS = 15
HELP_TARGET_S = 0.3
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    args = parser.parse_args(argv)
    for command in COMMANDS.values():  # warm the file cache and Python's bytecode cache
        wall(command)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            times[name].append(wall(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    floor = medians["import typer only"]
    help_s = medians["noderag --help"]
    lines = ["## Start-up", "", f"`python -m benchmarks.bench_startup --rounds {args.rounds}`: wall time of a whole "
             f"process, median of {args.rounds} interleaved rounds.", "",
             "| command | median s | × import-typer-only |", "|---|---:|---:|"]
    lines += [f"| {name} | {value:.3f} | {value / floor:.2f} |" for name, value in medians.items()]
    verdict = "met" if help_s <= HELP_TARGET_S else "NOT met"
    lines += ["", f"`noderag --help` {help_s:.3f} s against a target of at most {HELP_TARGET_S} s: {verdict} "
              f"(the Typer-only floor is {floor:.3f} s)."]
    print("\n".join(lines))
    return 0 if help_s <= HELP_TARGET_S else 1


if __name__ == "__main__":
    raise SystemExit(main())
