"""What the search reads, derived from a build's final tables once, at index time.

Every structure here is written into the build's generation by the last indexing stage
(`index/assemble.py`) as flat arrays (`.npy`), Arrow IPC files and a faiss index, and a query
process opens them by memory mapping (`search/retriever.py`): opening costs the same at any
size, and a question reads only the pages it touches.

| name | what |
|---|---|
| node_text (arrow) | text per node, in node order (= id order) |
| id_hash | per node, the 16 hex digits of its id as an integer (uint64); with its type, its id |
| type_codes | per node, its type as `TYPE_CODE` (int8) |
| tokens | per node, tokens of its text (uint16; int32 when a text has 65,536 or more) |
| vector_of_node | per node, its row in vectors.faiss or -1 (int32) |
| node_of_vector, scanned_rows | per vector, its node; the vector rows of the S, A, H nodes |
| scan8.faiss | below `search.clustered_from` S, A, H vectors: an int8 copy of them (`scan8` in the manifest: scale, rounding error) |
| cluster_centroids, cluster_indptr, cluster_rows | from there on: their clusters (`ivf.Clusters`): unit centroids, and each cluster's vector rows |
| cluster_codes | the int8 codes of those rows, cluster after cluster (ranking only: no scale is kept) |
| walk_* | P for the configured similarity weight (`ppr.WalkMatrix`) |
| leads_rows, leads_indptr, leads_indices | the structural edges that end in an A or H node (CSR over the rows that have one, `leads_rows`: a few in a hundred) |
| key_indptr, key_ids | per node, its sentence keys as 64-bit hashes (CSR; retrievable nodes only; `context.sentence_key_hash`) |
| doc_indptr, doc_codes, document_names (arrow) | per node, its source documents' paths, sorted |
| value_kinds | per node, the kinds of value a unit's text holds (`nlp.VALUE_BITS`: a date, a number; uint8; 0 for other types) |
| unit_chunk | per node, the chunk a unit may be shown whole in place of (`context.whole_chunks`): the T node it was cut from (the lowest row of its chunks), when that chunk lies on one page, slide or sheet (int32; -1 otherwise, and for other types) |
| place_indptr, place_rows, places (arrow) | per retrievable node, the chunks it came from as places (`places`): per chunk and document, JSON with the document, its content hash, the chunk's span and the pages, slides, sheets and sections over it; and the chunk's T node |
| name_* and name_keys (arrow) | the name index of the N and O nodes (`entry.NameIndex`) |
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faiss
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .. import ivf, nlp
from ..errors import DamagedError
from ..graph import EdgeArrays, csr_entries, csr_of_rows, distinct, hex_ids, per_entry, row_entries
from ..node_types import MAX_RETRIEVABLE_CODE, TYPE_CODE, TYPE_LETTERS
from . import context
from .entry import NameIndex, key_hashes, name_key, name_words
from .ppr import WalkMatrix

VERSION = 9  # of these structures' definition; a build of another is rebuilt
SCANNED = ("S", "A", "H")  # the vector side of dual search (spec §3.1)
IS_LED = np.isin(np.arange(len(TYPE_CODE)), [TYPE_CODE["A"], TYPE_CODE["H"]])  # by type code
KEY_IDS = "blake2b-64"  # what a build's sentence-key ids are (`context.sentence_key_hash`): only such are reused
TEXT_BLOCK = 65_536  # nodes whose texts are turned into Python strings at a time
GRID_ROWS = 65_536  # vectors put on the grid at a time to find their nearest centroid
WALK_ARRAYS = ("walk_indptr", "walk_indices", "walk_weights")


Store = Callable[[str, "np.ndarray | pa.Table | bytes"], None]  # a derived structure, by name: written as it comes


@dataclass(frozen=True)
class Adjacency:
    """A symmetric weighted adjacency as canonical CSR arrays (rows ascending, columns sorted, no zeros)."""

    indptr: np.ndarray  # int64
    indices: np.ndarray  # int32
    data: np.ndarray  # float64


@dataclass(frozen=True)
class EdgeParts:
    """The adjacency of the edge table entry by entry in two parts: the structural weight (an edge's
    weight less the 1 the similarity stage added to each pair it found, its `hnsw` flag) and that
    similarity share, so that the walk weighs similarity edges by search.similarity_weight without
    re-indexing. One sort of the edges serves every weight."""

    indptr: np.ndarray  # int64
    indices: np.ndarray  # int32, sorted within a row, one entry per neighbour
    structural: np.ndarray  # float64 per entry
    similar: np.ndarray  # uint8 per entry

    def adjacency(self, similarity_weight: float) -> Adjacency:
        """structural + similarity_weight x similarity share, cancelled entries dropped (weight 0:
        the structural edges alone); each entry has the bits of scipy's a + w x b."""
        if similarity_weight == 0:  # the structural weights as they are (0 x a share adds +0.0): no copy
            values = self.structural
        else:
            values = self.similar * np.float64(similarity_weight)
            values += self.structural
        keep = values != 0
        kept_before = np.zeros(len(keep) + 1, np.int32 if len(keep) < 2**31 else np.int64)
        np.cumsum(keep, out=kept_before[1:])
        return Adjacency(kept_before[self.indptr].astype(np.int64), self.indices[keep], values[keep])


def edge_parts(nodes: pa.Table, edges: pa.Table) -> EdgeParts:
    """The edge table's `EdgeParts` over the nodes in table order."""
    indptr, indices, order = csr_entries(nodes["id"].combine_chunks(), edges)
    return _edge_parts(indptr, indices, order, edges["weight"].to_numpy(), edges["hnsw"].to_numpy(zero_copy_only=False))


def edge_parts_of(n: int, edges: EdgeArrays) -> EdgeParts:
    """`edge_parts` of a build's edges given as node rows (`graph.EdgeArrays`: nothing to look up)."""
    return _edge_parts(*csr_of_rows(n, edges.source, edges.target), edges.weight, edges.hnsw)


def _edge_parts(indptr: np.ndarray, indices: np.ndarray, order: np.ndarray, weight: np.ndarray, hnsw: np.ndarray
                ) -> EdgeParts:
    similar = per_entry(hnsw, order, np.uint8)
    structural = per_entry(weight, order, np.float64)
    del order
    structural -= similar
    rows = np.repeat(np.arange(len(indptr) - 1, dtype=np.int32), np.diff(indptr))
    repeated = (indices[1:] == indices[:-1]) & (rows[1:] == rows[:-1])
    del rows
    if repeated.any():  # a pair listed twice (a self-loop is, once from each end): one entry, summed
        first = np.r_[True, ~repeated]
        group = np.cumsum(first) - 1
        structural = np.bincount(group, weights=structural)
        similar = np.bincount(group, weights=similar).astype(np.uint8)
        firsts_before = np.r_[0, np.cumsum(first)]
        indptr, indices = firsts_before[indptr], indices[first]
    return EdgeParts(indptr, indices, structural, similar)


def walk_matrix(parts: EdgeParts, weight: float) -> WalkMatrix:
    """P of structural edges + weight x similarity edges."""
    adjacency = parts.adjacency(weight)
    return WalkMatrix.from_csr(adjacency.indptr, adjacency.indices, adjacency.data)


_LETTER_BYTES = np.frombuffer("".join(TYPE_LETTERS).encode(), np.uint8)  # by type code


def id_hashes(ids: pa.Array | pa.ChunkedArray, codes: np.ndarray) -> np.ndarray:
    """The hex part of each `<type>_<16 hex>` id as a uint64 (`node_ids` gives the id back): half the
    bytes of the strings, in a file the query maps (`graph.hex_ids`, checked against the types)."""
    parsed = hex_ids(ids)
    if parsed is None or not (parsed[0] == _LETTER_BYTES[codes]).all():
        raise ValueError("node ids that are not <type>_<16 hex>")
    return parsed[1]


def node_ids(hashes: np.ndarray, codes: np.ndarray) -> list[str]:
    """The ids of nodes from their `id_hash` and type codes."""
    letters = TYPE_LETTERS[codes]
    return [f"{letter}_{value:016x}" for letter, value in zip(letters.tolist(), hashes.tolist(), strict=True)]


def _narrow(array: np.ndarray) -> np.ndarray:
    """An int64 index array as int32 when its values fit (always, below 2^31 entries): half the bytes."""
    return array.astype(np.int32) if not len(array) or int(array.max()) < 2**31 else array


def type_codes_of(types: pa.Array) -> np.ndarray:
    codes = np.zeros(len(types), dtype=np.int8)
    letters = np.asarray(types.to_numpy(zero_copy_only=False), dtype="<U1")
    for node_type, code in TYPE_CODE.items():
        codes[letters == node_type] = code
    return codes


def int8_codes(vectors: np.ndarray) -> tuple[np.ndarray, float]:
    """round(v x scale) for each vector, one scale for all (the largest component maps to 127): a
    quarter of the float32 vectors' memory traffic, which sets the cost of scoring many of them.
    Whole numbers in [-127, 127], returned as float32 (exact) with the scale."""
    scale = 127.0 / max(float(np.abs(vectors).max(initial=0.0)), 1e-12)
    return np.rint(vectors * np.float32(scale)), scale


def int8_code_rows(vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """`int8_codes(vectors[rows])`'s codes as int8, a block of rows at a time: only the codes are
    held whole (`vectors` may be a build's mapped half-precision rows)."""
    starts = list(range(0, len(rows), ivf.BLOCK))
    largest = max(ivf.in_parallel(lambda start: float(np.abs(vectors[rows[start : start + ivf.BLOCK]]).max(initial=0.0)),
                                  starts), default=0.0)
    scale = np.float32(127.0 / max(largest, 1e-12))
    codes = np.empty((len(rows), vectors.shape[1]), np.int8)

    def fill(start: int) -> None:  # elementwise: the same codes whichever thread does a block
        block = rows[start : start + ivf.BLOCK]
        codes[start : start + len(block)] = np.rint(np.asarray(vectors[block], np.float32) * scale)

    ivf.in_parallel(fill, starts)
    return codes


def scan8(vectors: np.ndarray) -> tuple[faiss.Index, float, float]:
    """An int8 copy of the given vectors for the vector side's scan, returned with the scale and the
    largest vector's rounding error (`VectorSide._scan8_top`)."""
    codes, scale = int8_codes(vectors)
    residual = vectors - codes * np.float32(1 / scale)
    # float32 rounding of the residual is ~1e-7 of a vector's norm: SCAN8_SLACK covers it
    error = float(np.sqrt(np.einsum("ij,ij->i", residual, residual).max(initial=0.0)))
    index = faiss.IndexScalarQuantizer(vectors.shape[1], faiss.ScalarQuantizer.QT_8bit_direct_signed,
                                       faiss.METRIC_INNER_PRODUCT)
    index.train(codes)
    index.add(codes)
    return index, scale, error


def document_lists(doc_ids: pa.ListArray, documents: pa.Table) -> tuple[np.ndarray, np.ndarray, pa.Array]:
    """Per node, the paths of its documents, sorted (a document id missing from the table shows
    as itself), as CSR (indptr int64, codes int32) into a sorted array of the distinct paths."""
    flat = pc.list_flatten(doc_ids)
    lengths = pc.fill_null(pc.list_value_length(doc_ids), 0).to_numpy()
    owner = np.repeat(np.arange(len(lengths)), lengths)
    found = pc.index_in(flat, value_set=documents["doc_id"].combine_chunks())
    paths = documents["path"].combine_chunks()
    shown = pc.if_else(pc.is_null(found), flat, pc.take(paths, pc.fill_null(found, 0)))
    names = pc.unique(shown)
    names = names.take(pc.array_sort_indices(names))  # byte order of UTF-8 = Python's string order
    codes = pc.index_in(shown, value_set=names).to_numpy(zero_copy_only=False).astype(np.int32)
    order = np.lexsort((codes, owner))
    indptr = np.r_[0, np.cumsum(lengths, dtype=np.int64)].astype(np.int64)
    return indptr, codes[order], names


def _marks(chunks: pa.Table) -> tuple[pa.Array, list]:
    """Per chunk, the index of its location among the distinct ones, and those locations parsed
    (`chunk.location`'s JSON): a folder's chunks share a handful of locations, or one each on pages."""
    locations = pc.fill_null(chunks["location"], "{}")
    distinct_locations = pc.unique(locations)
    at = pc.index_in(locations, value_set=distinct_locations)
    return at, [json.loads(where or "{}") for where in distinct_locations.to_pylist()]


_PLAIN = r'^[^"\\\x00-\x1f]*$'  # a string JSON writes between quotes as it is (ensure_ascii off)


def _json_strings(values: pa.Array) -> pa.Array:
    """Each string as a JSON string literal, as `json.dumps(..., ensure_ascii=False)` writes it."""
    plain = pc.match_substring_regex(values, _PLAIN).to_numpy(zero_copy_only=False)
    quoted = pc.binary_join_element_wise('"', values, '"', "")
    if plain.all():
        return quoted
    escaped = [json.dumps(v, ensure_ascii=False) for v in pc.filter(values, pa.array(~plain)).to_pylist()]
    return pc.replace_with_mask(quoted, pa.array(~plain), pa.array(escaped, pa.string()))


def places(nodes: pa.Table, codes: np.ndarray, documents: pa.Table, chunks: pa.Table | None
           ) -> tuple[np.ndarray, np.ndarray, pa.Table]:
    """Per retrievable node, the places it came from (CSR: indptr int64, rows int32 into the places
    table, each node's by document path, then position): one place per chunk and document (a chunk text two
    documents share is a place in each). A place is the document, its content hash, the chunk's
    span and `marks` (`chunk.location`: the pages, slides, sheets and sections over the chunk, with
    where each starts in its text), as JSON, and the chunk's T node row (`chunk_node`), whose text
    the search finds a unit in to narrow the place to it (`Retriever._places_of`). Entities and
    overviews, never shown, get none. The JSON is joined column by column, each piece written as
    `json.dumps` writes it."""
    n = nodes.num_rows
    if chunks is None or not chunks.num_rows:
        return (np.zeros(n + 1, np.int64), np.zeros(0, np.int32),
                pa.table({"place": pa.array([], pa.string()), "chunk_node": pa.array([], pa.int32())}))
    chunks = chunks.sort_by([("chunk_id", "ascending"), ("doc_id", "ascending")]).combine_chunks()
    doc = pc.index_in(chunks["doc_id"], value_set=documents["doc_id"].combine_chunks())  # null: not a document
    paths = pc.coalesce(pc.take(documents["path"].combine_chunks(), doc), chunks["doc_id"])
    hashes = pc.coalesce(pc.take(documents["content_hash"].combine_chunks(), doc), "")
    location, marks = _marks(chunks)
    marks_json = pa.array([json.dumps(m, ensure_ascii=False, separators=(",", ":")) for m in marks], pa.string())
    texts = pc.binary_join_element_wise(
        '{"document":', _json_strings(paths), ',"content_hash":', _json_strings(hashes),
        ',"span":[', pc.cast(chunks["start"], pa.string()), ",", pc.cast(chunks["end"], pa.string()),
        '],"marks":', pc.take(marks_json, location), "}", "")
    chunk_node = pc.fill_null(pc.index_in(chunks["chunk_id"], value_set=nodes["id"]), -1).cast(pa.int32())
    chunk_ids = chunks["chunk_id"].to_numpy(zero_copy_only=False)
    once, first, count = np.unique(chunk_ids, return_index=True, return_counts=True)
    lists = nodes["chunk_ids"]
    all_lengths = pc.fill_null(pc.list_value_length(lists), 0).to_numpy()
    lengths = np.where(codes <= MAX_RETRIEVABLE_CODE, all_lengths, 0)
    flat = pc.list_flatten(lists).filter(pa.array(np.repeat(codes <= MAX_RETRIEVABLE_CODE, all_lengths)))
    found = pc.index_in(flat, value_set=pa.array(once, pa.string()))
    known = pc.is_valid(found).to_numpy(zero_copy_only=False)
    owner = np.repeat(np.arange(n), lengths)[known]
    chunk = pc.fill_null(found, 0).to_numpy()[known]
    owner = np.repeat(owner, count[chunk])
    rows = np.repeat(first[chunk] - np.cumsum(np.r_[0, count[chunk]])[:-1], count[chunk]) + np.arange(len(owner))
    path_rank = pc.rank(paths, tiebreaker="dense").to_numpy()  # byte order of UTF-8 = Python's string order
    starts = chunks["start"].to_numpy()
    rows = rows[np.lexsort((starts[rows], path_rank[rows], owner))]  # a node's places by document, then place in it
    indptr = np.r_[0, np.cumsum(np.bincount(owner, minlength=n))].astype(np.int64)
    return indptr, rows.astype(np.int32), pa.table({"place": texts, "chunk_node": chunk_node})


def one_place_chunks(nodes: pa.Table, chunks: pa.Table | None) -> np.ndarray:
    """Per node, whether it is a chunk (T) that lies on one page, slide or sheet (or a document that
    has none): shown whole, it is cited as exactly as its units are. A chunk two documents share
    is judged by its last row."""
    one = np.zeros(nodes.num_rows, bool)
    if chunks is None or not chunks.num_rows:
        return one
    location, marks = _marks(chunks)
    spread = np.array([any(len(m.get(kind, [])) > 1 for kind in ("pages", "slides", "sheets")) for m in marks], bool)
    last_first = pa.array(np.arange(chunks.num_rows - 1, -1, -1))  # index_in finds a chunk id's first row
    at = pc.index_in(nodes["id"], value_set=chunks["chunk_id"].combine_chunks().take(last_first))
    found = pc.is_valid(at).to_numpy(zero_copy_only=False)
    row = chunks.num_rows - 1 - pc.fill_null(at, 0).to_numpy()
    one[found] = ~spread[location.to_numpy(zero_copy_only=False)[row[found]]]
    return one


def unit_chunks(structural: Adjacency, codes: np.ndarray, one_place: np.ndarray) -> np.ndarray:
    """Per node, the T node a unit (S) is joined to by its T-S edge (the lowest row where a sentence
    stands in several chunks) when that chunk is `one_place`, -1 for every other node."""
    owner = np.repeat(np.arange(len(codes)), np.diff(structural.indptr))
    pairs = (codes[owner] == TYPE_CODE["S"]) & (codes[structural.indices] == TYPE_CODE["T"])
    chunk = np.full(len(codes), -1, np.int32)
    rows, targets = owner[pairs], structural.indices[pairs].astype(np.int32)
    order = np.lexsort((targets, rows))
    rows, targets = rows[order], targets[order]
    first = np.r_[True, rows[1:] != rows[:-1]] if len(rows) else np.zeros(0, bool)
    rows, targets = rows[first], targets[first]
    chunk[rows] = np.where(one_place[targets], targets, -1)
    return chunk


@dataclass(frozen=True)
class EarlierText:
    """What an earlier build derived from each node's own text (sentence key ids, value kinds, name
    words, and the vector side's cluster of its vector), to take for the nodes whose id and text are
    unchanged instead of deriving it again (an update changes a few): `_text_structures` and
    `vector_clusters` give the same arrays either way. Read with `EarlierText.read`, which checks
    each file it uses against the build's manifest."""

    ids: pa.Array
    texts: pa.Array  # the text each structure was derived from (for N and O nodes: the name, else the text)
    key_indptr: np.ndarray
    key_ids: np.ndarray
    value_kinds: np.ndarray
    name_key: np.ndarray  # per node, its name's position in name_keys, or -1
    name_keys: pa.Array
    name_hash: np.ndarray  # per position in name_keys, its hash (`entry.key_hashes`)
    cluster_centroids: np.ndarray | None = None  # the vector side's, when the build has clusters
    cluster_of: np.ndarray | None = None  # per node, its vector's cluster among them, or -1

    FILES = ("nodes.parquet", "node_text.arrow", "key_indptr.npy", "key_ids.npy", "value_kinds.npy",
             "name_indptr.npy", "name_rows.npy", "name_keys.arrow", "name_hash.npy")
    CLUSTER_FILES = ("cluster_centroids.npy", "cluster_indptr.npy", "cluster_rows.npy", "node_of_vector.npy")

    @classmethod
    def read(cls, generation, vectors_id: str | None = None) -> EarlierText | None:
        """The earlier build's, or None when it holds another version of these structures, sentence
        keys numbered otherwise (a build made before they were `KEY_IDS`: the search reads those as
        well, but they cannot be mixed with these), or a file it needs does not match its checksum;
        then everything is derived again. Its clusters only when its vectors came from `vectors_id`
        (the embedder's `vector_id`: a node's text then has the same vector)."""
        meta = generation.meta
        embedded = generation.manifest.get("embedding", {}).get("vectors")
        files = cls.FILES + (cls.CLUSTER_FILES if "clusters" in meta and vectors_id and embedded == vectors_id else ())
        if meta.get("version") != VERSION or meta.get("key_ids") != KEY_IDS or generation.verify(files):
            return None
        try:
            nodes = generation.table("nodes", ["id", "type", "name"])
            text = generation.arrow("node_text")["text"]
            indptr, rows = generation.array("name_indptr"), generation.array("name_rows")
            keys = [generation.array(name) for name in ("key_indptr", "key_ids", "value_kinds")]
            name_keys = generation.arrow("name_keys")["key"].combine_chunks()
            name_hash = generation.array("name_hash")
            clustered = [generation.array(file.removesuffix(".npy")) for file in files if file in cls.CLUSTER_FILES]
        except DamagedError:  # a file its manifest does not list
            return None
        name_key = np.full(nodes.num_rows, -1, np.int64)
        name_key[rows] = np.repeat(np.arange(len(indptr) - 1), np.diff(indptr))
        centroids = cluster_of = None
        if clustered:
            centroids, cluster_indptr, members, node_of_vector = clustered
            cluster_of = np.full(nodes.num_rows, -1, np.int64)
            cluster_of[node_of_vector[members]] = np.repeat(np.arange(len(centroids)), np.diff(cluster_indptr))
        return cls(nodes["id"].combine_chunks(), _derived_from(nodes["type"], nodes["name"], text), *keys,
                   name_key, name_keys, name_hash, centroids, cluster_of)

    def clusters_of(self, rows: np.ndarray, centroids: np.ndarray) -> np.ndarray:
        """Per earlier row (-1: none), the cluster its vector was in when the earlier build's vector
        side had these `centroids`, else -1: the nearest centroid of the same vector."""
        if self.cluster_of is None or not np.array_equal(self.cluster_centroids, centroids):
            return np.full(len(rows), -1, np.int64)
        return np.where(rows >= 0, self.cluster_of[np.maximum(rows, 0)], -1)

    def rows_of(self, ids: pa.Array, texts: pa.Array) -> np.ndarray:
        """Per node, its row in the earlier build when it has the same id and derived-from text, else -1."""
        found = pc.index_in(ids, value_set=self.ids)
        same = pc.and_kleene(pc.is_valid(found), pc.equal(texts, self.texts.take(pc.fill_null(found, 0))))
        return np.where(pc.fill_null(same, False).to_numpy(zero_copy_only=False),
                        pc.fill_null(found, -1).to_numpy(zero_copy_only=False), -1)


def _derived_from(types: pa.ChunkedArray, names: pa.ChunkedArray, texts: pa.ChunkedArray) -> pa.Array:
    """Per node, the text its text structures are derived from: an entity's or overview's name (its
    text when it has none), every other node's text."""
    by_name = pc.and_kleene(pc.is_in(types, value_set=pa.array(["N", "O"])), pc.not_equal(names, ""))
    return pc.if_else(by_name, names, texts).combine_chunks()  # one array of every text made, not two


def _text_structures(nodes: pa.Table, codes: np.ndarray, earlier: EarlierText | None = None
                     ) -> tuple[dict[str, np.ndarray], dict[str, pa.Table], dict]:
    """The sentence keys, the value kinds and the name index: the Python-bound part, run beside the
    array part. Each node's share is a function of its own text; with `earlier`, the nodes it holds
    unchanged take theirs from it."""
    arrays, tables = {}, {}
    n = len(codes)
    derived_from = _derived_from(nodes["type"], nodes["name"], nodes["text"])
    earlier_row = earlier.rows_of(nodes["id"].combine_chunks(), derived_from) if earlier else np.full(n, -1)
    fresh = earlier_row < 0

    def texts_of(rows: np.ndarray) -> Iterator[list[str]]:
        """The texts of `rows` as Python strings, a block at a time (all at once they would take
        several times the column's memory)."""
        for start in range(0, len(rows), TEXT_BLOCK):
            yield derived_from.take(pa.array(rows[start : start + TEXT_BLOCK])).to_pylist()

    retrievable = codes <= MAX_RETRIEVABLE_CODE
    new_rows, kept_rows = np.flatnonzero(retrievable & fresh), np.flatnonzero(retrievable & ~fresh)
    lengths = np.zeros(n, np.int64)
    parts = [context.sentence_key_ids(texts) for texts in texts_of(new_rows)]
    lengths[new_rows] = np.concatenate([np.diff(indptr) for indptr, _ in parts]) if parts else 0
    new_ids = np.concatenate([ids for _, ids in parts]) if parts else np.zeros(0, np.int64)
    if earlier is not None:
        kept_from = earlier_row[kept_rows]
        lengths[kept_rows] = earlier.key_indptr[kept_from + 1] - earlier.key_indptr[kept_from]
    key_indptr = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    key_ids = np.empty(int(key_indptr[-1]), np.int64)
    key_ids[row_entries(key_indptr, new_rows)] = new_ids
    if earlier is not None:
        key_ids[row_entries(key_indptr, kept_rows)] = earlier.key_ids[row_entries(earlier.key_indptr, kept_from)]
    arrays["key_indptr"], arrays["key_ids"] = _narrow(key_indptr), key_ids

    units = codes == TYPE_CODE["S"]
    kinds = np.zeros(n, np.uint8)
    new_units = np.flatnonzero(units & fresh)
    kinds[new_units] = [nlp.value_kinds(text) for texts in texts_of(new_units) for text in texts]
    if earlier is not None:
        kept_units = np.flatnonzero(units & ~fresh)
        kinds[kept_units] = earlier.value_kinds[earlier_row[kept_units]]
    arrays["value_kinds"] = kinds

    named = np.flatnonzero((codes == TYPE_CODE["N"]) | (codes == TYPE_CODE["O"]))
    # per named node, its `name_key` and hash: the earlier build's as stored, else made here
    new_at = np.flatnonzero(fresh[named])
    new_keys = [name_key(name_words(text)) for texts in texts_of(named[new_at]) for text in texts]
    hashes = np.zeros(len(named), np.uint64)
    hashes[new_at] = key_hashes(new_keys)
    source = np.zeros(len(named), np.int64)  # where each key is taken from: 0 "", then new_keys, then stored
    source[new_at] = 1 + np.arange(len(new_at))
    stored = pa.array([], pa.string())
    if earlier is not None:
        kept = np.flatnonzero(~fresh[named])
        positions = earlier.name_key[earlier_row[named[kept]]]
        named_before = positions >= 0
        stored = earlier.name_keys.take(pa.array(positions[named_before]))
        source[kept[named_before]] = 1 + len(new_at) + np.arange(int(named_before.sum()))
        hashes[kept[named_before]] = earlier.name_hash[positions[named_before]]
    keys = pa.concat_arrays([pa.array([""], pa.string()), pa.array(new_keys, pa.string()),
                             stored.cast(pa.string())]).take(pa.array(source))
    names, keys = NameIndex.arrays(keys, hashes, named)
    arrays.update(names)
    tables["name_keys"] = pa.table({"key": keys})
    return arrays, tables, {"sentence_keys": int(len(distinct(key_ids))), "key_ids": KEY_IDS}


def _grid(vectors: np.ndarray, rows: np.ndarray | None = None) -> np.ndarray:
    """`ivf.quantised` of `vectors` (or of its `rows`, gathered a block at a time: no copy of them
    all) held in int16: whole numbers of at most 2048, so the same values in half the memory of
    float32, but for the sign of a zero (a centroid started at a vector keeps no -0.0)."""
    rows = np.arange(len(vectors)) if rows is None else rows
    out = np.empty((len(rows), vectors.shape[1]), np.int16)
    for start in range(0, len(rows), ivf.BLOCK):
        ivf.quantised(vectors[rows[start : start + ivf.BLOCK]], out[start : start + ivf.BLOCK])
    return out


def _nearest_centroid(vectors: np.ndarray, rows: np.ndarray, on_grid: np.ndarray) -> np.ndarray:
    """Each of `rows`' nearest centroid (`ivf.nearest`), its rows put on the grid `GRID_ROWS` at a
    time: the grid of them all would be the last stage's largest array."""
    found = [ivf.nearest(_grid(vectors, rows[start : start + GRID_ROWS]), on_grid, 1)[:, 0]
             for start in range(0, len(rows), GRID_ROWS)]
    return np.concatenate(found) if found else np.zeros(0, np.int32)


def vector_clusters(vectors: np.ndarray, names: list[str], seed: int, centroids: np.ndarray | None = None,
                    known: np.ndarray | None = None, rows: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The clusters the vector side probes in a large build: (unit centroids (c, d) float32, indptr,
    members as positions in `vectors`, or in its `rows` when given), each vector in its nearest
    cluster; order-free, as `ivf.Clusters` is, so the same vectors give the same bytes.
    `centroids`: an earlier build's (an incremental update keeps them, index/anchor.py), else
    trained (`ivf.train`, on the grid of the vectors it draws alone: `ivf.drawn`); `known`:
    with them, per vector its cluster where an earlier build found it (`EarlierText.clusters_of`),
    -1 elsewhere: only the others are scored against every centroid."""
    rows = np.arange(len(vectors)) if rows is None else rows
    if centroids is None:
        hashes = ivf.key_hashes(names, seed)
        n_clusters = ivf.cluster_count(len(rows), ivf.BUCKET)
        drawn = ivf.drawn(hashes, n_clusters)
        on_grid = ivf.train(_grid(vectors, rows[drawn]), hashes[drawn], n_clusters)
        nearest = _nearest_centroid(vectors, rows, on_grid)
    else:
        on_grid = np.asarray(centroids, np.float32) * np.float32(ivf.QUANT)  # exact: they were divided by it
        nearest = np.full(len(rows), -1, np.int64) if known is None else np.array(known, np.int64)
        todo = np.flatnonzero(nearest < 0)
        nearest[todo] = _nearest_centroid(vectors, rows[todo], on_grid)
    clusters = ivf.Clusters(on_grid, nearest[:, None].astype(np.int32), 1)
    indptr, members = clusters.members()
    return (clusters.centroids / np.float32(ivf.QUANT)).astype(np.float32), indptr, members


def prepare(store: Store, nodes: pa.Table, parts: EdgeParts, documents: pa.Table, vectors: np.ndarray,
            similarity_weight: float, seed: int = 42, clustered_from: int | None = None,
            chunks: pa.Table | None = None, centroids: np.ndarray | None = None,
            earlier: EarlierText | None = None) -> dict:
    """Every structure the search reads, each handed to `store` as soon as it is made (a build
    writes it from there instead of holding them all: at a million passages they are gigabytes), and
    what the search needs to know beside them (returned). Made from the final nodes (sorted by id), the edges as their
    `edge_parts` (so the edge table need not be held meanwhile), the documents table, the vectors
    (row i = `vector_row` i; float32, or a build's half-precision rows) and the chunks table (for
    where nodes came from; none: no places). `centroids`: the vector side's clusters to keep
    (`vector_clusters`); `earlier`: an earlier build's text structures, to take for the nodes it
    holds unchanged (`EarlierText`);"""
    meta = {}
    nodes = nodes.combine_chunks()
    n = nodes.num_rows
    codes = type_codes_of(nodes["type"])
    with ThreadPoolExecutor(1) as pool:
        text_part = pool.submit(_text_structures, nodes, codes, earlier)
        store("type_codes", codes)
        tokens = nodes["tokens"].to_numpy()
        store("tokens", tokens.astype(np.uint16 if not len(tokens) or int(tokens.max()) < 2**16 else np.int32))
        vector_row = nodes["vector_row"].to_numpy().astype(np.int32)
        store("vector_of_node", vector_row)
        store("node_text", pa.table({"text": nodes["text"]}))
        store("id_hash", id_hashes(nodes["id"], codes))

        embedded = np.flatnonzero(vector_row >= 0)
        node_of_vector = np.empty(len(embedded), dtype=np.int64)
        node_of_vector[vector_row[embedded]] = embedded
        store("node_of_vector", node_of_vector)
        scanned_rows = np.flatnonzero(np.isin(codes[node_of_vector], [TYPE_CODE[t] for t in SCANNED]))
        store("scanned_rows", scanned_rows)
        if clustered_from is not None and len(scanned_rows) >= clustered_from:
            scanned_nodes = pa.array(node_of_vector[scanned_rows])
            names = nodes["id"].combine_chunks().take(scanned_nodes)
            known = None
            if centroids is not None and earlier is not None:
                texts = nodes["text"].combine_chunks().take(scanned_nodes)
                known = earlier.clusters_of(earlier.rows_of(names, texts), centroids)
            centroids, indptr, members = vector_clusters(vectors, names.to_pylist(), seed, centroids, known,
                                                         scanned_rows)
            store("cluster_centroids", centroids)
            store("cluster_indptr", indptr)
            store("cluster_rows", scanned_rows[members])
            store("cluster_codes", int8_code_rows(vectors, scanned_rows[members]))
            meta["clusters"] = len(centroids)
        else:
            index, scale, error = scan8(np.asarray(vectors[scanned_rows], np.float32))
            store("scan8.faiss", faiss.serialize_index(index).tobytes())
            meta["scan8"] = {"scale": scale, "error": error}

        structural = parts.adjacency(0.0)
        walk = WalkMatrix.from_csr(structural.indptr, structural.indices, structural.data) if similarity_weight == 0 \
            else walk_matrix(parts, similarity_weight)  # weight 0 (the default): the structural edges alone
        for name, array in zip(WALK_ARRAYS, (walk.indptr, walk.indices, walk.weights), strict=True):
            store(name, array)
        meta["walk_similarity_weight"] = float(similarity_weight)
        # the structural edges that end in an A or H node: what an entity or overview leads to
        ends_led = IS_LED[codes[structural.indices]]
        counts = np.bincount(np.repeat(np.arange(n), np.diff(structural.indptr))[ends_led], minlength=n)
        store("leads_rows", np.flatnonzero(counts).astype(np.int32))
        store("leads_indptr", np.r_[0, np.cumsum(counts[counts > 0])].astype(np.int32))
        store("leads_indices", structural.indices[ends_led].astype(np.int32))
        store("unit_chunk", unit_chunks(structural, codes, one_place_chunks(nodes, chunks)))

        doc_indptr, doc_codes, names = document_lists(nodes["doc_ids"], documents)
        store("doc_indptr", _narrow(doc_indptr))
        store("doc_codes", doc_codes)
        store("document_names", pa.table({"path": names}))
        place_indptr, place_rows, place_table = places(nodes, codes, documents, chunks)
        store("place_indptr", _narrow(place_indptr))
        store("place_rows", place_rows)
        store("places", place_table)
        arrays, tables, text_meta = text_part.result()
    for name, value in {**arrays, **tables}.items():
        store(name, value)
    meta.update(text_meta)
    meta["version"] = VERSION
    return meta
