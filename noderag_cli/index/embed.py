"""Stage 6: embed every T, S, A and H node (N, R and O never are).

Vectors come through the embedder's memory and the embedding cache, so nodes embedded while
earlier stages ran (S, A, H for semantic matching) and nodes unchanged since the last run
cost nothing.

Rows are sorted by node id.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..embeddings import Embedder
from ..node_types import EMBEDDED_TYPES


def run(nodes: pa.Table, embedder: Embedder) -> tuple[list[str], np.ndarray]:
    embedded = nodes.filter(pc.is_in(nodes["type"], pa.array(EMBEDDED_TYPES))).sort_by("id")
    return embedded["id"].to_pylist(), embedder.embed(embedded["text"].to_pylist())
