"""`noderag index|query|stats|ablate`: parse, call the API, render with Rich. No logic here.

Exit codes: 0 success, 1 the run finished with failed items, 2 bad input or usage
(missing folder, invalid config, bad question file...), 3 the workspace cannot be
used (locked, not indexed, other embedding model), 4 the LLM engine is unreachable or
misconfigured, 130 interrupted. Every error is one line on stderr, never a traceback.

`index` in detail:
- 0 also when some files were skipped: binary (NUL bytes), not UTF-8, empty, a line over
  1,000,000 characters, larger than chunk.max_file_bytes, not a regular file, unreadable
  (permissions, broken or looping symlink), a file name that is not UTF-8. Each skipped file
  gets a one-line warning, is counted in the summary and listed by `stats --documents`.
- 2 when the input folder is missing, not a folder or unreadable, or holds no readable
  .txt/.md file at all (nothing in the workspace is changed); also for an invalid config.
- 3 when the workspace path is a file, the workspace is locked by a running `index`, holds
  vectors of another embedding model, has a corrupt manifest, or cannot be written (disk
  full, read-only). Stages already committed stay committed; run again to resume.
- 137 (killed) or 130 (Ctrl-C) leave the workspace resumable: `noderag index` again
  continues from the last committed stage and yields the same tables as an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from . import api
from .config import ConfigError
from .engines.base import EngineError
from .index.chunk import InputError
from .index.pipeline import Reporter
from .search import QueryError
from .workspace import WorkspaceError

EXIT_FAILED_ITEMS, EXIT_INPUT, EXIT_WORKSPACE, EXIT_ENGINE, EXIT_INTERRUPTED = 1, 2, 3, 4, 130

app = typer.Typer(
    help="Build a NodeRAG heterograph from a folder of documents and answer questions from it. "
    "Runs offline by default; LLM engines through litellm by config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
console = Console(stderr=True)
out = Console(highlight=False, soft_wrap=True, markup=False)  # stdout: answers and JSON print verbatim


def _fail(message: str, code: int) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _run(action):
    """Map the API's errors to one-line messages and exit codes."""
    try:
        return action()
    except (ConfigError, InputError, QueryError, api.QuestionFileError) as err:
        raise _fail(str(err), EXIT_INPUT) from None
    except WorkspaceError as err:
        raise _fail(str(err), EXIT_WORKSPACE) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; run the same command again to resume", EXIT_INTERRUPTED) from None
    except EngineError as err:
        raise _fail(str(err), EXIT_ENGINE) from None


class RichReporter(Reporter):
    def __init__(self, progress: Progress):
        self.progress = progress
        self.task = None

    def stage_started(self, stage: str, total: int | None) -> None:
        self.task = self.progress.add_task(stage, total=total)

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def stage_finished(self, stage: str, seconds: float, skipped: bool) -> None:
        if skipped:
            self.progress.add_task(f"{stage} (unchanged)", total=1, completed=1)
        elif self.task is not None:
            task = self.progress.tasks[self.task]
            total = task.total or task.completed or 1  # a count without a known total: what was counted
            self.progress.update(self.task, total=total, completed=total)
        self.task = None

    def warn(self, message: str) -> None:
        self.progress.console.print(f"[yellow]warning:[/] {message}", highlight=False, soft_wrap=True)


class LineReporter(Reporter):
    """Progress for a stderr that is not a terminal (a log file, a CI job, a pipe): plain lines, a
    stage's count at most every PROGRESS_SECONDS, never bars or control characters."""

    PROGRESS_SECONDS = 5.0

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.stage, self.total, self.done, self.last = None, None, 0, 0.0

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def stage_started(self, stage: str, total: int | None) -> None:
        self.stage, self.total, self.done, self.last = stage, total, 0, time.monotonic()
        self._line(f"{stage}: started" + (f", {total:,} to do" if total else ""))

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self.stage is not None and now - self.last >= self.PROGRESS_SECONDS:
            self.last = now
            self._line(f"{self.stage}: {self.done:,}" + (f" of {self.total:,}" if self.total else "") + " done")

    def stage_finished(self, stage: str, seconds: float, skipped: bool) -> None:
        self._line(f"{stage}: unchanged, skipped" if skipped else f"{stage}: finished in {seconds:.1f} s")
        self.stage = None

    def warn(self, message: str) -> None:
        self._line(f"warning: {message}")


@app.command()
def index(
    workspace: Annotated[Path, typer.Argument(help="workspace folder (created if missing)", readable=False)],
    input: Annotated[Path, typer.Option("--input", "-i", help="folder of .txt/.md documents, read recursively",
                                        readable=False)],
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config; default: the workspace's own")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what a run would do and cost, change nothing")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Index every .txt and .md file under INPUT into WORKSPACE; resumes and updates incrementally."""
    if dry_run:
        plan = _run(lambda: api.plan(workspace, input, config_path=config))
        if as_json:
            out.print_json(json.dumps(plan))
        else:
            _print_plan(plan)
        return
    if console.is_terminal:
        with Progress(SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, disable=as_json) as progress:
            result = _run(lambda: api.index(workspace, input, config_path=config, reporter=RichReporter(progress)))
    else:
        result = _run(lambda: api.index(workspace, input, config_path=config, reporter=LineReporter()))
    summary = {"workspace": str(workspace), "seconds": round(result.seconds, 3), "nodes": result.node_counts,
               "edges": result.edge_count, "documents": result.documents,
               "skipped_files": [{"path": p, "reason": r} for p, r in result.skipped_files],
               "failures": result.failures,
               "stages": {k: {kk: (round(vv, 3) if isinstance(vv, float) else vv) for kk, vv in v.items()}
                          for k, v in result.stages.items()}}
    if as_json:
        out.print_json(json.dumps(summary))
    else:
        table = Table(title=f"indexed {workspace} in {result.seconds:.1f}s")
        table.add_column("stage")
        table.add_column("seconds", justify="right")
        table.add_column("result")
        for stage, info in result.stages.items():
            detail = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in info.items()
                               if k not in ("skipped", "seconds"))
            table.add_row(stage, "skipped" if info["skipped"] else f"{info['seconds']:.2f}", detail or "unchanged")
        out.print(table)
        docs = result.documents
        out.print("documents: " + ", ".join(f"{docs.get(k, 0)} {k}" for k in ("new", "changed", "renamed", "deleted", "unchanged"))
                  + f", {len(result.skipped_files)} skipped")
        out.print("nodes: " + "  ".join(f"{t} {n}" for t, n in result.node_counts.items()) + f"   edges: {result.edge_count}")
        if result.skipped_files:
            out.print(f"[yellow]{len(result.skipped_files)} file(s) skipped[/] (see warnings above)")
    if result.failures:
        console.print(f"[yellow]{result.failures} item(s) failed[/]; `noderag index` again retries only those")
        raise typer.Exit(EXIT_FAILED_ITEMS)


def _print_plan(plan: dict) -> None:
    docs = plan["documents"]
    out.print(f"documents: {docs['new']} new, {docs['changed']} changed, {docs['renamed']} renamed, "
              f"{docs['deleted']} deleted, {docs['unchanged']} unchanged (skipped), {docs['skipped']} unreadable")
    for kind in ("new", "changed", "renamed", "deleted"):
        paths = plan["changes"][kind]
        if paths:
            shown = ", ".join(paths[:5]) + (f" and {len(paths) - 5} more" if len(paths) > 5 else "")
            out.print(f"  {kind}: {shown}")
    for item in plan["skipped"][:10]:
        out.print(f"  unreadable: {item['path']}: {item['reason']}", markup=False)
    chunks = plan["chunks"]
    out.print(f"chunks of new or changed documents: {chunks['in_changed_documents']}, "
              f"{chunks['to_decompose']} not decomposed yet")
    out.print("stages:")
    for stage, state in plan["stages"].items():
        out.print(f"  {stage:<12} {state}")
    if plan.get("llm"):
        llm = plan["llm"]
        table = Table(title=f"LLM estimate for {llm['model']} ({llm['method']})")
        for column in ("task", "calls", "input tokens", "output tokens", "cost"):
            table.add_column(column, justify="right" if column != "task" else "left")
        for task, row in llm["tasks"].items():
            table.add_row(task, str(row["calls"]), str(row["input_tokens"]), str(row["output_tokens"]), row["cost"])
        table.add_row("total", str(llm["total"]["calls"]), str(llm["total"]["input_tokens"]),
                      str(llm["total"]["output_tokens"]), llm["total"]["cost"])
        out.print(table)


@app.command()
def query(
    workspace: Annotated[Path, typer.Argument(help="an indexed workspace")],
    question: Annotated[str | None, typer.Argument(help="the question (omit with --questions)")] = None,
    questions: Annotated[Path | None, typer.Option("--questions", help="JSONL file, one {\"question\": ...} per line")] = None,
    budget: Annotated[int | None, typer.Option("--budget", min=1, help="context token budget")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=0, help="vector entry points")] = None,
    iterations: Annotated[int | None, typer.Option("--ppr-iterations", min=0, help="PPR iterations")] = None,
    alpha: Annotated[float | None, typer.Option("--ppr-alpha", min=0.0, max=1.0, help="PPR teleport weight")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config for search and engine settings")] = None,
    context_only: Annotated[bool, typer.Option("--context-only", help="retrieve only, no answer step")] = False,
    show_context: Annotated[bool, typer.Option("--show-context", help="print the retrieved nodes too")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable result (see README)")] = False,
) -> None:
    """Answer QUESTION from WORKSPACE with NodeRAG's dual search and shallow PPR."""
    if (question is None) == (questions is None):
        raise _fail("give either a QUESTION or --questions FILE", EXIT_INPUT)
    overrides = {k: v for k, v in {"search.budget_tokens": budget, "search.vector_top_k": top_k,
                                   "search.ppr_iterations": iterations, "search.ppr_alpha": alpha}.items() if v is not None}
    items, problems = _run(lambda: api.read_questions(questions)) if questions is not None else ([], [])
    for problem in problems:
        console.print(f"[yellow]warning:[/] {problem}", highlight=False)
    compiled = len(items) >= api.COMPILED_FROM_QUESTIONS
    session = _run(lambda: api.open_workspace(workspace, config_path=config, overrides=overrides, compiled=compiled))
    if questions is not None:
        for item in items:
            result = _run(lambda item=item: session.ask(item.question, answer=not context_only))
            out.print(json.dumps(result.as_dict(), ensure_ascii=False), highlight=False)
        return
    result = _run(lambda: session.ask(question, answer=not context_only))
    if as_json:
        out.print(json.dumps(result.as_dict(), ensure_ascii=False, indent=2), highlight=False)
        return
    if result.answer is not None:
        out.print(result.answer)
    if show_context or context_only:
        _print_context(result)
    elif not result.nodes:
        console.print("nothing in the workspace matched this question")


def _print_context(result) -> None:
    table = Table(title=f"context: {len(result.nodes)} nodes, {result.context_tokens} tokens, "
                        f"{result.timings.get('retrieval_ms', 0):.1f} ms")
    for column in ("type", "score", "text", "documents"):
        table.add_column(column)
    for node in result.nodes:
        text = node.text if len(node.text) < 300 else node.text[:297] + "..."
        table.add_row(node.type, f"{node.score:.4f}", text, ", ".join(node.documents))
    out.print(table)


@app.command()
def stats(
    workspace: Annotated[Path, typer.Argument(help="a workspace folder")],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    documents: Annotated[bool, typer.Option("--documents", help="list every document with its status")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="check every file of the current build against its "
                                                           "recorded checksum, and the cache; exit 3 if one differs")] = False,
) -> None:
    """What WORKSPACE holds: nodes per type, edges per kind, vectors, files, stages, LLM usage. Never writes to it."""
    report = _run(lambda: api.stats(workspace, verify=verify))
    if as_json:
        out.print(json.dumps(report, indent=2), highlight=False)
        return
    nodes = Table(title="nodes")
    nodes.add_column("type")
    nodes.add_column("count", justify="right")
    for node_type, count in report["nodes"].items():
        nodes.add_row(node_type, str(count))
    out.print(nodes)
    edges = Table(title="edges")
    edges.add_column("kind")
    edges.add_column("count", justify="right")
    for kind, count in report["edges"]["by_kind"].items():
        edges.add_row(kind, str(count))
    for label in ("non_hnsw", "hnsw", "merged_total"):
        edges.add_row(label, str(report["edges"][label]))
    out.print(edges)
    out.print(f"vectors: {report['vectors']['count']} of dimension {report['vectors']['dim']} "
              f"({report['vectors']['model']})")
    out.print(f"current build: {report['generation'] or 'none yet'}")
    if "verified" in report:
        out.print(f"verified: {report['verified']['files']} files of {report['verified']['generation']}, "
                  "every checksum matches")
    stages = Table(title="stages")
    for column in ("stage", "state", "seconds", "LLM calls", "cache hits", "failures", "in tokens", "out tokens", "cost $",
                   "new vectors"):
        stages.add_column(column)
    for stage, info in report["stages"].items():
        llm = info.get("llm") or {}
        stages.add_row(stage, info.get("state", "-"), str(info.get("seconds", "-")), str(llm.get("calls", 0)),
                       str(llm.get("cache_hits", 0)), str(info.get("failures", llm.get("failures", 0))),
                       str(llm.get("input_tokens", 0)), str(llm.get("output_tokens", 0)), f"{llm.get('cost_usd', 0):.4f}",
                       str(info.get("vectors_computed", "-")))
    out.print(stages)
    docs = report["documents"]
    out.print("documents: " + ", ".join(f"{n} {s}" for s, n in docs["by_status"].items()))
    if documents:
        listing = Table(title="documents")
        for column in ("path", "status", "chunks", "reason"):
            listing.add_column(column)
        for row in docs["list"]:
            chunks = str(row["chunks"])
            if row["status"] == "pending":
                chunks = f"{row['chunks_done']}/{row['chunks']} decomposed" if row["chunks"] else "-"
            listing.add_row(row["path"], row["status"], chunks, row["reason"])
        out.print(listing)
    files = Table(title="files")
    files.add_column("file")
    files.add_column("bytes", justify="right")
    for name, size in report["files"].items():
        files.add_row(name, f"{size:,}")
    out.print(files)


class _AblateProgress:
    """`evaluate.ablate.Progress` drawn with Rich: one bar for the run, named after the strategy running."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task = None

    def run_started(self, total: int) -> None:
        self.task = self.progress.add_task("ablate", total=total)

    def strategy_started(self, name: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=name)

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)

    def note(self, message: str) -> None:
        self.progress.console.print(f"[cyan]note:[/] {message}", highlight=False)

    def warn(self, message: str) -> None:
        self.progress.console.print(f"[yellow]warning:[/] {message}", highlight=False)


@app.command()
def ablate(
    workspace: Annotated[Path | None, typer.Argument(
        help="indexed workspace (with --questions); with --dataset it is built or reused here, "
             "default OUT/<dataset>-workspace")] = None,
    questions: Annotated[Path | None, typer.Option(
        "--questions", help="JSONL, one {\"question\", \"answers\", \"supporting_documents\"} per line")] = None,
    dataset: Annotated[str | None, typer.Option(
        "--dataset", help="musique or hotpotqa: read that format from --data, index its corpus (one document per "
                          "passage) into the workspace, evaluate its questions")] = None,
    data: Annotated[Path | None, typer.Option("--data", help="the dataset folder (corpus.json, questions.json)")] = None,
    variants: Annotated[str | None, typer.Option(
        "--variants", help="comma-separated strategies, default all: noderag, ppr-1 ... ppr-10, ppr-converge, no-cross, "
                           "graph-vector, no-exact, no-hnsw, with-hnsw, lazy-ppr, paper-rank, and the baselines naive, hyde, "
                           "lightrag-local, lightrag-global, lightrag-hybrid, graphrag-local, graphrag-global, hipporag")] = None,
    budgets: Annotated[str, typer.Option("--budgets", help="comma-separated context token budgets")] = "1000,2000,4000",
    out_dir: Annotated[Path, typer.Option("--out", "-o", help="folder for ablation.csv, ablation.json, ablation.png "
                                                              "(and the dataset's corpus and workspace)")] = Path("ablate-out"),
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML config for search and engine settings")] = None,
    answer: Annotated[bool, typer.Option("--answer", help="also answer with the shared prompt and score with an LLM "
                                                          "judge (needs an LLM engine)")] = False,
    limit: Annotated[int | None, typer.Option("--limit", help="only the first N questions")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the result as JSON instead of a table")] = False,
) -> None:
    """Run NodeRAG, its ablations and the baselines on every question at every budget; write a table and a plot."""
    from rich import box

    from .evaluate import ablate as ablation

    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=console, disable=as_json) as progress:
            result = _run(lambda: ablation.run_from_args(
                workspace, questions, dataset, data, variants, budgets, out_dir, config, answer, limit,
                progress=_AblateProgress(progress), reporter=RichReporter(progress)))
    except ablation.AblationInputError as err:
        raise _fail(str(err), EXIT_INPUT) from None
    if as_json:
        out.print(json.dumps(result.as_dict(), indent=2), highlight=False)
        return
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
        console.print(f"[yellow]skipped {name}:[/] {reason}", highlight=False)
    out.print("wrote " + ", ".join(result.files.values()))


def main() -> None:  # pragma: no cover
    """The `noderag` command: run it, then leave without tearing the interpreter down. Everything a
    command writes is on disk (fsynced) or flushed by then, and freeing an indexing run's millions of
    small objects one by one took ~0.2 s, 5% of an incremental update. An unexpected exception
    still ends the ordinary way, with its traceback."""
    try:
        app()
        code = 0
    except SystemExit as done:
        code = done.code
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


if __name__ == "__main__":  # pragma: no cover
    main()
