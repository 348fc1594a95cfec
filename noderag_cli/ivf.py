"""An order-free clustered index over unit vectors (an inverted file), for the similarity edges at
scale (index/similarity_edges.py) and the vector side of search (search/prepare.py).

Why clusters: the exact nearest neighbours of every vector cost n^2 d; scoring each vector only
against the members of the clusters nearest to it costs n x (probed members) x d.

Why it is a function of the set of vectors, never of an order or a history: an update must give
the same tables as a fresh build. So
- every product is taken between vectors on the 1/2048 grid (`quantised`): integer-valued float32
  whose dot products are integers below 2^24, exact in float32 whatever the BLAS kernel, block,
  thread count or machine (each partial sum is bounded like the whole, by Cauchy-Schwarz);
- the centroids are trained by k-means on that grid, re-rounded to it after each step (sums of
  integers in float64 are exact in any order, the norm's square too), starting from the vectors
  whose keys hash lowest with the seed, on a sample of the lowest-hashing vectors;
- ties are broken by index (centroid or row), and rows come sorted by key.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
from threadpoolctl import threadpool_limits

QUANT = 2048
BLOCK = 2048  # rows scored against the centroids at a time
BUCKET = 256  # vectors per cluster, on average
SAMPLE_PER_CLUSTER = 32  # vectors `train` draws per cluster to train on


def quantised(vectors: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Unit vectors on the 1/2048 grid, scaled by 2048 (integer-valued float32), into `out` if
    given (float32, or int16: the values are whole numbers of at most 2048, exact in half the
    memory; whoever multiplies rows widens them to float32 first, `widened`). Made a block of rows at a time: the only full-size array is the result, whatever the
    input's precision (a build's mapped half-precision vectors are widened block by block)."""
    out = np.empty(vectors.shape, np.float32) if out is None else out
    for start in range(0, len(vectors), BLOCK):
        block = np.asarray(vectors[start : start + BLOCK], np.float32) * np.float32(QUANT)
        out[start : start + BLOCK] = np.rint(block)
    return out


def widened(rows: np.ndarray) -> np.ndarray:
    """Rows of a grid (`quantised`) as float32, to multiply: the same values whichever dtype holds them."""
    return rows.astype(np.float32, copy=False)


_THREADS: list[int] = []  # set in an executor's worker process: it owns one core


def cores() -> int:
    """The threads `in_parallel` may use: the cores this process may run on, 1 in an executor's
    worker (its siblings have the others)."""
    if _THREADS:
        return _THREADS[0]
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def use_threads(count: int) -> None:
    _THREADS[:] = [count]


def in_parallel(job: Callable, items: list, workers: int | None = None,
                done: Callable[[Any], None] | None = None) -> list:
    """job(item) for every item, in order, on as many threads as this process has cores (or
    `workers`), with BLAS held to one thread per call: OpenBLAS's own threads are slower than one
    on the small products here, while Python threads over independent blocks use every core
    (numpy releases the GIL). Results never depend on the number of threads: each item is computed
    alone. `done(item)` is called in this thread as each result is taken, in order (progress)."""
    workers = min(len(items), workers or cores())
    with threadpool_limits(1, "blas"):
        if workers <= 1:
            results = (job(item) for item in items)
            return [_taken(result, item, done) for item, result in zip(items, results, strict=True)]
        with ThreadPoolExecutor(workers) as pool:
            return [_taken(result, item, done) for item, result in zip(items, pool.map(job, items), strict=True)]


def _taken(result: Any, item: Any, done: Callable[[Any], None] | None) -> Any:
    if done is not None:
        done(item)
    return result


def key_hashes(keys: Sequence[str], seed: int) -> np.ndarray:
    """A seeded 64-bit hash of each key (uint64): the order in which vectors are drawn as seeds
    and training sample, the same for a vector whatever else is in the set."""
    salt = seed.to_bytes(8, "little", signed=True)
    return np.fromiter((int.from_bytes(hashlib.blake2b(k.encode(), digest_size=8, key=salt).digest(), "little")
                        for k in keys), np.uint64, len(keys))


def nearest(grid: np.ndarray, centroids: np.ndarray, count: int) -> np.ndarray:
    """Each row's `count` nearest centroids (int32), nearest first, ties by centroid index."""
    count = min(count, len(centroids))

    def block(start: int) -> np.ndarray:
        scores = widened(grid[start : start + BLOCK]) @ centroids.T
        if count < scores.shape[1]:
            # everything tied with the count-th best competes; the sort below keeps the lower indices
            bound = -np.partition(-scores, count - 1, axis=1)[:, count - 1 : count]
            rows, cols = np.nonzero(scores >= bound)
        else:
            rows, cols = np.nonzero(np.ones(scores.shape, bool))
        order = np.lexsort((cols, -scores[rows, cols], rows))
        rows, cols = rows[order], cols[order]
        rank = np.arange(len(rows)) - np.searchsorted(rows, rows)
        out = np.empty((len(scores), count), np.int32)
        take = rank < count
        out[rows[take], rank[take]] = cols[take]
        return out

    parts = in_parallel(block, list(range(0, len(grid), BLOCK)))
    return np.concatenate(parts) if parts else np.zeros((0, count), np.int32)


def cluster_count(n: int, bucket: int) -> int:
    """About n / bucket clusters: how many `Clusters.build` trains."""
    return max(1, math.ceil(n / bucket))


def drawn(hashes: np.ndarray, n_clusters: int) -> np.ndarray:
    """The rows `train` draws its seeds and sample from, ascending: training on the grid of these
    alone, with their hashes, gives the centroids of training on every row, without a grid of all."""
    return np.sort(np.argsort(hashes, kind="stable")[: SAMPLE_PER_CLUSTER * n_clusters])


def train(grid: np.ndarray, hashes: np.ndarray, n_clusters: int, iterations: int = 8) -> np.ndarray:
    """k-means centroids on the grid (grid-valued float32), exactly reproducible: seeded by the
    `n_clusters` lowest-hashing vectors, trained on the `SAMPLE_PER_CLUSTER x n_clusters`
    lowest-hashing ones. A centroid that loses every member stays where it was."""
    order = np.argsort(hashes, kind="stable")
    n_clusters = min(n_clusters, len(grid))
    centroids = grid[order[:n_clusters]].astype(np.float32)
    sample = grid[np.sort(order[: min(len(grid), SAMPLE_PER_CLUSTER * n_clusters)])]
    for _ in range(iterations):
        labels = nearest(sample, centroids, 1)[:, 0]
        by_label = np.argsort(labels, kind="stable")
        present, starts = np.unique(labels[by_label], return_index=True)
        sums = np.add.reduceat(sample[by_label].astype(np.float64), starts, axis=0)
        norms = np.sqrt(np.einsum("ij,ij->i", sums, sums))  # exact: integers below 2^53
        moved = np.rint(sums * (QUANT / np.maximum(norms, 1.0))[:, None]).astype(np.float32)
        if np.array_equal(moved, centroids[present]):
            break
        centroids[present] = moved
    return centroids


@dataclass
class Clusters:
    """Vectors (rows) in clusters: each row's `probes` nearest centroids, best first; a row is a
    member of its first `assign` ones."""

    centroids: np.ndarray  # (c, d) grid-valued float32
    probes: np.ndarray  # (n, p) int32
    assign: int

    @classmethod
    def build(cls, grid: np.ndarray, keys: Sequence[str], seed: int, bucket: int, probes: int,
              assign: int) -> Clusters:
        """About n / bucket clusters of the rows of `grid`, named by `keys`."""
        n_clusters = cluster_count(len(grid), bucket)
        centroids = train(grid, key_hashes(keys, seed), n_clusters)
        return cls(centroids, nearest(grid, centroids, max(probes, assign)), min(assign, len(centroids)))

    def members(self) -> tuple[np.ndarray, np.ndarray]:
        """(indptr, rows): the rows of each cluster, ascending (CSR over the centroids)."""
        owner = self.probes[:, : self.assign].ravel()
        rows = np.repeat(np.arange(len(self.probes), dtype=np.int64), self.assign)
        order = np.lexsort((rows, owner))
        indptr = np.r_[0, np.cumsum(np.bincount(owner, minlength=len(self.centroids)))].astype(np.int64)
        return indptr, rows[order]


STORED_DTYPE = np.float16  # the precision a build stores its vectors in


def on_stored_grid(vectors: np.ndarray) -> np.ndarray:
    """float32 vectors rounded to the precision a build stores (half): the embedder returns every
    vector so, so that a vector read back from a build is the same bits as one computed afresh
    (an update equals a fresh build) and storing it loses nothing. Half precision keeps a cosine
    to about 1e-3, far below what separates neighbours, for half the disk of float32."""
    return np.asarray(vectors, np.float32).astype(STORED_DTYPE).astype(np.float32)


def flat_index(vectors: np.ndarray | Iterable[np.ndarray], dim: int | None = None) -> faiss.Index:
    """The vector index a build holds: inner product over the L2-normalised rows, each stored in
    half precision (`on_stored_grid`). `vectors`: the rows, or blocks of them (then `dim`), added
    a block at a time: the index's half-precision codes are the one copy of them all."""
    blocks = [vectors] if isinstance(vectors, np.ndarray) else vectors
    dim = vectors.shape[1] if isinstance(vectors, np.ndarray) else dim
    index = faiss.IndexScalarQuantizer(dim, faiss.ScalarQuantizer.QT_fp16, faiss.METRIC_INNER_PRODUCT)
    for block in blocks:
        if len(block):
            index.add(np.ascontiguousarray(on_stored_grid(block)))
    return index


class _Owned:
    """An array interface that holds the index owning the memory: an array made from it keeps
    the index (and so its mapping) alive, however the caller names or drops the index."""

    def __init__(self, index: faiss.Index, rows: np.ndarray):
        self.index = index
        self.__array_interface__ = rows.__array_interface__


def stored_vectors(index: faiss.Index) -> np.ndarray:
    """The rows of a build's vector index as they are stored, a view on its codes (memory-mapped
    when it was read so) that keeps the index alive: half precision, or float32 in a build made
    before vectors were stored in half (a flat index)."""
    dtype = np.float32 if isinstance(index, faiss.IndexFlat) else STORED_DTYPE
    if index.ntotal == 0:
        return np.zeros((0, index.d), dtype)
    width = np.dtype(dtype).itemsize
    codes = faiss.rev_swig_ptr(index.codes.data(), index.ntotal * index.d * width)
    return np.asarray(_Owned(index, codes.view(dtype).reshape(index.ntotal, index.d)))


def read_flat(path) -> np.ndarray:
    """A build's vectors file as float32 rows in memory (for the stages that use every row)."""
    return np.asarray(read_stored(path), np.float32)


def read_stored(path) -> np.ndarray:
    """A build's vectors file as stored (half precision), memory-mapped: for a stage that reads
    every row once, block by block, and should not hold a float32 copy of them all."""
    return stored_vectors(faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC))
