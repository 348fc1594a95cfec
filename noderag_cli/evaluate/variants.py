"""NodeRAG's ablations (paper §4, table 2 and figure 4; spec §5) as retrieval strategies.

Every variant runs on the same indexed workspace, without re-indexing:

- `noderag`: the full search with the workspace's search settings (the defaults unless its
  config changes them). Every other variant changes one thing against it.
- `ppr-1` ... `ppr-10`: PPR iterations (`ppr-2` is the default, so it equals `noderag`).
- `ppr-converge`: "deep" PPR, run to convergence. `SearchConfig.ppr_iterations` must be an int
  and the query path runs a fixed number of steps, so the variant runs the number of steps that
  provably reaches convergence (`iterations_to_converge`: 28 for alpha 0.5 at tolerance 1e-8),
  through the ordinary search code.
- `no-cross`: no graph walk at all: vector top-k over every embedded node (T, S, A, H), best
  first, until the budget is full.
- `graph-vector`: the same over the graph's own nodes S, A, H only; compare with the `naive`
  baseline (vector over text chunks T), the paper's "vector similarity on node data vs on chunks".
- `no-exact`: dual search without its exact side (`use_exact` False): entry points by vector only.
- `no-hnsw`: the heterograph without HNSW similarity edges. This needs another graph, built once
  from edges.parquet (rows of kind "similarity" dropped; a structural pair that was also in the
  HNSW base layer loses the +1 HNSW gave it) and cached in WORKSPACE/ablation/no-hnsw/, keyed by
  the digest of edges.parquet so a re-indexed workspace rebuilds it. That folder is a shadow
  workspace (the other files linked in), opened by an ordinary Retriever: the same search code.
- `lazy-ppr`: the reference code's lazy walk (`ppr_variant` "lazy").
- `paper-rank`: the paper's ranking, raw PPR scores (`rank` "ppr"), instead of this project's
  walk mass times similarity.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..config import SearchConfig
from ..graph import EDGE_SCHEMA
from ..search.retriever import Retriever
from ..workspace import Workspace, WorkspaceError, atomic_write_bytes, file_digest, write_parquet
from .baselines import Setup, Strategy, StrategySpec, vector_context

NO_HNSW_DIR = Path("ablation") / "no-hnsw"


CONVERGENCE_TOLERANCE = 1e-8
MAX_ITERATIONS = 200


def iterations_to_converge(alpha: float, variant: str, tolerance: float = CONVERGENCE_TOLERANCE) -> int:
    """Steps after which PPR has converged. The paper's iteration is a contraction by (1 - alpha) in
    L1, and the first step moves at most 2, so after t steps a step moves at most 2 (1 - alpha)^t:
    t = ceil(log(tolerance / 2) / log(1 - alpha)) steps reach `tolerance` (28 for alpha 0.5, 1e-8).
    The lazy walk has no such bound: it gets `MAX_ITERATIONS`."""
    if variant != "paper":
        return MAX_ITERATIONS
    if alpha >= 1:
        return 1
    return min(MAX_ITERATIONS, math.ceil(math.log(tolerance / 2) / math.log(1 - alpha)))


def search_params(base: SearchConfig, budget: int, overrides: dict) -> SearchConfig:
    """The variant's settings, validated; ppr_iterations None means "run to convergence"."""
    settings = {**base.model_dump(), **overrides, "budget_tokens": budget}
    if settings.get("ppr_iterations", 0) is None:
        settings["ppr_iterations"] = iterations_to_converge(settings["ppr_alpha"], settings["ppr_variant"])
    return SearchConfig.model_validate(settings)


def _search(retriever: Retriever, **overrides) -> Strategy:
    by_budget: dict[int, SearchConfig] = {}

    def run(question: str, budget: int):
        if budget not in by_budget:
            by_budget[budget] = search_params(retriever.config.search, budget, overrides)
        return retriever.retrieve(question, by_budget[budget])

    return run


# --------------------------------------------------------------------------- no-hnsw
def without_hnsw_edges(edges: pa.Table) -> pa.Table:
    """The edge table as if the HNSW stage had added nothing: rows of kind "similarity" dropped, and
    1 taken off the weight of the structural pairs that were also in the HNSW base layer."""
    table = edges.filter(pc.not_equal(edges["kind"], "similarity"))
    weight = pc.subtract(table["weight"].cast(pa.float32()), table["hnsw"].cast(pa.float32()))
    table = table.set_column(table.schema.get_field_index("weight"), "weight", weight)
    table = table.set_column(table.schema.get_field_index("hnsw"), "hnsw",
                             pa.array([False] * table.num_rows, pa.bool_()))
    return table.filter(pc.greater(table["weight"], 0)).cast(EDGE_SCHEMA)


SHADOW_SKIP = {"edges.parquet", "ablation", "cache.sqlite", "cache.sqlite-wal", "cache.sqlite-shm", ".lock", "noderag.log"}


def no_hnsw_workspace(workspace: Path) -> tuple[Path, str]:
    """A shadow workspace in WORKSPACE/ablation/no-hnsw/: every file of the workspace linked in,
    except edges.parquet, which is the no-HNSW edge table, rebuilt only when the workspace's own
    edges.parquet changed. A Retriever opens it the normal way, so the ablation searches with
    exactly the code the full search uses. Returns the folder and a note on what was done."""
    source = workspace / "edges.parquet"
    digest = file_digest(source)
    folder = workspace / NO_HNSW_DIR
    stamp, cached = folder / "source.json", folder / "edges.parquet"
    try:
        current = cached.is_file() and json.loads(stamp.read_text(encoding="utf-8")).get("edges_digest") == digest
    except (OSError, ValueError):
        current = False
    try:
        if not current:
            write_parquet(cached, without_hnsw_edges(pq.read_table(source)))
            atomic_write_bytes(stamp, json.dumps({"edges_digest": digest}).encode())
        for entry in workspace.iterdir():
            if entry.name in SHADOW_SKIP or entry.name.startswith(".edges"):
                continue
            link = folder / entry.name
            if link.is_symlink() and link.resolve() == entry.resolve():
                continue
            if link.is_symlink() or link.is_file():
                link.unlink()
            link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
    except OSError as err:
        raise WorkspaceError(f"cannot build the no-hnsw graph in {folder}: {err.strerror or err}") from None
    return folder, f"no-hnsw graph {'reused from' if current else 'built in'} {folder}"


def _no_hnsw(setup: Setup) -> Strategy:
    folder, note = no_hnsw_workspace(setup.workspace)
    retriever = setup.retriever
    shadow = Retriever(Workspace(folder), retriever.config, retriever.engine, retriever.embedder)
    setup.notes.append(note)
    return _search(shadow)


# --------------------------------------------------------------------------- registry
def _variants() -> dict[str, StrategySpec]:
    specs = [StrategySpec("noderag", "noderag", "full NodeRAG search (dual search, shallow PPR, cross nodes)",
                          lambda s: _search(s.retriever))]
    for iterations in range(1, 11):
        specs.append(StrategySpec(f"ppr-{iterations}", "ablation", f"PPR with {iterations} iteration(s) (figure 4)",
                                  lambda s, i=iterations: _search(s.retriever, ppr_iterations=i)))
    specs += [
        StrategySpec("ppr-converge", "ablation", "deep PPR, run to convergence (figure 4)",
                     lambda s: _search(s.retriever, ppr_iterations=None)),
        StrategySpec("no-cross", "ablation", "no cross nodes: vector top-k over all embedded nodes, no walk (table 2)",
                     lambda s: lambda q, b: vector_context(s.retriever, q, b, ("T", "S", "A", "H"))),
        StrategySpec("graph-vector", "ablation", "vector search over graph nodes S, A, H only (table 2; vs naive)",
                     lambda s: lambda q, b: vector_context(s.retriever, q, b, ("S", "A", "H"))),
        StrategySpec("no-exact", "ablation", "dual search without the exact side (table 2)",
                     lambda s: _search(s.retriever, use_exact=False)),
        StrategySpec("no-hnsw", "ablation", "no HNSW similarity edges in the graph (table 2)", _no_hnsw),
        StrategySpec("lazy-ppr", "ablation", "the reference code's lazy PPR walk",
                     lambda s: _search(s.retriever, ppr_variant="lazy")),
        StrategySpec("paper-rank", "ablation", "the paper's raw PPR ranking instead of walk x similarity",
                     lambda s: _search(s.retriever, rank="ppr")),
    ]
    return {spec.name: spec for spec in specs}


VARIANTS: dict[str, StrategySpec] = _variants()
