"""Stage 2: decompose every chunk into semantic units (S), entities (N) and relationships (R).

The engine's result for each chunk is cached under the engine's settings and the chunk's
title and text, and written batch by batch, so an interrupted or incremental run only pays
for chunks it has not seen. Failed chunks are reported, never cached, and retried next run.
One R node per distinct (source, relation, target) triple.

The graph is an aggregation of rows each decomposed chunk contributes: one per node mention
(`occurrences`: the node, the surface text, the chunk, its tokens) and one per edge mention
(`links`). A node's text is its most frequent surface form (ties: the smallest), its chunks
the distinct chunks, its mentions the count; an edge's weight is its count. Both row tables
are kept with the stage's outputs, keyed by chunk input, so an update keeps the rows of
unchanged chunks, drops those of removed ones, adds those of new ones and aggregates again:
the same tables as a fresh build, without re-reading or re-normalising unchanged units.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import nlp
from ..cache import DECOMPOSE, Cache
from ..engines.base import ChunkInput, Engine, Failure, Unit
from ..executor import Executor
from ..files import digest_text, write_parquet_parts
from ..graph import (
    EDGE_SCHEMA,
    NODE_SCHEMA,
    edge_rows,
    entity_id,
    merge_edges,
    nodes_from_mentions,
    normalize_name,
    relation_id,
    sorted_union,
    unit_id,
)
from ..spill import SHARD_WIDTH, Shards

BATCH = 64
ROWS_VERSION = 1  # of how units become rows: stored rows of another version are not reused
OCCURRENCE_SCHEMA = pa.schema([
    ("input", pa.string()),  # `input_name`: the chunk and decomposition cache key the rows were derived from
    ("seq", pa.int32()),  # order within the input
    ("node", pa.string()),
    ("text", pa.string()),  # surface form of this mention (N: the name)
    ("chunk", pa.string()),
    ("tokens", pa.int32()),  # of `text`
])
LINK_SCHEMA = pa.schema([
    ("input", pa.string()), ("seq", pa.int32()), ("source", pa.string()), ("target", pa.string()), ("kind", pa.string()),
])


def cache_keys(engine_identity: dict, chunks: Iterable[tuple[str, str]]) -> list[str]:
    """Each (title, text) chunk's decomposition cache key: the digest of [identity, title, text] as
    `files.json_digest` writes it, with the identity's JSON written once for the folder's chunks
    instead of once each."""
    head = f"[{json.dumps(engine_identity, sort_keys=True)}, "
    return [digest_text(f"{head}{json.dumps(title)}, {json.dumps(text)}]") for title, text in chunks]


def input_name(chunk_id: str, key: str) -> str:
    """The rows' `input`: the chunk and the decomposition cache key they were derived from."""
    return f"{chunk_id}\x1f{key}"


def input_key(name: str) -> str:
    """The decomposition cache key in an `input_name`."""
    return name.split("\x1f", 1)[1]


class Decomposed(NamedTuple):
    rows: Rows  # the rows of every chunk
    failures: dict[str, str]  # reason per chunk id
    work: dict[str, int]  # distinct chunk inputs `cached` (rows kept, or units from the cache), `decomposed`
    changed: tuple[pa.Table, pa.Table] | None  # when rows were kept from `previous`: those of the inputs gone and not kept
    checkpoints: list[str]  # the cache keys of the inputs whose rows were not kept (`forget_checkpoints`)


class Rows:
    """The occurrence and link rows of every chunk: the last run's rows that were kept (slices of
    its tables, in (input, seq) order) and the fresh ones, filed as the workers return them
    (`spill.Shards`, in files under `folder`) by input, to be sorted and written a shard at a time;
    and, when nothing was kept (a graph aggregated from every row), by the node a row mentions and
    by the first end of a link's pair, so each node and edge is aggregated from its shard alone.
    The stage holds a shard at a time instead of every row (at 100,000 passages they take 0.9 GB
    in Arrow)."""

    def __init__(self, folder: Path | None, kept: tuple[pa.Table, pa.Table], by_end: bool):
        self.kept = kept
        self.by_input = (Shards(folder, OCCURRENCE_SCHEMA), Shards(folder, LINK_SCHEMA))
        self.by_end = (Shards(folder, OCCURRENCE_SCHEMA), Shards(folder, LINK_SCHEMA)) if by_end else None

    def add(self, occurrences: pa.Table, links: pa.Table) -> None:
        self.by_input[0].add(occurrences, occurrences["input"])
        self.by_input[1].add(links, links["input"])
        if self.by_end is not None:
            self.by_end[0].add(occurrences, occurrences["node"])
            self.by_end[1].add(links, pc.if_else(pc.less(links["source"], links["target"]), links["source"],
                                                 links["target"]))  # `merge_edges` orders a pair so

    def flush(self) -> None:
        for shards in self._all():
            shards.flush()

    @functools.cached_property
    def fresh(self) -> tuple[pa.Table, pa.Table]:
        """The fresh occurrence and link rows, whole (an update's: some of the folder's)."""
        return tuple(pa.concat_tables([shards.schema.empty_table(), *(t for _, t in shards.shards())])
                     for shards in self.by_input)

    def in_input_order(self, which: int) -> Iterator[pa.Table]:
        """The occurrence (`which` 0) or link (1) rows in (input, seq) order, as `Table.sort_by`
        sorts them, a shard at a time (each contiguous: `write` gives the same bytes for the same
        rows, however they came). Only the fresh rows are sorted; each input's run of them goes in
        between the kept runs where its name sorts, so an update of a large folder places 1% of the
        rows instead of sorting all of them."""
        kept = self.kept[which]
        starts, ends, names = _input_runs(kept)
        shard_of = pc.utf8_slice_codeunits(names, 0, SHARD_WIDTH).to_pylist()
        first = {name: position for position, name in reversed(list(enumerate(shard_of)))}
        last = {name: position for position, name in enumerate(shard_of)}
        for name, fresh in self.by_input[which].shards(also=first):
            mine = kept.slice(int(starts[first[name]]), int(ends[last[name]] - starts[first[name]])) \
                if name in first else kept.schema.empty_table()
            part = _in_input_order(mine, fresh)
            if part.num_rows:
                yield part

    def write(self, paths: tuple[Path, Path]) -> None:
        """The occurrence and link rows to their files, in (input, seq) order."""
        for which, path in enumerate(paths):
            write_parquet_parts(path, with_version(self.kept[which]).schema, self.in_input_order(which))

    def graph(self, last: tuple[pa.Table, pa.Table] | None = None, changed: tuple[pa.Table, pa.Table] | None = None
              ) -> tuple[pa.Table, pa.Table]:
        """`build_graph`'s tables: when nothing was kept, from the rows filed by node and by an
        edge's first end, a shard at a time; else `updated_graph`'s from the `last` tables (if there
        are) by the `changed` rows."""
        if self.by_end is None:
            whole = [pa.concat_tables([kept, fresh]) for kept, fresh in zip(self.kept, self.fresh, strict=True)]
            return updated_graph(*whole, last, changed) if last is not None else build_graph(*whole)
        nodes = [nodes_from_mentions(shard) for _, shard in self.by_end[0].shards()]
        edges = [merge_edges([edge_rows(shard["source"], shard["target"], shard["kind"])])
                 for _, shard in self.by_end[1].shards()]
        return _contiguous(nodes, NODE_SCHEMA), _contiguous(edges, EDGE_SCHEMA)

    def close(self) -> None:
        for shards in self._all():
            shards.close()

    def _all(self) -> tuple[Shards, ...]:
        return (*self.by_input, *(self.by_end or ()))


def _contiguous(parts: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """`parts` (emptied: this holds them alone) as one table with a chunk per column, as a table
    made whole is written (the bounds of chunks move the pages' bounds in parquet), a column at a
    time: each column's parts let go as its copy is made."""
    columns = {name: [chunk for part in parts for chunk in part[name].chunks] for name in schema.names}
    parts.clear()
    return pa.table({name: pa.chunked_array(columns.pop(name), schema.field(name).type).combine_chunks()
                     for name in schema.names}, schema=schema)


def decompose_chunks(
    chunks: pa.Table, engine: Engine, cache: Cache, progress: Callable[[int], None] | None = None,
    previous: tuple[pa.Table, pa.Table] | None = None,
    executor: Executor | None = None, spill_folder: Path | None = None,
) -> Decomposed:
    """The occurrence and link rows of every chunk (`Rows`, filed in `spill_folder`); failure
    reasons per chunk id; how many distinct chunk inputs were `cached` (rows kept from `previous`,
    or units from the cache) and how many the engine `decomposed` in this call; when rows were kept
    from `previous`, the rows that changed (`updated_graph`'s `changed`: those of the inputs gone,
    and of those not kept); and the cache keys of the inputs whose rows were made in this call.

    The cache key is the engine's settings (name, model, sampling) with the chunk's title and
    text: the per-chunk status that lets an interrupted or incremental run pay only for chunks
    it has not decomposed yet. `previous` holds the rows of the last run (`stored_rows`).

    Rows are made on the `executor`'s workers, batch by batch, and so is the decomposition itself
    when the engine's is a pure function of the chunk (`pure_decompose`, the offline engine's); an
    LLM engine's calls are made here, where its limiter and connections live. Each batch's fresh
    units are cached as it returns, so a killed run keeps them. (A pure engine's entries are only
    a checkpoint: once the stage has committed its rows, `forget_checkpoints` removes them.)"""
    executor = executor or Executor()
    inputs = [
        ChunkInput(chunk_id=c, text=t, title=title)
        for c, t, title in zip(chunks["chunk_id"].to_pylist(), chunks["text"].to_pylist(), chunks["title"].to_pylist(), strict=True)
    ]
    inputs = list({c.chunk_id + "\x1f" + c.title: c for c in inputs}.values())
    keys = cache_keys(engine.identity, ((c.title, c.text) for c in inputs))
    names = [input_name(c.chunk_id, k) for c, k in zip(inputs, keys, strict=True)]
    kept_occurrences, kept_links, known, gone = _kept_rows(previous, names)
    stats = engine.stats.task("decompose")
    stats.cache_hits += len(known)
    pending = [(c, k, n) for c, k, n in zip(inputs, keys, names, strict=True) if n not in known]
    cached = cache.get_many(DECOMPOSE, [k for _, k, _ in pending])
    work: list[tuple[str, str, ChunkInput | None, list[Unit] | None]] = []  # (name, chunk id, chunk, units)
    failures: dict[str, str] = {}
    todo: list[tuple[ChunkInput, str, str]] = []
    for chunk, key, name in pending:
        if key in cached:
            work.append((name, chunk.chunk_id, None, _load_units(cached[key])))
            stats.cache_hits += 1
        else:
            todo.append((chunk, key, name))
    if progress and len(inputs) - len(todo):
        progress(len(inputs) - len(todo))
    key_of = {name: key for _, key, name in todo}
    if engine.pure_decompose is not None:
        work += [(name, chunk.chunk_id, chunk, None) for chunk, _, name in todo]
    else:
        work += _decompose_here(engine, todo, cache, failures, progress)

    rows = Rows(spill_folder, (kept_occurrences, kept_links), by_end=not known)

    def done(batch, result) -> None:
        outcomes, occurrences, links = result
        rows.add(occurrences, links)
        result[1] = result[2] = None  # filed: let go
        fresh = []
        for (name, chunk_id, chunk, _), outcome in zip(batch, outcomes, strict=True):
            if chunk is None:
                continue
            if isinstance(outcome, Failure):
                failures[chunk_id] = outcome.reason
            else:
                fresh.append((key_of[name], outcome))
        cache.put_many(DECOMPOSE, fresh)
        outcomes.clear()  # cached: let go
        if progress and any(item[2] is not None for item in batch):
            progress(sum(item[2] is not None for item in batch))

    batches = [work[i : i + BATCH] for i in range(0, len(work), BATCH)]
    del work
    executor.map(rows_of_batch, batches, done)
    rows.flush()
    changed = None
    if known:
        changed = tuple(pa.concat_tables([gone[i], rows.fresh[i]]) for i in (0, 1))
    return Decomposed(rows, failures, {"cached": len(inputs) - len(todo), "decomposed": len(todo)}, changed,
                      [key for _, key, _ in pending])


def _in_input_order(kept: pa.Table, fresh: pa.Table) -> pa.Table:
    """The rows of `kept` (in (input, seq) order) and of `fresh` (no input of theirs is in
    `kept`), sorted by (input, seq), contiguous."""
    order = pc.sort_indices(fresh, sort_keys=[("input", "ascending"), ("seq", "ascending")])
    table = fresh.take(order)
    if kept.num_rows:
        table = _between_runs(kept, table) if table.num_rows else kept
    return table.combine_chunks()


def _input_runs(table: pa.Table) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """(first row, row after the last, input name) of each run of rows with the same input, in
    row order (a run that crosses a chunk boundary counts as two)."""
    starts, ends, names = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [pa.array([], pa.string())]
    offset = 0
    for chunk in table["input"].chunks:
        if not len(chunk):
            continue
        encoded = pc.run_end_encode(chunk)
        run_ends = encoded.run_ends.to_numpy().astype(np.int64) + offset
        starts.append(np.r_[offset, run_ends[:-1]])
        ends.append(run_ends)
        names.append(encoded.values)
        offset += len(chunk)
    return np.concatenate(starts), np.concatenate(ends), pa.concat_arrays(names)


def _rows_of_runs(table: pa.Table, chosen: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> pa.Table:
    """The rows of the `chosen` runs, as slices of `table` (no copy), in row order."""
    picked = np.flatnonzero(chosen)
    if not len(picked):
        return table.schema.empty_table()
    breaks = np.flatnonzero(np.diff(picked) > 1)
    first, last = picked[np.r_[0, breaks + 1]], picked[np.r_[breaks, len(picked) - 1]]
    return pa.concat_tables([table.slice(a, b - a) for a, b in zip(starts[first].tolist(), ends[last].tolist(),
                                                                 strict=True)])


def _run_rows(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The rows from each start to its end, in order."""
    lengths = ends - starts
    return np.repeat(starts - np.r_[0, np.cumsum(lengths)[:-1]], lengths) + np.arange(int(lengths.sum()))


def _between_runs(kept: pa.Table, fresh: pa.Table) -> pa.Table:
    """`kept` and `fresh` (each sorted by (input, seq), no input in both) as one sorted table of
    slices: each fresh input's rows go before the first kept run whose name sorts after it."""
    kept_starts, _, kept_names = _input_runs(kept)
    fresh_starts, fresh_ends, fresh_names = _input_runs(fresh)
    at = np.searchsorted(np.array(kept_names.to_pylist(), dtype=object), np.array(fresh_names.to_pylist(), dtype=object))
    cuts = np.r_[kept_starts, kept.num_rows][at].tolist()
    parts, done = [], 0
    for cut, start, end in zip(cuts, fresh_starts.tolist(), fresh_ends.tolist(), strict=True):
        if cut > done:
            parts.append(kept.slice(done, cut - done))
            done = cut
        parts.append(fresh.slice(start, end - start))
    if done < kept.num_rows:
        parts.append(kept.slice(done))
    return pa.concat_tables(parts)


def _kept_rows(previous: tuple[pa.Table, pa.Table] | None, names: list[str]
               ) -> tuple[pa.Table, pa.Table, set[str], tuple[pa.Table, pa.Table]]:
    """The last run's occurrence and link rows of the inputs still present (slices of its tables,
    which are in input order: a run of rows per input is kept or not, not row by row), which inputs
    those are, and the rows of the inputs gone."""
    if previous is None:
        return OCCURRENCE_SCHEMA.empty_table(), LINK_SCHEMA.empty_table(), set(), \
            (OCCURRENCE_SCHEMA.empty_table(), LINK_SCHEMA.empty_table())
    wanted = pa.array(names, pa.string())
    kept, gone, present_inputs = [], [], []
    for table in previous:
        starts, ends, inputs = _input_runs(table)
        present = pc.is_in(inputs, value_set=wanted).to_numpy(zero_copy_only=False)
        kept.append(_rows_of_runs(table, present, starts, ends))
        gone_runs = np.flatnonzero(~present)  # copied: slices would keep the last run's tables alive with them
        gone.append(table.take(pa.array(_run_rows(starts[gone_runs], ends[gone_runs]))))
        present_inputs.append(inputs.filter(pa.array(present)))
    known = set(pc.unique(present_inputs[0]).to_pylist())  # the inputs with occurrences: decomposed before
    return kept[0], kept[1], known, (gone[0], gone[1])


def _decompose_here(engine: Engine, todo: list[tuple[ChunkInput, str, str]], cache: Cache,
                    failures: dict[str, str], progress: Callable[[int], None] | None) -> list:
    """An engine's decompositions made in this process (an LLM engine's: its limiter and
    connections live here), batch by batch, each batch's units cached as it returns; the work
    items of those that succeeded, failure reasons into `failures`."""
    work = []
    for start in range(0, len(todo), BATCH):
        batch = todo[start : start + BATCH]
        results = engine.decompose([c for c, _, _ in batch], progress)
        fresh = []
        for (chunk, key, name), result in zip(batch, results, strict=True):
            if isinstance(result, Failure):
                failures[chunk.chunk_id] = result.reason
                continue
            work.append((name, chunk.chunk_id, None, result))
            fresh.append((key, _dump_units(result)))
        cache.put_many(DECOMPOSE, fresh)
    return work


def forget_checkpoints(keys: list[str], engine: Engine, cache: Cache) -> int:
    """Remove a pure engine's cached decompositions under `keys` (`Decomposed.checkpoints`: the
    chunks whose rows a run made, from the engine or from what a killed run cached), now that their
    rows are committed: the rows are what an update reuses, and a second copy of every unit would
    only take disk. The chunks whose rows were kept had theirs removed by the run that made them
    (or, killed in between, by `noderag gc`). An LLM engine's stay: each is a paid reply. Returns
    how many were removed."""
    if engine.pure_decompose is None:
        return 0
    return cache.delete_many(DECOMPOSE, set(keys))


def rows_of_batch(batch: list[tuple[str, str, ChunkInput | None, list[Unit] | None]]):
    """A worker's share of `decompose_chunks`: each item's units (decomposed here, by the offline
    engine, when the item carries its chunk instead), and the rows of them all. Returns per item
    the units it decomposed as the cache stores them (`_dump_units`: bytes, not Python objects, go
    back to the indexing process), a Failure, or None for an item that came with its units; the
    occurrence rows; and the link rows."""
    from ..engines.offline import decompose_chunk

    outcomes = [decompose_chunk(chunk) if units is None else units for _, _, chunk, units in batch]
    units = {name: (chunk_id, outcome) for (name, chunk_id, _, _), outcome in zip(batch, outcomes, strict=True)
             if not isinstance(outcome, Failure)}
    occurrences, links = unit_rows(units, nlp.count_tokens)
    made = [None if chunk is None else outcome if isinstance(outcome, Failure) else _dump_units(outcome)
            for (_, _, chunk, _), outcome in zip(batch, outcomes, strict=True)]
    return [made, occurrences, links]  # a list: `done` lets go of the rows once filed


def _dump_units(units: list[Unit]) -> bytes:
    return json.dumps([[u.text, list(u.entities), [list(r) for r in u.relations]] for u in units]).encode()


def _load_units(blob: bytes) -> list[Unit]:
    return [Unit(text, tuple(ents), tuple(tuple(r) for r in rels)) for text, ents, rels in json.loads(blob)]


def unit_rows(
    units: dict[str, tuple[str, list[Unit]]], count_tokens: Callable[[list[str]], list[int]] | None = None
) -> tuple[pa.Table, pa.Table]:
    """Occurrence and link rows of each input's units: a unit is an S mention; each distinct
    entity string it names or relates (several strings may name one entity) an N mention with an
    S-N link; each valid triple an R mention with an S-R link and R-N links to both ends."""
    occ: dict[str, list] = {name: [] for name in ("input", "seq", "node", "text", "chunk")}
    link: dict[str, list] = {name: [] for name in LINK_SCHEMA.names}
    for name in sorted(units):
        chunk, chunk_units = units[name]
        mentions: list[tuple[str, str]] = []
        connections: list[tuple[str, str, str]] = []
        for unit in chunk_units:
            s = unit_id(unit.text)
            mentions.append((s, unit.text))
            names = [e for e in unit.entities if normalize_name(e)]
            names += [end for rel in unit.relations for end in (rel[0], rel[2]) if normalize_name(end)]
            for entity in dict.fromkeys(names):
                n = entity_id(entity)
                mentions.append((n, entity.strip()))
                connections.append((s, n, "S-N"))
            for source, relation, target in unit.relations:
                if not (normalize_name(source) and normalize_name(target) and relation.strip()):
                    continue
                r = relation_id(source, relation, target)
                mentions.append((r, f"{source} {relation.strip()} {target}"))
                connections += [(s, r, "S-R"), (r, entity_id(source), "R-N"), (r, entity_id(target), "R-N")]
        occ["input"] += [name] * len(mentions)
        occ["seq"] += range(len(mentions))
        occ["node"] += [node for node, _ in mentions]
        occ["text"] += [text for _, text in mentions]
        occ["chunk"] += [chunk] * len(mentions)
        link["input"] += [name] * len(connections)
        link["seq"] += range(len(connections))
        for column, position in (("source", 0), ("target", 1), ("kind", 2)):
            link[column] += [c[position] for c in connections]
    tokens = list(count_tokens(occ["text"])) if count_tokens and occ["text"] else [0] * len(occ["text"])
    return (pa.Table.from_pydict({**occ, "tokens": tokens}, schema=OCCURRENCE_SCHEMA),
            pa.Table.from_pydict(link, schema=LINK_SCHEMA))


def build_graph(occurrences: pa.Table, links: pa.Table) -> tuple[pa.Table, pa.Table]:
    """S, N, R nodes (sorted by id) and S-N, S-R, R-N edges, aggregated from the rows."""
    edges = edge_rows(links["source"], links["target"], links["kind"])
    return nodes_from_mentions(occurrences), merge_edges([edges])


def updated_graph(occurrences: pa.Table, links: pa.Table, last: tuple[pa.Table, pa.Table],
                  changed: tuple[pa.Table, pa.Table]) -> tuple[pa.Table, pa.Table]:
    """`build_graph`'s tables, the same bytes, from the last run's (`last`: built from its rows)
    when only the rows in `changed` (those of the inputs gone, and of the inputs added) differ: a
    node is a function of its own mentions and an edge of its pair's links, so only the nodes the
    changed rows mention, and the pairs whose two ends both belong to a changed link, are
    aggregated again, from every row that names them; the rest of `last` is kept. An update of 1%
    of a large folder then aggregates about 1% of the mentions instead of all of them. Falls back
    to `build_graph` when an id is not of the common width (`graph.fixed_width`)."""
    last_nodes, last_edges = last
    named = pc.unique(changed[0]["node"])
    kept_nodes = last_nodes.filter(pc.invert(pc.is_in(last_nodes["id"], value_set=named)))
    again = nodes_from_mentions(occurrences.filter(pc.is_in(occurrences["node"], value_set=named)))
    ends = pc.unique(pa.concat_arrays([changed[1]["source"].combine_chunks(), changed[1]["target"].combine_chunks()]))

    def both_ends(table: pa.Table) -> pa.ChunkedArray:
        return pc.and_(pc.is_in(table["source"], value_set=ends), pc.is_in(table["target"], value_set=ends))

    kept_edges = last_edges.filter(pc.invert(both_ends(last_edges)))
    linked = links.filter(both_ends(links))
    again_edges = merge_edges([edge_rows(linked["source"], linked["target"], linked["kind"])])
    nodes = sorted_union(kept_nodes, again, ("id",))
    edges = sorted_union(kept_edges, again_edges, ("source", "target"))
    if nodes is None or edges is None:
        return build_graph(occurrences, links)
    return nodes, edges


def stored_rows(occurrences: pa.Table, links: pa.Table) -> tuple[pa.Table, pa.Table] | None:
    """The rows an earlier run stored (its tables as read back), if they are of this ROWS_VERSION."""
    for table, schema in ((occurrences, OCCURRENCE_SCHEMA), (links, LINK_SCHEMA)):
        if (table.schema.metadata or {}).get(b"noderag-rows") != str(ROWS_VERSION).encode() or \
                not table.schema.remove_metadata().equals(schema):
            return None
    return occurrences.replace_schema_metadata(None), links.replace_schema_metadata(None)


def with_version(table: pa.Table) -> pa.Table:
    return table.replace_schema_metadata({"noderag-rows": str(ROWS_VERSION)})
