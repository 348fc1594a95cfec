"""Node and edge types, stable ids, table schemas, and the CSR graph built from the tables.

Ids are `<type>_<16 hex>` where the hex is a BLAKE2b hash of the type and the node's
normalised content, so they are identical across processes, runs and machines.
Nothing else in the package builds ids.
"""

from __future__ import annotations

import functools
import hashlib
import re
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

EDGE_KINDS = ("S-N", "S-R", "R-N", "A-N", "H-O", "H-S", "H-A", "T-S", "similarity")

NODE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),  # `<type>_<hash>`
        ("type", pa.string()),  # one of node_types.NODE_TYPES
        ("text", pa.string()),  # what the context shows; N and O: the name
        ("name", pa.string()),  # N: entity name, O: title, A: its entity's name, else ""
        ("chunk_ids", pa.list_(pa.string())),  # T chunks the node was derived from, sorted
        ("doc_ids", pa.list_(pa.string())),  # documents those chunks belong to, sorted
        ("tokens", pa.int32()),  # tokens of `text` under the one tokenizer (nlp.count_tokens)
        ("mentions", pa.int32()),  # N: mentions across units; S: chunks stating it; else 1
        ("community", pa.int32()),  # Leiden community (-1 where the node was not in the partition)
        ("vector_row", pa.int32()),  # row in vectors.faiss, -1 when not embedded
    ]
)
NODE_COLUMNS = NODE_SCHEMA.names

EDGE_SCHEMA = pa.schema(
    [
        ("source", pa.string()),  # the smaller id of the pair: edges are undirected
        ("target", pa.string()),
        ("kind", pa.string()),  # one of EDGE_KINDS; a structural kind wins over "similarity"
        ("weight", pa.float32()),  # 1 per time the pair was connected (structure, HNSW)
        ("hnsw", pa.bool_()),  # the pair is also in the HNSW base layer
    ]
)
EDGE_COLUMNS = EDGE_SCHEMA.names


ID_WIDTH = 18  # bytes of a node id: its type letter, "_" and `_hash`'s 16 hex digits


def _hash(*parts: str) -> str:
    return hashlib.blake2b("\x1f".join(parts).encode("utf-8"), digest_size=8).hexdigest()


_LEADING_ARTICLE = re.compile(r"^(the|a|an)\s+", re.IGNORECASE)
_EDGE_PUNCT = re.compile(r"^[\W_]+|[\W_]+$")


@functools.lru_cache(maxsize=1 << 18)
def normalize_name(name: str) -> str:
    """Case-folded, whitespace-collapsed, article- and possessive-free: "the Nobel Prize's" -> "nobel prize"."""
    text = unicodedata.normalize("NFKC", name).replace("\u2019", "'")
    text = re.sub(r"\s+", " ", text).strip()
    text = re.sub(r"'s$", "", text)
    text = _EDGE_PUNCT.sub("", text)
    text = _LEADING_ARTICLE.sub("", text)
    return text.casefold()


def normalize_text(text: str) -> str:
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip()


def document_id(relative_path: str) -> str:
    return "D_" + _hash("D", relative_path)


def chunk_id(text: str) -> str:
    return "T_" + _hash("T", normalize_text(text))


def unit_id(text: str) -> str:
    return "S_" + _hash("S", normalize_text(text))


@functools.lru_cache(maxsize=1 << 18)
def entity_id(name: str) -> str:
    return "N_" + _hash("N", normalize_name(name))


def relation_id(source: str, relation: str, target: str) -> str:
    return "R_" + _hash("R", normalize_name(source), normalize_text(relation).casefold(), normalize_name(target))


def attribute_id(entity_node_id: str) -> str:
    return "A_" + _hash("A", entity_node_id)


def high_level_id(text: str) -> str:
    return "H_" + _hash("H", normalize_text(text))


def overview_id(title: str) -> str:
    return "O_" + _hash("O", normalize_name(title))


def node_type(node_id: str) -> str:
    return node_id[0]


def nodes_table(rows: dict[str, list]) -> pa.Table:
    return pa.Table.from_pydict(rows, schema=NODE_SCHEMA)


def empty_edges() -> pa.Table:
    return EDGE_SCHEMA.empty_table()


def edge_rows(source, target, kind, hnsw: bool = False) -> pa.Table:
    """One row of weight 1 per connection, before `merge_edges` orders the pairs and sums repeats:
    `kind` is one kind for all rows or an array of them."""
    n = len(source)
    kinds = pa.repeat(pa.scalar(kind, pa.string()), n) if isinstance(kind, str) else kind
    return pa.table({"source": source, "target": target, "kind": kinds, "weight": pa.array(np.ones(n, np.float32)),
                     "hnsw": pa.array(np.full(n, hnsw))}).cast(EDGE_SCHEMA)


def make_edges(pairs: list[tuple[str, str]], kind: str) -> pa.Table:
    """Undirected edges of one kind from id pairs: canonical order, duplicates summed into weight."""
    if not pairs:
        return empty_edges()
    a = pa.array([p[0] for p in pairs], pa.string())
    b = pa.array([p[1] for p in pairs], pa.string())
    first = pc.less(a, b)
    return merge_edges([edge_rows(pc.if_else(first, a, b), pc.if_else(first, b, a), kind)])


def merge_edges(tables: list[pa.Table]) -> pa.Table:
    """Union of edge tables: one row per unordered pair (source < target), weights summed,
    `hnsw` or-ed, a structural kind kept over "similarity", sorted by (source, target).

    Pairs are coded as integers over the sorted ids, so the whole merge is numpy sorts and
    bincounts (the final merge of MuSiQue's 230k edges takes ~50 ms).
    """
    parts = [t.select(EDGE_COLUMNS).cast(EDGE_SCHEMA) for t in tables if t.num_rows]
    if not parts:
        return empty_edges()
    table = pa.concat_tables(parts)
    table = table.combine_chunks()
    coded, ids = ranked(pa.concat_arrays([table["source"].chunk(0), table["target"].chunk(0)]))
    a, b = coded[: table.num_rows], coded[table.num_rows :]
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    code = lo * len(ids) + hi
    similarity = pc.equal(table["kind"], "similarity").to_numpy(zero_copy_only=False).astype(np.int8)
    order = np.lexsort((similarity, code))  # stable: within a pair, structural rows first, then input order
    code = code[order]
    first = np.empty(len(code), dtype=bool)
    first[0] = True
    np.not_equal(code[1:], code[:-1], out=first[1:])
    group = np.cumsum(first) - 1
    weight = np.bincount(group, weights=table["weight"].to_numpy().astype(np.float64)[order])
    hnsw = np.bincount(group, weights=table["hnsw"].to_numpy(zero_copy_only=False).astype(np.float64)[order]) > 0
    keep = order[first]
    return pa.table(
        {"source": ids.take(pa.array(lo[keep])), "target": ids.take(pa.array(hi[keep])),
         "kind": table["kind"].take(pa.array(keep)), "weight": pa.array(weight.astype(np.float32)),
         "hnsw": pa.array(hnsw)},
        schema=EDGE_SCHEMA,
    )


def fixed_width(column: pa.Array | pa.ChunkedArray, width: int = ID_WIDTH) -> np.ndarray | None:
    """The values of a string column as a numpy array of `width`-byte strings (a view on its data,
    which sorts and compares as Arrow sorts strings: by bytes), or None unless every value has
    exactly `width` bytes (every node id does: a type letter, "_" and 16 hex digits)."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    if column.null_count:
        return None
    if not len(column):
        return np.zeros(0, f"S{width}")
    offsets = np.frombuffer(column.buffers()[1], np.int32, len(column) + 1, column.offset * 4)
    if not (np.diff(offsets) == width).all():
        return None
    return np.frombuffer(column.buffers()[2], np.uint8)[offsets[0] : offsets[-1]].view(f"S{width}")


_HEX_VALUE = np.full(256, 255, np.uint8)  # by byte: its value as a lower-case hex digit, else 255
_HEX_VALUE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


ROWS_BLOCK = 1 << 20  # ids parsed at a time: a 16-byte row of digits per id, for this many only


def hex_ids(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray] | None:
    """Per `<letter>_<16 hex>` node id, its letter's byte and its 16 hex digits as a uint64, read
    from the column's bytes in place (`fixed_width`); None unless every id is of that form. In
    that pair the ids sort as their strings do: by letter, then by the number."""
    text = fixed_width(column)
    if text is None:
        return None
    parts = [_hex(text[start : start + ROWS_BLOCK]) for start in range(0, len(text), ROWS_BLOCK)]
    if any(part is None for part in parts):
        return None
    if not parts:
        return np.zeros(0, np.uint8), np.zeros(0, np.uint64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


def _hex(text: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    raw = text.view(np.uint8).reshape(-1, ID_WIDTH)
    nibbles = _HEX_VALUE[raw[:, 2:]]
    if (raw[:, 1] != ord("_")).any() or (nibbles > 15).any():
        return None
    packed = (nibbles[:, 0::2] << 4) | nibbles[:, 1::2]  # (n, 8) bytes, most significant first
    return raw[:, 0].copy(), np.ascontiguousarray(packed).view(">u8").ravel().astype(np.uint64)


def node_rows(ids: pa.Array, wanted: pa.Array | pa.ChunkedArray, lookup: IdRows | None) -> np.ndarray:
    """Per id of `wanted`, its row in `ids`, -1 where it is not there: by `lookup` (`IdRows.of(ids)`,
    a binary search) where the ids allow, else by hashing the strings (`pc.index_in`)."""
    rows = lookup.rows(wanted) if lookup is not None else None
    if rows is None:
        rows = pc.fill_null(pc.index_in(wanted, value_set=ids), -1).to_numpy(zero_copy_only=False)
    return rows


@dataclass(frozen=True)
class IdRows:
    """Sorted node ids as `hex_ids`, with each type's span of rows: parsed once for the look-ups
    of several columns (an edge table's two ends). A look-up is a binary search of numbers within
    each type's rows instead of a hash table of strings (a build's millions of ids: less time, and
    no table of them all in memory), `ROWS_BLOCK` ids at a time."""

    numbers: np.ndarray
    spans: dict[int, tuple[int, int]]  # type letter's byte -> its rows [low, high)
    _bucket_tables: dict[int, tuple[np.uint64, np.ndarray]] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, ids: pa.Array | pa.ChunkedArray) -> IdRows | None:
        """None unless the ids are `hex_ids`, sorted and distinct."""
        have = hex_ids(ids)
        if have is None or len(have[0]) >= 2**31:
            return None
        letters, numbers = have
        step = np.diff(letters.astype(np.int16))
        if (step < 0).any() or ((step == 0) & (numbers[1:] <= numbers[:-1])).any():
            return None
        return cls(numbers, {int(letter): (int(np.searchsorted(letters, letter, "left")),
                                           int(np.searchsorted(letters, letter, "right")))
                             for letter in np.flatnonzero(np.bincount(letters, minlength=256))})

    def rows(self, wanted: pa.Array | pa.ChunkedArray) -> np.ndarray | None:
        """Per id of `wanted`, its row (int32), -1 where it is not there; None unless `wanted` is all
        `<letter>_<16 hex>` ids (then `node_rows` hashes the strings)."""
        text = fixed_width(wanted)
        if text is None:
            return None
        rows = np.full(len(text), -1, np.int32)
        for start in range(0, len(text), ROWS_BLOCK):
            part = _hex(text[start : start + ROWS_BLOCK])
            if part is None:
                return None
            for letter in np.flatnonzero(np.bincount(part[0], minlength=256)):  # the types: a handful
                if int(letter) not in self.spans:
                    continue
                low, high = self.spans[int(letter)]
                at = np.flatnonzero(part[0] == letter)
                place = self._places(int(letter), part[1][at])
                found = place < high - low
                found[found] = self.numbers[low:high][place[found]] == part[1][at][found]
                rows[start + at[found]] = low + place[found]
        return rows

    def _places(self, letter: int, wanted: np.ndarray) -> np.ndarray:
        """`np.searchsorted` of `wanted` among the numbers of one type. Ids are digests, so their
        numbers are spread evenly: the leading bits of a number give its bucket, and the few numbers
        of a bucket are stepped through, a couple of reads per id instead of a binary search's
        twenty reads all over the array (the other end of an edge table's rows is in no order).
        Numbers already in order (an edge table's first end) are searched as they are: in order, a
        binary search reads what the one before it read."""
        low, high = self.spans[letter]
        numbers = self.numbers[low:high]
        if len(wanted) < 2 or len(numbers) < 2 or (wanted[1:] >= wanted[:-1]).all():
            return np.searchsorted(numbers, wanted)
        shift, starts = self._buckets(letter)
        bucket = wanted >> shift
        place = starts[bucket].astype(np.int64)
        end = starts[bucket + np.uint64(1)]
        active = np.flatnonzero(place < end)
        while len(active):  # a bucket holds a few numbers: a few rounds, each over fewer ids
            beyond = numbers[place[active]] < wanted[active]
            active = active[beyond]
            place[active] += 1
            active = active[place[active] < end[active]]
        return place

    def _buckets(self, letter: int) -> tuple[np.uint64, np.ndarray]:
        """Per type, the shift that leaves a number's leading bits (about one number per bucket) and
        each bucket's first row within the type's rows, made on first use."""
        if letter not in self._bucket_tables:
            low, high = self.spans[letter]
            bits = max(1, int(high - low - 1).bit_length())
            shift = np.uint64(64 - bits)
            edges = np.searchsorted(self.numbers[low:high] >> shift, np.arange((1 << bits) + 1, dtype=np.uint64))
            self._bucket_tables[letter] = (shift, edges.astype(np.int32))
        return self._bucket_tables[letter]


def id_keys(table: pa.Table, key: tuple[str, ...]) -> np.ndarray | None:
    """Per row, the bytes of its id columns `key` one after the other (numpy byte strings, which
    sort as Arrow sorts the columns one after the other), or None unless every id has the common
    width (`fixed_width`)."""
    columns = [fixed_width(table[name]) for name in key]
    if any(c is None for c in columns):
        return None
    width = ID_WIDTH * len(key)
    if not table.num_rows:
        return np.zeros(0, f"S{width}")
    return np.concatenate([c.view(np.uint8).reshape(-1, ID_WIDTH) for c in columns], axis=1).reshape(-1).view(f"S{width}")


def _interleaved(first: int, places: np.ndarray) -> np.ndarray:
    """The order that takes `first` rows and, after them, rows to go at `places` (ascending: a
    row's place among the first rows, as searchsorted gives it) into one sorted sequence."""
    into = places + np.arange(len(places))
    is_second = np.zeros(first + len(places), bool)
    is_second[into] = True
    order = np.empty(len(is_second), np.int64)
    order[~is_second] = np.arange(first)
    order[is_second] = first + np.arange(len(places))
    return order


def sorted_union(first: pa.Table, second: pa.Table, key: tuple[str, ...]) -> pa.Table | None:
    """The rows of two tables each sorted by the id columns `key`, which no row of both shares, in
    one table sorted by them, with `second`'s schema (a table read back from parquet names its
    lists' items "element"): a merge (the place of each row of `second` among those of `first`),
    not a sort of strings. None unless every id has the common width (`fixed_width`)."""
    keys = [id_keys(table, key) for table in (first, second)]
    if keys[0] is None or keys[1] is None:
        return None
    order = _interleaved(first.num_rows, np.searchsorted(keys[0], keys[1]))
    return pa.concat_tables([first.cast(second.schema), second]).take(pa.array(order)).combine_chunks()


def _sorted_pairs(tables: list[pa.Table], keys: list[np.ndarray | None]) -> list[np.ndarray] | None:
    """Each table's kind codes (in EDGE_KINDS) when every table is a merged one (`merge_edges`: one row
    per pair, source < target, sorted) by its pair `keys` (ascending, distinct, None: ids of another
    form) and every kind is known; else None."""
    if any(k is None or (len(k) > 1 and not (k[1:] > k[:-1]).all()) for k in keys):
        return None
    found = [pc.index_in(t["kind"], value_set=pa.array(EDGE_KINDS, pa.string())) for t in tables]
    if any(f.null_count for f in found):
        return None  # a kind not among EDGE_KINDS
    return [np.asarray(f.to_numpy(), np.int8) for f in found]


def _merged(tables: list[pa.Table], keys: list[np.ndarray], codes: list[np.ndarray]) -> tuple[np.ndarray, ...]:
    """The union of merged edge tables (`union_of_merged`) by their sorted, distinct pair `keys`,
    merged in turn: per row of the union its key, the table and row it is taken from, its summed
    weight (float64), or-ed `hnsw` and kind code (the first structural kind)."""
    similarity = EDGE_KINDS.index("similarity")
    merged_keys, table_of, row_of = keys[0], np.zeros(len(keys[0]), np.int64), np.arange(len(keys[0]))
    weight = tables[0]["weight"].to_numpy().astype(np.float64)
    hnsw = tables[0]["hnsw"].to_numpy(zero_copy_only=False).astype(bool)
    kind = codes[0].copy()
    for number, (table, table_keys, table_kind) in enumerate(zip(tables[1:], keys[1:], codes[1:], strict=True), 1):
        places = np.searchsorted(merged_keys, table_keys)
        same = np.zeros(len(places), bool)
        inside = places < len(merged_keys)
        same[inside] = merged_keys[places[inside]] == table_keys[inside]
        at = places[same]
        weight[at] += table["weight"].to_numpy()[same]
        hnsw[at] |= table["hnsw"].to_numpy(zero_copy_only=False)[same]
        kind[at] = np.where(kind[at] == similarity, table_kind[same], kind[at])
        new = ~same
        order = _interleaved(len(merged_keys), places[new])
        merged_keys = np.concatenate([merged_keys, table_keys[new]])[order]
        table_of = np.concatenate([table_of, np.full(int(new.sum()), number)])[order]
        row_of = np.concatenate([row_of, np.flatnonzero(new)])[order]
        weight = np.concatenate([weight, table["weight"].to_numpy().astype(np.float64)[new]])[order]
        hnsw = np.concatenate([hnsw, table["hnsw"].to_numpy(zero_copy_only=False)[new]])[order]
        kind = np.concatenate([kind, table_kind[new]])[order]
    return merged_keys, table_of, row_of, weight, hnsw, kind


def union_of_merged(tables: list[pa.Table]) -> pa.Table:
    """`merge_edges(tables)` for tables that are each its output (one row per pair, source <
    target, sorted: what every stage writes), by merging them in turn: a pair in both of two tables
    becomes one row of their summed weight, or-ed `hnsw` and the first structural kind (that of
    the first table, unless it is "similarity"), the rest of the second table's rows are placed
    among the first's. The stages' edge tables are millions of rows: a merge of sorted ids instead
    of a sort of every id again. Falls back to `merge_edges` when a table is not so (or its ids
    are not of the common width)."""
    parts = [t.select(EDGE_COLUMNS).cast(EDGE_SCHEMA) for t in tables if t.num_rows]
    keys = [id_keys(t, ("source", "target")) for t in parts]
    codes = _sorted_pairs(parts, keys) if parts else None
    ends = [k.view(f"S{ID_WIDTH}").reshape(-1, 2) for k in keys] if codes is not None else []
    if codes is None or not all((e[:, 0] < e[:, 1]).all() for e in ends):
        return merge_edges(tables)
    _, table_of, row_of, weight, hnsw, kind = _merged(parts, keys, codes)
    starts = np.cumsum([0] + [t.num_rows for t in parts])
    taken = pa.array(starts[table_of] + row_of)

    def column(name: str) -> pa.Array:
        return pa.concat_arrays([c for t in parts for c in t[name].chunks]).take(taken)

    return pa.table({"source": column("source"), "target": column("target"),
                     "kind": pa.array(EDGE_KINDS, pa.string()).take(pa.array(kind)),
                     "weight": pa.array(weight.astype(np.float32)), "hnsw": pa.array(hnsw)}, schema=EDGE_SCHEMA)


@dataclass(frozen=True)
class EdgeArrays:
    """A merged edge table (`merge_edges`) as numpy arrays over the rows of its node table, which
    is sorted by id (so the pairs sort as their ids do): 14 bytes an edge where the table takes
    about 55, and no id to look up again. What the last stage holds of a build's edges; the table
    is made from it to be written (`table`)."""

    source: np.ndarray  # int32 node rows, source < target, sorted by (source, target)
    target: np.ndarray  # int32
    kind: np.ndarray  # int8: position in EDGE_KINDS
    weight: np.ndarray  # float32
    hnsw: np.ndarray  # bool

    @classmethod
    def union(cls, tables: list[pa.Table], ids: pa.Array) -> EdgeArrays:
        """`union_of_merged(tables)` over the sorted node ids `ids`, merged as rows: the ends of
        each table looked up once (`IdRows`), then merged by one integer per pair."""
        lookup = IdRows.of(ids)
        parts = [t.select(EDGE_COLUMNS).cast(EDGE_SCHEMA) for t in tables if t.num_rows]
        ends = [(_rows_of(ids, t["source"], lookup), _rows_of(ids, t["target"], lookup)) for t in parts]
        keys = [source.astype(np.int64) * len(ids) + target for source, target in ends]
        codes = _sorted_pairs(parts, keys) if parts else None
        if codes is None or not all((source < target).all() for source, target in ends):
            return cls.of(union_of_merged(tables), ids)
        del ends
        merged_keys, _, _, weight, hnsw, kind = _merged(parts, keys, codes)
        return cls((merged_keys // len(ids)).astype(np.int32), (merged_keys % len(ids)).astype(np.int32), kind,
                   weight.astype(np.float32), hnsw)

    @classmethod
    def of(cls, edges: pa.Table, ids: pa.Array) -> EdgeArrays:
        """A merged edge table over the sorted node ids `ids`."""
        lookup = IdRows.of(ids)
        kind = pc.index_in(edges["kind"], value_set=pa.array(EDGE_KINDS, pa.string()))
        if kind.null_count:
            raise ValueError("edge table has a kind not among graph.EDGE_KINDS")
        return cls(_rows_of(ids, edges["source"], lookup), _rows_of(ids, edges["target"], lookup),
                   np.asarray(kind.to_numpy(), np.int8), edges["weight"].to_numpy(),
                   edges["hnsw"].to_numpy(zero_copy_only=False).astype(bool))

    def table(self, ids: pa.Array, start: int = 0, stop: int | None = None) -> pa.Table:
        """The edge table (`EDGE_SCHEMA`) of the edges from `start` to `stop`, its ids taken from `ids`."""
        part = slice(start, stop)
        return pa.table({"source": ids.take(pa.array(self.source[part])),
                         "target": ids.take(pa.array(self.target[part])),
                         "kind": pa.array(EDGE_KINDS, pa.string()).take(pa.array(self.kind[part])),
                         "weight": pa.array(self.weight[part]), "hnsw": pa.array(self.hnsw[part])}, schema=EDGE_SCHEMA)

    def tables(self, ids: pa.Array, rows: int) -> Iterator[pa.Table]:
        """The edge table in parts of `rows` edges, each made when it is asked for (at least one)."""
        for start in range(0, max(len(self.kind), 1), rows):
            yield self.table(ids, start, start + rows)


def _rows_of(ids: pa.Array, wanted: pa.Array | pa.ChunkedArray, lookup: IdRows | None) -> np.ndarray:
    """`node_rows` of ids that must all be there (int32)."""
    rows = node_rows(ids, wanted, lookup)
    if (rows < 0).any():
        raise ValueError("edge table names a node that is not in the node table")
    return rows.astype(np.int32, copy=False)


def distinct(values: np.ndarray) -> np.ndarray:
    """`np.unique(values)`, by a sort: numpy's unique without return arguments hashes, which on
    integers is ten times slower for a query's few thousand rows and seventy times for a build's
    millions."""
    values = np.sort(values, axis=None)
    return values[np.r_[True, values[1:] != values[:-1]]] if len(values) else values


def row_entries(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Positions of every entry of the given CSR rows, row after row, without building a sub-matrix."""
    starts = indptr[rows]
    counts = indptr[rows + 1] - starts
    return np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(counts.sum())


def csr_entries(id_column: pa.Array, edges: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The symmetric adjacency of an edge table over the nodes `id_column` (in that order) as CSR
    positions: indptr (int64), columns sorted within a row (int32), and per entry the edge it comes
    from (int64: entry k is edge `order[k]` of the table, seen from its source when below the
    table's length, else edge `order[k]` - length seen from its target)."""
    lookup = IdRows.of(id_column)  # parsed once for both ends; None for ids of another form or not sorted
    src, dst = (_rows_of(id_column, edges[end], lookup) for end in ("source", "target"))
    return csr_of_rows(len(id_column), src, dst)


def csr_of_rows(n: int, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`csr_entries` of edges given as the node rows of their ends (int32)."""
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(src, minlength=n) + np.bincount(dst, minlength=n), out=indptr[1:])
    if len(src) and (src < dst).all() and \
            ((src[1:] > src[:-1]) | ((src[1:] == src[:-1]) & (dst[1:] > dst[:-1]))).all():
        order = _merged_entry_order(src, dst, indptr)
        return indptr, np.concatenate([dst, src])[order], order
    rows, cols = np.concatenate([src, dst]), np.concatenate([dst, src])
    # each graph-wide temporary is let go once its copy is made: at a million passages each is
    # hundreds of megabytes
    del src, dst
    key = rows.astype(np.int64)
    key *= max(n, 1)
    key += cols
    del rows
    order = np.argsort(key, kind="stable")  # lexsort((cols, rows))'s order, one key
    del key
    return indptr, cols[order], order


def _merged_entry_order(src: np.ndarray, dst: np.ndarray, indptr: np.ndarray) -> np.ndarray:
    """`csr_entries`' order for the rows of a merged edge table (`merge_edges`: source < target, in
    (source, target) order) whose nodes are in id order, as the stages' are: placed, not sorted. A
    node's row lists its smaller neighbours (the edges it is the target of, already in source
    order) before its larger ones (those it is the source of, already in target order), so only the
    edges' order by target is needed: a stable sort by two 16-bit halves (numpy's radix sort)."""
    edges = len(src)
    low = np.argsort((dst & 0xFFFF).astype(np.uint16), kind="stable")
    by_target = low[np.argsort((dst[low] >> 16).astype(np.uint16), kind="stable")]
    del low
    as_target = np.bincount(dst, minlength=len(indptr) - 1)
    as_source = np.diff(indptr) - as_target
    order = np.empty(2 * edges, np.int64)
    targets = dst[by_target]
    order[indptr[targets] + np.arange(edges) - (np.cumsum(as_target) - as_target)[targets]] = by_target + edges
    del targets, by_target
    order[indptr[src] + as_target[src] + np.arange(edges) - (np.cumsum(as_source) - as_source)[src]] = np.arange(edges)
    return order


def per_entry(values: np.ndarray, order: np.ndarray, dtype) -> np.ndarray:
    """Per CSR entry (`csr_entries`' order), the value of its edge (`values`: one per edge)."""
    values = np.asarray(values, dtype)
    return np.concatenate([values, values])[order]


def csr_arrays(id_column: pa.Array, edges: pa.Table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The symmetric adjacency of an edge table over the nodes `id_column` (in that order) as CSR
    arrays: indptr (int64), columns sorted within a row (int32), weights (float64)."""
    indptr, indices, order = csr_entries(id_column, edges)
    return indptr, indices, per_entry(edges["weight"].to_numpy(), order, np.float64)


@dataclass
class Graph:
    """The heterograph as arrays: node order = nodes table order, a symmetric weighted adjacency in
    CSR form (rows ascending, columns sorted within a row, one entry per neighbour).

    Indexing reads the CSR arrays directly; `adjacency` gives them as a scipy matrix for the query
    path, built on first use: importing scipy.sparse costs ~0.3 s, which an indexing run then does
    not pay."""

    id_column: pa.Array  # node ids (Arrow strings: not a Python object per node)
    types: np.ndarray  # '<U1' array
    indptr: np.ndarray  # (n + 1,) int64
    indices: np.ndarray  # column of each entry, int32
    weights: np.ndarray  # weight of each entry, float64

    @functools.cached_property
    def ids(self) -> np.ndarray:
        """Node ids as a numpy object array, made on first use: the indexing stages take the few ids
        they need from `id_column` instead of a Python string per node (~125 MB at 100,000 passages)."""
        return np.asarray(self.id_column.to_pylist(), dtype=object)

    @functools.cached_property
    def id_rank(self) -> np.ndarray:
        """Per node, the rank of its id among all (byte order, as Arrow sorts): an order by id without
        the ids as Python objects. A table sorted by id (as the stages' are) is its own rank."""
        keys = fixed_width(self.id_column)
        if keys is not None and (len(keys) < 2 or (keys[1:] > keys[:-1]).all()):
            return np.arange(len(keys), dtype=np.int64)
        rank = np.empty(len(self.id_column), np.int64)
        rank[pc.array_sort_indices(self.id_column).to_numpy()] = np.arange(len(self.id_column))
        return rank

    @functools.cached_property
    def index_of(self) -> dict[str, int]:
        """Row of each node id, built on first use: only evaluation asks for it, and the indexing
        stages, which walk the arrays, do not pay for it."""
        return {node: i for i, node in enumerate(self.ids.tolist())}

    @classmethod
    def from_tables(cls, nodes: pa.Table, edges: pa.Table) -> Graph:
        id_column = nodes["id"].combine_chunks() if isinstance(nodes["id"], pa.ChunkedArray) else nodes["id"]
        indptr, indices, weights = csr_arrays(id_column, edges)
        letters = fixed_width(nodes["type"], 1)  # a type is one letter: its bytes, without a str per node
        types = letters.astype("<U1") if letters is not None else np.asarray(nodes["type"].to_pylist(), dtype="<U1")
        return cls(id_column=id_column, types=types, indptr=indptr, indices=indices, weights=weights)

    @property
    def degree(self) -> np.ndarray:
        """Neighbours per node."""
        return np.diff(self.indptr)

    def neighbours(self, rows: np.ndarray) -> np.ndarray:
        """Column indices of the given rows, concatenated (with repeats)."""
        return self.indices[row_entries(self.indptr, rows)]

    def upper_edges(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(row, column, weight) of every edge once, row < column, in CSR order."""
        rows = np.repeat(np.arange(len(self.types)), self.degree)
        upper = self.indices > rows
        return rows[upper], self.indices[upper].astype(np.int64), self.weights[upper]

    @functools.cached_property
    def adjacency(self):
        """scipy.sparse.csr_matrix of the same arrays (imported here, see the class docstring)."""
        import scipy.sparse as sp

        n = len(self.types)
        index_type = np.int32 if len(self.indices) < 2**31 else np.int64
        return sp.csr_matrix((self.weights, self.indices.astype(index_type), self.indptr.astype(index_type)), shape=(n, n))


def ranked(column: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, pa.Array]:
    """Per row, its value's rank among the column's distinct values (int64), and those values
    sorted (byte order, as `sort_by` sorts strings): one pass of hashing, then a sort of the distinct
    values only, so that grouping and ordering rows is numpy on integers."""
    column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    encoded = pc.dictionary_encode(column)
    by_value = pc.array_sort_indices(encoded.dictionary).to_numpy()
    rank = np.empty(len(by_value), np.int64)
    rank[by_value] = np.arange(len(by_value))
    return rank[encoded.indices.to_numpy()], encoded.dictionary.take(pa.array(by_value))


def _runs(sorted_codes: np.ndarray) -> np.ndarray:
    """Positions where a sorted array takes a new value."""
    return np.flatnonzero(np.r_[True, sorted_codes[1:] != sorted_codes[:-1]]) if len(sorted_codes) else \
        np.zeros(0, np.int64)


def nodes_from_mentions(mentions: pa.Table) -> pa.Table:
    """A nodes table (sorted by id) from one row per mention (`node`, `text`, `chunk`, `tokens` of
    the text), as NodeSet builds it: a node's text is its most frequent surface form (ties: the
    smallest), its chunks the distinct chunks, its mentions the count; N nodes are named by their
    text. Vectorised on integer ranks (`ranked`), for tables of every mention in a corpus."""
    if mentions.num_rows == 0:
        return NODE_SCHEMA.empty_table()
    node, ids = ranked(mentions["node"])
    text, texts = ranked(mentions["text"])
    # the distinct (node, text) forms, with their mentions and their largest token count
    pair = node * len(texts) + text
    order = np.argsort(pair, kind="stable")
    starts = _runs(pair[order])
    form = pair[order[starts]]
    form_count = np.diff(np.r_[starts, len(order)])
    form_tokens = np.maximum.reduceat(mentions["tokens"].to_numpy()[order], starts) if len(starts) else starts
    del pair, order
    form_node, form_text = form // len(texts), form % len(texts)
    choice = np.lexsort((form_text, -form_count, form_node))  # per node: most mentions, then the smallest text
    chosen = choice[_runs(form_node[choice])]  # one per node, in id order
    chunk, chunk_values = ranked(mentions["chunk"])
    in_chunk = distinct(node * len(chunk_values) + chunk)  # distinct (node, chunk), sorted
    offsets = np.zeros(len(ids) + 1, np.int64)
    np.cumsum(np.bincount(in_chunk // len(chunk_values), minlength=len(ids)), out=offsets[1:])
    types = pc.utf8_slice_codeunits(ids, 0, 1)
    chosen_texts = texts.take(pa.array(form_text[chosen]))
    n = len(ids)
    return pa.table({
        "id": ids, "type": types, "text": chosen_texts, "name": pc.if_else(pc.equal(types, "N"), chosen_texts, ""),
        "chunk_ids": pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                              chunk_values.take(pa.array(in_chunk % len(chunk_values)))),
        "doc_ids": pa.ListArray.from_arrays(pa.array(np.zeros(n + 1, np.int32)), pa.array([], pa.string())),
        "tokens": pa.array(form_tokens[chosen].astype(np.int32)),
        "mentions": pa.array(np.bincount(node, minlength=n).astype(np.int32)),
        "community": pa.array(np.full(n, -1, np.int32)), "vector_row": pa.array(np.full(n, -1, np.int32)),
    }).cast(NODE_SCHEMA)


def _most_frequent(counts: dict[str, int]) -> str:
    if len(counts) == 1:
        return next(iter(counts))
    return min(counts.items(), key=lambda kv: (-kv[1], kv[0]))[0] if counts else ""


class NodeSet:
    """Accumulates nodes while a stage builds them: same id merges chunk ids and mentions;
    the display text and name are the most frequent surface forms (ties: the smallest), so
    the result does not depend on the order things were added in."""

    def __init__(self):
        self._rows: dict[str, list] = {}  # id -> [text counts, name counts, chunk ids, mentions]

    def add(self, node: str, text: str, chunk_ids=(), name: str = "", mentions: int = 1) -> str:
        row = self._rows.get(node)
        if row is None:
            row = self._rows[node] = [{}, {}, set(), 0]
        texts = row[0]
        texts[text] = texts.get(text, 0) + 1
        if name:
            names = row[1]
            names[name] = names.get(name, 0) + 1
        row[2].update(chunk_ids)
        row[3] += mentions
        return node

    def __contains__(self, node: str) -> bool:
        return node in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def table(self, count_tokens=None) -> pa.Table:
        """The nodes, sorted by id; `count_tokens` (texts -> counts) fills the tokens column."""
        ids = sorted(self._rows)
        rows = [self._rows[i] for i in ids]
        texts = [_most_frequent(r[0]) for r in rows]
        return nodes_table(
            {
                "id": ids,
                "type": [i[0] for i in ids],
                "text": texts,
                "name": [_most_frequent(r[1]) if r[1] else "" for r in rows],
                "chunk_ids": [sorted(r[2]) for r in rows],
                "doc_ids": [[] for _ in rows],
                "tokens": list(count_tokens(texts)) if count_tokens and texts else [0] * len(ids),
                "mentions": [r[3] for r in rows],
                "community": [-1] * len(ids),
                "vector_row": [-1] * len(ids),
            }
        )
