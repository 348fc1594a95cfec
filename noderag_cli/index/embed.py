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
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import ivf
from ..embeddings import Embedder
from ..node_types import EMBEDDED_TYPES

ROWS = 65_536  # vectors stacked at a time
ID_SCHEMA = pa.schema([("id", pa.string()), ("text_digest", pa.binary(16))])
"""embed.ids.parquet: row i is the node of vector i, and the digest of its text, by which the next
update's embedder takes the vector back without reading or hashing the texts (`Embedder.remember`)."""


COLUMNS = ["id", "type", "text"]  # what the stage reads of the node tables


def embedded(nodes: pa.Table) -> pa.Table:
    """The nodes of the types that are embedded."""
    return nodes.filter(pc.is_in(nodes["type"], pa.array(EMBEDDED_TYPES)))


def run(nodes: pa.Table, embedder: Embedder) -> tuple[pa.Table, faiss.Index]:
    """The embedded nodes' ids, sorted, with the digests of their texts (`ID_SCHEMA`), and their
    vector index (`ivf.flat_index`), from the nodes (`COLUMNS` at least; others are passed over)."""
    embedded_nodes = embedded(nodes).sort_by("id")
    texts = embedded_nodes["text"]
    digests = []

    def blocks() -> Iterator:
        for start in range(0, len(texts), ROWS):
            keys, vectors = embedder.embed_with_digests(texts.slice(start, ROWS).to_pylist())
            digests.append(keys)
            yield vectors

    index = ivf.flat_index(blocks(), embedder.dim)
    text_digests = np.concatenate(digests) if digests else np.zeros(0, "S16")
    return pa.table({"id": embedded_nodes["id"].combine_chunks(),
                     "text_digest": pa.FixedSizeBinaryArray.from_buffers(  # as bytes: a digest may end in zeros
                         pa.binary(16), len(text_digests), [None, pa.py_buffer(text_digests.tobytes())])},
                    schema=ID_SCHEMA), index
