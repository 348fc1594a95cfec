"""`noderag index`: build or update a workspace, or say what a run would do (`--dry-run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    EXIT_FAILED_ITEMS,
    LineReporter,
    RichReporter,
    json_mode,
    out,
    print_json,
    progress_bars,
    results_table,
    run_api,
    warn,
)


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
    accept_cache_loss: Annotated[bool, typer.Option(
        "--accept-cache-loss", help="go on when the workspace's cache lost paid LLM replies since the last run "
                                    "(emptied or replaced): they are asked, and paid for, again")] = False,
    exact: Annotated[bool, typer.Option(
        "--exact", help="this update's tables equal a fresh build's: every summary whose texts moved is written "
                        "again (index.update: exact, for this run)")] = False,
    rebuild: Annotated[bool, typer.Option(
        "--rebuild", help="a full build: every attribute and community written from its texts as they are now, "
                          "the anchor of the next incremental updates (answers the cache holds cost nothing)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the summary as JSON")] = False,
) -> None:
    """Index every document under FOLDER into WORKSPACE; resumes, and updates in proportion to what changed."""
    from .. import nlp

    nlp.load_ahead()  # beside the imports below
    from .. import api

    json_mode(as_json)
    reading = api.Reading(follow_symlinks, include, exclude)
    if dry_run:
        plan = run_api(lambda: api.plan(workspace, input, config_path=config, reading=reading, max_cost_usd=max_cost,
                                        exact=exact, rebuild=rebuild))
        if as_json:
            print_json(plan)
        else:
            _print_plan(plan)
        return
    with progress_bars() as bars:
        reporter = RichReporter(bars) if bars is not None else LineReporter()
        result = run_api(lambda: api.index(workspace, input, config_path=config, reporter=reporter, reading=reading,
                                        max_cost_usd=max_cost, accept_cache_loss=accept_cache_loss, exact=exact,
                                        rebuild=rebuild))
    if as_json:
        print_json({"workspace": str(workspace), **result.as_dict()})
    else:
        table = results_table(f"indexed {workspace} in {result.seconds:.1f}s", ["stage", "seconds", "result"], ("seconds",))
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
        warn(f"rate-limited by the server: waited {result.rate_limit_seconds:.0f} s over {result.rate_limit_waits} "
              "wait(s); llm.requests_per_minute and llm.tokens_per_minute set below the server's limits avoid that")
    if result.failures:
        warn(f"{result.failures} item(s) failed: `noderag stats {workspace} --documents` says why; "
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
        table = results_table(f"LLM estimate for {llm['model']} ({llm['method']})", columns, tuple(columns[1:]))
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
