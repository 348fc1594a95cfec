"""Exact updates (`index --exact`): after adding, changing, renaming and deleting documents (alone,
together, and in sequence), `noderag index --exact` on the old workspace yields the same node and
edge tables as indexing the final folder from scratch, pays only for what changed (chunks
decomposed, vectors computed), survives a SIGKILL mid-update, and never retrieves a deleted
document again. Every run here is in exact mode; the default, incremental mode is tested in
test_anchored_updates.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import (
    SAMPLE_CORPUS,
    assert_same_tables,
    build_file,
    copy_corpus,
    copy_workspace,
    noderag,
)
from conftest import index as run_index

from noderag_cli.graph import document_id, entity_id, fixed_width
from noderag_cli.index.stages import STAGE_NAMES as STAGES

NEW_DOCUMENT = """# The Korven Institute

The Korven Institute is a research library in Vessmouth, founded in 1902 by Edda Marrow.
Its reading room holds the papers of the Sound Maritime Society and the logbooks of the Calder Point Shipworks.
Every spring the institute lends its archive to the Vessmouth Lantern Festival.
"""

SECOND_NEW_DOCUMENT = """Harbour Pilots of the Orlen

The pilots of the River Orlen guided ships into Vessmouth harbour until 1931.
Tobias Renning served as their last master pilot before the Great Storm of 1871 was forgotten.
"""

QUESTION = "Who founded the society that awards the Greyling Medal?"


def index(workspace: Path, folder: Path, *extra, **options):
    return run_index(workspace, folder, "--exact", *extra, **options)


def fresh(folder: Path, workspace: Path) -> Path:
    index(workspace, folder)
    return workspace


def stage_info(run) -> dict:
    return {s: run.json()["stages"][s] for s in STAGES}


def vectors_computed(run, stage: str | None = None) -> int:
    """Vectors the run computed (cache misses of the embedding cache) in one stage or in all."""
    stages = run.json()["stages"]
    return sum(stages[s].get("vectors_computed", 0) for s in ([stage] if stage else STAGES))


def embedded_texts(workspace: Path, types: str) -> set[str]:
    nodes = pq.read_table(build_file(workspace, "nodes.parquet"), columns=["type", "text"]).to_pylist()
    return {n["text"] for n in nodes if n["type"] in types}


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new))


def round_one(folder: Path) -> None:
    """Two documents added, one changed, one renamed into another folder, one deleted."""
    (folder / "institutes").mkdir()
    (folder / "institutes" / "korven_institute.md").write_text(NEW_DOCUMENT)
    (folder / "harbour_pilots.txt").write_text(SECOND_NEW_DOCUMENT)
    edit(folder / "history" / "dunholt.txt", "Dunholt", "Dunholt Parva")
    (folder / "places").mkdir()
    shutil.move(folder / "river_orlen.txt", folder / "places" / "river_orlen.txt")
    (folder / "wenna_caddick.txt").unlink()


def round_two(folder: Path) -> None:
    """After round one: the deleted document comes back, an added one changes, the renamed one goes."""
    shutil.copy(SAMPLE_CORPUS / "wenna_caddick.txt", folder / "wenna_caddick.txt")
    edit(folder / "institutes" / "korven_institute.md", "1902", "1904")
    (folder / "places" / "river_orlen.txt").unlink()


@pytest.fixture(scope="session")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(corpus copy, its workspace), built once; tests copy both before changing anything."""
    root = tmp_path_factory.mktemp("base")
    corpus = root / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    return corpus, fresh(corpus, root / "ws")


@pytest.fixture(scope="session")
def round_one_fresh(tmp_path_factory) -> tuple[Path, Path]:
    """The folder after round one, and a workspace built from it from scratch."""
    root = tmp_path_factory.mktemp("round-one")
    corpus = root / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    round_one(corpus)
    return corpus, fresh(corpus, root / "ws")


def working_copy(base, tmp_path) -> tuple[Path, Path]:
    corpus, workspace = base
    shutil.copytree(corpus, tmp_path / "corpus")
    return tmp_path / "corpus", copy_workspace(workspace, tmp_path / "ws")


def test_add_document(base, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    before = embedded_texts(workspace, "TSAHR")
    (corpus / "institutes").mkdir()
    (corpus / "institutes" / "korven_institute.md").write_text(NEW_DOCUMENT)
    run = index(workspace, corpus)
    assert run.json()["documents"] == {"new": 1, "changed": 0, "renamed": 0, "deleted": 0, "unchanged": 17}
    decompose = stage_info(run)["decompose"]
    assert (decompose["decomposed"], decompose["cached"]) == (1, 17)  # only the new chunk is decomposed
    # unchanged nodes are never re-embedded: the vectors computed are those of new T and S texts
    # when units are made, then new A and H texts, and R texts the offline engine reads when it
    # summarises an entity again (R nodes have no vector in the build to recall); the embed stage
    # itself finds every node's vector in memory
    assert 0 < vectors_computed(run, "decompose") <= len(embedded_texts(workspace, "ST") - before)
    assert vectors_computed(run, "embed") == 0
    new_texts = embedded_texts(workspace, "TSAH") - before
    assert vectors_computed(run) <= len(new_texts) + len(embedded_texts(workspace, "R"))
    nodes = pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
    added = document_id("institutes/korven_institute.md")
    assert any(n["type"] == "T" and n["doc_ids"] == [added] for n in nodes)
    assert entity_id("Korven Institute") in {n["id"] for n in nodes}
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))


def test_change_document(base, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    old_units = {n["text"] for n in pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
                 if n["type"] == "S" and document_id("tobias_renning.txt") in n["doc_ids"]}
    edit(corpus / "tobias_renning.txt", "roughly 80% over 2.5 years", "roughly 75% over three years")
    run = index(workspace, corpus)
    assert run.json()["documents"]["changed"] == 1
    assert stage_info(run)["decompose"]["decomposed"] == 1
    nodes = pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
    texts = {n["text"] for n in nodes}
    assert not any("80%" in t for t in texts), "text of the old version survived"
    assert any("75% over three years" in t for t in texts)
    assert entity_id("80%") not in {n["id"] for n in nodes}
    assert old_units - texts  # the old version's units are gone
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))


def test_rename_document_costs_no_decomposition_and_no_vectors(base, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    (corpus / "archive").mkdir()
    shutil.move(corpus / "greyling_medal.md", corpus / "archive" / "greyling_medal.md")
    run = index(workspace, corpus)
    assert run.json()["documents"]["renamed"] == 1
    info = stage_info(run)
    assert info["decompose"]["decomposed"] == 0
    assert vectors_computed(run) == 0
    # the graph's content did not change, only provenance: the content stages are skipped
    assert all(info[s]["skipped"] for s in ("attributes", "communities", "embed")), info
    nodes = pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
    old, new = document_id("greyling_medal.md"), document_id("archive/greyling_medal.md")
    assert not any(old in n["doc_ids"] for n in nodes)
    assert any(new in n["doc_ids"] for n in nodes)
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))


def test_delete_document_removes_everything_derived_from_it(base, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    gone = document_id("greyling_medal.md")
    nodes = pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
    only_there = {n["id"] for n in nodes if n["doc_ids"] == [gone]}
    assert {i[0] for i in only_there} >= {"T", "S", "N", "R"}
    hit = noderag("query", workspace, QUESTION, "--json", "--context-only")
    assert any("greyling_medal.md" in n["documents"] for n in json.loads(hit.stdout)["nodes"])

    (corpus / "greyling_medal.md").unlink()
    run = index(workspace, corpus)
    assert run.json()["documents"]["deleted"] == 1
    nodes = pq.read_table(build_file(workspace, "nodes.parquet")).to_pylist()
    assert not any(gone in n["doc_ids"] for n in nodes)
    ids = {n["id"] for n in nodes}
    assert not only_there & ids, "nodes derived only from the deleted document survived"
    edges = pq.read_table(build_file(workspace, "edges.parquet")).to_pylist()
    assert not any(e["source"] in only_there or e["target"] in only_there for e in edges)
    answer = noderag("query", workspace, QUESTION, "--json", "--context-only")
    assert answer.returncode == 0, answer.stderr
    for node in json.loads(answer.stdout)["nodes"]:
        assert "greyling_medal.md" not in node["documents"], node
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))


def test_sequence_of_changes_equals_fresh_builds(base, round_one_fresh, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    round_one(corpus)
    # the dry run says what will happen and writes nothing
    files_before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in workspace.rglob("*") if p.is_file()}
    plan = noderag("index", workspace, "--input", corpus, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    plan = plan.json()
    assert plan["documents"] == {"new": 2, "changed": 1, "renamed": 1, "deleted": 1, "unchanged": 14, "skipped": 0}
    assert plan["changes"]["renamed"] == ["river_orlen.txt -> places/river_orlen.txt"]
    assert plan["changes"]["deleted"] == ["wenna_caddick.txt"]
    assert plan["chunks"] == {"in_changed_documents": 4, "to_decompose": 3}  # the renamed chunk is cached
    assert plan["stages"]["chunk"] == "run: the input folder changed"
    assert plan["stages"]["decompose"] == "run: its inputs may change (cached work is reused)"
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in workspace.rglob("*") if p.is_file()} == files_before

    run = index(workspace, corpus)
    assert run.json()["documents"] == {k: v for k, v in plan["documents"].items() if k != "skipped"}
    assert stage_info(run)["decompose"]["decomposed"] == 3
    assert_same_tables(workspace, round_one_fresh[1])

    round_two(corpus)
    run = index(workspace, corpus)
    assert run.json()["documents"] == {"new": 1, "changed": 1, "renamed": 0, "deleted": 1, "unchanged": 16}
    # the new document, and wenna_caddick.txt back: the offline engine keeps no decompositions beyond
    # the rows of the current folder's chunks (an LLM engine's replies stay cached: test_llm_incremental)
    assert stage_info(run)["decompose"]["decomposed"] == 2
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))
    statuses = noderag("stats", workspace, "--json").json()["documents"]["by_status"]
    assert statuses == {"indexed": 18}


def test_kill_during_an_update_and_resume(base, round_one_fresh, tmp_path):
    corpus, workspace = working_copy(base, tmp_path)
    round_one(corpus)
    killed = index(workspace, corpus, env={"NODERAG_TEST_KILL_AT": "decompose:15"}, expect=None)  # the cached inputs
    assert killed.returncode == -signal.SIGKILL
    # the previous complete build is untouched and still answers; stats says what is pending
    assert_same_tables(workspace, base[1])
    answer = noderag("query", workspace, QUESTION, "--json", "--context-only")
    assert answer.returncode == 0 and json.loads(answer.stdout)["nodes"]
    listing = {row["path"]: row for row in noderag("stats", workspace, "--json").json()["documents"]["list"]}
    assert listing["institutes/korven_institute.md"]["status"] == "pending"
    assert listing["institutes/korven_institute.md"]["reason"] == "new"
    assert listing["history/dunholt.txt"]["reason"] == "changed"
    assert listing["places/river_orlen.txt"]["reason"] == "renamed from river_orlen.txt"
    assert listing["places/river_orlen.txt"]["chunks_done"] == 1
    assert listing["institutes/korven_institute.md"]["chunks_done"] == 0
    assert listing["wenna_caddick.txt"]["status"] == "pending"
    assert listing["wenna_caddick.txt"]["reason"].startswith("removed from the input")
    assert listing["greyling_medal.md"]["status"] == "indexed"

    killed = index(workspace, corpus, env={"NODERAG_TEST_KILL_AT": "similarity:commit"}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    resumed = index(workspace, corpus)
    info = stage_info(resumed)
    assert all(info[s]["skipped"] for s in STAGES[:-2]) and not info["similarity"]["skipped"]
    assert not info["assemble"]["skipped"]
    assert_same_tables(workspace, round_one_fresh[1])
    assert noderag("stats", workspace, "--json").json()["documents"]["by_status"] == {"indexed": 18}


def test_a_killed_update_resumes_with_the_work_the_last_committed_run_left(base, tmp_path):
    """A stage killed midway leaves the next run what its last committed run left: the decompose
    stage keeps the rows of the unchanged chunks and takes the new chunk's units from the cache,
    where the killed run checkpointed them (then lets them go, as it lets go of those it made); the
    similarity stage searches only the new rows' lists. The resumed update does the work of an
    update never killed, and gives its tables."""
    from noderag_cli.cache import DECOMPOSE, Cache

    def decompositions_cached(workspace: Path) -> int:
        cache = Cache(workspace / "cache.sqlite", read_only=True)
        try:
            return cache.count(DECOMPOSE)
        finally:
            cache.close()

    corpus, workspace = working_copy(base, tmp_path)
    straight = copy_workspace(workspace, tmp_path / "straight")
    assert decompositions_cached(workspace) == 0
    (corpus / "institutes").mkdir()
    (corpus / "institutes" / "korven_institute.md").write_text(NEW_DOCUMENT)
    expected = stage_info(index(straight, corpus))
    killed = index(workspace, corpus, env={"NODERAG_TEST_KILL_AT": "decompose:18"}, expect=None)  # 17 kept, 1 new
    assert killed.returncode == -signal.SIGKILL
    assert decompositions_cached(workspace) == 1
    killed = index(workspace, corpus, env={"NODERAG_TEST_KILL_AT": "similarity:start"}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    resumed = stage_info(index(workspace, corpus))
    decompose = noderag("stats", workspace, "--json").json()["stages"]["decompose"]  # the second run's
    assert (decompose["decomposed"], decompose["cached"]) == (0, 18)
    assert decompositions_cached(workspace) == 0
    assert resumed["similarity"]["rows_searched"] == expected["similarity"]["rows_searched"]
    assert 0 < expected["similarity"]["rows_searched"] < resumed["similarity"]["edges"]
    assert_same_tables(workspace, straight)


def _same_size_edit(path: Path, old: str, new: str) -> None:
    """Change a file's bytes, not its size, and set its modification time back: only its change
    time (and content) tells."""
    assert len(old) == len(new)
    before = path.stat()
    edit(path, old, new)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size and path.stat().st_mtime_ns == before.st_mtime_ns


def test_a_file_unchanged_since_the_last_scan_is_not_read_again(tmp_path, monkeypatch):
    """The scan takes an unchanged file's content hash from the cache (by path, size, times, inode)
    instead of reading it; an edit that keeps the size and the modification time is still read."""
    from noderag_cli.cache import Cache
    from noderag_cli.config import ChunkConfig
    from noderag_cli.index import scan as scanning

    corpus = copy_corpus(tmp_path / "corpus")
    monkeypatch.setattr(scanning, "RECENT_NS", 0)  # the files were written just now
    reads: list[str] = []
    read_text = scanning._read_text
    monkeypatch.setattr(scanning, "_read_text", lambda path, limit: (reads.append(path), read_text(path, limit))[1])
    cache = Cache(tmp_path / "cache.sqlite")
    first = scanning.scan(corpus, ChunkConfig(), memory=cache)
    scanning.remember(cache, first)
    assert len(reads) == len(first) > 10 and all(f.remember_key and f.text for f in first)

    reads.clear()
    second = scanning.scan(corpus, ChunkConfig(), memory=cache)
    assert reads == []
    assert [(f.path, f.content_hash, f.size) for f in second] == [(f.path, f.content_hash, f.size) for f in first]
    assert all(f.deferred and f.text is None for f in second)

    _same_size_edit(corpus / "tobias_renning.txt", "roughly 80%", "roughly 75%")
    third = {f.path: f for f in scanning.scan(corpus, ChunkConfig(), memory=cache)}
    assert reads == [str(corpus / "tobias_renning.txt")]
    assert third["tobias_renning.txt"].content_hash != {f.path: f for f in first}["tobias_renning.txt"].content_hash
    assert "75%" in third["tobias_renning.txt"].text


def test_updates_in_place_with_unread_files_equal_fresh_builds(tmp_path):
    """End to end, files left unread by the scan: an in-place edit that keeps size and modification
    time is found, and a chunk setting change (every document cut again, so the unread files are
    read after all) gives the tables of a fresh build."""
    corpus = copy_corpus(tmp_path / "corpus")
    time.sleep(2.1)  # older than scan.RECENT_NS when first read: the scan remembers them
    workspace = fresh(corpus, tmp_path / "ws")
    _same_size_edit(corpus / "tobias_renning.txt", "roughly 80%", "roughly 75%")
    run = index(workspace, corpus)
    assert run.json()["documents"]["changed"] == 1
    assert_same_tables(workspace, fresh(corpus, tmp_path / "fresh"))

    config = tmp_path / "chunks.yaml"
    config.write_text("chunk: {chunk_tokens: 200, overlap_tokens: 20}\n")
    index(workspace, corpus, "--config", config)
    index(tmp_path / "fresh-200", corpus, "--config", config)
    assert_same_tables(workspace, tmp_path / "fresh-200")


def test_an_update_takes_the_unchanged_nodes_text_structures_from_the_last_build(base, round_one_fresh, tmp_path):
    """The sentence keys, value kinds and name words of a node depend on its text alone, so the
    assemble stage takes them from the last build for the nodes whose text is unchanged: the
    update's files equal a fresh build's, byte for byte, whether the last build's are used or
    found damaged (then everything is derived again)."""
    import numpy as np

    from noderag_cli.generation import Generation
    from noderag_cli.search.prepare import EarlierText, _text_structures, type_codes_of

    structures = [f for f in EarlierText.FILES if f not in ("nodes.parquet", "node_text.arrow")]
    corpus, workspace = working_copy(base, tmp_path)
    last_build = build_file(workspace, "nodes.parquet").parent
    manifest = json.loads((last_build / "manifest.json").read_text())
    earlier = EarlierText.read(Generation(workspace, last_build.name, last_build, manifest))
    assert earlier is not None
    del manifest["query"]["key_ids"]  # a build whose sentence keys were numbered otherwise: read by the search, not reused
    assert EarlierText.read(Generation(workspace, last_build.name, last_build, manifest)) is None
    round_one(corpus)
    index(workspace, corpus)
    for name in structures:
        assert build_file(workspace, name).read_bytes() == build_file(round_one_fresh[1], name).read_bytes(), name
    nodes = pq.read_table(build_file(workspace, "nodes.parquet"))
    rows = earlier.rows_of(nodes["id"].combine_chunks(), nodes["text"].combine_chunks())
    assert (rows >= 0).mean() > 0.8  # most nodes were there unchanged: the cache is what the update used
    taken, derived = (_text_structures(nodes, type_codes_of(nodes["type"]), e) for e in (earlier, None))
    assert all(np.array_equal(taken[0][k], derived[0][k]) for k in derived[0]) and taken[1:] == derived[1:]

    # a damaged file of the last build: not built upon, and the update still equals a fresh build
    corpus, workspace = working_copy(base, tmp_path / "damaged")
    key_ids = build_file(workspace, "key_ids.npy")
    data = bytearray(key_ids.read_bytes())
    data[-1] ^= 0x40
    key_ids.write_bytes(bytes(data))
    round_one(corpus)
    index(workspace, corpus)
    for name in structures:
        assert build_file(workspace, name).read_bytes() == build_file(round_one_fresh[1], name).read_bytes(), name


def test_an_update_aggregates_only_the_changed_rows_into_a_full_aggregations_bytes():
    """`decompose.updated_graph`: the last run's graph, with the rows of two chunks gone and of one
    added, gives the bytes `build_graph` gives from every row (a table read back from parquet, as
    the stage reads it); ids not all of one width fall back to `build_graph`, the same tables."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from noderag_cli import nlp
    from noderag_cli.engines.base import ChunkInput
    from noderag_cli.engines.offline import decompose_chunk
    from noderag_cli.files import parquet_bytes
    from noderag_cli.index import decompose

    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(SAMPLE_CORPUS.glob("*.*")) if p.suffix in {".md", ".txt"}}
    units = {name: (name, decompose_chunk(ChunkInput(chunk_id=name, text=text, title=name)))
             for name, text in texts.items()}
    occurrences, links = decompose.unit_rows(units, nlp.count_tokens)
    gone, added = sorted(texts)[:2], sorted(texts)[-1:]

    def longer(ids):
        return pc.binary_join_element_wise(ids, pa.scalar("x"), "")

    for lengthened in (False, True):  # True: ids of another width, aggregated whole
        if lengthened:
            occurrences = occurrences.set_column(2, "node", longer(occurrences["node"]))
            links = links.set_column(2, "source", longer(links["source"])).set_column(3, "target", longer(links["target"]))

        def rows(names):
            return tuple(t.filter(pc.is_in(t["input"], value_set=pa.array(names))) for t in (occurrences, links))  # noqa: B023

        before = rows([n for n in texts if n not in added])
        last = tuple(pq.read_table(pa.BufferReader(parquet_bytes(t))) for t in decompose.build_graph(*before))
        now, changed = rows([n for n in texts if n not in gone]), rows(gone + added)
        expected = [parquet_bytes(t) for t in decompose.build_graph(*now)]
        assert [parquet_bytes(t) for t in decompose.updated_graph(*now, last, changed)] == expected
        assert len(pc.unique(changed[0]["node"])) < len(pc.unique(now[0]["node"]))  # a part aggregated again
        assert (fixed_width(last[0]["id"]) is None) == lengthened


def test_a_build_aggregates_each_node_and_edge_from_its_shard_into_a_whole_aggregations_bytes(tmp_path):
    """`decompose.Rows.graph`: the rows filed in files by the node they mention and by the first end
    of a link's pair, arriving in pieces and out of order, aggregated a shard at a time, give the
    bytes `build_graph` gives from every row at once."""

    from noderag_cli import nlp
    from noderag_cli.engines.base import ChunkInput
    from noderag_cli.engines.offline import decompose_chunk
    from noderag_cli.files import parquet_bytes
    from noderag_cli.index import decompose

    texts = {p.name: p.read_text(encoding="utf-8") for p in sorted(SAMPLE_CORPUS.glob("*.*")) if p.suffix in {".md", ".txt"}}
    units = {name: (name, decompose_chunk(ChunkInput(chunk_id=name, text=text, title=name)))
             for name, text in texts.items()}
    occurrences, links = decompose.unit_rows(units, nlp.count_tokens)
    rows = decompose.Rows(tmp_path / "spill", (decompose.OCCURRENCE_SCHEMA.empty_table(),
                                               decompose.LINK_SCHEMA.empty_table()), by_end=True)
    for piece in reversed(range(0, max(occurrences.num_rows, links.num_rows), 37)):
        rows.add(occurrences.slice(piece, 37), links.slice(piece, 37))
    rows.flush()
    assert min(len(list(shards.shards())) for shards in rows.by_end) > 4
    expected = [parquet_bytes(t) for t in decompose.build_graph(occurrences, links)]
    assert [parquet_bytes(t) for t in rows.graph()] == expected
    rows.close()


def test_an_update_keeps_the_last_runs_rows_by_input_and_sorts_only_the_fresh_ones(tmp_path):
    """`decompose._kept_rows` and `Rows`: the last run's rows of the inputs still present (taken as
    runs, in several chunks as parquet reads them), with the fresh rows of new inputs that sort
    before, between and after them (filed in shards on disk, in memory without a folder), give the
    table of sorting every row, and the file of a build that kept nothing and got every row fresh
    in another order; the rows of the inputs gone are those left out; no fresh rows leaves the kept
    ones as they are."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from noderag_cli.files import parquet_bytes
    from noderag_cli.index import decompose

    def rows(names: list[str]) -> pa.Table:
        table = {"input": [], "seq": [], "node": [], "text": [], "chunk": [], "tokens": []}
        for name in names:
            for seq in range(1 + len(name) % 3):
                for column, value in zip(table, (name, seq, f"S_{name}{seq}", f"{name} unit {seq}", name, seq + 1),
                                         strict=True):
                    table[column].append(value)
        return pa.table(table, schema=decompose.OCCURRENCE_SCHEMA)

    last_names = [f"b{i:03d}" for i in range(0, 60, 2)]
    present = [n for n in last_names if n not in ("b010", "b012", "b040")]
    fresh_names = ["a000", "b011", "b013", "b041", "c000", "b058x"]
    expected = rows(present + fresh_names).sort_by([("input", "ascending"), ("seq", "ascending")])
    stored = pq.read_table(pa.BufferReader(parquet_bytes(rows(last_names))))
    stored = pa.concat_tables([stored.slice(0, 7), stored.slice(7, 20), stored.slice(27)])  # runs across chunks
    links = decompose.LINK_SCHEMA.empty_table()
    kept, kept_links, known, gone = decompose._kept_rows((stored, links), present + fresh_names)
    assert known == set(present)
    assert set(gone[0]["input"].to_pylist()) == {"b010", "b012", "b040"}
    fresh = rows(fresh_names)
    files = {}
    for folder in (None, tmp_path / "spill"):
        update = decompose.Rows(folder, (kept, kept_links), by_end=False)
        for part in (fresh.slice(5), fresh.slice(0, 5)):  # as workers return them: not in order
            update.add(part, links)
        assert pa.concat_tables(update.in_input_order(0)).equals(expected)
        update.write((tmp_path / "occurrences.parquet", tmp_path / "links.parquet"))
        files[folder] = (tmp_path / "occurrences.parquet").read_bytes()
        assert pq.read_table(tmp_path / "occurrences.parquet").equals(decompose.with_version(expected))
        update.close()
    build = decompose.Rows(tmp_path / "spill", (stored.schema.empty_table(), links), by_end=True)
    everything = rows(present + fresh_names)
    for start in reversed(range(0, everything.num_rows, 4)):  # in another order, in other pieces
        build.add(everything.slice(start, 4), links)
    build.write((tmp_path / "occurrences.parquet", tmp_path / "links.parquet"))
    assert (tmp_path / "occurrences.parquet").read_bytes() == files[None] == files[tmp_path / "spill"]
    assert len(list(build.by_input[0].shards())) > 1  # the rows were sorted a shard at a time
    build.close()
    unchanged = decompose.Rows(None, (kept, kept_links), by_end=False)
    assert pa.concat_tables([kept.schema.empty_table(), *unchanged.in_input_order(0)]).equals(
        expected.filter(pc.is_in(expected["input"], pa.array(present))))
    assert not list(os.scandir(tmp_path / "spill"))  # the shards' files are unlinked as soon as made


def test_an_update_takes_the_last_builds_vectors_back_with_or_without_their_stored_digests(base, tmp_path):
    """The embedder's memory is filled from the last build's vectors by the digests of their texts:
    those the build stores beside them, or, for a build without them (made before builds stored
    them) or whose file of them does not match its manifest, its texts hashed. Either way a renamed
    document costs no vector, and the update's tables are the same."""
    import json

    from noderag_cli.files import file_digest, json_digest
    from noderag_cli.workspace import VECTOR_DIGESTS

    for stored in ("kept", "none", "ids only"):
        corpus, workspace = working_copy(base, tmp_path / stored)
        manifest_path, digests = build_file(workspace, "manifest.json"), build_file(workspace, VECTOR_DIGESTS)
        manifest = json.loads(manifest_path.read_text())
        del manifest["checksum"]
        if stored == "none":  # as an earlier build: no digests file
            del manifest["files"][VECTOR_DIGESTS]
            digests.unlink()
        if stored == "ids only":  # the file of ids alone that an earlier version's embed stage wrote
            ids_only = pq.read_table(digests, columns=["id"])
            digests.unlink()  # a hard link to the embed stage's file: not written through
            pq.write_table(ids_only, digests)
            manifest["files"][VECTOR_DIGESTS] = {"bytes": digests.stat().st_size, "blake2b": file_digest(digests)}
        manifest_path.write_text(json.dumps({**manifest, "checksum": json_digest(manifest)}))
        shutil.move(corpus / "greyling_medal.md", corpus / "greyling_medal_renamed.md")
        run = index(workspace, corpus)
        assert vectors_computed(run) == 0, stored
        assert_same_tables(workspace, fresh(corpus, tmp_path / f"fresh-{stored}"))


def test_the_decomposition_cache_keys_are_the_digests_of_identity_title_and_text():
    """The keys a workspace's cache holds are the digest of [identity, title, text] as json_digest
    writes it: keys made another way would find none of the entries an earlier run paid for."""
    from noderag_cli.files import json_digest
    from noderag_cli.index.decompose import cache_keys

    identity = {"name": "litellm", "model": "m", "sampling": {"temperature": 0.0, "seed": 7}, "prompts": ["é", 1]}
    chunks = [("", ""), ("Title", "text"), ('a "quoted" title', "line\nbreak\ttab \\ back"), ("Zoë", "日本語 ☃ \u2028"),
              ("\x00", "\ud83d\ude00")]
    assert cache_keys(identity, chunks) == [json_digest([identity, title, text]) for title, text in chunks]
    assert cache_keys(identity, iter(chunks)) == cache_keys(identity, chunks)
