"""Where the walk starts, and the second round of a multi-hop search.

A question that needs two hops names the first hop's entity ("the director of film X") and not
the second's (the director). The first round finds film X's passage; what the second hop needs
is the entity that passage names, and its own passages. So:

- **Specific entities start the walk** (`search.exact_share`): the entities the question names
  carry that share of the start, each in proportion to how specific it is, the vector entry
  points the rest. An entity named in three passages says more about where to look than one
  named in three thousand (HippoRAG weighs its entities the same way). `None`: the same share on
  every entry point (the paper).
- **A second round** (`search.second_round_chunks`): the entities named in the chunks of the
  first round's best units (the passage the first hop found, not only its best sentence; values
  such as dates and quantities left out) become entry points too, weighted by specificity and taking `search.second_round_share` of the start,
  and the walk runs again from the first round's start and them. The bridge entity's own units
  are then one step from an entry point, where the first round reached them three steps away,
  after the walk had spread over every name of the first passage.

Specificity is log((n + 1) / (d + 1)) for a graph of n nodes and an entity of d edges: the
inverse document frequency of the entity, with its edges (to units, relationships, attributes)
counting its mentions. Everything here works on the few rows a question touches.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ..graph import distinct, row_entries
from ..nlp import is_value
from ..node_types import TYPE_CODE
from .ppr import WalkMatrix, uniform_start

MAX_BRIDGE_UNITS = 50
"""Best first-round units looked at for the chunks they come from."""
CROWDED = 256
"""Edges from which an entity is taken to be named outside the first passage without looking."""


def specificity(walk: WalkMatrix, rows: np.ndarray) -> np.ndarray:
    """log((n + 1) / (degree + 1)) of each row: positive, larger for rarer names."""
    degree = (walk.indptr[rows + 1] - walk.indptr[rows]).astype(np.float64)
    return np.log((walk.n + 1.0) / (degree + 1.0))


def start_shares(walk: WalkMatrix, entries: np.ndarray, exact: np.ndarray, exact_share: float | None) -> np.ndarray:
    """The walk's start on `entries` (sorted, distinct): `exact_share` on the `exact` entries by
    specificity and the rest evenly on the others; uniform when `exact_share` is None or either
    side is empty."""
    is_exact = np.isin(entries, exact)
    if exact_share is None or is_exact.all() or not is_exact.any():
        return uniform_start(entries)
    weight = specificity(walk, entries[is_exact])
    start = np.empty(len(entries))
    start[is_exact] = exact_share * weight / weight.sum()
    start[~is_exact] = (1.0 - exact_share) / np.count_nonzero(~is_exact)
    return start


def _neighbours_of_type(walk: WalkMatrix, codes: np.ndarray, rows: np.ndarray, code: int) -> tuple[np.ndarray, np.ndarray]:
    """(neighbour, position in `rows` of the row it neighbours) for every neighbour of type `code`."""
    offsets = row_entries(walk.indptr, rows)
    owner = np.repeat(np.arange(len(rows)), walk.indptr[rows + 1] - walk.indptr[rows])
    columns = walk.indices[offsets].astype(np.int64)
    wanted = codes[columns] == code
    return columns[wanted], owner[wanted]


def _same_document(rows_a: np.ndarray, rows_b: np.ndarray, doc_indptr: np.ndarray, doc_codes: np.ndarray) -> np.ndarray:
    """Per pair, whether the first documents of the two rows agree: a chunk and a unit joined by a
    structural edge always do; a similarity edge (walked when `search.similarity_weight` > 0) may
    join a unit to another document's chunk, which is not where the unit came from."""
    last = max(len(doc_codes) - 1, 0)
    codes = doc_codes if len(doc_codes) else np.zeros(1, np.int32)
    first_a = np.where(doc_indptr[rows_a + 1] > doc_indptr[rows_a], codes[np.minimum(doc_indptr[rows_a], last)], -1)
    first_b = np.where(doc_indptr[rows_b + 1] > doc_indptr[rows_b], codes[np.minimum(doc_indptr[rows_b], last)], -2)
    return first_a == first_b


def best_units(codes: np.ndarray, rows: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The first round's best units (S rows of `rows`, by `scores`, ties by row), at most
    `MAX_BRIDGE_UNITS`: where the second round looks for the chunks the first hop found."""
    is_unit = codes[rows] == TYPE_CODE["S"]
    units = rows[is_unit]
    return units[np.lexsort((units, -scores[is_unit]))[:MAX_BRIDGE_UNITS]].astype(np.int64)


def bridge_candidates(walk: WalkMatrix, codes: np.ndarray, doc_indptr: np.ndarray, doc_codes: np.ndarray,
                      best: np.ndarray, chunks: int, exclude: np.ndarray) -> np.ndarray:
    """The entities (N rows, sorted) named by the units of the first `chunks` chunks that the `best`
    units (in rank order) come from, less those in `exclude` (sorted) and those no unit outside
    those chunks names: they lead nowhere new. An entity with more than `CROWDED` edges surely is
    named elsewhere, and its edges are not gathered."""
    if chunks <= 0 or not len(best):
        return np.zeros(0, np.int64)
    chunk_rows, owner = _neighbours_of_type(walk, codes, best, TYPE_CODE["T"])
    own = _same_document(chunk_rows, best[owner], doc_indptr, doc_codes)
    chunk_rows, owner = chunk_rows[own], owner[own]
    if not len(chunk_rows):
        return np.zeros(0, np.int64)
    order = np.lexsort((chunk_rows, owner))  # by the rank of the unit, then row
    once, first = np.unique(chunk_rows[order], return_index=True)
    chosen = once[np.argsort(first, kind="stable")][:chunks]
    members, owner = _neighbours_of_type(walk, codes, chosen, TYPE_CODE["S"])
    members = distinct(members[_same_document(members, chosen[owner], doc_indptr, doc_codes)])
    entities, _ = _neighbours_of_type(walk, codes, members, TYPE_CODE["N"])
    entities = np.setdiff1d(entities, exclude)
    degree = walk.indptr[entities + 1] - walk.indptr[entities]
    rare = degree <= CROWDED
    units, owner = _neighbours_of_type(walk, codes, entities[rare], TYPE_CODE["S"])
    elsewhere = ~rare
    elsewhere[rare] = np.bincount(owner[~np.isin(units, members)], minlength=int(rare.sum())) > 0
    return entities[elsewhere]


def without_values(entities: np.ndarray, texts: pa.Array, known: dict[int, bool]) -> np.ndarray:
    """The entities whose name (in `texts`, by row) is not a value, a date or a quantity
    (`nlp.is_value`): a year or a number is rarely what a passage of its own is about, and as
    bridges they spread the walk over every passage of the same year. `known` keeps each row's
    verdict for the session (names do not change within a build)."""
    missing = [row for row in entities.tolist() if row not in known]
    if missing:
        names = texts.take(pa.array(missing, pa.int64())).to_pylist()
        known.update(zip(missing, map(is_value, names), strict=True))
    return entities[~np.fromiter((known[row] for row in entities.tolist()), bool, len(entities))]


def with_bridges(walk: WalkMatrix, entries: np.ndarray, start: np.ndarray, bridges: np.ndarray,
                 share: float) -> tuple[np.ndarray, np.ndarray]:
    """The second round's entry points (sorted) and start: the first round's start scaled to
    1 - `share`, and `share` on the bridge entities (none of them a first-round entry point) by
    specificity."""
    weight = specificity(walk, bridges)
    merged = np.concatenate([entries, bridges])
    shares = np.concatenate([(1.0 - share) * start, share * weight / weight.sum()])
    order = np.argsort(merged, kind="stable")
    return merged[order], shares[order]
