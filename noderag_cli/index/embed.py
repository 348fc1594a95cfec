"""Stage 6: embed every T, S, A and H node (N, R and O never are).

Vectors come through the embedding cache, so nodes embedded while earlier stages ran
(S, A, H for semantic matching, T and S for the first HNSW block) and nodes unchanged
since the last run cost nothing.

Row order is the HNSW insertion order (see `similarity_edges`): first every S and T node
by id, then every A node by id, then every H node by id.
"""

from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..embeddings import Embedder

BLOCKS = (("S", "T"), ("A",), ("H",))
"""The HNSW insertion blocks, in order; each block's rows are sorted by node id."""


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def embed_texts(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """embedder.embed, fed distinct texts shortest first: batches of similar length pad less (the
    bundled model pools over padded batches), and a text's vector does not depend on its batch.
    Vectors are also kept for the life of the embedder, so stages of one run that need the same
    texts (units for K-means, the embed stage, the first HNSW block) look them up only once."""
    if not texts:
        return embedder.embed([])
    memo = _MEMO.setdefault(embedder, {})
    missing = sorted(set(texts).difference(memo), key=lambda t: (len(t), t))
    if missing:
        memo.update(zip(missing, embedder.embed(missing), strict=True))
    return np.stack([memo[t] for t in texts])


def ordered(nodes: pa.Table) -> list[pa.Table]:
    """The embedded nodes of a table, one table per HNSW block, each sorted by id."""
    return [nodes.filter(pc.is_in(nodes["type"], pa.array(types))).sort_by("id") for types in BLOCKS]


def run(nodes: pa.Table, embedder: Embedder) -> tuple[list[str], np.ndarray]:
    blocks = ordered(nodes)
    ids = [i for block in blocks for i in block["id"].to_pylist()]
    texts = [t for block in blocks for t in block["text"].to_pylist()]
    return ids, embed_texts(embedder, texts)


def block_sizes(ids: list[str]) -> list[int]:
    """Rows per block of an id list in run() order."""
    return [sum(1 for i in ids if i[0] in types) for types in BLOCKS]
