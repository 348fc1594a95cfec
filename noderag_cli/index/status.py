"""What a workspace holds and what an `index` run would do, read from its files without writing:
`stats` (counts, stage states, documents and their status, failed items, LLM usage) and `plan`
(`index --dry-run`)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ..cache import cache_damage
from ..config import changed
from ..engines.identity import identity
from ..errors import DamagedError, NoBuildError
from ..generation import repair_hint
from ..node_types import NODE_TYPES
from ..workspace import Workspace
from .chunk import document_chunks
from .pipeline import damaged_outputs, decide, output_digests, run_config, scan_digest_of, settings_digest
from .run import Reading, workspace_config
from .scan import scan
from .stages import STAGES
from .state import (
    Manifest,
    cache_loss,
    compare_documents,
    decomposed,
    documents_status,
    failed_items,
    indexed_state,
)


def stats(workspace: str | Path, verify: bool = False) -> dict:
    """Everything `noderag stats` shows, as plain data; never writes to the workspace. With
    `verify`, every file of the current build is checked against its recorded checksum, and the
    cache against SQLite's own check: a mismatch raises WorkspaceError naming the file."""
    ws = Workspace(Path(workspace))
    ws.check_indexed()
    manifest = Manifest.load(ws)
    ordered = {stage.name: manifest.stages[stage.name].to_json() for stage in STAGES if stage.name in manifest.stages}
    report: dict = {"workspace": str(ws.root), "input": manifest.input, "stages": ordered, "generation": None,
                    "nodes": {}, "edges": {"by_kind": {}, "non_hnsw": 0, "hnsw": 0, "merged_total": 0},
                    "vectors": {"count": 0, "dim": manifest.embedding.get("dim"),
                                "model": manifest.embedding.get("model")}}
    try:
        generation = ws.open_generation()
    except NoBuildError:
        if verify:  # a workspace with no usable build does not pass a check
            raise
        generation = None
    if generation is not None:
        with generation:
            built = generation.manifest["counts"]
            report["generation"] = generation.name
            report["nodes"], report["edges"] = dict(built["nodes"]), built["edges"]
            report["vectors"]["count"] = built["vectors"]
            report["anchor"] = built.get("anchor")  # builds made before incremental updates have none
            if verify:
                problems = generation.verify()
                if problems:
                    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                    raise DamagedError(f"workspace file {problems[0]}{more}; "
                                       + repair_hint(ws.root, manifest.input))
                report["verified"] = {"generation": generation.name, "files": len(generation.manifest.get("files", {}))}
    if verify:
        damaged = [path for stage in STAGES if stage.name != "assemble"  # the build: checked above
                   for path in damaged_outputs(ws, stage, manifest.entry(stage.name))]
        if damaged:
            more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
            raise DamagedError(f"workspace file {damaged[0]} does not match the checksum recorded when it was "
                               f"written{more}; " + repair_hint(ws.root, manifest.input))
        problem = cache_damage(ws.cache_path, thorough=True)
        if problem:
            raise DamagedError(f"workspace file {ws.cache_path} is damaged ({problem[:160]}); "
                               f"`noderag index {ws.root} --input {manifest.input or 'FOLDER'}` keeps what is "
                               "readable and rebuilds the rest")
        loss = cache_loss(ws, manifest)
        if loss is not None:
            message, paid = loss
            raise DamagedError(f"{message}; restore it from a backup, or `noderag index {ws.root} --input "
                               f"{manifest.input or 'FOLDER'}{' --accept-cache-loss' if paid else ''}` computes "
                               f"{'(and pays for) ' if paid else ''}what it held again")
    report["nodes"] = {t: report["nodes"].get(t, 0) for t in NODE_TYPES}
    documents = documents_status(ws, workspace_config(ws))
    by_status: dict[str, int] = {}
    for row in documents:
        by_status[row["status"]] = by_status.get(row["status"], 0) + 1
    report["documents"] = {"by_status": by_status, "list": [
        {k: row[k] for k in ("path", "status", "reason", "chunks", "chunks_done", "title")} for row in documents]}
    report["failed_items"] = failed_items(ws)
    llm_totals: dict[str, float | bool | None] = {}
    for info in report["stages"].values():
        for key, value in (info.get("llm") or {}).items():
            if key == "price_known":
                llm_totals[key] = False
            elif value is None or llm_totals.get(key, 0) is None:  # an unknown price: the total is unknown too
                llm_totals[key] = None
            else:
                llm_totals[key] = llm_totals.get(key, 0) + value
    report["llm"] = llm_totals
    report["files"] = {p.relative_to(ws.root).as_posix(): p.stat().st_size
                       for p in sorted(ws.root.rglob("*")) if p.is_file() and not p.name.startswith(".")}
    ws.close()
    return report


def plan(workspace: str | Path, input_folder: str | Path, config_path: Path | None = None,
         reading: Reading | None = None, max_cost_usd: float | None = None, exact: bool = False,
         rebuild: bool = False) -> dict:
    """What `index` would do, without writing anything: documents new, changed, renamed, deleted and
    unchanged since the last complete build; chunks still to decompose; each stage's fate, by the
    pipeline's own rule (`pipeline.decide`); and with an LLM engine, the estimated calls, tokens
    and cost, and whether they fit in the spending cap. `exact`, `rebuild`: as `index` takes them."""
    ws = Workspace(Path(workspace))
    ws.check_usable()
    config = run_config(workspace_config(ws, config_path, reading), exact)
    if max_cost_usd is not None:
        config = config.model_copy(update={"llm": changed(config.llm, max_cost_usd=max_cost_usd)})
    files = scan(Path(input_folder), config.chunk, memory=ws.read_only_cache())
    readable = [f for f in files if not f.reason]
    changes = compare_documents(indexed_state(ws), {f.path: f.content_hash for f in readable})
    counts = {k: len(v) for k, v in changes.items()} | {"skipped": len(files) - len(readable)}
    touched = set(changes["new"]) | set(changes["changed"]) | {p.split(" -> ")[1] for p in changes["renamed"]}
    fresh = [f for f in readable if f.path in touched]
    cache = ws.read_only_cache()
    pieces = document_chunks(fresh, config.chunk, cache=ws.read_only_cache())
    new_chunks = [(c[2], entry.title, c[0]) for entry in pieces for c in entry.chunks]
    to_decompose = len(new_chunks) - len(decomposed(ws, cache, config, new_chunks))
    manifest = Manifest.load(ws)
    engine_identity = identity(config.llm)
    scan_digest = scan_digest_of(files)
    stages: dict[str, str] = {}
    digests: dict = {}
    for stage in STAGES:
        entry = manifest.entry(stage.name)
        decision = decide(ws, stage, entry, settings_digest(config, engine_identity, stage), digests, scan_digest,
                          rebuild or manifest.rebuild_pending)
        digests.update({o: None for o in stage.outputs} if decision.run else output_digests(stage, entry))
        stages[stage.name] = f"run: {decision.reason}" if decision.run else "skip (unchanged)"
    result = {"workspace": str(ws.root), "input": str(input_folder), "documents": counts,
              "changes": {k: v for k, v in changes.items() if k != "unchanged"},
              "formats": dict(sorted(Counter(f.reader for f in readable).items())), "left_out": files.left_out,
              "skipped": [{"path": f.path, "reason": f.reason} for f in files if f.reason] +
                         [{"path": f.path, "reason": entry.failure} for f, entry in zip(fresh, pieces, strict=True)
                          if entry.failure],
              "chunks": {"in_changed_documents": len(new_chunks), "to_decompose": to_decompose},
              "stages": stages}
    if config.paid():
        from .estimate import estimate_llm

        result["llm"] = estimate_llm(ws, Path(input_folder), config, rebuild or manifest.rebuild_pending)
        limit, estimate = config.llm.max_cost_usd, result["llm"]["total"]["cost_usd"]
        if limit is not None:
            result["llm"]["spending_cap"] = {"limit_usd": limit, "fits": None if estimate is None else estimate <= limit}
    ws.close()
    return result
