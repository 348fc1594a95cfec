"""NodeRAG's ablations (paper §4, table 2 and figure 4; spec §5) as retrieval strategies.

Every variant runs on the same indexed workspace, without re-indexing:

- `noderag`: the full search with the workspace's search settings (the defaults unless its
  config changes them). Every other variant changes one thing against it.
- `ppr-1` ... `ppr-10`: PPR iterations (`ppr-3` is the default, so it equals `noderag`).
- `ppr-converge`: "deep" PPR, run to convergence. `SearchConfig.ppr_iterations` must be an int
  and the query path runs a fixed number of steps, so the variant runs the number of steps that
  provably reaches convergence (`iterations_to_converge`: 28 for alpha 0.5 at tolerance 1e-8),
  through the ordinary search code.
- `no-cross`: no graph walk at all: vector top-k over every embedded node (T, S, A, H), best
  first, until the budget is full.
- `graph-vector`: the same over the graph's own nodes S, A, H only; compare with the `naive`
  baseline (vector over text chunks T), the paper's "vector similarity on node data vs on chunks".
- `no-exact`: dual search without its exact side (`use_exact` False): entry points by vector only.
- `no-hnsw`: the walk without the similarity (HNSW) edges (`similarity_weight` 0). That is now the
  default, so it equals `noderag` unless the workspace's config walks them (`configs/paper.yaml`
  walks them at the paper's weight 1). The weight only changes the transition matrix the walk
  uses (built once per weight when the workspace is opened): weight 0 is exactly the graph without
  the rows of kind "similarity" and without the +1 they gave structural pairs.
- `with-hnsw`: the walk over the similarity edges at the paper's weight 1: with the default weight 0,
  this is the variant that measures what the paper's HNSW edges bring to the walk.
- `lazy-ppr`: the reference code's lazy walk (`ppr_variant` "lazy").
- `paper-rank`: the paper's ranking, raw PPR scores (`rank` "ppr"), instead of this project's
  walk mass times similarity.
- `uniform-start`: the walk starts evenly on every entry point (`exact_share` None, the paper),
  not with a share on the question's entities weighted by how specific they are.
- `one-round`: no second round from the entities of the first round's best chunks
  (`second_round_chunks` 0, the paper).
- `no-diversity`: the context by score alone (`document_diversity` 1, the paper), without the
  factor on nodes whose documents are already in it.
- `no-whole-chunks`: the best documents' units as they were chosen, never their chunk shown whole
  (`whole_chunks` 0).
- `no-asked-kind`: units ranked without regard to the kind of value the question asks for
  (`asked_kind_weight` 0).
- `no-question-words`: units and chunks ranked by walk and vector alone, not also by the
  question's words they hold (`question_words_weight` 0).
"""

from __future__ import annotations

import math

from ..config import SearchConfig, changed
from ..node_types import EMBEDDED_TYPES
from ..search.prepare import SCANNED
from ..search.retriever import Retriever
from .baselines import Strategy, StrategySpec, vector_context

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
    settings = {**overrides, "budget_tokens": budget}
    if settings.get("ppr_iterations", 0) is None:
        settings["ppr_iterations"] = iterations_to_converge(settings.get("ppr_alpha", base.ppr_alpha),
                                                            settings.get("ppr_variant", base.ppr_variant))
    return changed(base, **settings)


def _search(retriever: Retriever, **overrides) -> Strategy:
    by_budget: dict[int, SearchConfig] = {}

    def run(question: str, budget: int):
        if budget not in by_budget:
            by_budget[budget] = search_params(retriever.config.search, budget, overrides)
        return retriever.retrieve(question, by_budget[budget])

    return run


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
                     lambda s: lambda q, b: vector_context(s.retriever, q, b, EMBEDDED_TYPES)),
        StrategySpec("graph-vector", "ablation", "vector search over graph nodes S, A, H only (table 2; vs naive)",
                     lambda s: lambda q, b: vector_context(s.retriever, q, b, SCANNED)),
        StrategySpec("no-exact", "ablation", "dual search without the exact side (table 2)",
                     lambda s: _search(s.retriever, use_exact=False)),
        StrategySpec("no-hnsw", "ablation", "no HNSW similarity edges in the walk (table 2)",
                     lambda s: _search(s.retriever, similarity_weight=0.0)),
        StrategySpec("with-hnsw", "ablation", "similarity (HNSW) edges walked at the paper's weight 1",
                     lambda s: _search(s.retriever, similarity_weight=1.0)),
        StrategySpec("lazy-ppr", "ablation", "the reference code's lazy PPR walk",
                     lambda s: _search(s.retriever, ppr_variant="lazy")),
        StrategySpec("paper-rank", "ablation", "the paper's raw PPR ranking instead of walk x similarity",
                     lambda s: _search(s.retriever, rank="ppr")),
        StrategySpec("uniform-start", "ablation", "the walk starts evenly on every entry point (the paper)",
                     lambda s: _search(s.retriever, exact_share=None)),
        StrategySpec("one-round", "ablation", "no second round from the entities of the best first-round chunks",
                     lambda s: _search(s.retriever, second_round_chunks=0)),
        StrategySpec("no-diversity", "ablation", "the context by score alone, no factor for documents already in it",
                     lambda s: _search(s.retriever, document_diversity=1.0)),
        StrategySpec("no-whole-chunks", "ablation", "the best documents' units, never their short chunk shown whole",
                     lambda s: _search(s.retriever, whole_chunks=0)),
        StrategySpec("no-asked-kind", "ablation", "units ranked without the kind of value the question asks for",
                     lambda s: _search(s.retriever, asked_kind_weight=0.0)),
        StrategySpec("no-question-words", "ablation", "units and chunks ranked without the question's words they hold",
                     lambda s: _search(s.retriever, question_words_weight=0.0)),
    ]
    return {spec.name: spec for spec in specs}


VARIANTS: dict[str, StrategySpec] = _variants()
