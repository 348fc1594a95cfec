"""Stage 2: decompose every chunk into semantic units (S), entities (N) and relationships (R).

The engine's result for each chunk is cached under the engine's name and the chunk's
text, and written batch by batch, so an interrupted or incremental run only pays for
chunks it has not seen. Failed chunks are reported, never cached, and retried next run.
One R node per distinct (source, relation, target) triple.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pyarrow as pa

from ..engines.base import ChunkInput, Engine, Failure, Unit
from ..graph import NodeSet, entity_id, make_edges, merge_edges, normalize_name, relation_id, unit_id
from ..workspace import Cache, json_digest

BATCH = 64


def cache_key(engine_settings: dict, title: str, text: str) -> str:
    return json_digest([engine_settings, title, text])


def decompose_chunks(
    chunks: pa.Table, engine: Engine, cache: Cache, progress: Callable[[int], None] | None = None,
    engine_settings: dict | None = None,
) -> tuple[dict[str, list[Unit]], dict[str, str], dict[str, int]]:
    """Units per chunk id, from the cache where possible; failure reasons per chunk id; and
    how many distinct chunks were `cached` and how many the engine `decomposed` in this call.

    The cache key is the engine's settings (name, model, sampling) with the chunk's title and
    text: the per-chunk status that lets an interrupted or incremental run pay only for chunks
    it has not decomposed yet."""
    engine_settings = engine_settings or {"name": engine.name}
    inputs = [
        ChunkInput(chunk_id=c, text=t, title=title)
        for c, t, title in zip(chunks["chunk_id"].to_pylist(), chunks["text"].to_pylist(), chunks["title"].to_pylist(), strict=True)
    ]
    inputs = list({c.chunk_id + "\x1f" + c.title: c for c in inputs}.values())
    keys = [cache_key(engine_settings, c.title, c.text) for c in inputs]
    cached = cache.get_many("decompose", keys)
    units: dict[str, list[Unit]] = {}
    failures: dict[str, str] = {}
    todo: list[tuple[ChunkInput, str]] = []
    for chunk, key in zip(inputs, keys, strict=True):
        if key in cached:
            units.setdefault(chunk.chunk_id, []).extend(_load_units(cached[key]))
            engine.stats.task("decompose").cache_hits += 1
        else:
            todo.append((chunk, key))
    if progress and len(inputs) - len(todo):
        progress(len(inputs) - len(todo))
    for start in range(0, len(todo), BATCH):
        batch = todo[start : start + BATCH]
        results = engine.decompose([c for c, _ in batch], progress)
        fresh = []
        for (chunk, key), result in zip(batch, results, strict=True):
            if isinstance(result, Failure):
                failures[chunk.chunk_id] = result.reason
                continue
            units.setdefault(chunk.chunk_id, []).extend(result)
            fresh.append((key, _dump_units(result)))
        cache.put_many("decompose", fresh)
    return units, failures, {"cached": len(inputs) - len(todo), "decomposed": len(todo)}


def _dump_units(units: list[Unit]) -> bytes:
    return json.dumps([[u.text, list(u.entities), [list(r) for r in u.relations]] for u in units]).encode()


def _load_units(blob: bytes) -> list[Unit]:
    return [Unit(text, tuple(ents), tuple(tuple(r) for r in rels)) for text, ents, rels in json.loads(blob)]


def build_graph(
    units_by_chunk: dict[str, list[Unit]], count_tokens: Callable[[list[str]], list[int]] | None = None
) -> tuple[pa.Table, pa.Table]:
    """S, N, R nodes and S-N, S-R, R-N edges from the units of every chunk."""
    nodes = NodeSet()
    s_n, s_r, r_n = [], [], []
    for chunk in sorted(units_by_chunk):
        for unit in units_by_chunk[chunk]:
            s = nodes.add(unit_id(unit.text), unit.text, [chunk])
            names = [e for e in unit.entities if normalize_name(e)]
            names += [end for rel in unit.relations for end in (rel[0], rel[2]) if normalize_name(end)]
            for name in dict.fromkeys(names):
                n = nodes.add(entity_id(name), name.strip(), [chunk], name=name.strip())
                s_n.append((s, n))
            for source, relation, target in unit.relations:
                if not (normalize_name(source) and normalize_name(target) and relation.strip()):
                    continue
                r = nodes.add(relation_id(source, relation, target), f"{source} {relation.strip()} {target}", [chunk])
                s_r.append((s, r))
                r_n.extend([(r, entity_id(source)), (r, entity_id(target))])
    edges = merge_edges([make_edges(s_n, "S-N"), make_edges(s_r, "S-R"), make_edges(r_n, "R-N")])
    return nodes.table(count_tokens), edges
