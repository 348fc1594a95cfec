"""Stage 5: text insertion. Every chunk becomes a T node, linked to the units it yielded."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..graph import edge_rows, merge_edges, nodes_from_mentions


def run(chunks: pa.Table, units: pa.Table) -> tuple[pa.Table, pa.Table]:
    """T nodes (tokens from the chunks table) and T-S edges."""
    mentions = pa.table({"node": chunks["chunk_id"], "text": chunks["text"], "chunk": chunks["chunk_id"],
                         "tokens": chunks["tokens"]})
    units = units.filter(pc.starts_with(units["id"], "S_"))
    sources = units["chunk_ids"].combine_chunks()
    lengths = pc.fill_null(pc.list_value_length(sources), 0).to_numpy()
    unit_ids = pc.take(units["id"], pa.array(np.repeat(np.arange(units.num_rows), lengths)))
    return nodes_from_mentions(mentions), merge_edges([edge_rows(pc.list_flatten(sources), unit_ids, "T-S")])
