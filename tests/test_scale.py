"""Indexing and search built for size, on real workspaces made by the CLI: the clustered
similarity candidates and the clustered vector side (forced on the sample corpus by config),
updates on that path equal to fresh builds, the same tables from one worker as from several, and a
walk that never makes arrays of the graph's size.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE_CORPUS, assert_same_tables, build_file, copy_workspace, index, noderag

from noderag_cli import api, executor, ivf
from noderag_cli.index import similarity_edges as se
from noderag_cli.index.stages import STAGE_NAMES
from noderag_cli.search.ppr import shallow_ppr
from noderag_cli.search.vectors import SCAN8_CANDIDATES

CLUSTERED = "similarity: {exact_below: 0, probes: 4}\nsearch: {clustered_from: 0, vector_probes: 3}\n"


@pytest.fixture(scope="module")
def clustered_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "clustered.yaml"
    path.write_text(CLUSTERED)
    return path


@pytest.fixture(scope="module")
def clustered_build(tmp_path_factory, clustered_config) -> Path:
    workspace = tmp_path_factory.mktemp("clustered") / "ws"
    index(workspace, SAMPLE_CORPUS, "--config", clustered_config)
    return workspace


def test_clustered_candidates_are_the_exact_best_of_the_probed_clusters():
    """Every list is the best k of its probed clusters' members by the grid's exact cosine, ties by
    row; and with every cluster probed it is the exact k nearest of all."""
    rng = np.random.default_rng(7)
    vectors = rng.standard_normal((900, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = np.asarray([f"S_{i:04d}:x" for i in range(len(vectors))], dtype=object)
    k, probes = 8, 3
    lists = se.clustered_lists(keys, vectors, k, seed=1, probes=probes, assign=2)
    grid = ivf.quantised(vectors)
    clusters = ivf.Clusters.build(grid, keys.tolist(), 1, ivf.BUCKET, probes, 2)
    indptr, members = clusters.members()
    for row in range(0, len(vectors), 37):
        own = np.unique(np.concatenate([members[indptr[c] : indptr[c + 1]] for c in clusters.probes[row, :probes]]))
        own = own[own != row]
        scores = (grid[row] @ grid[own].T) / np.float32(ivf.QUANT**2)
        best = own[np.lexsort((own, -scores))][:k]
        assert lists.candidates[row, : len(best)].tolist() == best.tolist()
    everything = se.clustered_lists(keys, vectors, k, seed=1, probes=len(clusters.centroids), assign=2)
    exact = se.neighbour_lists(keys, vectors, k)
    assert np.array_equal(everything.candidates[:, :k], exact.candidates[:, :k])
    assert np.array_equal(everything.kept, exact.kept)


def test_clusters_are_a_function_of_the_set_of_vectors():
    """The same vectors, in another order, give the same centroids and the same clusters."""
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((700, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = [f"T_{i:04d}" for i in range(700)]
    order = rng.permutation(700)
    a = ivf.Clusters.build(ivf.quantised(vectors), keys, 5, 64, 3, 1)
    b = ivf.Clusters.build(ivf.quantised(vectors[order]), [keys[i] for i in order], 5, 64, 3, 1)
    assert np.array_equal(a.centroids, b.centroids)
    assert np.array_equal(a.probes[order], b.probes)


def test_stored_vectors_are_half_precision_and_read_back_exactly(tmp_path):
    """A build's vectors file holds each vector once, in half precision; vectors on the stored grid
    (as the embedder returns them) read back to the same float32 bits, and the mapped view stays
    valid when the caller drops the index that maps it."""
    import gc

    import faiss

    rows = ivf.on_stored_grid(np.random.default_rng(3).standard_normal((300, 16)).astype(np.float32))
    faiss.write_index(ivf.flat_index(rows), str(tmp_path / "v.faiss"))
    assert (tmp_path / "v.faiss").stat().st_size < 300 * 16 * 2 + 200
    assert np.array_equal(ivf.read_flat(tmp_path / "v.faiss"), rows)
    mapped = ivf.stored_vectors(faiss.read_index(str(tmp_path / "v.faiss"), faiss.IO_FLAG_MMAP_IFC))
    gc.collect()
    assert mapped.dtype == np.float16 and np.array_equal(mapped.astype(np.float32), rows)
    # the embed stage adds them a block at a time: the same file as from all the rows at once
    faiss.write_index(ivf.flat_index((rows[i : i + 64] for i in range(0, 300, 64)), 16), str(tmp_path / "b.faiss"))
    assert (tmp_path / "b.faiss").read_bytes() == (tmp_path / "v.faiss").read_bytes()


def test_update_on_the_clustered_path_equals_a_fresh_build(tmp_path, clustered_build, clustered_config):
    """Documents added, changed and deleted on a workspace whose similarity edges and vector side
    come from clusters: the update's tables equal a fresh build's, byte for byte."""
    folder = shutil.copytree(SAMPLE_CORPUS, tmp_path / "docs")
    workspace = copy_workspace(clustered_build, tmp_path / "ws")
    documents = sorted(p for p in folder.rglob("*") if p.suffix in (".md", ".txt"))
    documents[0].unlink()
    documents[1].write_text(documents[1].read_text() + "\n\nThe archive moved to Dunholt in 1977 after the flood.\n")
    (folder / "new.md").write_text("# Calder Point\n\nCalder Point Shipworks built the Orlen ferries in 1911.\n")
    updated = index(workspace, folder, "--config", clustered_config, "--exact")
    assert updated.json()["stages"]["similarity"]["skipped"] is False
    fresh = tmp_path / "fresh"
    index(fresh, folder, "--config", clustered_config)
    assert_same_tables(workspace, fresh)
    assert build_file(workspace, "vectors.faiss").read_bytes() == build_file(fresh, "vectors.faiss").read_bytes()
    for name in ("cluster_centroids.npy", "cluster_rows.npy", "cluster_codes.npy"):
        assert build_file(workspace, name).read_bytes() == build_file(fresh, name).read_bytes()


def test_anchored_clustered_lists_are_maintained_exactly(monkeypatch):
    """Lists kept against an anchor's centroids (an incremental update): the stored lists of the
    last run, with deleted rows dropped and new rows merged in, equal a search of every row against
    the same clusters; only the new rows are searched again, and the centroids are the anchor's.
    The stored probes of the rows kept are those a computation gives, and only the new rows' are
    computed."""
    rng = np.random.default_rng(11)
    centres = rng.standard_normal((12, 24))
    vectors = centres[rng.integers(0, 12, 2400)] + 0.7 * rng.standard_normal((2400, 24))
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)
    names = np.asarray([f"S_{i:05d}" for i in range(len(vectors))], dtype=object)
    k, probes = 8, 3

    def rows(chosen: np.ndarray):
        return se.keys(list(names[chosen]), vectors[chosen]), vectors[chosen]

    first = se.clustered_lists(*rows(np.arange(2000)), k, seed=1, probes=probes, assign=2)
    previous = se.to_table(rows(np.arange(2000))[0], first)
    kept = np.r_[np.flatnonzero(rng.random(2000) > 0.03), np.arange(2000, 2400)]  # 3% deleted, 400 new
    keys, now = rows(kept)
    probed = []
    monkeypatch.setattr(se, "nearest", lambda grid, *a: probed.append(len(grid)) or ivf.nearest(grid, *a))
    maintained = se.clustered_lists(keys, now, k, seed=1, probes=probes, assign=2, centroids=first.centroids,
                                    previous=previous)
    assert probed == [400]
    searched = se.clustered_lists(keys, now, k, seed=1, probes=probes, assign=2, centroids=first.centroids)
    assert probed == [400, len(kept)]
    assert np.array_equal(maintained.probes, searched.probes)
    assert np.array_equal(se.to_table(keys, maintained)["probes"].to_pylist(), searched.probes.tolist())
    older = se.clustered_lists(keys, now, k, seed=1, probes=probes, assign=2, centroids=first.centroids,
                               previous=previous.drop_columns(["probes"]))  # lists stored without probes
    assert probed[-1] == len(kept) and np.array_equal(older.candidates, maintained.candidates)
    assert np.array_equal(maintained.centroids, first.centroids)
    assert np.array_equal(maintained.candidates[:, :k], searched.candidates[:, :k])
    assert np.array_equal(maintained.kept, searched.kept)
    assert maintained.searched == 400 and searched.searched == len(kept)
    retrained = se.clustered_lists(keys, now, k, seed=1, probes=probes, assign=2)
    assert not np.array_equal(retrained.centroids, first.centroids)  # a full build trains them afresh


def test_an_incremental_update_on_the_clustered_path_keeps_the_anchor_clusters(tmp_path, clustered_build,
                                                                               clustered_config):
    """The default update of a clustered workspace keeps the last full build's centroids (the
    similarity lists', the semantic matching's K-means, the search's vector side) and searches only
    the new rows' similarity lists; two updates of copies give the same bytes, and one
    killed after the similarity stage wrote its files resumes to them; `--rebuild` trains every
    centroid again, as a fresh build does."""
    folder = shutil.copytree(SAMPLE_CORPUS, tmp_path / "docs")
    documents = sorted(p for p in folder.rglob("*") if p.suffix in (".md", ".txt"))
    documents[1].write_text(documents[1].read_text() + "\n\nThe archive moved to Dunholt in 1977 after the flood.\n")
    (folder / "new.md").write_text("# Calder Point\n\nCalder Point Shipworks built the Orlen ferries in 1911.\n")
    runs = {}
    for name, env in (("one", None), ("two", None), ("killed", {"NODERAG_TEST_KILL_AT": "similarity:commit"})):
        workspace = copy_workspace(clustered_build, tmp_path / name)
        runs[name] = index(workspace, folder, "--config", clustered_config, env=env, expect=None if env else 0)
    assert runs["killed"].returncode == -signal.SIGKILL
    index(tmp_path / "killed", folder, "--config", clustered_config)
    similarity = runs["one"].json()["stages"]["similarity"]
    vectors = runs["one"].json()["stages"]["embed"]["vectors"]
    assert similarity["update"].startswith("incremental") and 0 < similarity["rows_searched"] < vectors / 4
    for kept in ("similarity_centroids.parquet", "semantic_centroids.parquet", "cluster_centroids.npy"):
        assert build_file(tmp_path / "one", kept).read_bytes() == build_file(clustered_build, kept).read_bytes(), kept
    for other in ("two", "killed"):
        assert_same_tables(tmp_path / "one", tmp_path / other)
    rebuilt = index(tmp_path / "one", folder, "--config", clustered_config, "--rebuild").json()["stages"]
    assert rebuilt["similarity"]["update"].startswith("full build")
    assert rebuilt["similarity"]["rows_searched"] == rebuilt["embed"]["vectors"]
    fresh = tmp_path / "fresh"
    index(fresh, folder, "--config", clustered_config)
    assert_same_tables(tmp_path / "one", fresh)
    for trained in ("similarity_centroids.parquet", "semantic_centroids.parquet", "cluster_centroids.npy"):
        assert build_file(tmp_path / "one", trained).read_bytes() == build_file(fresh, trained).read_bytes(), trained


def test_an_update_takes_unchanged_vectors_clusters_from_the_earlier_build(tmp_path, clustered_build,
                                                                          clustered_config):
    """An incremental update keeps the vector side's centroids; a vector whose node has the same id
    and text as in the earlier build takes its cluster from there instead of being scored against
    every centroid, and the clusters are those scoring every vector gives."""
    from noderag_cli.index.assemble import open_current
    from noderag_cli.search.prepare import EarlierText, vector_clusters
    from noderag_cli.workspace import Workspace

    folder = shutil.copytree(SAMPLE_CORPUS, tmp_path / "docs")
    (folder / "new.md").write_text("# Calder Point\n\nCalder Point Shipworks built the Orlen ferries in 1911.\n")
    workspace = copy_workspace(clustered_build, tmp_path / "ws")
    with open_current(Workspace(workspace)) as before:
        embedded = before.manifest["embedding"]["vectors"]
        earlier = EarlierText.read(before, embedded)
        assert earlier is not None and earlier.cluster_of is not None
        index(workspace, folder, "--config", clustered_config)
        with open_current(Workspace(workspace)) as after:
            nodes = after.table("nodes", ["id", "text"])
            scanned = after.array("node_of_vector")[after.array("scanned_rows")]
            names, texts = nodes["id"].combine_chunks().take(scanned), nodes["text"].combine_chunks().take(scanned)
            centroids = after.array("cluster_centroids")
            known = earlier.clusters_of(earlier.rows_of(names, texts), centroids)
            assert 0 < (known < 0).sum() < len(known) / 4  # the new document's vectors only
            vectors = ivf.read_stored(after.path("vectors.faiss"))[after.array("scanned_rows")]
            _, indptr, members = vector_clusters(vectors, names.to_pylist(), 42, centroids)  # every vector scored
            assert np.array_equal(after.array("cluster_indptr"), indptr)
            assert np.array_equal(after.array("cluster_rows"), after.array("scanned_rows")[members])


def test_a_builds_edge_table_written_a_row_group_at_a_time_is_the_whole_tables_file(tmp_path, monkeypatch):
    """The last stage makes and writes the edge table a row group at a time (`EdgeArrays.tables`,
    `Generation.table_parts`): with row groups small enough that the sample corpus's edges take
    several, the file is the bytes of the whole table written at once, and the build's every other
    file is the default build's."""
    import pyarrow.parquet as pq

    from noderag_cli import files
    from noderag_cli.index import assemble

    api.index(tmp_path / "whole", SAMPLE_CORPUS)
    monkeypatch.setattr(files, "ROW_GROUP", 1000)
    monkeypatch.setattr(assemble, "ROW_GROUP", 1000)
    api.index(tmp_path / "parts", SAMPLE_CORPUS)
    written = build_file(tmp_path / "parts", "edges.parquet")
    assert pq.ParquetFile(written).metadata.num_row_groups >= 3
    edges = pq.read_table(written).combine_chunks()
    assert written.read_bytes() == files.parquet_bytes(edges).to_pybytes()  # the table whole, groups of 1,000
    monkeypatch.undo()
    assert pq.read_table(build_file(tmp_path / "whole", "edges.parquet")).equals(edges)
    for name in ("nodes.parquet", "walk_indices.npy", "node_text.arrow", "vectors.faiss"):
        assert build_file(tmp_path / "parts", name).read_bytes() == build_file(tmp_path / "whole", name).read_bytes()


def test_the_vector_sides_clusters_are_those_of_the_whole_grid_made_a_block_at_a_time(monkeypatch):
    """`vector_clusters` trains on the vectors `ivf.train` draws alone and puts the rest on the grid a
    block at a time: the centroids and members of training and assigning on the grid of them all."""
    from noderag_cli.search import prepare

    rng = np.random.default_rng(11)
    vectors = rng.standard_normal((9000, 16)).astype(np.float32)
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(ivf.STORED_DTYPE)
    rows = np.sort(rng.choice(len(vectors), 7000, replace=False))
    names = [f"S_{i:05x}" for i in rows.tolist()]
    whole = ivf.Clusters.build(prepare._grid(vectors, rows), names, 42, ivf.BUCKET, 1, 1)
    monkeypatch.setattr(prepare, "GRID_ROWS", 1000)
    centroids, indptr, members = prepare.vector_clusters(vectors, names, 42, rows=rows)
    assert len(centroids) == len(whole.centroids) > 20
    assert np.array_equal(centroids, (whole.centroids / np.float32(ivf.QUANT)).astype(np.float32))
    assert [a.tolist() for a in whole.members()] == [indptr.tolist(), members.tolist()]


def test_clustered_vector_side_finds_what_the_scan_finds(clustered_build, tmp_path):
    """With every cluster probed, the clustered vector side returns exactly the scan's top k; with
    a few, each result is a true cosine and a subset of the scan's candidates."""
    with api.open_workspace(clustered_build, compiled=False) as session:
        retriever = session.retriever
        assert retriever.build.vector_side.clusters is not None and not (build_file(clustered_build, "scan8.faiss")).exists()
        count = len(retriever.build.vector_side.clusters[0])
        # more members than the int8 codes pass on to exact rescoring: the codes choose, and must not miss
        assert len(retriever.build.vector_side.clusters[2]) > SCAN8_CANDIDATES + 10
        assert retriever.build.vector_side.clusters[3].dtype == np.int8 and retriever.build.vector_side.clusters[3].shape == (len(retriever.build.vector_side.clusters[2]),
                                                                                          retriever.build.vector_side.vectors.shape[1])
        codes, rows = retriever.build.vector_side.clusters[3], retriever.build.vector_side.clusters[2]
        vectors = retriever.build.vector_side.float_vectors
        scale = 127 / np.abs(vectors[retriever.build.vector_side.scanned_rows]).max()
        assert np.abs(codes.astype(np.float32) / scale - vectors[rows]).max() <= 0.5 / scale + 1e-6
        for question in ("Who founded the Korven Institute?", "Where was the Greyling Medal first awarded?",
                         "Which village were the Penrake brothers born in?", "What happened in the flood?",
                         "Who built the Orlen ferries?", "What does the society award?"):
            query = retriever.embed_question(question)
            everything = retriever.build.vector_side.search(query, 10, ("S", "A", "H"), probes=count)
            flat = retriever.build.vector_side.search(query, 10, ("S", "A", "H"), retriever.build.vector_side.similarities(query))
            assert everything[0].tolist() == flat[0].tolist()
            assert np.allclose(everything[1], flat[1])
            few_rows, few_scores = retriever.build.vector_side.search(query, 10, ("S", "A", "H"), probes=1)
            rows = retriever.build.vector_side.vector_of_node[few_rows]
            assert np.allclose(few_scores, vectors[rows] @ query, atol=1e-6)


def test_one_worker_and_several_give_the_same_tables(tmp_path, built):
    """`executor.workers: 1` (all in one process) against 2 worker processes: the same tables, byte
    for byte. The sample corpus alone is one batch of chunks, which runs in the indexing process
    whatever the workers (`test_work_too_small_for_a_pool_runs_in_this_process`), so the folder here
    is the sample corpus and copies of it, enough chunks to go to the pool."""
    from noderag_cli.executor import POOL_BATCHES_PER_WORKER
    from noderag_cli.index.decompose import BATCH

    one = tmp_path / "one.yaml"
    one.write_text("executor: {workers: 1}\n")
    several = tmp_path / "several.yaml"
    several.write_text("executor: {workers: 2}\n")
    index(tmp_path / "sample", SAMPLE_CORPUS, "--config", several)
    assert_same_tables(tmp_path / "sample", built)

    folder = tmp_path / "copies"
    shutil.copytree(SAMPLE_CORPUS, folder / "original")
    texts = [p for p in SAMPLE_CORPUS.rglob("*") if p.suffix in (".txt", ".md")]
    for copy in range(1, 12):
        for path in texts:
            target = folder / f"copy{copy:02d}" / path.relative_to(SAMPLE_CORPUS)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text(encoding="utf-8") + f"\nThis is copy {copy} of the record.\n",
                              encoding="utf-8")
    index(tmp_path / "a", folder, "--config", one)
    chunks = json.loads(index(tmp_path / "b", folder, "--config", several).stdout)["stages"]["decompose"]["decomposed"]
    assert -(-chunks // BATCH) >= 2 * POOL_BATCHES_PER_WORKER  # batches enough for the 2 workers' pool
    assert_same_tables(tmp_path / "a", tmp_path / "b")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")
def test_work_too_small_for_a_pool_runs_in_this_process():
    """An update of a few documents must not pay for starting worker processes: fewer batches than
    POOL_BATCHES_PER_WORKER per worker run here, more go to the workers. (`readlink /proc/self`
    names the process that ran the batch.)"""
    import os

    from noderag_cli.executor import POOL_BATCHES_PER_WORKER, Executor

    executor = Executor(2)
    try:
        few = executor.map(os.readlink, ["/proc/self"] * (2 * POOL_BATCHES_PER_WORKER - 1))
        many = executor.map(os.readlink, ["/proc/self"] * (2 * POOL_BATCHES_PER_WORKER))
    finally:
        executor.close()
    assert set(few) == {str(os.getpid())}
    assert str(os.getpid()) not in many and len(set(many)) >= 1


def _descendants(root: int) -> set[int]:
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers follow the run through prctl, Linux only")
def test_workers_end_when_the_indexing_process_is_killed(tmp_path):
    """SIGKILL to `noderag index` while its workers decompose: the workers are gone within seconds,
    not left computing batches nobody will read."""
    import os
    import signal
    import subprocess
    import time

    folder = tmp_path / "docs"
    rng = np.random.default_rng(5)
    words = [f"{a}{b}" for a in ("Kor", "Lan", "Mer", "Tav", "Bri") for b in ("ven", "dor", "holt", "wick", "ton")]
    for number in range(3000):
        sentences = [f"{rng.choice(words)} met {rng.choice(words)} at {rng.choice(words)} in {1800 + number % 200}."
                     for _ in range(12)]
        path = folder / f"d{number // 500}" / f"f{number}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(" ".join(sentences))
    (tmp_path / "two.yaml").write_text("executor: {workers: 2}\n")
    process = subprocess.Popen([sys.executable, "-m", "noderag_cli.cli", "index", str(tmp_path / "ws"), "--input",
                                str(folder), "--config", str(tmp_path / "two.yaml")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_descendants(process.pid)) < 3 and time.monotonic() < deadline:  # fork server and 2 workers
            assert process.poll() is None, "the run ended before its workers started"
            time.sleep(0.1)
        workers = _descendants(process.pid)
        assert len(workers) >= 3
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in workers):
        time.sleep(0.2)
    alive = [pid for pid in workers if Path(f"/proc/{pid}").exists()
             and (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"still running after the indexing process was killed: {alive}"


def test_the_walk_matches_a_dense_walk(built):
    """The sparse numpy walk gives the support and mass of the dense walk (P^T x on whole vectors)."""
    with api.open_workspace(built, compiled=False) as session:
        walk = session.retriever.build.walk_matrix(0.0)
        entries = np.array([3, 40, 41], np.int64)
        dense = np.zeros(walk.n)
        dense[entries] = 1 / 3
        p = walk.as_csr()
        for _ in range(3):
            step = np.asarray(p.T @ dense).ravel() * 0.5
            step[entries] += 0.5 / 3
            dense = step
        support, mass = shallow_ppr(walk, entries, 0.5, 3)
        assert support.tolist() == np.flatnonzero(dense > 0).tolist()
        assert np.allclose(mass, dense[support], rtol=1e-12)


def test_the_walk_allocates_nothing_of_the_graphs_size():
    """On a graph of 400,000 nodes (a ring, each node linked to its 2 neighbours on each side), a
    3-step walk from 3 entry points allocates a few kilobytes, not the 3.2 MB of one float per
    node."""
    import tracemalloc

    from noderag_cli.search.ppr import WalkMatrix

    n = 400_000
    offsets = np.array([-2, -1, 1, 2])
    columns = np.sort((np.arange(n)[:, None] + offsets) % n, axis=1).ravel().astype(np.int32)
    walk = WalkMatrix.from_csr(np.arange(0, 4 * n + 1, 4, dtype=np.int64), columns, np.ones(4 * n))
    entries = np.array([10, 5_000, 300_000], np.int64)
    tracemalloc.start()
    try:
        support, mass = shallow_ppr(walk, entries, 0.5, 3)
        numpy_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(support) == 3 * 13 and np.isclose(mass.sum(), 1.0)
    assert numpy_peak < 64 * 1024, numpy_peak


def test_each_stage_reports_its_peak_memory(built):
    """The indexing process's peak resident memory per stage (Linux), in the manifest and --json."""
    import json

    stages = json.loads((built / "manifest.json").read_text())["stages"]
    peaks = [info.get("peak_rss_mb") for info in stages.values()]
    assert all(isinstance(p, int) and 50 < p < 4000 for p in peaks), peaks


PEAK_RSS = ("import resource, subprocess, sys\n"
            "code = subprocess.run(sys.argv[2:]).returncode\n"
            "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))\n"
            "sys.exit(code)\n")


def test_a_gigabyte_file_is_skipped_without_reading_it_into_memory(tmp_path):
    """A 1 GB text file is over chunk.max_file_bytes and skipped with one line; with the limit
    raised, a 1 GB file of NUL bytes is told binary from its first block. Either way the indexing
    process stays far below the file's size (sparse files: no disk is used)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    shutil.copy(SAMPLE_CORPUS / "greyling_medal.md", folder / "greyling_medal.md")
    with open(folder / "huge.txt", "wb") as handle:
        handle.truncate(1 << 30)
    for extra, reason in (((), "larger than chunk.max_file_bytes"), (("--config", "raised"), "binary file")):
        if extra:
            (tmp_path / "raised").write_text("chunk: {max_file_bytes: 2000000000}\n")
            extra = ("--config", str(tmp_path / "raised"))
        peak = tmp_path / "peak"
        run = noderag("index", tmp_path / f"ws{len(extra)}", "--input", folder, "--json", *extra,
                      prefix=[sys.executable, "-c", PEAK_RSS, str(peak)])
        assert run.returncode == 0, run.stderr
        assert any(item["path"] == "huge.txt" and reason in item["reason"] for item in run.json()["skipped_files"])
        assert int(peak.read_text()) < 700 * 1024, f"peak RSS {int(peak.read_text()) // 1024} MB"


def test_clustered_search_is_the_same_compiled_or_not(clustered_build):
    """The compiled int8 scoring of probed members and numpy's give the same estimates, so the
    same rows and cosines, bit for bit, at every number of probes."""
    from noderag_cli.search import kernels
    from noderag_cli.search.vectors import probe_top

    with api.open_workspace(clustered_build, compiled=False) as session:
        side = session.retriever.build.vector_side
        for question in ("Who founded the Korven Institute?", "What happened in the flood?", "Who built the Orlen ferries?"):
            query = session.retriever.embed_question(question)
            for probes in (1, 2, len(side.clusters[0])):
                plain = probe_top(*side.clusters, side.vectors, query, 5, probes)
                compiled = probe_top(*side.clusters, side.vectors, query, 5, probes, kernels)
                assert plain[0].tolist() == compiled[0].tolist()
                assert plain[1].tobytes() == compiled[1].tobytes()


def test_kept_kmeans_centroids_keep_each_unchanged_vector_in_its_cluster():
    """The semantic matching's K-means with an anchor's centroids trains nothing: every vector joins
    its nearest centroid, as the trained ones were assigned, so the vectors of the first run keep
    their clusters beside new ones."""
    from noderag_cli.index.communities import kmeans_labels

    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((900, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    labels, centroids = kmeans_labels(vectors[:800], seed=3)
    assert centroids is not None and len(centroids) == 29  # ceil(sqrt(800))
    again, kept = kmeans_labels(vectors, seed=3, centroids=centroids)
    assert kept is centroids and np.array_equal(again[:800], labels)
    nearest = np.argmax(vectors[800:] @ centroids.T, axis=1)
    assert np.array_equal(again[800:], nearest)


# --- a kill during each graph-wide stage, at a few thousand passages ----------------------------

GRAPH_WIDE_KILLS = {  # a point inside the stage: after n items it reported, or (assemble) before CURRENT moves
    "attributes:20": "attributes", "communities:5": "communities", "similarity:1": "similarity",
    "assemble:publish": "assemble",
}


def _renamed(text: str, copy: int) -> str:
    """The text with each capitalised word made another name for copy `copy` (0: the text itself)."""
    if copy == 0:
        return text
    suffix = "".join("aeiourstln"[int(digit)] for digit in str(copy))
    return re.sub(r"\b([A-Z][a-z]{2,})\b", lambda m: m.group(1) + suffix, text)


@pytest.fixture(scope="module")
def passages_folder(tmp_path_factory) -> Path:
    """About 2,000 passages: the sample corpus's paragraphs, then copies of them under other names."""
    folder = tmp_path_factory.mktemp("passages")
    paragraphs = [part.strip() for path in sorted(SAMPLE_CORPUS.glob("*.*")) if path.suffix in (".txt", ".md")
                  for part in path.read_text().split("\n\n") if len(part.split()) >= 12]
    for number in range(2_000):
        copy, position = divmod(number, len(paragraphs))
        target = folder / f"c{copy:03d}" / f"p{position:03d}.txt"
        target.parent.mkdir(exist_ok=True)
        target.write_text(_renamed(paragraphs[position], copy) + "\n")
    return folder


@pytest.fixture(scope="module")
def passages_build(tmp_path_factory, passages_folder) -> Path:
    workspace = tmp_path_factory.mktemp("passages-build") / "ws"
    index(workspace, passages_folder)
    return workspace


@pytest.mark.parametrize("point", list(GRAPH_WIDE_KILLS))
def test_a_kill_inside_a_graph_wide_stage_resumes_to_the_same_build(point, passages_folder, passages_build, tmp_path):
    """SIGKILL (as the out-of-memory killer sends it) inside each graph-wide stage of a 2,000-passage
    build: the stages before it stay done, and the next run redoes that stage only and gives every
    file of an uninterrupted build's generation (its contents digest covers each file's checksum)."""
    workspace = tmp_path / "ws"
    killed = index(workspace, passages_folder, env={"NODERAG_TEST_KILL_AT": point}, expect=None)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stage = GRAPH_WIDE_KILLS[point]
    stages = json.loads((workspace / "manifest.json").read_text())["stages"]
    assert stages[stage]["state"] == "running"
    resumed = index(workspace, passages_folder).json()["stages"]
    assert all(resumed[s]["skipped"] for s in STAGE_NAMES[: STAGE_NAMES.index(stage)])
    assert not resumed[stage]["skipped"]
    assert_same_tables(workspace, passages_build)
    contents = [json.loads(build_file(w, "manifest.json").read_text())["contents"] for w in (workspace, passages_build)]
    assert contents[0] == contents[1]


def test_a_tiny_memory_budget_spills_the_similarity_arrays_and_builds_the_same_tables(tmp_path, clustered_build,
                                                                                     clustered_config):
    """`executor.memory_mb` far below the clustered similarity search's arrays: they go to memory-mapped
    files under the workspace (the stage says how much), the build's every file is the in-memory
    build's, and no spill file is left behind. The same arrays from the function itself, spilled or not."""
    config = tmp_path / "tiny.yaml"
    config.write_text(CLUSTERED + "executor: {memory_mb: 0.001}\n")
    workspace = tmp_path / "ws"
    run = index(workspace, SAMPLE_CORPUS, "--config", config).json()
    assert run["stages"]["similarity"]["spilled_mb"] > 0
    assert run["stages"]["embed"]["spilled_mb"] > 0  # the vectors the stages before it made, held in files
    unspilled = index(tmp_path / "unspilled", SAMPLE_CORPUS, "--config", clustered_config).json()["stages"]
    assert "spilled_mb" not in unspilled["similarity"] and "spilled_mb" not in unspilled["embed"]  # no budget
    assert_same_tables(workspace, clustered_build)
    contents = [json.loads(build_file(w, "manifest.json").read_text())["contents"] for w in (workspace, clustered_build)]
    assert contents[0] == contents[1]
    assert not (workspace / "stages" / ".spill").exists()
    again = index(workspace, SAMPLE_CORPUS, "--config", clustered_config).json()["stages"]
    assert all(stage["skipped"] for stage in again.values())  # the budget is in no stage's fingerprint

    from noderag_cli.spill import Spill

    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((2000, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    keys = np.asarray([f"S_{i:04d}:x" for i in range(len(vectors))], dtype=object)
    spill = Spill(tmp_path / ".spill", 0.01)
    spilled = se.clustered_lists(keys, vectors, 8, seed=1, probes=3, assign=2, spill=spill)
    held = se.clustered_lists(keys, vectors, 8, seed=1, probes=3, assign=2)
    assert isinstance(spilled.candidates, np.memmap) and spill.spilled > 0
    assert np.array_equal(spilled.candidates, held.candidates) and np.array_equal(spilled.kept, held.kept)
    assert list((tmp_path / ".spill").iterdir()) == []  # mapped, already unlinked
    spill.close()
    assert not (tmp_path / ".spill").exists()


def test_an_embedders_vectors_held_in_files_are_the_vectors_held_in_memory(tmp_path):
    """`VectorMemory.hold_in_files` (a run not expected to fit its budget): the blocks made before
    move to files (a block given whole stays), vectors added after in pieces across blocks come back
    the same as from memory, whatever rows are asked in whatever order, the files are unlinked as
    soon as made, and clearing the memory lets the folder go."""
    from noderag_cli.embeddings import MEMORY_BLOCK, VectorMemory

    rng = np.random.default_rng(5)
    vectors = rng.standard_normal((2 * MEMORY_BLOCK + 999, 8)).astype(np.float16)
    keys = VectorMemory.digests([f"text {i}" for i in range(len(vectors))])
    held, filed = VectorMemory(8), VectorMemory(8)
    given = 1000  # a block given whole first (the last build's mapped vectors), then one made before the files
    for memory in (held, filed):
        memory.add(keys[:given], vectors[:given], whole=True)
        memory.add(keys[given:40_000], vectors[given:40_000])
    filed.hold_in_files(tmp_path / ".spill")  # the block made so far moves to a file; the given one stays
    assert not isinstance(filed._blocks[0], np.memmap) and isinstance(filed._blocks[1], np.memmap)
    for memory in (held, filed):
        for start in range(40_000, len(vectors), 40_000):
            memory.add(keys[start : start + 40_000], vectors[start : start + 40_000])
    assert filed.spilled_mb == round(2 * MEMORY_BLOCK * 8 * 2 / 1e6, 1) and held.spilled_mb == 0  # two made blocks
    assert list((tmp_path / ".spill").iterdir()) == []  # mapped, already unlinked
    asked = rng.permutation(len(vectors))[:50_000]
    for memory in (held, filed):
        assert np.array_equal(memory.take(memory.find(keys[asked])), vectors[asked])
    filed.clear()
    assert not (tmp_path / ".spill").exists()


def test_the_memory_budget_is_a_quarter_of_the_machine_unless_set():
    """`executor.memory_mb: auto` (the default) gives a quarter of the physical memory; a number is
    taken as it is, 0 for no limit; anything else is refused in one line."""
    import os

    from noderag_cli.config import Config, ConfigError, changed
    from noderag_cli.spill import budget_mb

    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e6
    assert Config().executor.memory_mb == "auto" and budget_mb("auto") == pytest.approx(physical / 4)
    assert budget_mb(0) == 0 and budget_mb(256) == 256
    for bad in (-5, "lots", True):
        with pytest.raises(ConfigError, match="must be auto, 0"):
            changed(Config().executor, memory_mb=bad)


def _resident_mb() -> float:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def _freed_after_release(size_mb: int) -> float:
    """Resident MB given back once a touched array of `size_mb` is freed and `release_memory` ran."""
    from noderag_cli.executor import release_memory

    block = np.ones(size_mb * 125_000)  # float64: size_mb MB, every page touched
    holding = _resident_mb()
    del block
    release_memory()
    return holding - _resident_mb()


@pytest.mark.skipif(not Path("/proc/self/statm").is_file() or executor._glibc() is None, reason="glibc on Linux")
def test_an_index_run_keeps_freed_memory_below_its_budget_and_gives_it_back_past_it():
    """Within `keeping_freed_memory`, memory a step frees stays in the process for the next (a page
    the system hands out again costs its zeroing, and in a virtual machine a trip to the host) while
    the process holds less than the budget; past the budget, and after the run, it goes back."""
    with executor.keeping_freed_memory(1_000_000):  # a budget far above this process
        assert _freed_after_release(300) < 50
    assert _freed_after_release(300) > 250  # after the run: given back at once, as before
    with executor.keeping_freed_memory(1):  # a budget this process is already past
        assert _freed_after_release(300) > 250


def test_freed_memory_is_kept_only_by_a_build_expected_to_fit_its_budget():
    """The choice is made from the input's size before the stages: a build whose expected peak,
    kept, is over `executor.memory_mb` gives memory back as before; no limit (0) always keeps."""
    import contextlib

    from noderag_cli.config import Config
    from noderag_cli.executor import KEPT_GROWTH, PEAK_PER_INPUT, keeping_memory_if_it_fits
    from noderag_cli.index.scan import scan

    size = sum(f.size for f in scan(SAMPLE_CORPUS, Config().chunk))
    expected = PEAK_PER_INPUT * KEPT_GROWTH * size / 1e6

    def keeps(memory_mb) -> bool:
        return not isinstance(keeping_memory_if_it_fits(size, memory_mb), contextlib.nullcontext)

    assert keeps(expected * 2) and keeps(0) and keeps("auto")
    assert not keeps(expected / 2)


def test_a_build_expected_to_fit_its_budget_decodes_each_stage_table_once(tmp_path, monkeypatch):
    """A run that keeps what it frees (`executor.memory_fits`) also keeps the stage tables it has
    read while a later stage reads them: the decompose stage's nodes, read by five stages, are
    never decoded (the attributes stage gets them as written, the others as it read them); over the
    budget, once per stage, and by the communities stage twice: the ids and types its graph needs,
    then once Leiden is done the whole table. The tables built are the same."""
    from collections import Counter

    from noderag_cli.config import Config, changed
    from noderag_cli.workspace import Workspace

    reads: Counter = Counter()
    read_table = Workspace.read_table

    def counted(self, path, columns=None):
        reads[path.name] += 1
        return read_table(self, path, columns)

    monkeypatch.setattr(Workspace, "read_table", counted)
    api.index(tmp_path / "kept", SAMPLE_CORPUS)
    kept = dict(reads)
    reads.clear()
    config = Config()
    api.index(tmp_path / "read", SAMPLE_CORPUS, config=config.model_copy(
        update={"executor": changed(config.executor, memory_mb=0.001)}))
    assert "decompose.nodes.parquet" not in kept and reads["decompose.nodes.parquet"] == 6
    assert sum(kept.values()) < sum(reads.values())
    assert_same_tables(tmp_path / "kept", tmp_path / "read")


def test_what_holds_the_spill_folders_name_is_removed_never_followed(tmp_path):
    """A symlink (to a folder outside), a FIFO or a file where the spill folder goes: the name is
    taken back, nothing is written through the link or into the FIFO, and the arrays spill."""
    import os

    from noderag_cli.spill import Spill

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("mine")
    for make in (lambda p: p.symlink_to(outside), os.mkfifo, lambda p: p.write_text("x")):
        folder = tmp_path / "stages" / ".spill"
        folder.parent.mkdir(exist_ok=True)
        make(folder)
        spill = Spill(folder, 0.001)
        array = spill.full((50_000,), 7, np.int32)
        assert isinstance(array, np.memmap) and int(array.sum()) == 350_000
        assert folder.is_dir() and not folder.is_symlink()
        spill.close()
        assert not folder.exists()
    assert [p.name for p in outside.iterdir()] == ["keep.txt"] and (outside / "keep.txt").read_text() == "mine"


def test_spilling_onto_a_full_disk_is_an_error_not_a_crash(tmp_path):
    """A spilled array takes its file's blocks when it is made: no room is an OSError (ENOSPC),
    which `index` reports in one line, never a SIGBUS when a page is first written."""
    import errno
    import os
    import subprocess

    from noderag_cli.spill import Spill

    target = tmp_path / "small"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    try:
        spill = Spill(target / ".spill", 0.001)
        assert spill.empty((100_000,), np.uint8).sum() == 0  # fits: made, and readable
        with pytest.raises(OSError) as raised:
            spill.empty((8_000_000,), np.float32)
        assert raised.value.errno == errno.ENOSPC
        assert list((target / ".spill").iterdir()) == []  # not even the file it could not fill
        spill.close()
    finally:
        subprocess.run(["umount", "-l", str(target)], capture_output=True)


def test_kmeans_trains_on_faiss_own_sample_from_half_precision_rows():
    """Past 256 points per centroid (65,536 vectors) the semantic matching's K-means trains on the
    sample faiss itself draws (`faiss.rand_perm` with the seed), the only rows widened to float32
    with a block at a time for the labels: the centroids and labels of faiss given every vector
    in float32 (it samples the same points), from the half-precision rows the embedder holds."""
    import faiss

    from noderag_cli.index.communities import KMEANS_SAMPLE, kmeans_labels

    rng = np.random.default_rng(8)
    vectors = rng.standard_normal((70_000, 8)).astype(np.float32)
    vectors = (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float16)
    labels, centroids = kmeans_labels(vectors, seed=5)
    k = 265  # ceil(sqrt(70,000)): 67,840 training points of 70,000
    assert centroids.shape == (k, 8) and k * KMEANS_SAMPLE < len(vectors)
    every = faiss.Kmeans(8, k, niter=20, seed=5, spherical=True, min_points_per_centroid=1,
                         max_points_per_centroid=KMEANS_SAMPLE)
    every.train(vectors.astype(np.float32))
    assert np.array_equal(centroids, every.centroids)
    assert np.array_equal(labels, every.index.search(vectors.astype(np.float32), 1)[1].ravel())


def test_the_embedders_memory_holds_vectors_by_digest_in_blocks(monkeypatch):
    """`embeddings.VectorMemory`: rows copied into blocks (here of 7 rows, so additions span
    them) or held as given, found by the digest of their text wherever they lie, -1 for a text
    not held; and an embedder built on it gives the vectors it computes alone, for texts asked
    again, repeated, or taken from an earlier build (`remember`, a text two nodes share once)."""
    from noderag_cli import embeddings
    from noderag_cli.config import EmbeddingConfig

    monkeypatch.setattr(embeddings, "MEMORY_BLOCK", 7)
    memory = embeddings.VectorMemory(4)
    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((30, 4)).astype(np.float16)
    texts = [f"text {i}" for i in range(30)]
    keys = embeddings.VectorMemory.digests(texts)
    memory.add(keys[:5], vectors[:5])
    memory.add(keys[5:12], vectors[5:12], whole=True)
    memory.add(keys[12:30], vectors[12:30])
    assert memory.size == 30 and len(memory._blocks) == 1 + 1 + 3
    rows = memory.find(keys[::-1])
    assert np.array_equal(memory.take(rows), vectors[::-1])
    assert (memory.find(embeddings.VectorMemory.digests(["text 30", ""])) == -1).all()
    more = embeddings.VectorMemory.digests([f"more {i}" for i in range(40)])
    for i in range(40):  # one at a time: some wait unsorted, some are sorted in
        memory.add(more[i : i + 1], vectors[i % 30 : i % 30 + 1])
        assert memory.find(more[i : i + 1])[0] == 30 + i and memory.find(keys[3:4])[0] == 3
    assert memory._recent and len(memory._keys) > 30
    assert np.array_equal(memory.take(memory.find(np.concatenate([more, keys]))),
                          np.concatenate([vectors[np.arange(40) % 30], vectors]))

    alone = embeddings.Embedder(EmbeddingConfig())
    asked = ["a river mill", "the granite chapel", "a river mill", "harbour"]
    expected = np.stack([alone.embed([text])[0] for text in asked])
    embedder = embeddings.Embedder(EmbeddingConfig())
    embedder.embed_ahead(asked[:2])
    assert np.array_equal(embedder.embed(asked), expected) and embedder.computed == 3
    assert embedder.embed(asked, embeddings.STORED_DTYPE).dtype == embeddings.STORED_DTYPE
    earlier = embeddings.Embedder(EmbeddingConfig())
    earlier.remember(embeddings.VectorMemory.digests(["harbour", "a river mill", "harbour"]), expected[[3, 0, 3]])
    assert np.array_equal(earlier.embed(asked), expected) and earlier.computed == 1
