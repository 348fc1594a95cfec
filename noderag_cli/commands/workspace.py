"""`noderag stats`, `init`, `gc` and `export`: what a workspace holds, its config, its upkeep."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import (
    json_mode,
    out,
    print_json,
    results_table,
    run_api,
    warn,
)


def _stage_details(info: dict) -> str:
    """A stage's LLM use and vectors in words; only what is not zero."""
    llm = info.get("llm") or {}
    parts = [f"{llm[key]:,} {label}" for key, label in (("calls", "LLM calls"), ("cache_hits", "cache hits"))
             if llm.get(key)]
    failures = info.get("failures", llm.get("failures", 0))
    if failures:
        parts.append(f"{failures:,} failed")
    if info.get("final_failures"):
        parts.append(f"{info['final_failures']:,} without result")
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


def stats(
    workspace: Annotated[Path, typer.Argument(help="a workspace folder", metavar="WORKSPACE", show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    documents: Annotated[bool, typer.Option("--documents", help="list every document with its status")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="check every file of the current build against its "
                                                           "recorded checksum, and the cache; exit 3 if one differs")] = False,
) -> None:
    """What WORKSPACE holds: nodes per type, edges per kind, vectors, files, stages, LLM usage. Never writes to it."""
    from .. import api

    json_mode(as_json)
    report = run_api(lambda: api.stats(workspace, verify=verify))
    if as_json:
        print_json(report)
        return
    nodes = results_table("nodes", ["type", "count"], ("count",))
    for node_type, count in report["nodes"].items():
        nodes.add_row(node_type, f"{count:,}")
    out.print(nodes)
    edges = results_table("edges", ["kind", "count"], ("count",))
    for kind, count in report["edges"]["by_kind"].items():
        edges.add_row(kind, f"{count:,}")
    for label in ("non_hnsw", "hnsw", "merged_total"):
        edges.add_row(label, f"{report['edges'][label]:,}")
    out.print(edges)
    out.print(f"vectors: {report['vectors']['count']:,} of dimension {report['vectors']['dim']} "
              f"({report['vectors']['model']})")
    out.print(f"current build: {report['generation'] or 'none yet'}")
    if report.get("anchor"):
        kept = report["anchor"]
        out.print(f"since the last full build: {kept['changed_share']:.1%} of the chunks changed")
        out.print(f"stale summaries: {kept['stale_attributes']:,} attributes, {kept['stale_communities']:,} "
                  "communities (index --rebuild)")
    if "verified" in report:
        out.print(f"verified: {report['verified']['files']} files of {report['verified']['generation']}, "
                  "every checksum matches")
    stages = results_table("stages", ["stage", "state", "seconds", "LLM use, vectors"], ("seconds",))
    for stage, info in report["stages"].items():
        stages.add_row(stage, info.get("state", "-"), str(info.get("seconds", "-")), _stage_details(info))
    out.print(stages)
    docs = report["documents"]
    out.print("documents: " + ", ".join(f"{n} {s}" for s, n in docs["by_status"].items()))
    if documents:
        listing = results_table("documents", ["path", "status", "chunks", "reason"])
        for row in docs["list"]:
            chunks = str(row["chunks"])
            if row["status"] == "pending":
                chunks = f"{row['chunks_done']}/{row['chunks']} decomposed" if row["chunks"] else "-"
            listing.add_row(row["path"], row["status"], chunks, row["reason"])
        out.print(listing)
        for final, title in ((False, "other failed items (retried by the next `noderag index`)"),
                             (True, "items with no result (the engine gives the same on every run: never retried)")):
            rows = [row for row in report["failed_items"] if row["final"] == final]
            if rows:
                items = results_table(title, ["stage", "item", "reason"])
                for row in rows:
                    items.add_row(row["stage"], row["item"], row["reason"])
                out.print(items)
    files = results_table("files", ["file", "bytes"], ("bytes",))
    for name, size in report["files"].items():
        files.add_row(name, f"{size:,}")
    out.print(files)


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
    from .. import api

    paths = run_api(lambda: api.init(workspace, llm, force, prompts))
    out.print(f"wrote {', '.join(map(str, paths))}; edit, then `noderag index {workspace} --input FOLDER`")


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
    from .. import api

    json_mode(as_json)
    report = run_api(lambda: api.gc(workspace, dry_run, include_unfinished))
    if as_json:
        print_json(report)
        return
    verb = "would free" if dry_run else "freed"
    cache = report["cache"]
    out.print(f"{verb} {report['bytes_freed']:,} bytes: {len(report['generations'])} old build(s), "
              f"{len(report['files'])} leftover file(s), {cache['removed']:,} of {cache['entries']:,} cache entries")
    if report["held_generations"]:
        out.print(f"kept {', '.join(report['held_generations'])}: a query still reads it; run gc again later")
    if cache["skipped"]:
        warn(f"cache not collected: {cache['skipped']}")


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
    from .. import api

    json_mode(as_json)
    written = run_api(lambda: api.export(workspace, fmt, out_path))
    if as_json:
        print_json(written)
    else:
        out.print(f"wrote {written['nodes']:,} nodes and {written['edges']:,} edges of build {written['generation']} "
                  f"to {', '.join(written['files'])}")
