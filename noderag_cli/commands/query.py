"""`noderag query` and `noderag mcp`: questions answered from the current build."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    CONFIG_DEFAULTS,
    EXIT_FAILED_ITEMS,
    EXIT_INPUT,
    console,
    fail,
    json_mode,
    out,
    print_json,
    results_table,
    run_api,
    warn,
)


def _answer_lines(session, questions: Path, items: list, answer: bool, params, found: list) -> int:
    """`--questions`: one JSON line out per line in, in order; a bad line, or a question that cannot
    be searched, gets `{"line", "error"}` in its place and the run goes on. Exit 1 if any failed.
    Each result is also appended to `found` (for the page)."""
    from ..errors import QueryError

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
            warn(f"{questions} line {number}: {error}")
            print_json({"line": number, "error": error}, indent=None)
        else:
            found.append(result)
            print_json({"line": number, **result.as_dict()}, indent=None)
    return EXIT_FAILED_ITEMS if failed else 0


def _write_page(results: list, target: Path, workspace: Path) -> None:
    """`--html`: the page of what the questions found (page.py); never into a workspace."""
    from .. import page
    from ..workspace import refuse_output_inside

    refuse_output_inside(target, "--html")
    page.write(results, target, f"noderag: what the search found in {workspace.name}")


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
    from .. import nlp

    nlp.load_ahead()  # beside the imports below
    from .. import api
    from ..files import check_output
    from ..questions import read_question_lines
    from ..workspace import refuse_output_inside

    json_mode(as_json or questions is not None)
    if (question is None) == (questions is None):
        raise fail("give either a QUESTION or --questions FILE", EXIT_INPUT)
    flags = {"budget": budget, "top_k": top_k, "iterations": iterations, "alpha": alpha}
    changes = {CONFIG_DEFAULTS[flag].split(".")[1]: value for flag, value in flags.items() if value is not None}
    items = run_api(lambda: read_question_lines(questions)) if questions is not None else []
    compiled = len(items) >= api.COMPILED_FROM_QUESTIONS
    session = run_api(lambda: api.open_workspace(workspace, config_path=config, compiled=compiled))
    params = run_api(lambda: session.search_settings(**changes))
    if html_page is not None:
        run_api(lambda: (refuse_output_inside(html_page, "--html"), check_output(html_page, "--html")))  # before any work
    if questions is not None:
        found: list = []
        code = run_api(lambda: _answer_lines(session, questions, items, not context_only, params, found))
        if html_page is not None:
            run_api(lambda: _write_page(found, html_page, workspace))
        if code:
            raise typer.Exit(code)
        return
    explain = as_json or html_page is not None
    result = run_api(lambda: session.ask(question, answer=not context_only, params=params, explain=explain))
    if html_page is not None:
        run_api(lambda: _write_page([result], html_page, workspace))
        console.print(f"wrote {html_page}")
    if as_json:
        print_json(result.as_dict())
        return
    if result.answer is not None:
        out.print(result.answer)
    if show_context or context_only:
        _print_context(result)
    if not result.nodes:
        budget_tokens = params.budget_tokens
        if result.smallest_match_tokens > budget_tokens:
            warn(f"the budget of {budget_tokens} tokens is smaller than the smallest matching node "
                  f"({result.smallest_match_tokens} tokens); raise --budget")
        else:
            warn("nothing in the workspace matched this question")


def _print_context(result) -> None:
    table = results_table(f"context: {len(result.nodes)} nodes, {result.context_tokens} tokens, "
                   f"{result.timings.get('retrieval_ms', 0):.1f} ms", ["type", "via", "score", "text", "documents"])
    for node in result.nodes:
        table.add_row(node.type, node.via, f"{node.score:.4f}", node.text, ", ".join(node.documents))
    out.print(table)


def mcp(
    workspace: Annotated[Path, typer.Argument(help="an indexed workspace", metavar="WORKSPACE", show_default=False)],
) -> None:
    """Serve WORKSPACE over the Model Context Protocol on stdin/stdout, for agents and chat clients:
    tools `search` (context, or an answer), `node` and `document`. Read-only; picks up a new build after
    `noderag index` without a restart. Needs the extra: pip install 'noderag-cli[mcp]'."""
    from .. import mcp_server

    run_api(lambda: mcp_server.require_sdk())
    run_api(lambda: mcp_server.serve(workspace))
