"""Stage 5: text insertion. Every chunk becomes a T node, linked to the units it yielded."""

from __future__ import annotations

import pyarrow as pa

from ..graph import NodeSet, make_edges


def run(chunks: pa.Table, units: pa.Table) -> tuple[pa.Table, pa.Table]:
    """T nodes (tokens from the chunks table) and T-S edges."""
    built = NodeSet()
    tokens_of: dict[str, int] = {}
    for chunk, text, tokens in zip(
        chunks["chunk_id"].to_pylist(), chunks["text"].to_pylist(), chunks["tokens"].to_pylist(), strict=True
    ):
        built.add(chunk, text, [chunk])
        tokens_of[text] = tokens
    pairs = [
        (chunk, unit)
        for unit, sources in zip(units["id"].to_pylist(), units["chunk_ids"].to_pylist(), strict=True)
        if unit.startswith("S_")
        for chunk in sources
    ]
    return built.table(lambda texts: [tokens_of[t] for t in texts]), make_edges(pairs, "T-S")
