"""What each indexing stage reads and writes is declared once, as handles (index/outputs.py): a
stage's inputs are the handles its code reads, the stages its reuse check watches are derived from
them, and a read of a handle a stage did not declare stops the run."""

from __future__ import annotations

import dataclasses
import shutil

import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE_CORPUS, assert_same_tables

from noderag_cli import api
from noderag_cli.graph import merge_edges
from noderag_cli.index import pipeline
from noderag_cli.index.outputs import (
    CHUNK_IDS,
    CHUNKS,
    DECOMPOSE_EDGES,
    DECOMPOSE_NODES,
    EDGE_OUTPUTS,
    LINKS,
    NODE_OUTPUTS,
)
from noderag_cli.index.pipeline import decide, fingerprint
from noderag_cli.index.stages import BY_NAME, STAGES, Stage, UndeclaredInput
from noderag_cli.index.state import StageEntry
from noderag_cli.workspace import EDGES, NODES, Workspace


def test_a_read_the_stage_did_not_declare_stops_the_run(tmp_path, monkeypatch):
    """The text stage reads the chunks; declared without them, its run stops at the read, naming
    the stage and the file, instead of building from a file its reuse check does not watch."""
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    text = BY_NAME["text"]
    without = dataclasses.replace(text, inputs=(DECOMPOSE_NODES,))
    monkeypatch.setattr(pipeline, "STAGES", tuple(without if s is text else s for s in STAGES))
    with pytest.raises(UndeclaredInput, match="stage text reads chunk.chunks.parquet"):
        api.index(tmp_path / "ws", corpus)


def test_the_scanned_files_are_let_go_once_no_stage_left_reads_the_input(tmp_path, monkeypatch):
    """The scan's record of each file (a text file's text with it) is held for the chunk stage, the
    one stage that reads the input folder, and by nothing once it is done: every later stage runs
    without them, and the build is the same."""
    import gc
    import weakref

    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    scanned, alive_after = [], []
    chunk, decompose = BY_NAME["chunk"], BY_NAME["decompose"]

    def chunk_watched(run):
        scanned.extend(weakref.ref(f) for f in run.files)
        return chunk.run(run)

    def decompose_watched(run):
        gc.collect()
        alive_after.extend(ref() for ref in scanned if ref() is not None)
        return decompose.run(run)

    watched = {chunk: dataclasses.replace(chunk, run=chunk_watched),
               decompose: dataclasses.replace(decompose, run=decompose_watched)}
    monkeypatch.setattr(pipeline, "STAGES", tuple(watched.get(s, s) for s in STAGES))
    api.index(tmp_path / "ws", corpus)
    assert len(scanned) == len([p for p in corpus.rglob("*") if p.suffix in (".md", ".txt")]) and alive_after == []
    monkeypatch.undo()
    api.index(tmp_path / "control", corpus)
    assert_same_tables(tmp_path / "ws", tmp_path / "control")


def test_a_new_stage_is_rerun_when_a_file_it_declares_changes_and_only_then(tmp_path):
    """No second list: a stage's declared inputs are what its fingerprint watches, file by file."""
    extra = Stage("extra", lambda run: {}, inputs=(CHUNK_IDS, DECOMPOSE_NODES))
    ws = Workspace(tmp_path / "ws")
    before = {CHUNKS: "c", CHUNK_IDS: "i", DECOMPOSE_NODES: "n", DECOMPOSE_EDGES: "e"}
    entry = StageEntry("done", fingerprint(extra, "s", before, ""), "s", outputs=None)
    assert decide(ws, extra, entry, "s", {**before, CHUNK_IDS: "i2"}, "").reason == "its inputs changed"
    assert decide(ws, extra, entry, "s", {**before, DECOMPOSE_NODES: "n2"}, "").reason == "its inputs changed"
    unread = decide(ws, extra, entry, "s", {**before, CHUNKS: "c2", DECOMPOSE_EDGES: "e2"}, "")
    assert unread.reason != "its inputs changed"  # files of the same stages that it does not read


def test_every_stage_writes_its_edges_merged(built):
    """A stage that reads one edge table takes it as written (`StageRun.edges`), which holds only
    while every stage writes its edges as `merge_edges` leaves them: one row per pair, sorted."""
    ws = Workspace(built)
    for output in EDGE_OUTPUTS:
        table = output.read(ws)
        assert table.num_rows, output
        assert merge_edges([table]).equals(table), output


def test_every_node_and_edge_table_is_embedded_and_assembled():
    """The graph's tables are the outputs named nodes.parquet and edges.parquet of every stage:
    the embed stage reads every node table and assemble every table."""
    declared = [o for stage in STAGES for o in stage.outputs]
    assert set(NODE_OUTPUTS) == {o for o in declared if o.file == NODES}
    assert set(EDGE_OUTPUTS) == {o for o in declared if o.file == EDGES}
    assert set(NODE_OUTPUTS) <= set(BY_NAME["embed"].inputs)
    assert set(NODE_OUTPUTS) | set(EDGE_OUTPUTS) <= set(BY_NAME["assemble"].inputs)
    for stage in STAGES:  # an input is some earlier stage's output
        earlier = {o for s in STAGES[:STAGES.index(stage)] for o in s.outputs}
        assert set(stage.inputs) <= earlier, stage.name


def test_stage_edge_tables_merge_as_sorted_tables_into_merge_edges_bytes():
    """`graph.union_of_merged` (how a stage reads several stages' edges): a pair two tables hold is
    one row of their summed weight, or-ed hnsw and the structural kind even when the similarity
    table comes first; a table that is not merge_edges' output (unsorted) or ids of another width
    take merge_edges itself. Every case gives merge_edges' bytes."""
    import pyarrow as pa

    from noderag_cli.files import parquet_bytes
    from noderag_cli.graph import edge_rows, union_of_merged

    def node(i: int, letter: str = "S") -> str:
        return f"{letter}_{i:016x}"

    def rows(pairs, kind, hnsw=False):
        return merge_edges([edge_rows(pa.array([a for a, _ in pairs]), pa.array([b for _, b in pairs]), kind, hnsw)])

    similar = rows([(node(1), node(2)), (node(3), node(4)), (node(2), node(5))], "similarity", hnsw=True)
    structural = rows([(node(1), node(2)), (node(1), node(2)), (node(0), node(7, "T"))], "T-S")
    entities = rows([(node(9, "N"), node(3)), (node(2), node(5))], "S-N")
    for tables in ([similar, structural, entities], [structural, similar], [entities, similar]):
        assert parquet_bytes(union_of_merged(tables)) == parquet_bytes(merge_edges(tables))
    both = union_of_merged([similar, structural]).to_pylist()
    assert {"source": node(1), "target": node(2), "kind": "T-S", "weight": 3.0, "hnsw": True} in both
    unsorted = pa.Table.from_pylist(structural.to_pylist()[::-1], schema=structural.schema)
    longer = rows([(node(1) + "x", node(2))], "S-N")
    for tables in ([similar, unsorted], [similar, longer]):
        assert parquet_bytes(union_of_merged(tables)) == parquet_bytes(merge_edges(tables))


def test_the_last_stage_merges_edges_as_node_rows_into_the_same_table_and_search_parts():
    """`graph.EdgeArrays` (how the last stage holds a build's edges: node rows, not id strings): the
    table it makes has `union_of_merged`'s bytes, by the merge of rows and by the fallback (a
    table not sorted), and the search's adjacency (`edge_parts_of`) equals the one made from that
    table; an end that is not a node is refused."""
    import numpy as np
    import pyarrow as pa

    from noderag_cli.files import parquet_bytes
    from noderag_cli.graph import EdgeArrays, edge_rows, union_of_merged
    from noderag_cli.search.prepare import edge_parts, edge_parts_of

    ids = sorted(f"{letter}_{i * 7919:016x}" for letter in "NST" for i in range(12))
    rng = np.random.default_rng(9)

    def rows(kind, count, hnsw=False):
        pairs = rng.integers(0, len(ids), (count, 2))
        pairs = pairs[pairs[:, 0] != pairs[:, 1]]
        return merge_edges([edge_rows(pa.array([ids[a] for a in pairs[:, 0]]), pa.array([ids[b] for b in pairs[:, 1]]),
                                      kind, hnsw)])

    similar, structural, entities = rows("similarity", 60, hnsw=True), rows("T-S", 40), rows("S-N", 30)
    unsorted = pa.Table.from_pylist(structural.to_pylist()[::-1], schema=structural.schema)
    nodes = pa.table({"id": pa.array(ids)})
    for tables in ([similar, structural, entities], [entities, similar], [similar, unsorted]):
        merged = EdgeArrays.union(tables, pa.array(ids))
        expected = union_of_merged(tables)
        assert parquet_bytes(merged.table(pa.array(ids))) == parquet_bytes(expected)
        by_rows, by_table = edge_parts_of(len(ids), merged), edge_parts(nodes, expected)
        for name in ("indptr", "indices", "structural", "similar"):
            assert np.array_equal(getattr(by_rows, name), getattr(by_table, name)), name
    with pytest.raises(ValueError, match="not in the node table"):
        EdgeArrays.union([similar, structural], pa.array(ids[1:]))


def test_node_rows_are_found_by_number_within_each_type_as_hashing_the_strings_finds_them(monkeypatch):
    """`graph.IdRows` (how the graph-wide stages turn edge ends into node rows): the same rows as
    Arrow's `index_in` of the strings, -1 for an id the nodes lack, across types whose numbers
    overlap; and None (the caller then hashes the strings) for nodes not sorted by id or ids of
    another form. `csr_entries` gives the same arrays either way."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    from noderag_cli import graph
    from noderag_cli.graph import IdRows, csr_entries

    def rows_in(ids, wanted):  # None where the binary search does not apply
        lookup = IdRows.of(ids)
        return None if lookup is None else lookup.rows(wanted)

    monkeypatch.setattr(graph, "ROWS_BLOCK", 64)  # ids parsed a block at a time: several blocks here
    rng = np.random.default_rng(4)
    numbers = rng.integers(0, 2**63, 300, dtype=np.uint64)
    ids = sorted({f"{letter}_{int(value):016x}" for letter in "NST" for value in numbers[:120]} |
                 {f"S_{int(value):016x}" for value in numbers[120:]})
    column = pa.array(ids)
    near = [f"S_{int(value) + step:016x}" for value in numbers[:40] for step in (-1, 1)]  # between two ids
    wanted = pa.array([ids[i] for i in rng.integers(0, len(ids), 500)] + near + ["S_" + "0" * 16, "S_" + "f" * 16]
                      + ["R_" + ids[0][2:], "N_" + "f" * 16])
    expected = pc.fill_null(pc.index_in(wanted, value_set=column), -1).to_numpy(zero_copy_only=False)
    assert np.array_equal(rows_in(column, wanted), expected) and (expected[-2:] == -1).all()
    in_order = pc.sort_indices(wanted)  # an edge table's first end: searched as it is, not by buckets
    assert np.array_equal(rows_in(column, wanted.take(in_order)), expected[in_order.to_numpy()])
    assert rows_in(pa.array(ids[::-1]), wanted) is None  # not sorted
    assert rows_in(pa.array(ids[:-1] + ["S_" + "g" * 16]), wanted) is None  # not hex
    assert rows_in(column, pa.array(["S_1"])) is None  # another width
    edges = pa.table({"source": pa.array([ids[0], ids[5], ids[9]]), "target": pa.array([ids[3], ids[2], ids[0]]),
                      "weight": pa.array([1.0, 2.0, 3.0], pa.float32())})
    shuffled = pa.array(ids[1:] + ids[:1])  # not sorted: the strings are hashed
    by_number = csr_entries(column, edges)
    by_string = csr_entries(shuffled, edges)
    order = pc.index_in(shuffled, value_set=column).to_numpy()  # row of each shuffled node in `column`
    assert np.array_equal(np.diff(by_number[0])[order], np.diff(by_string[0]))
    with pytest.raises(ValueError, match="not in the node table"):
        csr_entries(pa.array(ids[1:]), edges)


def test_a_merged_edge_tables_adjacency_is_placed_as_the_general_sort_orders_it():
    """`csr_arrays` of a merged edge table (source < target, sorted: every stage's) over nodes in id
    order places each entry (a node's smaller neighbours, then its larger ones) instead of sorting
    them; the same arrays as the sort that takes edges in any order, which the table's rows reversed
    get. Node counts past 65,536 test both halves of the targets' radix sort."""
    import numpy as np
    import pyarrow as pa

    from noderag_cli.graph import csr_arrays, edge_rows, merge_edges

    rng = np.random.default_rng(7)
    for count, edge_count in ((4, 10), (40, 300), (140_000, 200_000)):
        ids = pa.array(sorted({f"{letter}_{int(v):016x}" for letter in "NS"
                               for v in rng.integers(0, 2**63, count // 2, dtype=np.uint64)}))
        ends = rng.integers(0, len(ids), (edge_count, 2))
        ends = ends[ends[:, 0] != ends[:, 1]]
        merged = merge_edges([edge_rows(ids.take(pa.array(ends[:, 0])), ids.take(pa.array(ends[:, 1])), "S-N")])
        merged = merged.set_column(3, "weight", pa.array(rng.random(merged.num_rows).astype(np.float32)))
        placed = csr_arrays(ids, merged)
        sorted_ = csr_arrays(ids, merged.take(pa.array(np.arange(merged.num_rows)[::-1])))
        assert merged.num_rows and all(np.array_equal(a, b) for a, b in zip(placed, sorted_, strict=True))
        assert placed[0][-1] == 2 * merged.num_rows  # each edge seen from both ends
    assert len(ids) > 2**16  # the last graph's targets need both halves


def test_a_stage_reads_back_its_last_tables_read_ahead_and_still_checked(tmp_path, monkeypatch):
    """While the chunk stage runs, the decompose stage's last rows and graph are read and hashed on
    a thread; the stage takes them from there. A damaged one is still refused with a warning naming
    the file: that update decomposes every chunk again and builds the tables of an update of an
    undamaged copy. A stage that reads back a table it did not declare stops the run."""
    from noderag_cli.index import stages

    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    api.index(tmp_path / "ws", corpus)
    shutil.copytree(tmp_path / "ws", tmp_path / "damaged")
    (corpus / "added.md").write_text("# Added\n\nThe Penrake ferry was rebuilt in 1911 at Harlow.\n")
    occurrences = tmp_path / "damaged" / "stages" / "decompose.occurrences.parquet"
    rows = pq.read_table(occurrences)
    pq.write_table(rows.slice(0, rows.num_rows - 1), occurrences)  # a table still, not the one recorded

    read_ahead: list[str] = []
    hashed_by_the_stage: list[str] = []  # read by the stage itself, not ahead
    read_back = stages._read_back

    def counted(path, use_threads=False):
        (hashed_by_the_stage if use_threads else read_ahead).append(path.name)
        return read_back(path, use_threads)

    monkeypatch.setattr(stages, "_read_back", counted)

    class Warnings(stages.Reporter):
        said: list[str] = []

        def warn(self, message: str) -> None:
            self.said.append(message)

    update = api.index(tmp_path / "ws", corpus)
    assert {"decompose.occurrences.parquet", "decompose.links.parquet", "decompose.nodes.parquet",
            "decompose.edges.parquet"} <= set(read_ahead)
    assert not [name for name in hashed_by_the_stage if name.startswith("decompose.")]  # taken, not read again
    assert update.stages["decompose"]["decomposed"] == 1
    damaged = api.index(tmp_path / "damaged", corpus, reporter=Warnings())
    assert [w for w in Warnings.said if "does not match the checksum" in w] == [
        f"workspace file {occurrences} does not match the checksum recorded when it was written: rebuilt, with the "
        "work it holds taken from the cache"]
    assert damaged.stages["decompose"]["decomposed"] == update.stages["decompose"]["cached"] + 1 > 2
    assert_same_tables(tmp_path / "ws", tmp_path / "damaged")

    decompose = BY_NAME["decompose"]
    without = dataclasses.replace(decompose, reads_back=(LINKS.file, NODES, EDGES))
    monkeypatch.setattr(pipeline, "STAGES", tuple(without if s is decompose else s for s in STAGES))
    (corpus / "added.md").write_text("# Added\n\nThe Penrake ferry was rebuilt in 1912 at Harlow.\n")
    with pytest.raises(UndeclaredInput, match="stage decompose reads back its last occurrences"):
        api.index(tmp_path / "ws", corpus)


def test_a_table_kept_as_written_is_the_table_its_file_reads_back(tmp_path, monkeypatch):
    """`files.as_read_back`: a table as `write_parquet`'s file gives it back, to the layout (one
    chunk a column) and the types' inner names (a list's items are "element" in parquet), so a
    stage given it instead of the file computes the same bytes. None past one row group."""
    import pyarrow as pa

    from noderag_cli import files

    schema = pa.schema({"id": pa.string(), "chunk_ids": pa.list_(pa.string()), "n": pa.int32()})
    table = pa.concat_tables([pa.table({"id": ["a", "b"], "chunk_ids": [["x"], ["y", "z"]], "n": [1, 2]}, schema),
                              pa.table({"id": ["c"], "chunk_ids": [[]], "n": [3]}, schema)]).replace_schema_metadata({"k": "v"})
    assert table["chunk_ids"].num_chunks == 2 and table.schema.field("chunk_ids").type.value_field.name == "item"
    files.write_parquet(tmp_path / "t.parquet", table)
    back, kept = pq.read_table(tmp_path / "t.parquet"), files.as_read_back(table)
    assert str(kept.schema) == str(back.schema) and kept.schema.metadata == back.schema.metadata
    assert kept.equals(back) and [c.num_chunks for c in kept.columns] == [c.num_chunks for c in back.columns]
    assert files.parquet_bytes(kept) == files.parquet_bytes(back)
    monkeypatch.setattr(files, "ROW_GROUP", 2)
    assert files.as_read_back(table) is None


def test_a_run_hands_a_stages_tables_to_the_next_stage_without_decoding_them_and_builds_the_same(tmp_path,
                                                                                                monkeypatch):
    """In a run expected to fit its memory, the outputs of a stage that the next stage reads are
    handed on as written: none of them is decoded from its file, while a run whose memory budget
    keeps no table decodes each; both builds are the same."""
    handed_on = {output.path(Workspace(tmp_path)).name for stage, following in zip(STAGES[:-1], STAGES[1:], strict=True)
                 for output in following.inputs if output in stage.outputs}
    corpus = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    decoded: list[str] = []
    read_table = Workspace.read_table

    def counted(self, path, columns=None):
        decoded.append(path.name)
        return read_table(self, path, columns)

    monkeypatch.setattr(Workspace, "read_table", counted)
    tight = tmp_path / "tight.yaml"
    tight.write_text("executor: {memory_mb: 0.001}\n")
    api.index(tmp_path / "decoded", corpus, config_path=tight)
    next_reads = handed_on & set(decoded)  # the tables the next stage reads (not the vectors, a mapped file)
    assert {"chunk.chunks.parquet", "decompose.nodes.parquet", "decompose.edges.parquet",
            "similarity.edges.parquet"} <= next_reads
    decoded.clear()
    api.index(tmp_path / "kept", corpus)
    assert decoded and not next_reads & set(decoded)
    assert_same_tables(tmp_path / "kept", tmp_path / "decoded")
