"""Stage 6: embed every T, S, A and H node (N, R and O never are).

Vectors come through the embedder's memory and the embedding cache, so nodes embedded while
earlier stages ran (S, A, H for semantic matching) and nodes unchanged since the last run
cost nothing.

Rows are sorted by node id. They go into the build's vector index a block at a time: its
half-precision codes are the one copy of every vector (a float32 array of them all was 1 GB at
200,000 passages, and its half-precision stack and rounded copy as much again).
"""

from __future__ import annotations

from collections.abc import Iterator

import faiss
import pyarrow as pa
import pyarrow.compute as pc

from .. import ivf
from ..embeddings import Embedder
from ..node_types import EMBEDDED_TYPES

ROWS = 65_536  # vectors stacked at a time


def run(nodes: pa.Table, embedder: Embedder) -> tuple[list[str], faiss.Index]:
    """The ids of the embedded nodes, sorted, and their vector index (`ivf.flat_index`)."""
    embedded = nodes.filter(pc.is_in(nodes["type"], pa.array(EMBEDDED_TYPES))).sort_by("id")
    texts = embedded["text"]

    def blocks() -> Iterator:
        for start in range(0, len(texts), ROWS):
            yield embedder.embed(texts.slice(start, ROWS).to_pylist())

    return embedded["id"].to_pylist(), ivf.flat_index(blocks(), embedder.dim)
