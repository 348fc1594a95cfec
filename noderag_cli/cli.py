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

import logging
import os
import sys
from typing import Annotated

import typer

from .commands import ablate as ablation
from .commands import index as indexing
from .commands import query as querying
from .commands import workspace as upkeep
from .commands.common import EXIT_INPUT, Command, print_json, say
from .errors import OutputError

app = typer.Typer(
    help="Build a NodeRAG heterograph from a folder of documents and answer questions from it. "
    "Runs offline by default; LLM engines through litellm by config.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


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


# the commands, in the order `--help` lists them
app.command(cls=Command, short_help="build or update WORKSPACE from a folder of documents")(indexing.index)
app.command(cls=Command, short_help="answer a question (or a JSONL file of them) from WORKSPACE")(querying.query)
app.command(cls=Command, short_help="serve WORKSPACE to agents over MCP (stdio)")(querying.mcp)
app.command(cls=Command, short_help="what WORKSPACE holds; never writes to it")(upkeep.stats)
app.command(cls=Command, short_help="write WORKSPACE/config.yaml with every setting explained")(upkeep.init)
app.command(cls=Command, short_help="remove old builds and cache entries nothing refers to")(upkeep.gc)
app.command(cls=Command, short_help="write the graph as GraphML or Neo4j bulk-import CSV")(upkeep.export)
app.command(cls=Command, short_help="compare NodeRAG, its ablations and baselines at equal budgets")(ablation.ablate)


def _usage_error(err) -> int:
    """A usage error (unknown option, bad value): one line, with the help to read; and with --json
    the JSON object, also on one line."""
    code = getattr(err, "exit_code", EXIT_INPUT)
    context = getattr(err, "ctx", None)
    message = " ".join(err.format_message().split())
    helper = f" (`{context.command_path} --help` lists the options)" if context is not None else ""
    say("error:", "bold red", message.rstrip(".") + helper)
    if "--json" in sys.argv[1:]:
        print_json({"error": message, "exit_code": code}, indent=None)
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
    except OutputError as err:  # stdout could not be written: said on stderr, which still can be
        say("error:", "bold red", str(err))
        code = err.exit_code
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
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # the reader went away, or the error above was already said
            code = code or 1
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
