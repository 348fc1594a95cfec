"""How a context node was reached, for people judging a search by the path it took.

A node is an entry point (its name matched the question: "exact"; its vector did: "vector"; it
started the second round as a bridge entity: "bridge") or was reached by the walk ("walk"). For a
walked node the path back to an entry point follows, step by step, the neighbour that sent it
the most mass (its mass x its transition weight to the node), preferring a neighbour that is
itself an entry point: the walk spreads from the entry points, so this retraces where the node's
score came from. A bridge's path leads back to the first round's entry points, which found the
unit that names it. The work grows with the degrees of the nodes on the paths, never with the graph.
"""

from __future__ import annotations

import numpy as np

from ..graph import EDGE_KINDS
from .ppr import WalkMatrix

VIA_ORDER = ("exact", "vector", "bridge")  # a node that is several kinds of entry is named by the first


def via(rows: np.ndarray, exact: np.ndarray, vector: np.ndarray, bridges: np.ndarray) -> list[str]:
    """Per row: "exact", "vector", "bridge" or "walk"."""
    found = np.full(len(rows), "walk", dtype=object)
    for name, entries in reversed(list(zip(VIA_ORDER, (exact, vector, bridges), strict=True))):
        found[np.isin(rows, entries)] = name
    return found.tolist()


def path_back(walk: WalkMatrix, support: np.ndarray, mass: np.ndarray, entries: np.ndarray, row: int,
              max_steps: int) -> list[int]:
    """Rows from an entry point (sorted `entries`) to `row`, by the neighbour that sent the most mass
    (`support` sorted, `mass` per support row); shorter when no neighbour in the support is left."""
    path = [int(row)]
    seen = {int(row)}
    for _ in range(max_steps):
        here = path[-1]
        if len(path) > 1 and _member(entries, np.array([here]))[0]:
            break
        neighbours = walk.indices[walk.indptr[here]:walk.indptr[here + 1]].astype(np.int64)
        weights = walk.weights[walk.indptr[here]:walk.indptr[here + 1]].astype(np.float64)
        position = np.minimum(np.searchsorted(support, neighbours), max(len(support) - 1, 0))
        usable = (support[position] == neighbours) & ~np.isin(neighbours, list(seen)) if len(support) else \
            np.zeros(len(neighbours), bool)
        if not usable.any():
            break
        neighbours, weights, position = neighbours[usable], weights[usable], position[usable]
        sent = mass[position] * walk.inverse_degrees(neighbours) * weights
        is_entry = _member(entries, neighbours)
        if is_entry.any():
            sent = np.where(is_entry, sent, -1.0)
        best = int(neighbours[np.lexsort((neighbours, -sent))[0]])  # ties: the lower row
        path.append(best)
        seen.add(best)
    return path[::-1]


def edge_kind(type_a: str, type_b: str) -> str:
    """The kind of edge two node types make: the structural kind where one exists (it wins over
    "similarity" in the edge table), else "similarity"."""
    for kind in EDGE_KINDS:
        if {type_a, type_b} == set(kind.split("-")) and type_a != type_b:
            return kind
    return "similarity"


def _member(sorted_values: np.ndarray, values: np.ndarray) -> np.ndarray:
    if not len(sorted_values):
        return np.zeros(len(values), bool)
    position = np.minimum(np.searchsorted(sorted_values, values), len(sorted_values) - 1)
    return sorted_values[position] == values
