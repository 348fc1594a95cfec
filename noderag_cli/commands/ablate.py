"""`noderag ablate`: NodeRAG, its ablations and baselines at equal budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    LineReporter,
    RichReporter,
    json_mode,
    out,
    print_json,
    progress_bars,
    run_api,
    say,
    warn,
)


class _AblateBars(RichReporter):
    """`evaluate.ablate.AblationReporter` drawn with Rich: indexing stages as `index` draws them, then
    one bar for the run, named after the strategy running."""

    def run_started(self, total: int) -> None:
        self.task = self.progress.add_task("ablate", total=total)

    def strategy_started(self, name: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=name)

    def note(self, message: str) -> None:
        say("note:", "cyan", message)


class _AblateLines(LineReporter):
    """`evaluate.ablate.AblationReporter` as plain lines (stderr not a terminal)."""

    def run_started(self, total: int) -> None:
        self._line(f"ablate: {total:,} searches to run")

    def strategy_started(self, name: str, total: int) -> None:
        self.stage_started(name, None)

    def note(self, message: str) -> None:
        self._line(f"note: {message}")


def ablate(
    workspace: Annotated[Path | None, typer.Argument(
        metavar="WORKSPACE", show_default=False,
        help="indexed workspace (with --questions); with --dataset it is built or reused here, "
             "default OUT/<dataset>-workspace")] = None,
    questions: Annotated[Path | None, typer.Option(
        "--questions", metavar="FILE",
        help="JSONL, one {\"question\", \"answers\", \"supporting_documents\"} per line")] = None,
    dataset: Annotated[str | None, typer.Option(
        "--dataset", metavar="NAME", help="musique or hotpotqa: read that format from --data, index its corpus (one "
                                          "document per passage) into the workspace, evaluate its questions")] = None,
    data: Annotated[Path | None, typer.Option("--data", metavar="FOLDER",
                                              help="the dataset folder (corpus.json, questions.json)")] = None,
    variants: Annotated[str | None, typer.Option(
        "--variants", metavar="NAMES",
        help="comma-separated strategies (see --list), default all")] = None,
    budgets: Annotated[str, typer.Option("--budgets", metavar="TOKENS",
                                         help="comma-separated context token budgets")] = "1000,2000,4000",
    out_dir: Annotated[Path, typer.Option("--out", "-o", metavar="FOLDER",
                                          help="folder for ablation.csv, ablation.json, ablation.png "
                                               "(and the dataset's corpus and workspace)")] = Path("ablate-out"),
    config: Annotated[Path | None, typer.Option("--config", "-c", metavar="FILE",
                                                help="YAML config for search and engine settings")] = None,
    answer: Annotated[bool, typer.Option("--answer", help="also answer with the shared prompt and score with an LLM "
                                                          "judge (needs an LLM engine)")] = False,
    limit: Annotated[int | None, typer.Option("--limit", metavar="N", help="only the first N questions")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON instead of a table")] = False,
    list_strategies: Annotated[bool, typer.Option(
        "--list", help="name every strategy (NodeRAG, its ablations, the baselines, the seed systems) with what "
                       "it changes, and stop")] = False,
) -> None:
    """Run NodeRAG, its ablations and the baselines on every question at every budget; write a table and a plot.
    `--list` names the strategies."""
    from ..evaluate import ablate as ablation

    json_mode(as_json)
    if list_strategies:
        strategies = [{"name": s.name, "kind": s.kind, "description": s.description} for s in ablation.STRATEGIES.values()]
        if as_json:
            print_json(strategies)
        else:
            for s in strategies:
                out.print(f"{s['name']:<28} {s['kind']:<9} {s['description']}", markup=False, highlight=False)
        return
    with progress_bars() as bars:
        progress = _AblateLines() if bars is None else _AblateBars(bars)
        result = run_api(lambda: ablation.run_from_args(
            workspace, questions, dataset, data, variants, budgets, out_dir, config, answer, limit,
            progress=progress))
    if ablation.PNG_SKIPPED in result.notes:
        say("note:", "cyan", ablation.PNG_SKIPPED)
    if as_json:
        print_json(result.as_dict())
        return
    from rich import box
    from rich.table import Table

    judged = any(row["judge_accuracy"] is not None for row in result.rows)
    table = Table(title=f"{result.dataset or result.workspace}: {result.questions} questions, "
                        f"{len(result.rows)} rows in {result.seconds.get('run', 0):.1f}s", box=box.SIMPLE_HEAD,
                  caption="baselines in italics; kinds, descriptions and notes in ablation.json")
    columns = ["strategy", "budget", "contained", "recall", "tokens", "med ms", "p95 ms"]
    for column in columns + (["judge"] if judged else []):
        table.add_column(column, justify="left" if column == "strategy" else "right", no_wrap=True)

    def cell(value, digits: int = 3) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for row in result.rows:
        cells = [row["strategy"], str(row["budget"]), cell(row["answer_containment"]), cell(row["support_recall"]),
                 cell(row["mean_context_tokens"], 0), cell(row["latency_median_ms"], 1), cell(row["latency_p95_ms"], 1)]
        table.add_row(*cells, *([cell(row["judge_accuracy"])] if judged else []),
                      style="italic" if row["kind"] == "baseline" else None)
    out.print(table)
    for name, reason in result.skipped.items():
        warn(f"skipped {name}: {reason}")
    out.print("wrote " + ", ".join(result.files.values()))
