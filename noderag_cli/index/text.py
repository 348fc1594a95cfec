"""Stage 5: text insertion. Every chunk becomes a T node, linked to the units it yielded."""

from __future__ import annotations

import pyarrow as pa

from ..graph import NodeSet, make_edges


def run(chunks: pa.Table, units: pa.Table) -> tuple[pa.Table, pa.Table]:
    built = NodeSet()
    for chunk, text in zip(chunks["chunk_id"].to_pylist(), chunks["text"].to_pylist(), strict=True):
        built.add(chunk, text, [chunk])
    pairs = [
        (chunk, unit)
        for unit, sources in zip(units["id"].to_pylist(), units["chunk_ids"].to_pylist(), strict=True)
        if unit.startswith("S_")
        for chunk in sources
    ]
    return built.table(), make_edges(pairs, "T-S")
