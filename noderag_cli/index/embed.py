"""Stage 6: embed every T, S, A and H node (N, R and O never are).

Vectors come through the embedding cache, so nodes embedded while earlier stages ran
(S, A, H for semantic matching) and nodes unchanged since the last run cost nothing.

Rows are sorted by node id.
"""

from __future__ import annotations

import weakref

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..embeddings import Embedder

EMBEDDED = ("T", "S", "A", "H")


_MEMO: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def embed_texts(embedder: Embedder, texts: list[str]) -> np.ndarray:
    """embedder.embed, with vectors kept for the life of the embedder, so stages of one run that
    need the same texts (units for K-means, the embed stage) look them up only once."""
    if not texts:
        return embedder.embed([])
    memo = _MEMO.setdefault(embedder, {})
    missing = [t for t in dict.fromkeys(texts) if t not in memo]
    if missing:
        memo.update(zip(missing, embedder.embed(missing), strict=True))
    return np.stack([memo[t] for t in texts])


def run(nodes: pa.Table, embedder: Embedder) -> tuple[list[str], np.ndarray]:
    embedded = nodes.filter(pc.is_in(nodes["type"], pa.array(EMBEDDED))).sort_by("id")
    return embedded["id"].to_pylist(), embed_texts(embedder, embedded["text"].to_pylist())
