"""Stage 7: similarity edges between embedded nodes (paper §2.6), and the vector index.

The paper adds the base layer of an HNSW index as semantic edges. That layer approximates a
pruned nearest-neighbour graph: a node's nearest candidates, each kept only if no already kept,
more similar neighbour is closer to it than the node is (HNSW's neighbour-selection heuristic).
We compute that graph exactly: the `neighbours` most similar nodes by cosine, then the same
heuristic. Computed exactly, it depends on the set of vectors only, not on an insertion order,
so an update recomputes just the rows whose candidates changed and still equals a fresh build
(an HNSW index must be rebuilt in full, in a fresh build's order, to give the same edges).

Exact means exact to the bit: cosines are computed on the vectors rounded to multiples of
1/2048. Their dot products are integers below 2^24 (Cauchy-Schwarz: at most about 2048^2), which
float32 represents exactly, so every BLAS kernel, block shape and summation order gives the same
value, for (a, b) as for (b, a). The rounding moves a cosine by about 1e-4. Ties are broken by
node id. The candidate lists and which candidates the heuristic kept are stored per node
(`neighbours.parquet`) for the next run; not their scores: those are exact, so the next run
recomputes the few it reads (a row's last, and the rows it changes) to the same bits, and the
file is half as large.

From `similarity.exact_below` embedded nodes on, scoring every node against every other (n^2 d)
gives way to candidates from an order-free clustered index (`clustered_lists`, `ivf.py`): each
node is scored exactly against the members of its nearest clusters only. The lists are then the
exact best of those candidates, a function of the set of vectors and the centroids; how many of
the exact 64 they hold is measured in docs/benchmarks.md. A full build trains the centroids (a
function of the set of vectors, so an exact update equals a fresh build). An incremental update
keeps the last full build's centroids (anchor.py): the lists are then exact for those clusters,
so they are maintained like the exact ones: new vectors join their nearest clusters and enter the
stored lists of the rows that probe those clusters, and only new rows and rows that lost more than
SLACK candidates are searched again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..executor import trim_heap
from ..graph import distinct
from ..ivf import BLOCK, BUCKET, QUANT, Clusters, in_parallel, nearest, quantised, widened
from ..spill import Spill

VERSION = 4  # of the neighbour lists' definition or file: stored lists of another version are not reused
ROW_BLOCK = 1024  # rows pruned at a time
SEARCH_BLOCK = 512  # rows scored against every row at a time
PRUNE_BLOCK = 128  # rows per gathered (rows, k, dim) block
CLUSTER_BLOCK = 4096
"""Rows (of neighbouring home clusters) scored against their probed clusters at a time, on each core.
A block's scores above its rows' bounds are held until its lists are chosen: at 100,000 passages
blocks of 8,192 rows made the stage's peak 3.4 GB, of 4,096 2.9 GB in the same time, of 2,048
2.6 GB but 10% slower (one product serves fewer rows)."""
TRIM_CLUSTERS = 64  # clusters scored between two releases of the spilled arrays' pages (spill.py)
ASSIGN = 2  # clustered index: a vector belongs to its 2 nearest clusters (a neighbour near a border is found)
NEIGHBOURS_SCHEMA = pa.schema([("id", pa.string()), ("candidates", pa.list_(pa.int32())),
                               ("kept", pa.list_(pa.bool_())), ("probes", pa.list_(pa.int32()))])
SLACK = 16  # candidates stored beyond k: a row outlives that many deletions without a new search
SUBSAMPLE = 4  # the k-th best of every 4th column bounds the k-th best of the row from below


@dataclass
class Neighbours:
    """Per node (rows sorted by id): its best candidates by exact score, then column (-1 padded;
    `k + SLACK` are kept so that deletions rarely force a full search), and which of the first k
    the heuristic kept."""

    candidates: np.ndarray  # (n, k + SLACK) int32 rows
    kept: np.ndarray  # (n, k) bool
    searched: int = 0  # rows searched (against every node, or their probed clusters) this run
    pruned: int = 0  # rows the heuristic was rerun on (from their first flag a change can move)
    centroids: np.ndarray | None = None  # the clustered index's, when the candidates came from one
    probes: np.ndarray | None = None  # (n, p) int32: each row's nearest of those centroids, nearest first


def scores_against(grid: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Exact cosines of the rows `rows` of `quantised` vectors against every row."""
    return (widened(grid[rows]) @ widened(grid).T) * np.float32(1 / QUANT**2)


def exact_scores(grid: np.ndarray, rows: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Exact cosines of each of `rows` with its `candidates` (-1: -inf), the bits `scores_against`
    gives: the products of whole numbers, summed in any order, are whole numbers below 2^24."""
    out = np.full(candidates.shape, -np.inf, np.float32)
    step = PRUNE_BLOCK * max(1, 16 // max(candidates.shape[1], 1))  # gathered in small blocks, which stay in cache

    def block(start: int) -> None:  # the gathers are the cost (a row's candidates lie anywhere): one per core
        cols = candidates[start : start + step]
        dots = np.matmul(widened(grid[np.maximum(cols, 0)]), widened(grid[rows[start : start + step], :, None]))[:, :, 0]
        out[start : start + step] = np.where(cols >= 0, dots * np.float32(1 / QUANT**2), -np.inf)

    in_parallel(block, list(range(0, len(rows), step)))
    return out


def top_k(scores: np.ndarray, rows: np.ndarray, k: int, columns: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `scores` (the rows `rows` of the full matrix): the k best columns other than the
    row itself, by score then column; padded with -1 / -inf when there are fewer. `columns`: the
    row each column of `scores` stands for, ascending (default: all rows). Sets each row's own
    column of `scores` to -inf."""
    if columns is None:
        scores[np.arange(len(rows)), rows] = -np.inf
    else:
        own = np.minimum(np.searchsorted(columns, rows), len(columns) - 1)
        present = columns[own] == rows
        scores[np.flatnonzero(present), own[present]] = -np.inf
    k_eff = min(k, scores.shape[1] - 1)
    lowest = np.finfo(np.float32).min  # a bound of -inf would let the -inf diagonal through
    bound = np.full(len(rows), lowest, np.float32)
    sample = scores[:, ::SUBSAMPLE]
    if k_eff > 0 and sample.shape[1] > k_eff:
        bound = np.maximum(np.partition(sample, sample.shape[1] - k_eff, axis=1)[:, sample.shape[1] - k_eff], lowest)
    r, c = np.nonzero(scores >= bound[:, None])
    found, values = select(r, c, scores[r, c], len(rows), k)
    if columns is not None:
        found = np.where(found >= 0, columns[np.maximum(found, 0)], -1)
    return found, values


def _descending_key(values: np.ndarray) -> np.ndarray:
    """uint64 keys of float32 values that sort in descending order of the values."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32)
    ascending = bits ^ np.where(bits >> 31, np.uint32(0xFFFFFFFF), np.uint32(0x80000000))
    return (~ascending).astype(np.uint64)


def select(r: np.ndarray, c: np.ndarray, values: np.ndarray, n_rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """From (row, column, score) triples, given in column order: each row's k best columns, by
    score then column."""
    key = (r.astype(np.uint64) << np.uint64(32)) | _descending_key(values)
    order = np.argsort(key, kind="stable")  # triples come in column order within a row
    r, c, values = r[order], c[order], values[order]
    rank = np.arange(len(r)) - np.searchsorted(r, r)
    take = rank < k
    out_cols = np.full((n_rows, k), -1, np.int64)
    out_scores = np.full((n_rows, k), -np.inf, np.float32)
    out_cols[r[take], rank[take]] = c[take]
    out_scores[r[take], rank[take]] = values[take]
    return out_cols, out_scores


def prune(grid: np.ndarray, candidates: np.ndarray, scores: np.ndarray, start: np.ndarray | None = None,
          kept: np.ndarray | None = None) -> np.ndarray:
    """HNSW's heuristic on each row's candidate list (best first): a candidate is kept unless a
    kept, better candidate is more similar to it than the row's node is. With `start` (per row) and
    `kept`, a row's flags before its start are taken from `kept` and only the rest decided: each
    flag depends on the candidates before it only, so the result is the same as deciding them all,
    for the part of the gram matrices from the start on."""
    n, k = candidates.shape
    order = np.argsort(start, kind="stable") if start is not None else np.arange(n)  # like starts together
    first = start[order] if start is not None else np.zeros(n, np.int64)
    given = kept[order] & (np.arange(k) < first[:, None]) if kept is not None else np.zeros((n, k), bool)

    def block(begin: int) -> np.ndarray:
        rows = order[begin : begin + ROW_BLOCK]
        cand = candidates[rows]
        score = scores[rows] * np.float32(QUANT**2)
        from_ = first[begin : begin + ROW_BLOCK]
        gram = np.empty((len(cand), k, k), np.float32)  # rows of it before a row's start are never read
        for part in range(0, len(cand), PRUNE_BLOCK):  # gathered in small blocks, which stay in cache
            vectors = widened(grid[np.maximum(cand[part : part + PRUNE_BLOCK], 0)])
            low = int(from_[part : part + PRUNE_BLOCK].min())
            np.matmul(vectors[:, low:], vectors.transpose(0, 2, 1), out=gram[part : part + len(vectors), low:])
        valid = cand >= 0
        out = given[begin : begin + ROW_BLOCK].copy()
        for j in range(int(from_.min()) if len(from_) else k, k):
            blocked = (out[:, :j] & (gram[:, j, :j] > score[:, j : j + 1])).any(axis=1)
            out[:, j] = np.where(from_ <= j, valid[:, j] & ~blocked, out[:, j])
        return out

    blocks = in_parallel(block, list(range(0, n, ROW_BLOCK)))
    out = np.empty((n, k), bool)
    if blocks:
        out[order] = np.concatenate(blocks)
    return out


def neighbour_lists(ids: np.ndarray, vectors: np.ndarray, k: int, previous: pa.Table | None = None,
                    progress: Callable[[int], None] | None = None) -> Neighbours:
    """The pruned k-nearest-neighbour lists of `vectors` (rows sorted by `ids`, which must name a
    node and its vector: a row whose vector changed is a new row). A row of
    `previous` (`to_table` of an earlier run, same model and k) is reused when at least k of its
    candidates still exist: those are the best among the surviving old nodes, so merging in the
    new nodes that beat its last one gives the exact list again. New rows are scored against
    every row once: that block gives both their own lists and what they bring to the reused ones.
    `progress(n)`: n more rows have their lists (the reused ones at once)."""
    n, width = len(ids), k + SLACK
    lists = _Lists.start(ids, k, width, previous)
    grid = quantised(vectors)
    search = np.flatnonzero(~lists.reused)
    progress = progress or (lambda _: None)
    progress(n - len(search))
    old = np.flatnonzero(lists.reused)
    last_score, last_col = lists.last(grid)
    place = np.full(n, -1, np.int64)
    place[old] = np.arange(len(old))

    def block(start: int):
        rows = search[start : start + SEARCH_BLOCK]
        block_scores = scores_against(grid, rows)
        beats = None
        if len(old):
            new = lists.is_new[rows]
            against = block_scores[new] if not new.all() else block_scores
            a, col = np.nonzero(against >= last_score)
            value = against[a, col]
            enters = (value > last_score[col]) | (rows[new][a] < last_col[col])
            beats = (place[col[enters]], rows[new][a[enters]], value[enters])
        return rows, top_k(block_scores, rows, width), beats

    found = []
    starts = list(range(0, len(search), SEARCH_BLOCK))
    searched = in_parallel(block, starts, done=lambda start: progress(len(search[start : start + SEARCH_BLOCK])))
    for rows, (block_candidates, block_scores), beats in searched:
        lists.candidates[rows], lists.scores[rows] = block_candidates, block_scores
        if beats is not None:
            found.append(beats)
    if found:
        lists.merge_new(grid, found, old)
    return lists.pruned(grid, searched=len(search))


@dataclass
class _Lists:
    """Lists being brought up to date: an earlier run's rows taken in (`_take_previous`), the rest
    to be searched. The scores of a reused row are computed when the run first reads them."""

    k: int
    candidates: np.ndarray
    scores: np.ndarray
    kept: np.ndarray
    reused: np.ndarray  # rows taken from the earlier run
    unscored: np.ndarray  # reused rows whose scores are not computed yet
    decided: np.ndarray  # per reused row, its first candidates as taken in whose flags the last run decided
    blocked_at: np.ndarray  # per reused row, the first candidate as taken in after a deleted kept one (k: none)
    is_new: np.ndarray  # rows the earlier run did not have

    @classmethod
    def start(cls, ids: np.ndarray, k: int, width: int, previous: pa.Table | None, spill: Spill | None = None) -> _Lists:
        n = len(ids)
        spill = spill or Spill.none()
        candidates = spill.full((n, width), -1, np.int32)  # rows: a build has fewer than 2^31
        scores = spill.full((n, width), -np.inf, np.float32)
        kept = spill.full((n, width), False, bool)
        reused = is_new = np.zeros(n, bool)
        decided = blocked_at = np.full(n, k, np.int64)
        if previous is not None and previous.num_rows and n > k:
            reused, decided, blocked_at = _take_previous(previous, ids, k, candidates, kept)
            is_new = ~pc.is_in(pa.array(ids, pa.string()), value_set=previous["id"].combine_chunks()).to_numpy(
                zero_copy_only=False)
        return cls(k, candidates, scores, kept, reused, reused.copy(), decided, blocked_at, is_new)

    def last(self, grid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row, the score and column of the last entry of a reused row's list: a new row enters
        the list when it beats it (score, then column); inf / -1 for other rows."""
        old, n = np.flatnonzero(self.reused), len(self.reused)
        length = (self.candidates[old] >= 0).sum(axis=1)
        last_score = np.full(n, np.inf, np.float32)
        last_col = np.full(n, -1, np.int64)
        last_col[old] = self.candidates[old, length - 1]
        last_score[old] = exact_scores(grid, old, last_col[old, None])[:, 0]
        return last_score, last_col

    def score(self, grid: np.ndarray, rows: np.ndarray) -> None:
        """Compute the scores of those of `rows` that are reused and not scored yet."""
        rows = rows[self.unscored[rows]]
        self.scores[rows] = exact_scores(grid, rows, self.candidates[rows])
        self.unscored[rows] = False

    def merge_new(self, grid: np.ndarray, found: list[tuple[np.ndarray, np.ndarray, np.ndarray]],
                  old: np.ndarray) -> None:
        """`_merge_new` on the reused rows' lists. Their scores are left to be computed for the
        rows that are pruned again (`pruned`): a new entry's place needs a few of them only."""
        hit = _merge_new(grid, found, old, self.candidates)
        self.unscored[hit] = True

    def pruned(self, grid: np.ndarray, searched: int, centroids: np.ndarray | None = None) -> Neighbours:
        """The lists with the heuristic's flags brought up to date. A candidate's flag depends only
        on the kept candidates ahead of it, so a reused row keeps its flags but for its events: a
        new row merged in, or a candidate that moved up into the first k (the last run did not
        decide it). Each event is decided against the kept ones ahead of it; from the first event
        kept, or the first candidate after a deleted kept one, the row is pruned again."""
        k, n = self.k, len(self.reused)
        kept = self.kept[:, :k]
        start = np.zeros(n, np.int64)  # a searched row is pruned whole
        old = np.flatnonzero(self.reused)
        start[old] = k  # a reused row without events keeps its flags
        cols = self.candidates[old, :k]
        inserted = self.is_new[np.maximum(cols, 0)] & (cols >= 0)  # only new rows are merged in
        touched = np.flatnonzero(inserted.any(axis=1) | (self.decided[old] < k) | (self.blocked_at[old] < k))
        rows, cols, inserted = old[touched], cols[touched], inserted[touched]
        taken_in = np.arange(k) - (np.cumsum(inserted, axis=1) - inserted)  # an old candidate's place as taken in
        decided = taken_in < self.decided[rows, None]
        flags = ~inserted & decided & np.take_along_axis(self.kept[rows], np.minimum(taken_in, k - 1), axis=1)
        event = (inserted | ~decided) & (cols >= 0)
        after_lost = ~inserted & (taken_in >= self.blocked_at[rows, None])
        start[rows] = np.where(after_lost.any(axis=1), after_lost.argmax(axis=1), k)
        event &= np.arange(k) < start[rows, None]
        at, j = np.nonzero(event)
        stays = _kept_events(grid, rows[at], cols, flags, at, j)
        first = np.full(len(rows), k, np.int64)
        np.minimum.at(first, at[stays], j[stays])
        start[rows] = np.minimum(start[rows], first)
        kept[rows] = flags  # an event before the row's start is not kept
        redo = np.flatnonzero(start < k)
        self.score(grid, redo)
        if len(redo) == n:  # every row (a full build, or every list changed): the lists, not a copy
            kept[:] = prune(grid, self.candidates[:, :k], self.scores[:, :k], start, kept)
        else:
            kept[redo] = prune(grid, self.candidates[redo, :k], self.scores[redo, :k], start[redo], kept[redo])
        return Neighbours(self.candidates, kept, searched=searched, pruned=len(redo), centroids=centroids)


def _kept_events(grid: np.ndarray, rows: np.ndarray, cols: np.ndarray, flags: np.ndarray, at: np.ndarray,
                 j: np.ndarray) -> np.ndarray:
    """Whether the heuristic keeps each event i: the candidate `cols[at[i], j[i]]` of the node
    `rows[i]`, given the kept candidates ahead of it (`flags[at[i], :j[i]]`): kept unless one of them
    is more similar to it than the node is. The same exact scores as `prune`'s."""
    candidate = cols[at, j]
    own = exact_scores(grid, rows, candidate[:, None])[:, 0]
    event, ahead = np.nonzero(flags[at] & (np.arange(cols.shape[1]) < j[:, None]))
    closer = exact_scores(grid, candidate[event], cols[at[event], ahead][:, None])[:, 0] > own[event]
    blocked = np.zeros(len(at), bool)
    blocked[event[closer]] = True
    return ~blocked


PROBE_PHASES = ((0, 1), (1, 4), (4, None))  # probe ranks scored before the bound is raised again


def _best_of(parts: list, rows: np.ndarray, n: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `width` best distinct columns (not itself) among (row position, column, score)
    triples."""
    r = np.concatenate([p[0] for p in parts])
    c = np.concatenate([p[1] for p in parts])
    v = np.concatenate([p[2] for p in parts])
    keep = c != rows[r]
    first = np.unique(r[keep].astype(np.int64) * n + c[keep], return_index=True)[1]  # a pair met twice, once
    return select(r[keep][first], c[keep][first], v[keep][first], len(rows), width)  # by (row, column)


def _chain(centroids: np.ndarray) -> np.ndarray:
    """A position for each cluster along a greedy nearest-neighbour path through the centroids:
    rows taken in that order probe clusters their predecessors probed, still in the processor's
    cache (at 470,000 nodes the members no longer fit it, and products fed from memory ran at half
    speed)."""
    count = len(centroids)
    similar = centroids @ centroids.T
    free = np.ones(count, bool)
    position = np.empty(count, np.int64)
    at = 0
    for step in range(count):
        position[at] = step
        free[at] = False
        if step + 1 < count:
            row = np.where(free, similar[at], -np.inf)
            at = int(np.argmax(row))
    return position


def clustered_lists(keys: np.ndarray, vectors: np.ndarray, k: int, seed: int, probes: int, assign: int,
                    centroids: np.ndarray | None = None, previous: pa.Table | None = None,
                    progress: Callable[[int], None] | None = None, spill: Spill | None = None) -> Neighbours:
    """Pruned neighbour lists like `neighbour_lists`, each row's candidates drawn from an order-free
    clustered index (`ivf.Clusters`): the rows that belong to one of its `probes` nearest clusters
    (each row belongs to its `assign` nearest), scored exactly on the grid.

    Without `centroids` they are trained on the vectors (a full build: the lists are a function of
    the set of vectors). With an anchor's `centroids` (an incremental update) the clusters keep
    them, and `previous` (`to_table` of the last run against the same centroids) is maintained as
    `neighbour_lists` maintains the exact lists: rows that keep at least k candidates are reused,
    the new rows of the clusters each of them probes merged in (`_newcomers`); the rest searched.
    `progress(n)`: n more rows have their candidates (the reused ones at once). `spill`: where the
    stage's full-size arrays (the grid, its copy by cluster, the lists) go past its memory budget."""
    width = k + SLACK
    spill = spill or Spill.none()
    grid = quantised(vectors, spill.empty(vectors.shape, np.int16))  # whole numbers of at most 2048
    spill.trim()
    if centroids is None:
        clusters = Clusters.build(grid, keys.tolist(), seed, BUCKET, probes, assign)
    else:
        clusters = Clusters(centroids, kept_probes(grid, centroids, max(probes, assign), keys, previous),
                            min(assign, len(centroids)))
    lists = _Lists.start(keys, k, width, previous, spill)
    search = np.flatnonzero(~lists.reused)
    if progress:
        progress(len(keys) - len(search))
    _clustered_search(grid, clusters, search, width, probes, lists.candidates, lists.scores, progress, spill)
    old, new = np.flatnonzero(lists.reused), np.flatnonzero(lists.is_new)
    if len(old) and len(new):
        last_score, last_col = lists.last(grid)
        lists.merge_new(grid, [_newcomers(grid, clusters, probes, old, new, last_score[old], last_col[old])], old)
    neighbours = lists.pruned(grid, searched=len(search), centroids=clusters.centroids)
    neighbours.probes = clusters.probes
    return neighbours


def kept_probes(grid: np.ndarray, centroids: np.ndarray, count: int, keys: np.ndarray,
                previous: pa.Table | None) -> np.ndarray:
    """Each row's `count` nearest centroids (`ivf.nearest`), for an update against an anchor's
    centroids: a row that `previous` (the last run's lists, against the same centroids) holds under
    the same key, the same node with the same vector, keeps the probes it stored, and only the
    others are computed: every vector's nearest centroids were the update's largest product."""
    stored = previous is not None and "probes" in previous.column_names
    if stored:
        at = pc.index_in(pa.array(keys, pa.string()), value_set=previous["id"].combine_chunks())
        found = pc.is_valid(at).to_numpy(zero_copy_only=False)
        column = previous["probes"].combine_chunks()
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        stored = bool(len(lengths)) and bool((lengths == min(count, len(centroids))).all())
    if not stored:
        return nearest(grid, centroids, count)
    width = min(count, len(centroids))
    probes = np.empty((len(keys), width), np.int32)
    values = pc.list_flatten(column).to_numpy().reshape(-1, width)
    probes[found] = values[pc.drop_null(at).to_numpy()]
    missing = np.flatnonzero(~found)
    if len(missing):
        probes[missing] = nearest(grid[missing], centroids, count)
    return probes


def _clustered_search(grid: np.ndarray, clusters: Clusters, rows: np.ndarray, width: int, probes: int,
                      candidates: np.ndarray, scores: np.ndarray, progress: Callable[[int], None] | None = None,
                      spill: Spill | None = None) -> None:
    """The `width` best candidates (and scores) of each of `rows` among the members of its probed
    clusters, written into those rows of `candidates` and `scores` (all rows' lists) by the block
    that found them: a second full-size pair of arrays, and the blocks' results held until all are
    done, were the stage's largest copies.

    Rows are taken in blocks of neighbouring home clusters (their nearest; `_chain`), and their
    probed clusters in phases by rank (`PROBE_PHASES`). In each phase, for each cluster the block's
    rows probe, the rows probing it are scored against its members (a copy of the grid laid out
    cluster by cluster, in int16: half a float32 copy's memory, widened a cluster at a time): one
    product serves the many rows of a block that probe the cluster.
    Only scores that reach a row's width-th best so far are kept: the best of the nearest clusters
    bound what the farther ones can bring."""
    n = len(grid)
    spill = spill or Spill.none()
    indptr, members = clusters.members()
    laid_out = spill.empty((len(members), grid.shape[1]), np.int16)  # each cluster's members, contiguous: on
    for start in range(0, len(members), BLOCK):  # the grid they are whole numbers of at most 2048, exact in int16
        laid_out[start : start + BLOCK] = grid[members[start : start + BLOCK]]
    spill.trim()
    probed = clusters.probes[:, :probes]
    by_home = rows[np.lexsort((rows, _chain(clusters.centroids)[probed[rows, 0]]))]
    blocks = [by_home[i : i + CLUSTER_BLOCK] for i in range(0, len(rows), CLUSTER_BLOCK)]
    scale = np.float32(1 / QUANT**2)

    def by_cluster(ranked: np.ndarray):
        """(cluster, positions of the rows probing it) for each cluster in `ranked`, a block's
        probes of some ranks."""
        local, rank = np.nonzero(ranked >= 0)
        cluster = ranked[local, rank]
        order = np.lexsort((local, cluster))
        local, cluster = local[order], cluster[order]
        edges = np.flatnonzero(np.r_[True, cluster[1:] != cluster[:-1], True]) if len(cluster) else np.zeros(1, int)
        return [(int(cluster[a]), local[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)]

    def visited(ranked: np.ndarray):
        """`by_cluster`, letting the spilled arrays' pages go every `TRIM_CLUSTERS` clusters: a
        block's rows probe many clusters, and the pages it read stay mapped until let go."""
        for count, found in enumerate(by_cluster(ranked), 1):
            if count % TRIM_CLUSTERS == 0:
                spill.trim()
            yield found

    def block(rows: np.ndarray):
        vectors_of_rows = widened(grid[rows])
        parts = []
        for w, who in visited(probed[rows, :1]):  # each row's first list: the best of its home cluster
            start, stop = indptr[w], indptr[w + 1]
            found, found_scores = top_k((vectors_of_rows[who] @ laid_out[start:stop].T.astype(np.float32)) * scale,
                                        rows[who], width,
                                        members[start:stop])
            r, c = np.nonzero(found >= 0)
            parts.append((who[r], found[r, c], found_scores[r, c]))
        for lo, hi in PROBE_PHASES[1:]:
            listed, listed_scores = _best_of(parts, rows, n, width)
            r, c = np.nonzero(listed >= 0)
            parts = [(r, listed[r, c], listed_scores[r, c])]
            bound = listed_scores[:, -1]  # scores below it cannot enter a list any more
            for w, who in visited(probed[rows, lo:hi]):
                start, stop = indptr[w], indptr[w + 1]
                found_scores = (vectors_of_rows[who] @ laid_out[start:stop].T.astype(np.float32)) * scale
                r, c = np.nonzero(found_scores >= bound[who, None])
                if len(r):
                    parts.append((who[r], members[start + c], found_scores[r, c]))
        candidates[rows], scores[rows] = _best_of(parts, rows, n, width)  # blocks' rows are disjoint

    def done(rows: np.ndarray) -> None:
        trim_heap()
        spill.trim()
        if progress:
            progress(len(rows))

    in_parallel(block, blocks, done=done)


NEWCOMER_BLOCK = 64  # changed clusters scored at a time


def _newcomers(grid: np.ndarray, clusters: Clusters, probes: int, old: np.ndarray, new: np.ndarray,
               last_score: np.ndarray, last_col: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(position in `old`, new row, score) for each new row that enters a reused row's list: it is a
    member of a cluster the row probes and beats the list's last entry (`last_score`, `last_col`
    per position in `old`). Each cluster that gained members is scored against the reused rows
    that probe it, so the work is the new rows times the rows probing their clusters."""
    scale = np.float32(1 / QUANT**2)
    count = len(clusters.centroids)
    gained = clusters.probes[new, : clusters.assign].ravel().astype(np.int64)
    joining = np.repeat(new, clusters.assign)
    order = np.lexsort((joining, gained))
    gained, joining = gained[order], joining[order]
    gained_at = np.searchsorted(gained, np.arange(count + 1))
    probed = clusters.probes[old, :probes].ravel().astype(np.int64)
    prober = np.repeat(np.arange(len(old)), min(probes, clusters.probes.shape[1]))
    order = np.lexsort((prober, probed))
    probed, prober = probed[order], prober[order]
    probed_at = np.searchsorted(probed, np.arange(count + 1))
    changed = distinct(gained)

    def block(start: int):
        parts = []
        for w in changed[start : start + NEWCOMER_BLOCK]:
            who = prober[probed_at[w] : probed_at[w + 1]]
            if not len(who):
                continue
            joined = joining[gained_at[w] : gained_at[w + 1]]
            scores = (widened(grid[old[who]]) @ widened(grid[joined]).T) * scale
            a, b = np.nonzero(scores >= last_score[who, None])
            value = scores[a, b]
            enters = (value > last_score[who[a]]) | (joined[b] < last_col[who[a]])
            parts.append((who[a[enters]], joined[b[enters]], value[enters]))
        return parts

    parts = [p for ps in in_parallel(block, list(range(0, len(changed), NEWCOMER_BLOCK))) for p in ps]
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    position = np.concatenate([p[0] for p in parts])
    row = np.concatenate([p[1] for p in parts])
    value = np.concatenate([p[2] for p in parts])
    first = np.unique(position * len(grid) + row, return_index=True)[1]  # a row met in two of the clusters, once
    return position[first], row[first], value[first]


def _take_previous(previous: pa.Table, ids: np.ndarray, k: int, candidates, kept):
    """Fill in the rows of nodes that still exist and keep at least k existing candidates, in
    order, deleted ones dropped. Returns (reused rows, and per row in its list as taken in: how many
    of the first candidates the last run decided (k less the deletions among its first k), and the
    position of the first candidate after a deleted kept one (k: none)). Lists of one length whose candidates all
    still exist (most of them: an update deletes few nodes) are copied as rows of a matrix; only
    the others are compacted entry by entry."""
    n = len(ids)
    at = pc.index_in(previous["id"], value_set=pa.array(ids, pa.string()))
    row, present = pc.fill_null(at, 0).to_numpy().astype(np.int64), pc.is_valid(at).to_numpy(zero_copy_only=False)

    def flat(column: str) -> np.ndarray:
        return pc.list_flatten(previous[column].combine_chunks()).to_numpy(zero_copy_only=False)

    lengths = pc.list_value_length(previous["candidates"].combine_chunks()).to_numpy()
    named, flags = flat("candidates"), flat("kept")  # candidates as rows of `previous`
    reused, decided, blocked_at = np.zeros(n, bool), np.full(n, k, np.int64), np.full(n, k, np.int64)
    lists = np.arange(len(row))  # the rows of `previous` compacted entry by entry
    width = int(lengths[0]) if len(lengths) else 0
    if len(lengths) and k <= width <= candidates.shape[1] and (lengths == width).all():
        named, flags = named.reshape(-1, width), flags.reshape(-1, width)
        intact = present & present[named].all(axis=1)
        target = row[intact]
        candidates[target, :width] = row[named[intact]]
        kept[target, :width] = flags[intact]
        reused[target] = True
        lists = np.flatnonzero(~intact)
        named, flags, lengths = named[lists].ravel(), flags[lists].ravel(), lengths[lists]
    owner = np.repeat(np.arange(len(lists)), lengths)
    position = np.arange(len(owner)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    flat_rows, exists = row[named], present[named]
    usable = present[lists] & (np.bincount(owner[exists], minlength=len(lists)) >= k)
    take = exists & usable[owner]
    taken = np.bincount(owner[take], minlength=len(lists))
    slot = np.arange(int(take.sum())) - np.repeat(np.cumsum(taken) - taken, taken)
    target = row[lists][owner[take]]
    candidates[target, slot] = flat_rows[take]
    kept[target, slot] = flags[take]
    early = ~exists & (position < k)  # deleted from a list's first k
    ahead = np.concatenate([[0], np.cumsum(early)])
    gone_before = ahead[:-1] - np.repeat(ahead[np.cumsum(lengths) - lengths], lengths)  # in its list
    decided_early = k - np.bincount(owner[early], minlength=len(lists))
    blocking = early & flags.astype(bool)  # a kept one: the candidates after it lose what it blocked
    blocked_early = np.full(len(lists), k, np.int64)
    np.minimum.at(blocked_early, owner[blocking], position[blocking] - gone_before[blocking])
    taken_rows = row[lists][usable]
    reused[taken_rows] = True
    decided[taken_rows] = decided_early[usable]
    blocked_at[taken_rows] = blocked_early[usable]
    return reused, decided, blocked_at


def _merge_new(grid: np.ndarray, found: list[tuple[np.ndarray, np.ndarray, np.ndarray]], old: np.ndarray,
               candidates) -> np.ndarray:
    """Reused rows take in the new nodes that beat their last candidate: `found` holds (position in
    `old`, new row, score) triples. Each row's list is sorted (score, then column) and the new
    columns are not in it, so this is a merge of two sorted lists: a new entry's place is the
    number of the row's entries ahead of it (`_entries_ahead`), plus the new ones of the row ahead
    of it. Returns the rows whose lists changed."""
    width = candidates.shape[1]
    o = np.concatenate([f[0] for f in found])
    if not len(o):
        return np.zeros(0, np.int64)
    c = np.concatenate([f[1] for f in found])
    v = np.concatenate([f[2] for f in found])
    order = np.lexsort((c, -v, o))
    o, c, v = o[order], c[order], v[order]
    hit, first = np.unique(o, return_index=True)
    slot = np.searchsorted(hit, o)  # row of the triple among the hit rows
    targets = old[hit]
    rank = np.arange(len(o)) - first[slot]  # among the new entries of its row
    before = _entries_ahead(grid, targets[slot], candidates, c, v)
    old_cols = candidates[targets]
    inserted = np.zeros((len(hit), width + 1), np.int64)
    np.add.at(inserted, (slot, before), 1)
    shift = np.cumsum(inserted[:, :width], axis=1)  # new entries ahead of each old one
    merged_cols = np.full((len(hit), width), -1, candidates.dtype)
    destination = np.arange(width) + shift
    fits = destination < width
    rows = np.broadcast_to(np.arange(len(hit))[:, None], fits.shape)[fits]
    merged_cols[rows, destination[fits]] = old_cols[fits]
    destination = before + rank
    fits = destination < width
    merged_cols[slot[fits], destination[fits]] = c[fits]
    candidates[targets] = merged_cols
    return targets


def _entries_ahead(grid: np.ndarray, rows: np.ndarray, candidates, cols: np.ndarray,
                   values: np.ndarray) -> np.ndarray:
    """For each new entry (column `cols[i]`, exact score `values[i]` for row `rows[i]`), how many
    entries of the row's sorted list (`candidates[rows[i]]`) go before it: those with a higher
    score, or the same and a smaller column (-1 padding: none). A binary search, each step scoring
    one entry per new one (`exact_scores`), not the whole list."""
    lo, hi = np.zeros(len(rows), np.int64), np.full(len(rows), candidates.shape[1], np.int64)
    while (open_ := np.flatnonzero(lo < hi)).size:
        mid = (lo[open_] + hi[open_]) // 2
        entry = candidates[rows[open_], mid]
        score = exact_scores(grid, rows[open_], entry[:, None])[:, 0]  # -inf for padding
        ahead = (score > values[open_]) | ((score == values[open_]) & (entry >= 0) & (entry < cols[open_]))
        lo[open_] = np.where(ahead, mid + 1, lo[open_])
        hi[open_] = np.where(ahead, hi[open_], mid)
    return lo


PAIR_ROWS = 65_536  # lists turned into pairs at a time


def pairs(neighbours: Neighbours) -> np.ndarray:
    """Undirected (lo, hi) row pairs of the kept lists, each once, sorted. Made `PAIR_ROWS` lists at
    a time: the row and column of every entry at once were the stage's largest temporaries."""
    n, k = neighbours.kept.shape
    codes = [np.zeros(0, np.int64)]
    for start in range(0, n, PAIR_ROWS):
        kept = neighbours.kept[start : start + PAIR_ROWS]
        rows = np.repeat(np.arange(start, start + len(kept), dtype=np.int64), k)[kept.ravel()]
        cols = neighbours.candidates[start : start + PAIR_ROWS, :k][kept]
        codes.append(distinct(np.minimum(rows, cols) * n + np.maximum(rows, cols)))
    codes = distinct(np.concatenate(codes))
    return np.stack([codes // max(n, 1), codes % max(n, 1)], axis=1)


def to_table(ids: np.ndarray, neighbours: Neighbours) -> pa.Table:
    """One row per node: its candidates (as rows of this table) and kept flags (False past the
    first k), best first; its probes (`Neighbours.probes`; empty for exact lists)."""
    valid = neighbours.candidates >= 0
    kept = np.zeros(valid.shape, bool)
    kept[:, : neighbours.kept.shape[1]] = neighbours.kept
    offsets = pa.array(np.r_[0, np.cumsum(valid.sum(axis=1))].astype(np.int32))
    probes = np.zeros((len(ids), 0), np.int32) if neighbours.probes is None else neighbours.probes
    return pa.table({
        "id": pa.array(ids, pa.string()),
        "candidates": pa.ListArray.from_arrays(offsets, pa.array(neighbours.candidates[valid].astype(np.int32))),
        "kept": pa.ListArray.from_arrays(offsets, pa.array(kept[valid], pa.bool_())),
        "probes": pa.ListArray.from_arrays(pa.array(np.arange(len(ids) + 1, dtype=np.int32) * probes.shape[1]),
                                           pa.array(probes.ravel().astype(np.int32))),
    }, schema=NEIGHBOURS_SCHEMA)


def keys(ids: list[str], vectors: np.ndarray) -> np.ndarray:
    """Row names for `neighbour_lists`: the node id and a 64-bit fingerprint of its vector (a node
    keeps its id when its text changes, as an entity's attribute does)."""
    names = np.empty(len(ids), dtype=object)
    for start in range(0, len(ids), BLOCK):  # float32 rows a block at a time (the vectors may be stored in half)
        rows = np.ascontiguousarray(vectors[start : start + BLOCK], np.float32)
        names[start : start + len(rows)] = [f"{i}:{hashlib.blake2b(row, digest_size=8).hexdigest()}"
                                            for i, row in zip(ids[start : start + BLOCK], rows, strict=True)]
    return names
