"""What every command shares: one-line errors and their exit codes, JSON and text output, progress
(bars on a terminal, plain lines elsewhere), and the usage lines of `--help`."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import time

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
            from ..config import Config

            defaults = Config()
            for param in self.params:
                if param.name in CONFIG_DEFAULTS:
                    section, key = CONFIG_DEFAULTS[param.name].split(".")
                    value = getattr(getattr(defaults, section), key)
                    param.show_default = f"{value}, or the config's {CONFIG_DEFAULTS[param.name]}"
        super().format_help(ctx, formatter)


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """Text for a terminal: control characters (an escape sequence in a document or a file name
    would retitle the window or move the cursor) shown as `\x1b`, direction overrides as `\u202e`."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 256 else f"\\u{ord(m.group()):04x}", text)


def unwritable(err: OSError) -> OSError:
    """A failed write to standard output as `OutputError` (one line), but a reader that went away
    (a closed pipe, `| head`) as it is: the command ends quietly, as Unix tools do."""
    from ..errors import OutputError

    return err if isinstance(err, BrokenPipeError) else OutputError(f"cannot write the output: {err.strerror or err}")


class _Console(Console):
    """Document text verbatim to a pipe or a file, printable to a terminal (`printable`)."""

    def print(self, *objects, **kwargs) -> None:
        if self.is_terminal:
            objects = tuple(printable(o) if isinstance(o, str) else o for o in objects)
        try:
            super().print(*objects, **kwargs)
        except OSError as err:
            raise unwritable(err) from None


console = _Console(stderr=True, markup=False, emoji=False, highlight=False)  # messages and progress
out = _Console(highlight=False, soft_wrap=True, markup=False, emoji=False)  # results: document text verbatim
_json_errors = False  # a command run with --json (or --questions): its error is also one JSON line on stdout


_LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def print_json(payload, indent: int | None = 2) -> None:
    """JSON on stdout, as is (never through Rich, which would render markup or emoji codes in it).
    The line breaks json leaves raw are escaped so that one record stays one line for any reader."""
    text = json.dumps(payload, ensure_ascii=False, indent=indent).translate(_LINE_BREAKS_JSON_KEEPS)
    try:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    except OSError as err:
        raise unwritable(err) from None


def say(label: str, style: str, message: str) -> None:
    message = " ".join(message.splitlines())  # one line, whatever a library's message held
    console.print(Text.assemble((label, style), " ", printable(message) if console.is_terminal else message),
                  soft_wrap=True)


def warn(message: str) -> None:
    say("warning:", "yellow", message)


def fail(message: str, code: int) -> typer.Exit:
    say("error:", "bold red", message)
    if _json_errors:
        print_json({"error": message, "exit_code": code}, indent=None)
    return typer.Exit(code)


def json_mode(as_json: bool) -> None:
    global _json_errors
    _json_errors = as_json


def run_api(action):
    """The API's errors as one-line messages and their exit codes (errors.py: one base per code)."""
    from ..errors import NoderagError

    try:
        return action()
    except NoderagError as err:
        raise fail(str(err), err.exit_code) from None
    except KeyboardInterrupt:
        raise fail("interrupted; run the same command again to resume", EXIT_INTERRUPTED) from None


def results_table(title: str | None, columns: list[str], right: tuple[str, ...] = ()):
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


MEMORY_SECONDS = 1.0  # a stage's memory is measured at most this often (a walk over /proc)


def in_memory() -> str:
    """What the indexing process and its workers hold now, as progress shows it."""
    from ..executor import tree_resident_mb  # not at import: the CLI's other commands do not need it

    return f"{tree_resident_mb():,.0f} MB in memory"


def peak_note(peak_mb: int | None) -> str:
    return f"peak {peak_mb:,} MB" if peak_mb else ""


class RichReporter:
    """`index/stages.Reporter` drawn as Rich bars (a terminal stderr), each with what the stage
    holds in memory while it runs and its peak when done."""

    def __init__(self, progress):
        self.progress = progress
        self.task = None
        self.measured = 0.0

    def stage_started(self, stage: str, total: int | None) -> None:
        self.task = self.progress.add_task(stage, total=total, memory="")
        self.measured = 0.0

    def advance(self, n: int = 1) -> None:
        if self.task is not None:
            self.progress.advance(self.task, n)
            now = time.monotonic()
            if now - self.measured >= MEMORY_SECONDS:
                self.measured = now
                self.progress.update(self.task, memory=in_memory())

    def stage_finished(self, stage: str, seconds: float, skipped: bool, peak_mb: int | None = None) -> None:
        if skipped:
            self.progress.add_task(f"{stage} (unchanged)", total=1, completed=1, memory="")
        elif self.task is not None:
            task = self.progress.tasks[self.task]
            total = task.total or task.completed or 1  # a count without a known total: what was counted
            self.progress.update(self.task, total=total, completed=total, memory=peak_note(peak_mb))
        self.task = None

    def warn(self, message: str) -> None:
        warn(message)


class LineReporter:
    """`index/stages.Reporter` for a stderr that is not a terminal (a log file, a CI job, a pipe): plain
    lines, a stage's count (with what it holds in memory) at most every PROGRESS_SECONDS, never bars
    or control characters."""

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
            self._line(f"{self.stage}: {self.done:,}" + (f" of {self.total:,}" if self.total else "")
                       + f" done, {in_memory()}")

    def stage_finished(self, stage: str, seconds: float, skipped: bool, peak_mb: int | None = None) -> None:
        if skipped:
            self._line(f"{stage}: unchanged, skipped")
        else:
            self._line(f"{stage}: finished in {seconds:.1f} s" + (f", {peak_note(peak_mb)}" if peak_mb else ""))
        self.stage = None

    def warn(self, message: str) -> None:
        self._line(f"warning: {message}")


@contextlib.contextmanager
def progress_bars():
    """Rich progress bars on a terminal stderr; None elsewhere (the caller prints plain lines)."""
    if not console.is_terminal:
        yield None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    class Memory(ProgressColumn):
        def render(self, task) -> Text:
            return Text(task.fields.get("memory", ""), style="dim")

    with Progress(SpinnerColumn(), TextColumn("{task.description:<24}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), Memory(), console=console) as progress:
        yield progress
