"""Stage 7: the HNSW index and its base-layer similarity edges (paper §2.6).

One faiss `IndexHNSWFlat` over the L2-normalised vectors (inner product). The base
layer's neighbour lists are read out of the index and become `similarity` edges; a
pair that already has a structural edge gains +1 weight instead. The build runs on one
thread: HNSW insertion is order-dependent, and a multi-threaded build is not
reproducible. Level draws use faiss's fixed internal seed.

Construction contract: vectors are added in blocks, always the same three (every S and T
node, then every A node, then every H node; see `embed.BLOCKS`), each block in one `add`
call. The first block is known once decomposition is done, so the pipeline builds it in
the background while attributes and communities are computed; a fresh build and an
update build the same blocks in the same order, hence the same index.
"""

from __future__ import annotations

import faiss
import numpy as np

from ..config import HnswConfig


def new_index(dim: int, config: HnswConfig) -> faiss.IndexHNSWFlat:
    index = faiss.IndexHNSWFlat(dim, config.m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = config.ef_construction
    index.hnsw.efSearch = config.ef_search
    return index


def add_block(index: faiss.IndexHNSWFlat, vectors: np.ndarray) -> None:
    """One block, one `add` call, on one OpenMP thread (set for the calling thread only)."""
    if not len(vectors):
        return
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        index.add(np.ascontiguousarray(vectors, dtype=np.float32))
    finally:
        faiss.omp_set_num_threads(threads)


def build_index(vectors: np.ndarray, config: HnswConfig, blocks: list[int] | None = None,
                index: faiss.IndexHNSWFlat | None = None) -> faiss.IndexHNSWFlat:
    """The index over `vectors`, added block by block (`blocks`: rows per block; default one
    block). With `index` holding the first blocks already, only the remaining rows are added."""
    blocks = blocks if blocks is not None else [len(vectors)]
    assert sum(blocks) == len(vectors)
    index = index if index is not None else new_index(vectors.shape[1], config)
    start = 0
    for size in blocks:
        if start + size > index.ntotal:
            add_block(index, vectors[max(start, index.ntotal) : start + size])
        start += size
    return index


def base_layer_pairs(index: faiss.IndexHNSWFlat) -> np.ndarray:
    """(row, neighbour) pairs of layer 0, each undirected pair once, row < neighbour."""
    hnsw = index.hnsw
    n = index.ntotal
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    offsets = faiss.vector_to_array(hnsw.offsets).astype(np.int64)
    neighbors = faiss.vector_to_array(hnsw.neighbors)
    width = hnsw.nb_neighbors(0)
    layer0 = neighbors[offsets[:n, None] + np.arange(width)[None, :]]
    rows = np.repeat(np.arange(n, dtype=np.int64), width)
    cols = layer0.ravel().astype(np.int64)
    keep = (cols >= 0) & (cols != rows)
    lo, hi = np.minimum(rows[keep], cols[keep]), np.maximum(rows[keep], cols[keep])
    codes = np.unique(lo * n + hi)
    return np.stack([codes // n, codes % n], axis=1)
