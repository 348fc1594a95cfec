"""`noderag index` and `noderag stats` end to end on sample_corpus/, through the real CLI.

Covers: the seven node types and every edge kind, the workspace layout, determinism (byte-
identical tables from two builds), stage skipping and re-running on a setting change, resume
after a real SIGKILL at several points, the workspace lock, the embedding-model guard, and
every kind of bad input (one clear line each, no traceback, nothing committed lost).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import (
    SAMPLE_CORPUS,
    assert_one_line_error,
    assert_same_tables,
    build_file,
    copy_workspace,
    index,
    manifest,
    noderag,
    read_bytes,
)

from noderag_cli.graph import EDGE_COLUMNS, EDGE_KINDS, NODE_COLUMNS, entity_id
from noderag_cli.index.stages import STAGE_NAMES as STAGES
from noderag_cli.node_types import NODE_TYPES
from noderag_cli.workspace import Workspace

STRUCTURAL = [k for k in EDGE_KINDS if k != "similarity"]


def without_dac_override() -> list[str]:
    """A command prefix under which permission bits apply: root ignores them unless the
    capabilities that override them are dropped (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: cannot make a file unreadable")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]


# --- a complete build ---------------------------------------------------------------------


def test_all_node_types_and_edge_kinds_present(built):
    nodes = pq.read_table(build_file(built, "nodes.parquet"))
    edges = pq.read_table(build_file(built, "edges.parquet"))
    assert nodes.column_names == NODE_COLUMNS
    assert edges.column_names == EDGE_COLUMNS
    types = nodes["type"].to_pylist()
    for node_type in NODE_TYPES:
        assert types.count(node_type) > 0, f"no {node_type} node"
    kinds = set(edges["kind"].to_pylist())
    assert kinds == set(EDGE_KINDS), f"missing edge kinds: {set(EDGE_KINDS) - kinds}"
    # every edge joins the node types its kind names, and ids are canonical (source < target)
    type_of = dict(zip(nodes["id"].to_pylist(), types, strict=True))
    for row in edges.to_pylist():
        assert row["source"] < row["target"]
        pair = {type_of[row["source"]], type_of[row["target"]]}
        if row["kind"] != "similarity":
            assert pair == set(row["kind"].split("-")), row
        else:
            assert pair <= {"T", "S", "A", "H"} and row["hnsw"], row
    # provenance: every node but O/H keeps chunk ids; every T, S node maps to documents
    for row in nodes.to_pylist():
        assert row["id"].startswith(row["type"] + "_")
        if row["type"] in ("T", "S", "N", "R", "A"):
            assert row["chunk_ids"] and row["doc_ids"], row["id"]
        assert row["tokens"] > 0


def test_node_ids_are_content_hashes_stable_across_runs(built, built_again):
    assert_same_tables(built, built_again)
    assert build_file(built, "vectors.faiss").read_bytes() == build_file(built_again, "vectors.faiss").read_bytes()
    ids = set(pq.read_table(build_file(built, "nodes.parquet"), columns=["id"])["id"].to_pylist())
    assert entity_id("Greyling Medal") in ids  # the id a fresh process computes for the name
    assert entity_id("the Greyling Medal's") == entity_id("greyling  medal")


def test_workspace_layout(built):
    config = yaml.safe_load((built / "config.yaml").read_text())
    assert config["similarity"]["neighbours"] == 64 and config["llm"]["engine"] == "offline"
    assert "api_key" not in json.dumps(config).replace("api_key_env", "")
    state = manifest(built)
    assert state["embedding"] == {"model": "wordllama:l2_supercat:256", "dim": 256,
                                  "vectors": "wordllama:l2_supercat:256:pool-own-tokens:fp16"}
    assert list(state["stages"]) == sorted(STAGES)
    for stage in STAGES:
        entry = state["stages"][stage]
        assert entry["state"] == "done" and len(entry["fingerprint"]) == 32 and len(entry["outputs"]) == 32
    documents = pq.read_table(build_file(built, "documents.parquet"))
    assert documents.equals(pq.read_table(built / "stages" / "chunk.documents.parquet"))  # the latest scan, built
    assert documents.column_names == ["doc_id", "path", "title", "content_hash", "bytes", "status", "reason", "chunks"]
    paths = documents["path"].to_pylist()
    assert "history/dunholt.txt" in paths and "greyling_medal.md" in paths  # recursive, .txt and .md
    assert not any(p.endswith(".jsonl") for p in paths)
    # the faiss index: row i is the node whose vector_row is i, T/S/A/H only
    nodes = pq.read_table(build_file(built, "nodes.parquet")).to_pylist()
    index = faiss.read_index(str(build_file(built, "vectors.faiss")))
    embedded = sorted((n for n in nodes if n["vector_row"] >= 0), key=lambda n: n["vector_row"])
    assert [n["vector_row"] for n in embedded] == list(range(index.ntotal))
    assert {n["type"] for n in embedded} == {"T", "S", "A", "H"}
    assert all(n["vector_row"] == -1 for n in nodes if n["type"] in ("N", "R", "O"))
    stored = index.reconstruct_n(0, index.ntotal)  # half precision (each vector once, at half the bytes of float32)
    assert index.sa_code_size() == 2 * index.d and np.array_equal(stored, stored.astype(np.float16).astype(np.float32))
    log = (built / "noderag.log").read_text()
    assert "stage assemble done" in log and "run finished" in log
    assert not list(built.rglob("*.tmp"))
    # one generation, named by CURRENT; its manifest lists every file in it with size and checksum
    generation = build_file(built, "")
    assert [p.name for p in (built / "generations").iterdir()] == [generation.name]
    listed = json.loads((generation / "manifest.json").read_text())["files"]
    present = {p.name for p in generation.iterdir()} - {"manifest.json", ".readers"}
    assert set(listed) == present and {"nodes.parquet", "edges.parquet", "vectors.faiss", "config.yaml"} <= present
    assert all(listed[name]["bytes"] == (generation / name).stat().st_size for name in listed)
    assert not any((built / name).exists() for name in ("nodes.parquet", "edges.parquet", "vectors.faiss"))


def test_index_prints_progress_and_summary(built):
    text = (built.parent / "index-output.txt").read_text()
    for stage in STAGES:
        assert stage in text
    assert "nodes: T 17" in text and "edges:" in text
    for node_type in NODE_TYPES:
        assert f" {node_type} " in text.split("nodes:")[1]
    assert "documents: 17 new" in text


def test_stats_json_reports_everything(built):
    report = noderag("stats", built, "--json")
    assert report.returncode == 0, report.stderr
    data = report.json()
    nodes = pq.read_table(build_file(built, "nodes.parquet"), columns=["type", "vector_row"])
    edges = pq.read_table(build_file(built, "edges.parquet"), columns=["kind", "hnsw"])
    types = nodes["type"].to_pylist()
    assert data["nodes"] == {t: types.count(t) for t in NODE_TYPES}
    kinds = edges["kind"].to_pylist()
    assert data["edges"]["by_kind"] == {k: kinds.count(k) for k in sorted(EDGE_KINDS)}
    # table 4 of the paper: HNSW edges, other edges and the merged total, separately
    assert data["edges"]["merged_total"] == edges.num_rows
    assert data["edges"]["non_hnsw"] == edges.num_rows - kinds.count("similarity")
    assert data["edges"]["hnsw"] == sum(edges["hnsw"].to_pylist())
    assert data["edges"]["hnsw"] + data["edges"]["non_hnsw"] > data["edges"]["merged_total"]  # some overlap merged
    assert data["vectors"] == {"count": sum(1 for r in nodes["vector_row"].to_pylist() if r >= 0), "dim": 256,
                               "model": "wordllama:l2_supercat:256"}
    assert list(data["stages"]) == list(STAGES)
    assert all(data["stages"][s]["state"] == "done" and data["stages"][s]["seconds"] >= 0 for s in STAGES)
    assert data["generation"] == (built / "CURRENT").read_text().strip()
    assert data["files"][f"generations/{data['generation']}/nodes.parquet"] == build_file(built, "nodes.parquet").stat().st_size
    assert data["documents"]["by_status"] == {"indexed": 17}
    assert "llm" in data and isinstance(data["llm"], dict)


def test_stats_text(built):
    run = noderag("stats", built, "--documents")
    assert run.returncode == 0, run.stderr
    for word in ("non_hnsw", "hnsw", "merged_total", "vectors:", "dimension 256", "history/dunholt.txt", "indexed"):
        assert word in run.stdout
    assert noderag("stats", built.parent / "nowhere").returncode == 3


# --- skipping, re-running, resuming ---------------------------------------------------------


def test_second_run_skips_every_stage(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    before = read_bytes(workspace)
    result = index(workspace, SAMPLE_CORPUS).json()
    assert all(result["stages"][s]["skipped"] for s in STAGES), result["stages"]
    assert result["documents"]["unchanged"] == 17 and result["documents"]["new"] == 0
    assert read_bytes(workspace) == before


def test_changed_setting_reruns_its_stage_and_later_ones(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    config = tmp_path / "m16.yaml"
    config.write_text("similarity:\n  neighbours: 16\n")
    result = index(workspace, SAMPLE_CORPUS, "--config", config).json()
    ran = {s for s in STAGES if not result["stages"][s]["skipped"]}
    assert ran == {"similarity", "assemble"}
    assert yaml.safe_load((workspace / "config.yaml").read_text())["similarity"]["neighbours"] == 16
    assert build_file(workspace, "edges.parquet").read_bytes() != build_file(built, "edges.parquet").read_bytes()

    config.write_text("similarity:\n  neighbours: 16\ngraph:\n  seed: 7\n")
    result = index(workspace, SAMPLE_CORPUS, "--config", config).json()
    ran = {s for s in STAGES if not result["stages"][s]["skipped"]}
    assert {"attributes", "communities", "similarity"} <= ran
    assert not ran & {"chunk", "decompose", "text"}
    # without --config the workspace's own (now seed 7) config is used: nothing to do
    result = index(workspace, SAMPLE_CORPUS).json()
    assert all(result["stages"][s]["skipped"] for s in STAGES)


KILL_POINTS = {
    "decompose:3": "decompose",  # after 3 chunks were decomposed
    "communities:start": "communities",
    "embed:commit": "embed",  # outputs written, manifest not yet updated
    "similarity:commit": "similarity",  # final tables written, manifest not yet updated
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_resume_after_sigkill(point, built, tmp_path):
    workspace = tmp_path / "ws"
    killed = index(workspace, SAMPLE_CORPUS, env={"NODERAG_TEST_KILL_AT": point}, expect=None)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    stage = KILL_POINTS[point]
    state = manifest(workspace)["stages"]
    assert state[stage]["state"] == "running"
    done_before = [s for s in STAGES[: STAGES.index(stage)]]
    assert all(state[s]["state"] == "done" for s in done_before)
    # an unfinished build is not queried as if it were complete
    refused = noderag("query", workspace, "Who founded the Sound Maritime Society?", "--context-only")
    assert refused.returncode == 3
    assert_one_line_error(refused, "did not finish")
    stats = noderag("stats", workspace, "--json").json()
    assert stats["documents"]["by_status"] == {"pending": 17}

    resumed = index(workspace, SAMPLE_CORPUS).json()
    assert all(resumed["stages"][s]["skipped"] for s in done_before), resumed["stages"]
    assert not resumed["stages"][stage]["skipped"]
    assert_same_tables(workspace, built)
    assert noderag("stats", workspace, "--json").json()["documents"]["by_status"] == {"indexed": 17}


# --- the lock and the embedding model -----------------------------------------------------------


def test_second_index_while_one_runs_is_refused(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    before = read_bytes(workspace)
    with Workspace(workspace).lock():
        refused = index(workspace, SAMPLE_CORPUS, expect=3)
        assert_one_line_error(refused, "is being indexed by another run", f"pid {os.getpid()}")
    assert read_bytes(workspace) == before
    # released: the next run goes through
    assert all(v["skipped"] for v in index(workspace, SAMPLE_CORPUS).json()["stages"].values())


def test_lock_of_a_killed_run_does_not_stick(tmp_path):
    workspace = tmp_path / "ws"
    process = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys; from noderag_cli.workspace import Workspace\n"
        f"with Workspace({str(workspace)!r}).lock():\n    os.kill(os.getpid(), signal.SIGKILL)")])
    assert process.wait(60) == -signal.SIGKILL
    assert (workspace / ".lock").is_file()
    with Workspace(workspace).lock():  # the dead holder's flock is gone with its process
        pass


def test_other_embedding_model_is_refused(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    before = read_bytes(workspace)
    config = tmp_path / "dim128.yaml"
    config.write_text("embedding:\n  dim: 128\n")
    refused = index(workspace, SAMPLE_CORPUS, "--config", config, expect=3)
    assert_one_line_error(refused, "wordllama:l2_supercat:256", "wordllama:l2_supercat:128", "new workspace")
    assert read_bytes(workspace) == before
    assert yaml.safe_load((workspace / "config.yaml").read_text())["embedding"]["dim"] == 256


# --- bad input --------------------------------------------------------------------------------


def write_bad_corpus(folder: Path) -> dict[str, str]:
    """Good documents plus one file of each bad kind; returns {path: expected reason fragment}."""
    folder.mkdir()
    shutil.copy(SAMPLE_CORPUS / "greyling_medal.md", folder / "greyling_medal.md")
    shutil.copy(SAMPLE_CORPUS / "sound_maritime_society.txt", folder / "sound_maritime_society.txt")
    (folder / "image.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (folder / "latin1.txt").write_bytes("Caf\u00e9 na pra\u00e7a, \u00e0 beira-mar.".encode("latin-1"))
    (folder / "empty.md").write_bytes(b"")
    (folder / "blank.txt").write_bytes(b"  \n\n\t\n")
    (folder / "one_line.txt").write_bytes(b"lorem ipsum dolor " * 290_000)  # 5.2 MB, no newline
    (folder / "nested").mkdir()
    (folder / "nested" / "loop").symlink_to("..")  # a directory symlink loop
    (folder / "ping.md").symlink_to("pong.md")  # a file symlink loop
    (folder / "pong.md").symlink_to("ping.md")
    (folder / "dangling.txt").symlink_to("missing.txt")
    os.mkfifo(folder / "pipe.txt")
    (folder / os.fsdecode(b"bad-\xff-name.txt")).write_text("A name that is not UTF-8.")
    return {"image.txt": "binary", "latin1.txt": "not valid UTF-8", "empty.md": "empty", "blank.txt": "empty",
            "one_line.txt": "a line of 5,220,000 characters", "ping.md": "unreadable", "pong.md": "unreadable",
            "dangling.txt": "unreadable", "pipe.txt": "not a regular file", "bad-\ufffd-name.txt": "not valid UTF-8"}


def test_progress_on_a_stderr_that_is_not_a_terminal_is_plain_lines(tmp_path):
    """Scripts and CI capture stderr: each stage says when it starts and finishes, in plain lines
    (no bars, no escape codes, no carriage returns), with --json as without; stdout stays JSON."""
    run = noderag("index", tmp_path / "ws", "--input", SAMPLE_CORPUS, "--json")
    assert run.returncode == 0, run.stderr
    run.json()
    assert "\x1b" not in run.stderr and "\r" not in run.stderr
    lines = run.stderr.splitlines()
    for stage in STAGES:
        assert any(line.startswith(f"{stage}: started") for line in lines), (stage, lines)
        finished = [line for line in lines if line.startswith(f"{stage}: finished in ")]
        assert len(finished) == 1 and re.fullmatch(rf"{stage}: finished in [\d.]+ s, peak [\d,]+ MB", finished[0])
    assert lines.index("decompose: started, 17 to do") < lines.index("embed: started")
    assert any(re.fullmatch(r"similarity: started, \d+ to do", line) for line in lines)  # counted in rows


def test_line_progress_counts_at_most_every_few_seconds():
    import io

    from noderag_cli.commands.common import LineReporter

    stream = io.StringIO()
    reporter = LineReporter(stream)
    reporter.stage_started("decompose", 1000)
    for _ in range(999):
        reporter.advance()  # all within far less than PROGRESS_SECONDS: no count lines
    reporter.PROGRESS_SECONDS = 0.0
    reporter.advance()
    reporter.stage_finished("decompose", 1.5, False, peak_mb=4321)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "decompose: started, 1,000 to do" and lines[2] == "decompose: finished in 1.5 s, peak 4,321 MB"
    # what the stage holds: this process's own memory at least, and its children's (workers; here,
    # whatever servers earlier tests of the session left running), no more
    from noderag_cli.executor import tree_resident_mb

    held = re.fullmatch(r"decompose: 1,000 of 1,000 done, ([\d,]+) MB in memory", lines[1])
    own_mb = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6
    assert held and own_mb * 0.5 - 50 < int(held[1].replace(",", "")) < tree_resident_mb() * 1.5 + 50
    assert len(lines) == 3


def test_bad_files_are_skipped_with_one_line_each(tmp_path):
    folder = tmp_path / "corpus"
    expected = write_bad_corpus(folder)
    unreadable = folder / "locked.txt"
    unreadable.write_text("Nobody may read this file.")
    unreadable.chmod(0)
    expected["locked.txt"] = "Permission denied"
    workspace = tmp_path / "ws"
    run = noderag("index", workspace, "--input", folder, "--json", prefix=without_dac_override())
    assert run.returncode == 0, run.stderr
    assert "Traceback" not in run.stderr
    summary = run.json()
    skipped = {item["path"]: item["reason"] for item in summary["skipped_files"]}
    assert set(skipped) == set(expected), skipped
    for path, fragment in expected.items():
        assert fragment in skipped[path], (path, skipped[path])
        lines = [line for line in run.stderr.splitlines() if line.startswith(f"warning: skipped {path}:")]
        assert len(lines) == 1, (path, run.stderr)
    assert summary["documents"]["new"] == 2
    assert summary["nodes"]["T"] >= 2
    listing = noderag("stats", workspace, "--json").json()["documents"]
    assert listing["by_status"] == {"indexed": 2, "skipped": len(expected)}
    statuses = {row["path"]: (row["status"], row["reason"]) for row in listing["list"]}
    assert statuses["latin1.txt"][0] == "skipped" and "UTF-8" in statuses["latin1.txt"][1]
    assert statuses["greyling_medal.md"] == ("indexed", "")


def test_input_folder_problems_stop_cleanly_and_keep_the_workspace(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    before = {**read_bytes(workspace), **read_bytes(workspace, ["manifest.json", "stages/chunk.documents.parquet"])}
    only_bad = tmp_path / "only-bad"
    only_bad.mkdir()
    (only_bad / "image.md").write_bytes(b"\x00\x01\x02")
    empty = tmp_path / "empty"
    empty.mkdir()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a folder")
    cases = [(tmp_path / "missing", "input folder not found"), (a_file, "input is not a folder"),
             (empty, "no readable"), (only_bad, "no readable")]
    for folder, message in cases:
        run = index(workspace, folder, expect=2)
        assert_one_line_error(run, message)
    assert {**read_bytes(workspace), **read_bytes(workspace, ["manifest.json", "stages/chunk.documents.parquet"])} == before
    answer = noderag("query", workspace, "Who founded the Sound Maritime Society?", "--context-only", "--json")
    assert answer.returncode == 0 and json.loads(answer.stdout)["nodes"]


def test_unreadable_input_folder(tmp_path):
    folder = tmp_path / "locked"
    folder.mkdir()
    (folder / "a.txt").write_text("Some text in a locked folder.")
    folder.chmod(0)
    try:
        run = noderag("index", tmp_path / "ws", "--input", folder, prefix=without_dac_override())
    finally:
        folder.chmod(0o755)
    assert run.returncode == 2
    assert_one_line_error(run, "input folder is not readable")
    assert not (tmp_path / "ws").exists()  # nothing created for a run that cannot start


def test_missing_input_creates_no_workspace(tmp_path):
    run = index(tmp_path / "ws", tmp_path / "missing", expect=2)
    assert_one_line_error(run, "input folder not found")
    assert not (tmp_path / "ws").exists()


def test_workspace_path_that_is_a_file(tmp_path):
    target = tmp_path / "ws"
    target.write_text("precious")
    run = index(target, SAMPLE_CORPUS, expect=3)
    assert_one_line_error(run, "exists and is not a folder")
    assert target.read_text() == "precious"


def test_unwritable_workspace(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    before = read_bytes(workspace)
    config = tmp_path / "m8.yaml"
    config.write_text("similarity:\n  neighbours: 8\n")
    for path in [workspace, *workspace.rglob("*")]:
        path.chmod(0o555 if path.is_dir() else 0o444)
    try:
        run = noderag("index", workspace, "--input", SAMPLE_CORPUS, "--config", config,
                      prefix=without_dac_override())
    finally:
        for path in [workspace, *workspace.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
    assert run.returncode == 3, run.stderr
    assert_one_line_error(run, str(workspace))
    assert read_bytes(workspace) == before


def test_config_of_an_older_workspace_still_loads(tmp_path):
    """Workspaces indexed before the exact similarity edges saved an `hnsw` section; it is ignored."""
    from noderag_cli.config import load_config

    path = tmp_path / "config.yaml"
    path.write_text("hnsw: {m: 32, ef_construction: 200, ef_search: 128}\nsearch: {ppr_iterations: 2}\n")
    config = load_config(path)
    assert config.search.ppr_iterations == 2 and config.similarity.neighbours == 64
