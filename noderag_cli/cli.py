"""`noderag index|query|stats|ablate`: parse, call the API, render with Rich. No logic here.

Exit codes: 0 success, 1 the run finished with failed items, 2 bad input or usage
(missing folder, invalid config, bad question file...), 3 the workspace cannot be
used (locked, not indexed, other embedding model), 4 the LLM engine is unreachable or
misconfigured, 130 interrupted. Every error is one line on stderr, never a traceback; with
`--json` it is also a JSON object `{"error", "exit_code"}` on stdout, where results go.

Output: document text is printed verbatim (no markup, no emoji codes); progress goes to
stderr, as bars on a terminal and as plain lines every few seconds anywhere else. Imports
are lazy so that `--help` and `--version` answer at once.

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

import contextlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text
from typer.core import TyperArgument, TyperCommand

EXIT_FAILED_ITEMS, EXIT_INPUT, EXIT_INTERRUPTED = 1, 2, 130  # the others: errors.py, one base per code

CONFIG_DEFAULTS = {"budget": "search.budget_tokens", "top_k": "search.vector_top_k",
                   "iterations": "search.ppr_iterations", "alpha": "search.ppr_alpha"}
"""`query` options that set a search setting: `--help` shows its default, a given value changes it."""


class Command(TyperCommand):
    """Usage lines that name arguments as users read them (`WORKSPACE [QUESTION]`), and options
    whose default is a config setting shown with its value (the config is read only for help)."""

    def collect_usage_pieces(self, ctx):
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or param.name.upper()
                pieces.append(name if param.required else f"[{name}]")
        return pieces

    def format_help(self, ctx, formatter):
        if any(param.name in CONFIG_DEFAULTS for param in self.params):
            from .config import Config

            defaults = Config()
            for param in self.params:
                if param.name in CONFIG_DEFAULTS:
                    section, key = CONFIG_DEFAULTS[param.name].split(".")
                    value = getattr(getattr(defaults, section), key)
                    param.show_default = f"{value}, or the config's {CONFIG_DEFAULTS[param.name]}"
        super().format_help(ctx, formatter)


app = typer.Typer(
    help="Build a NodeRAG heterograph from a folder of documents and answer questions from it. "
    "Runs offline by default; LLM engines through litellm by config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text for a terminal: control characters (an escape sequence in a document or a file name
    would retitle the window or move the cursor) shown as `\x1b`, direction overrides as `\u202e`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text)


class _Console(Console):
    """Document text verbatim to a pipe or a file, printable to a terminal (`printable`)."""

    def print(self, *objects, **kwargs) -> None:
        if self.is_terminal:
            objects = tuple(printable(o) if isinstance(o, str) else o for o in objects)
        super().print(*objects, **kwargs)


console = _Console(stderr=True, markup=False, emoji=False, highlight=False)  # messages and progress
out = _Console(highlight=False, soft_wrap=True, markup=False, emoji=False)  # results: document text verbatim
_json_errors = False  # a command run with --json (or --questions): its error is also one JSON line on stdout


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        print(f"noderag {version('noderag-cli')}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="print the version and exit")] = False,
) -> None:
    """Build a NodeRAG heterograph from a folder of documents and answer questions from it.
    Runs offline by default; LLM engines through litellm by config."""


_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _print_json(payload, indent: int | None = 2) -> None:
    """JSON on stdout, as is (never through Rich, which would render markup or emoji codes in it).
    The line breaks json leaves raw are escaped so that one record stays one line for any reader."""
    text = json.dumps(payload, ensure_ascii=False, indent=indent).translate(_LINE_BREAKS_JSON_KEEPS)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _say(label: str, style: str, message: str) -> None:
    message = " ".join(message.splitlines())  # one line, whatever a library's message held
    console.print(Text.assemble((label, style), " ", printable(message) if console.is_terminal else message),
                  soft_wrap=True)


def _warn(message: str) -> None:
    _say("warning:", "yellow", message)


def _fail(message: str, code: int) -> typer.Exit:
    _say("error:", "bold red", message)
    if _json_errors:
        _print_json({"error": message, "exit_code": code}, indent=None)
    return typer.Exit(code)


def _json_mode(as_json: bool) -> None:
    global _json_errors
    _json_errors = as_json


def _run(action):
    """The API's errors as one-line messages and their exit codes (errors.py: one base per code)."""
    from .errors import NoderagError

    try:
        return action()
    except NoderagError as err:
        raise _fail(str(err), err.exit_code) from None
    except KeyboardInterrupt:
        raise _fail("interrupted; run the same command again to resume", EXIT_INTERRUPTED) from None


def _table(title: str | None, columns: list[str], right: tuple[str, ...] = ()):
    from rich.table import Table

    class Shown(Table):
        """A results table whose cells are shown printable on a terminal (`printable`)."""

        def add_row(self, *cells, **kwargs) -> None:
            if out.is_terminal:
                cells = tuple(printable(c) if isinstance(c, str) else c for c in cells)
            super().add_row(*cells, **kwargs)

    table = Shown(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left", overflow="fold")
    return table


class RichReporter:
    """`pipeline.Reporter` drawn as Rich bars (a terminal stderr)."""

    def __init__(self, progress):
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
        _warn(message)


class LineReporter:
    """`pipeline.Reporter` for a stderr that is not a terminal (a log file, a CI job, a pipe): plain
    lines, a stage's count at most every PROGRESS_SECONDS, never bars or control characters."""

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


@contextlib.contextmanager
def _bars():
    """Rich progress bars on a terminal stderr; None elsewhere (the caller prints plain lines)."""
    if not console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console) as progress:
        yield progress


@app.command(cls=Command, short_help="build or update WORKSPACE from a folder of documents")
def index(
    workspace: Annotated[Path, typer.Argument(help="workspace folder (created if missing)", readable=False,
                                              metavar="WORKSPACE", show_default=False)],
    input: Annotated[Path, typer.Option("--input", "-i", help="folder of documents (text, Markdown, PDF, Word, "
                                        "PowerPoint, Excel, HTML, EPUB), read recursively",
                                        readable=False, metavar="FOLDER", show_default=False)],
    config: Annotated[Path | None, typer.Option("--config", "-c", metavar="FILE",
                                                help="YAML config; default: the workspace's own")] = None,
    follow_symlinks: Annotated[bool | None, typer.Option(
        "--follow-symlinks/--no-follow-symlinks", show_default=False,
        help="read files whose links lead out of FOLDER, or not (skipped with a warning); kept in the "
             "workspace's config [default: not]")] = None,
    include: Annotated[list[str] | None, typer.Option(
        "--include", metavar="GLOB", show_default=False,
        help="read only files matching a pattern (repeatable; a pattern with / matches the path in FOLDER, one "
             "without the file name); kept in the workspace's config")] = None,
    exclude: Annotated[list[str] | None, typer.Option(
        "--exclude", metavar="GLOB", show_default=False,
        help="do not read files matching a pattern (repeatable); kept in the workspace's config")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what a run would read, do and cost, change "
                                                            "nothing")] = False,
    max_cost: Annotated[float | None, typer.Option(
        "--max-cost", metavar="USD", show_default=False,
        help="spending cap of this run (over llm.max_cost_usd): a run estimated over it does not start (exit 2); "
             "one that reaches it stops with its paid work kept (exit 1), and a rerun with a higher cap goes on")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Index every document under FOLDER into WORKSPACE; resumes and updates incrementally."""
    from . import api

    _json_mode(as_json)
    reading = api.Reading(follow_symlinks, include, exclude)
    if dry_run:
        plan = _run(lambda: api.plan(workspace, input, config_path=config, reading=reading, max_cost_usd=max_cost))
        if as_json:
            _print_json(plan)
        else:
            _print_plan(plan)
        return
    with _bars() as bars:
        reporter = RichReporter(bars) if bars is not None else LineReporter()
        result = _run(lambda: api.index(workspace, input, config_path=config, reporter=reporter, reading=reading,
                                        max_cost_usd=max_cost))
    if as_json:
        _print_json({"workspace": str(workspace), **result.as_dict()})
    else:
        table = _table(f"indexed {workspace} in {result.seconds:.1f}s", ["stage", "seconds", "result"], ("seconds",))
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
            out.print(f"{len(result.skipped_files)} file(s) skipped (see the warnings above, or `noderag stats "
                      f"{workspace} --documents`)")
    if result.rate_limit_waits:
        _warn(f"rate-limited by the server: waited {result.rate_limit_seconds:.0f} s over {result.rate_limit_waits} "
              "wait(s); llm.requests_per_minute and llm.tokens_per_minute set below the server's limits avoid that")
    if result.failures:
        _warn(f"{result.failures} item(s) failed: `noderag stats {workspace} --documents` says why; "
              "`noderag index` again retries only those")
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
    formats = plan["formats"]
    out.print("files to read: " + (", ".join(f"{n} {kind}" for kind, n in formats.items()) or "none")
              + (f"; {plan['left_out']} left out by --include/--exclude" if plan["left_out"] else ""))
    for item in plan["skipped"][:10]:
        out.print(f"  unreadable: {item['path']}: {item['reason']}")
    if len(plan["skipped"]) > 10:
        out.print(f"  and {len(plan['skipped']) - 10} more unreadable")
    chunks = plan["chunks"]
    out.print(f"chunks of new or changed documents: {chunks['in_changed_documents']}, "
              f"{chunks['to_decompose']} not decomposed yet")
    out.print("stages:")
    for stage, state in plan["stages"].items():
        out.print(f"  {stage:<12} {state}")
    if plan.get("llm"):
        llm = plan["llm"]
        columns = ["task", "calls", "input tokens", "output tokens", "cost"]
        table = _table(f"LLM estimate for {llm['model']} ({llm['method']})", columns, tuple(columns[1:]))
        for task, row in llm["tasks"].items():
            table.add_row(task, str(row["calls"]), str(row["input_tokens"]), str(row["output_tokens"]), row["cost"])
        table.add_row("total", str(llm["total"]["calls"]), str(llm["total"]["input_tokens"]),
                      str(llm["total"]["output_tokens"]), llm["total"]["cost"])
        out.print(table)
        cap = llm.get("spending_cap")
        if cap is not None:
            verdict = {True: "the estimate fits", False: "the estimate is over it: the run would not start",
                       None: "the model has no price: set llm.price_per_million_tokens"}[cap["fits"]]
            out.print(f"spending cap ${cap['limit_usd']:.4f}: {verdict}")


def _answer_lines(session, questions: Path, items: list, answer: bool, params, found: list) -> int:
    """`--questions`: one JSON line out per line in, in order; a bad line, or a question that cannot
    be searched, gets `{"line", "error"}` in its place and the run goes on. Exit 1 if any failed.
    Each result is also appended to `found` (for the page)."""
    from .errors import QueryError

    failed = 0
    for number, item in items:
        error = item if isinstance(item, str) else None
        if error is None:
            try:
                result = session.ask(item.question, answer=answer, params=params, explain=True)
            except QueryError as err:
                error = str(err)
        if error is not None:
            failed += 1
            _warn(f"{questions} line {number}: {error}")
            _print_json({"line": number, "error": error}, indent=None)
        else:
            found.append(result)
            _print_json({"line": number, **result.as_dict()}, indent=None)
    return EXIT_FAILED_ITEMS if failed else 0


def _write_page(results: list, target: Path, workspace: Path) -> None:
    """`--html`: the page of what the questions found (page.py); never into a workspace."""
    from . import page
    from .errors import InputError
    from .workspace import refuse_output_inside

    refuse_output_inside(target, "--html")
    if target.is_dir():
        raise InputError(f"--html {target} is a folder; the page goes to a file")
    try:
        page.write(results, target, f"noderag: what the search found in {workspace.name}")
    except OSError as err:
        raise InputError(f"cannot write {target}: {err.strerror or err}") from err


@app.command(cls=Command, short_help="answer a question (or a JSONL file of them) from WORKSPACE")
def query(
    workspace: Annotated[Path, typer.Argument(help="an indexed workspace", metavar="WORKSPACE", show_default=False)],
    question: Annotated[str | None, typer.Argument(help="the question (omit with --questions)", metavar="QUESTION",
                                                   show_default=False)] = None,
    questions: Annotated[Path | None, typer.Option(
        "--questions", metavar="FILE", help="JSONL file, one {\"question\": ...} per line; prints one JSON line per "
                                            "line, {\"line\": N, \"error\": ...} for a bad one (exit 1)")] = None,
    budget: Annotated[int | None, typer.Option("--budget", min=1, metavar="TOKENS", help="context token budget")] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=0, metavar="N", help="vector entry points")] = None,
    iterations: Annotated[int | None, typer.Option("--ppr-iterations", min=0, metavar="N",
                                                   help="PPR iterations")] = None,
    alpha: Annotated[float | None, typer.Option("--ppr-alpha", min=0.0, max=1.0, metavar="A",
                                                help="PPR teleport weight")] = None,
    config: Annotated[Path | None, typer.Option("--config", "-c", metavar="FILE",
                                                help="YAML config for search and engine settings")] = None,
    context_only: Annotated[bool, typer.Option("--context-only", help="retrieve only, no answer step")] = False,
    show_context: Annotated[bool, typer.Option("--show-context", help="print the retrieved nodes too")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable result (see docs/usage.md)")] = False,
    html_page: Annotated[Path | None, typer.Option(
        "--html", metavar="FILE", help="also write a self-contained HTML page showing the subgraph each question "
                                       "used: entry points, the walk's paths, the context")] = None,
) -> None:
    """Answer QUESTION from WORKSPACE with NodeRAG's dual search and shallow PPR."""
    from . import api
    from .questions import read_question_lines
    from .workspace import refuse_output_inside

    _json_mode(as_json or questions is not None)
    if (question is None) == (questions is None):
        raise _fail("give either a QUESTION or --questions FILE", EXIT_INPUT)
    flags = {"budget": budget, "top_k": top_k, "iterations": iterations, "alpha": alpha}
    changes = {CONFIG_DEFAULTS[flag].split(".")[1]: value for flag, value in flags.items() if value is not None}
    items = _run(lambda: read_question_lines(questions)) if questions is not None else []
    compiled = len(items) >= api.COMPILED_FROM_QUESTIONS
    session = _run(lambda: api.open_workspace(workspace, config_path=config, compiled=compiled))
    params = _run(lambda: session.search_settings(**changes))
    if html_page is not None:
        _run(lambda: refuse_output_inside(html_page, "--html"))  # before any work
    if questions is not None:
        found: list = []
        code = _run(lambda: _answer_lines(session, questions, items, not context_only, params, found))
        if html_page is not None:
            _run(lambda: _write_page(found, html_page, workspace))
        if code:
            raise typer.Exit(code)
        return
    explain = as_json or html_page is not None
    result = _run(lambda: session.ask(question, answer=not context_only, params=params, explain=explain))
    if html_page is not None:
        _run(lambda: _write_page([result], html_page, workspace))
        console.print(f"wrote {html_page}")
    if as_json:
        _print_json(result.as_dict())
        return
    if result.answer is not None:
        out.print(result.answer)
    if show_context or context_only:
        _print_context(result)
    if not result.nodes:
        budget_tokens = params.budget_tokens
        if result.smallest_match_tokens > budget_tokens:
            _warn(f"the budget of {budget_tokens} tokens is smaller than the smallest matching node "
                  f"({result.smallest_match_tokens} tokens); raise --budget")
        else:
            _warn("nothing in the workspace matched this question")


def _print_context(result) -> None:
    table = _table(f"context: {len(result.nodes)} nodes, {result.context_tokens} tokens, "
                   f"{result.timings.get('retrieval_ms', 0):.1f} ms", ["type", "via", "score", "text", "documents"])
    for node in result.nodes:
        table.add_row(node.type, node.via, f"{node.score:.4f}", node.text, ", ".join(node.documents))
    out.print(table)


def _stage_details(info: dict) -> str:
    """A stage's LLM use and vectors in words; only what is not zero."""
    llm = info.get("llm") or {}
    parts = [f"{llm[key]:,} {label}" for key, label in (("calls", "LLM calls"), ("cache_hits", "cache hits"))
             if llm.get(key)]
    failures = info.get("failures", llm.get("failures", 0))
    if failures:
        parts.append(f"{failures:,} failed")
    if llm.get("ungrounded"):
        parts.append(f"{llm['ungrounded']:,} ungrounded dropped")
    if llm.get("input_tokens") or llm.get("output_tokens"):
        parts.append(f"{llm.get('input_tokens', 0):,} in / {llm.get('output_tokens', 0):,} out tokens")
    if llm.get("calls"):
        cost = llm.get("cost_usd")
        parts.append("cost unknown" if cost is None else f"${cost:.4f}")
    if info.get("vectors_computed"):
        parts.append(f"{info['vectors_computed']:,} new vectors")
    return ", ".join(parts)


@app.command(cls=Command, short_help="serve WORKSPACE to agents over MCP (stdio)")
def mcp(
    workspace: Annotated[Path, typer.Argument(help="an indexed workspace", metavar="WORKSPACE", show_default=False)],
) -> None:
    """Serve WORKSPACE over the Model Context Protocol on stdin/stdout, for agents and chat clients:
    tools `search` (context, or an answer), `node` and `document`. Read-only; picks up a new build after
    `noderag index` without a restart. Needs the extra: pip install 'noderag-cli[mcp]'."""
    from . import mcp_server

    _run(lambda: mcp_server.require_sdk())
    _run(lambda: mcp_server.serve(workspace))


@app.command(cls=Command, short_help="what WORKSPACE holds; never writes to it")
def stats(
    workspace: Annotated[Path, typer.Argument(help="a workspace folder", metavar="WORKSPACE", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    documents: Annotated[bool, typer.Option("--documents", help="list every document with its status")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="check every file of the current build against its "
                                                           "recorded checksum, and the cache; exit 3 if one differs")] = False,
) -> None:
    """What WORKSPACE holds: nodes per type, edges per kind, vectors, files, stages, LLM usage. Never writes to it."""
    from . import api

    _json_mode(as_json)
    report = _run(lambda: api.stats(workspace, verify=verify))
    if as_json:
        _print_json(report)
        return
    nodes = _table("nodes", ["type", "count"], ("count",))
    for node_type, count in report["nodes"].items():
        nodes.add_row(node_type, f"{count:,}")
    out.print(nodes)
    edges = _table("edges", ["kind", "count"], ("count",))
    for kind, count in report["edges"]["by_kind"].items():
        edges.add_row(kind, f"{count:,}")
    for label in ("non_hnsw", "hnsw", "merged_total"):
        edges.add_row(label, f"{report['edges'][label]:,}")
    out.print(edges)
    out.print(f"vectors: {report['vectors']['count']:,} of dimension {report['vectors']['dim']} "
              f"({report['vectors']['model']})")
    out.print(f"current build: {report['generation'] or 'none yet'}")
    if "verified" in report:
        out.print(f"verified: {report['verified']['files']} files of {report['verified']['generation']}, "
                  "every checksum matches")
    stages = _table("stages", ["stage", "state", "seconds", "LLM use, vectors"], ("seconds",))
    for stage, info in report["stages"].items():
        stages.add_row(stage, info.get("state", "-"), str(info.get("seconds", "-")), _stage_details(info))
    out.print(stages)
    docs = report["documents"]
    out.print("documents: " + ", ".join(f"{n} {s}" for s, n in docs["by_status"].items()))
    if documents:
        listing = _table("documents", ["path", "status", "chunks", "reason"])
        for row in docs["list"]:
            chunks = str(row["chunks"])
            if row["status"] == "pending":
                chunks = f"{row['chunks_done']}/{row['chunks']} decomposed" if row["chunks"] else "-"
            listing.add_row(row["path"], row["status"], chunks, row["reason"])
        out.print(listing)
        if report["failed_items"]:
            items = _table("other failed items (retried by the next `noderag index`)", ["stage", "item", "reason"])
            for row in report["failed_items"]:
                items.add_row(row["stage"], row["item"], row["reason"])
            out.print(items)
    files = _table("files", ["file", "bytes"], ("bytes",))
    for name, size in report["files"].items():
        files.add_row(name, f"{size:,}")
    out.print(files)


@app.command(cls=Command, short_help="write WORKSPACE/config.yaml with every setting explained")
def init(
    workspace: Annotated[Path, typer.Argument(help="workspace folder (created if missing)", metavar="WORKSPACE",
                                              show_default=False)],
    llm: Annotated[str | None, typer.Option(
        "--llm", metavar="openai|ollama|openai-compatible", show_default=False,
        help="start from that LLM preset (litellm engine, model, server, limits) [default: offline]")] = None,
    prompts: Annotated[bool, typer.Option("--prompts", help="also write the built-in LLM prompts to "
                                                           "WORKSPACE/prompts, one file per task, and use them")] = False,
    force: Annotated[bool, typer.Option("--force", help="replace the workspace's config.yaml (and prompts)")] = False,
) -> None:
    """Write WORKSPACE/config.yaml with every setting, what it means and its default (and with
    --prompts the LLM prompts, to adapt to a domain); edit them, then `noderag index WORKSPACE
    --input FOLDER` uses them."""
    from . import api

    paths = _run(lambda: api.init(workspace, llm, force, prompts))
    out.print(f"wrote {', '.join(map(str, paths))}; edit, then `noderag index {workspace} --input FOLDER`")


@app.command(cls=Command, short_help="remove old builds and cache entries nothing refers to")
def gc(
    workspace: Annotated[Path, typer.Argument(help="a workspace folder", metavar="WORKSPACE", show_default=False)],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="say what would be removed, remove nothing (works on a "
                                                            "read-only workspace)")] = False,
    include_unfinished: Annotated[bool, typer.Option(
        "--include-unfinished", help="also remove the cache entries of an index run that did not finish (the next "
                                     "run pays for them again)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Remove what no current table or build of WORKSPACE refers to: old builds no query holds,
    leftover files, cache entries no stage needs (deleted documents' text among them). Safe while
    queries run; the next `index` re-pays nothing: what an unfinished run paid for is kept."""
    from . import api

    _json_mode(as_json)
    report = _run(lambda: api.gc(workspace, dry_run, include_unfinished))
    if as_json:
        _print_json(report)
        return
    verb = "would free" if dry_run else "freed"
    cache = report["cache"]
    out.print(f"{verb} {report['bytes_freed']:,} bytes: {len(report['generations'])} old build(s), "
              f"{len(report['files'])} leftover file(s), {cache['removed']:,} of {cache['entries']:,} cache entries")
    if report["held_generations"]:
        out.print(f"kept {', '.join(report['held_generations'])}: a query still reads it; run gc again later")
    if cache["skipped"]:
        _warn(f"cache not collected: {cache['skipped']}")


@app.command(cls=Command, short_help="write the graph as GraphML or Neo4j bulk-import CSV")
def export(
    workspace: Annotated[Path, typer.Argument(help="an indexed workspace", metavar="WORKSPACE", show_default=False)],
    fmt: Annotated[str, typer.Option("--format", "-f", metavar="graphml|csv",
                                     help="GraphML (networkx, Gephi) or Neo4j bulk-import CSV")] = "graphml",
    out_path: Annotated[Path | None, typer.Option(
        "--out", "-o", metavar="PATH", show_default=False,
        help="the GraphML file or the CSV folder [default: WORKSPACE's name + .graphml or -csv, here]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print what was written as JSON")] = False,
) -> None:
    """Write WORKSPACE's graph (every node and edge, with type, text, documents, community, edge kind,
    weight and the similarity flag) for other tools. Reads the current build; never writes to it."""
    from . import api

    _json_mode(as_json)
    written = _run(lambda: api.export(workspace, fmt, out_path))
    if as_json:
        _print_json(written)
    else:
        out.print(f"wrote {written['nodes']:,} nodes and {written['edges']:,} edges of build {written['generation']} "
                  f"to {', '.join(written['files'])}")


class _AblateBars(RichReporter):
    """`evaluate.ablate.AblationReporter` drawn with Rich: indexing stages as `index` draws them, then
    one bar for the run, named after the strategy running."""

    def run_started(self, total: int) -> None:
        self.task = self.progress.add_task("ablate", total=total)

    def strategy_started(self, name: str, total: int) -> None:
        if self.task is not None:
            self.progress.update(self.task, description=name)

    def note(self, message: str) -> None:
        _say("note:", "cyan", message)


class _AblateLines(LineReporter):
    """`evaluate.ablate.AblationReporter` as plain lines (stderr not a terminal)."""

    def run_started(self, total: int) -> None:
        self._line(f"ablate: {total:,} searches to run")

    def strategy_started(self, name: str, total: int) -> None:
        self.stage_started(name, None)

    def note(self, message: str) -> None:
        self._line(f"note: {message}")


@app.command(cls=Command, short_help="compare NodeRAG, its ablations and baselines at equal budgets")
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
        help="comma-separated strategies (listed above), default all")] = None,
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
) -> None:
    """Run NodeRAG, its ablations and the baselines on every question at every budget; write a table and a plot.

    \b
    Strategies: noderag, ppr-1 ... ppr-10, ppr-converge, no-cross, graph-vector,
      no-exact, no-hnsw, with-hnsw, lazy-ppr, paper-rank, uniform-start, one-round,
      no-diversity
    Baselines: naive, hyde, lightrag-local, lightrag-global, lightrag-hybrid,
      graphrag-local, graphrag-global, hipporag
    Seed systems: archrag, archrag-single-layer, archrag-leiden,
      archrag-entity-only, graphrag-local-c0 ... graphrag-local-c3,
      graphrag-global-c0 ... graphrag-global-c3
    """
    from .evaluate import ablate as ablation

    _json_mode(as_json)
    with _bars() as bars:
        progress = _AblateLines() if bars is None else _AblateBars(bars)
        result = _run(lambda: ablation.run_from_args(
            workspace, questions, dataset, data, variants, budgets, out_dir, config, answer, limit,
            progress=progress))
    if ablation.PNG_SKIPPED in result.notes:
        _say("note:", "cyan", ablation.PNG_SKIPPED)
    if as_json:
        _print_json(result.as_dict())
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
        _warn(f"skipped {name}: {reason}")
    out.print("wrote " + ", ".join(result.files.values()))


def _usage_error(err) -> int:
    """A usage error (unknown option, bad value): one line, with the help to read; and with --json
    the JSON object, also on one line."""
    code = getattr(err, "exit_code", EXIT_INPUT)
    context = getattr(err, "ctx", None)
    message = " ".join(err.format_message().split())
    helper = f" (`{context.command_path} --help` lists the options)" if context is not None else ""
    _say("error:", "bold red", message.rstrip(".") + helper)
    if "--json" in sys.argv[1:]:
        _print_json({"error": message, "exit_code": code}, indent=None)
    return code


def main() -> None:  # pragma: no cover
    """The `noderag` command: run it, then leave without tearing the interpreter down. Everything a
    command writes is on disk (fsynced) or flushed by then, and freeing an indexing run's millions of
    small objects one by one is slow. An unexpected exception still ends the ordinary way, with its
    traceback."""
    try:
        code = app(standalone_mode=False, prog_name="noderag")
    except SystemExit as done:
        code = done.code
    except Exception as err:
        if not (hasattr(err, "show") and hasattr(err, "exit_code")):  # not one of click's usage errors
            raise
        code = _usage_error(err)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    if not isinstance(code, int):
        code = 0
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
