"""Generations: queries during updates, kills anywhere in an update, read-only workspaces, damaged
files, and commands pointed at a folder that is not a workspace.

Every `noderag` here is a real child process; the query loop is a second Python process calling
the API (opening the workspace anew for each question), so a query and an update really overlap.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
    SAMPLE_CORPUS,
    assert_one_line_error,
    assert_same_tables,
    build_file,
    copy_corpus,
    copy_workspace,
    index,
    noderag,
)

from noderag_cli import api

QUESTIONS = [json.loads(line)["question"] for line in (SAMPLE_CORPUS / "questions.jsonl").read_text().splitlines()]
EXTRA = """# The Korven Institute

The Korven Institute is a research library in Vessmouth, founded in 1902 by Edda Marrow.
Its reading room holds the papers of the Sound Maritime Society and the logbooks of the Calder Point Shipworks.
"""


def signature(result) -> list:
    """What a retrieval is, to compare across builds: node ids and scores, exactly."""
    return [(n.id, n.score) for n in result.nodes]


def answers(workspace: Path) -> dict[str, list]:
    with api.open_workspace(workspace, compiled=False) as session:
        return {q: signature(session.retrieve(q)) for q in QUESTIONS}


@pytest.fixture(scope="module")
def second_corpus(tmp_path_factory) -> Path:
    """sample_corpus with one document changed and one added: the other build updates alternate to."""
    folder = copy_corpus(tmp_path_factory.mktemp("second") / "corpus")
    (folder / "institutes").mkdir()
    (folder / "institutes" / "korven_institute.md").write_text(EXTRA)
    dunholt = folder / "history" / "dunholt.txt"
    dunholt.write_text(dunholt.read_text().replace("village", "fishing village", 1))
    return folder


@pytest.fixture(scope="module")
def second_built(second_corpus, tmp_path_factory) -> Path:
    workspace = tmp_path_factory.mktemp("second-built") / "ws"
    index(workspace, second_corpus)
    return workspace


@pytest.fixture(scope="module")
def expected(built, second_built) -> dict[str, list]:
    """Per question, the two results a query may give while the workspace moves between the builds."""
    first, second = answers(built), answers(second_built)
    assert first != second  # the builds differ where the questions look
    return {q: [first[q], second[q]] for q in QUESTIONS}


LOOP = textwrap.dedent("""
    import json, sys, time
    from pathlib import Path
    from noderag_cli import api
    workspace, questions, stop = Path(sys.argv[1]), json.loads(sys.argv[2]), Path(sys.argv[3])
    done = 0
    while not stop.exists() or done < int(sys.argv[4]):
        question = questions[done % len(questions)]
        try:
            with api.open_workspace(workspace, compiled=False) as session:
                result = session.retrieve(question)
                line = {"question": question, "nodes": [[n.id, n.score] for n in result.nodes],
                        "generation": session.generation}
        except Exception as err:  # every failure is reported, none ends the loop
            line = {"question": question, "error": f"{type(err).__name__}: {err}"}
        print(json.dumps(line), flush=True)
        done += 1
""")


def test_queries_during_updates_always_answer_from_a_complete_build(built, second_corpus, expected, tmp_path):
    import threading

    workspace = copy_workspace(built, tmp_path / "ws")
    stop = tmp_path / "stop"
    loop = subprocess.Popen([sys.executable, "-c", LOOP, str(workspace), json.dumps(QUESTIONS), str(stop), "200"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines: list[dict] = []
    reader = threading.Thread(target=lambda: lines.extend(json.loads(line) for line in loop.stdout), daemon=True)
    reader.start()

    def answered(count: int) -> None:
        """Wait until the loop has answered `count` questions in all."""
        deadline = time.monotonic() + 120
        while len(lines) < count and loop.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)

    try:
        answered(1)
        cli_runs = []
        for round_ in range(6):  # six updates, alternating between the two folders
            update = subprocess.Popen([sys.executable, "-m", "noderag_cli.cli", "index", str(workspace), "--input",
                                       str(second_corpus if round_ % 2 == 0 else SAMPLE_CORPUS), "--json",
                                       "--exact"],  # each build then equals one of the two fresh builds
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
            question = QUESTIONS[round_]
            cli_runs.append((question, noderag("query", workspace, question, "--context-only", "--json")))
            out, err = update.communicate(timeout=300)
            assert update.returncode == 0, err
            answered(len(lines) + 5)  # some questions answered from each new build too
        stop.touch()
        loop.wait(timeout=600)
        reader.join(timeout=60)
    finally:
        loop.kill()
    assert len(lines) >= 200, loop.stderr.read()
    failures = [line for line in lines if "error" in line]
    assert not failures, failures[:3]
    for line in lines:
        assert [tuple(pair) for pair in line["nodes"]] in expected[line["question"]], line["question"]
    assert len({line["generation"] for line in lines}) >= 4  # the loop saw the builds come and go
    for question, run in cli_runs:
        assert run.returncode == 0, run.stderr
        got = [(n["id"], n["score"]) for n in run.json()["nodes"]]
        assert got in [[(i, round(s, 8)) for i, s in option] for option in expected[question]]
    # a build a reader still held stays until the next run; then only the current one is left
    again = index(workspace, SAMPLE_CORPUS, "--exact").json()
    assert all(info["skipped"] for info in again["stages"].values())
    assert [p.name for p in (workspace / "generations").iterdir()] == [build_file(workspace, "").name]


def test_an_open_build_is_not_removed_under_its_reader(built, second_corpus, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    first = build_file(workspace, "").name
    with api.open_workspace(workspace, compiled=False) as session:
        before = signature(session.retrieve(QUESTIONS[0]))
        index(workspace, second_corpus)
        assert (workspace / "generations" / first).is_dir()  # held: kept
        assert signature(session.retrieve(QUESTIONS[0])) == before  # still the build it opened
        assert session.generation == first
    index(workspace, SAMPLE_CORPUS)  # nobody holds it now: removed
    assert first not in {p.name for p in (workspace / "generations").iterdir()}


# kill points of an update: the last two stages, and both sides of the swap
UPDATE_KILLS = ["similarity:commit", "assemble:start", "assemble:publish", "assemble:commit"]


@pytest.mark.parametrize("point", UPDATE_KILLS)
def test_sigkill_anywhere_in_an_update(point, built, second_corpus, second_built, expected, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    killed = index(workspace, second_corpus, "--exact", env={"NODERAG_TEST_KILL_AT": point}, expect=None)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    batch = tmp_path / "questions.jsonl"
    batch.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS))
    run = noderag("query", workspace, "--questions", batch, "--context-only")
    assert run.returncode == 0, run.stderr
    for line in run.stdout.splitlines():  # the old build, or the new one once CURRENT names it
        result = json.loads(line)
        got = [(n["id"], n["score"]) for n in result["nodes"]]
        assert got in [[(i, round(s, 8)) for i, s in option] for option in expected[result["question"]]]
    assert len(run.stdout.splitlines()) == len(QUESTIONS)
    new_current = point == "assemble:commit"
    assert_same_tables(workspace, second_built if new_current else built)
    assert noderag("stats", workspace, "--json").returncode == 0
    resumed = index(workspace, second_corpus, "--exact").json()
    assert resumed["stages"]["decompose"]["skipped"]  # finished work is not redone
    assert_same_tables(workspace, second_built)
    assert [p.name for p in (workspace / "generations").iterdir()] == [build_file(workspace, "").name]


@pytest.fixture
def read_only_mount(tmp_path):
    """A tmpfs mounted here, to be remounted read-only; skipped where this process may not mount."""
    target = tmp_path / "mnt"
    target.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(target)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    yield target
    subprocess.run(["umount", "-l", str(target)], capture_output=True)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns) if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def test_a_read_only_workspace_answers_and_is_left_unchanged(built, read_only_mount):
    workspace = read_only_mount / "ws"
    shutil.copytree(built, workspace)
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    before = snapshot(workspace)
    run = noderag("query", workspace, QUESTIONS[0], "--json")
    assert run.returncode == 0, run.stderr
    assert run.json()["nodes"] and run.json()["answer"]
    batch = read_only_mount.parent / "questions.jsonl"
    batch.write_text("\n".join(json.dumps({"question": q}) for q in QUESTIONS))
    assert noderag("query", workspace, "--questions", batch, "--context-only").returncode == 0
    stats = noderag("stats", workspace, "--json", "--verify")
    assert stats.returncode == 0, stats.stderr
    assert stats.json()["verified"]["generation"] == build_file(workspace, "").name
    assert noderag("stats", workspace, "--documents").returncode == 0
    assert snapshot(workspace) == before
    refused = index(workspace, SAMPLE_CORPUS, expect=3)
    assert_one_line_error(refused, "not writable")
    assert snapshot(workspace) == before


def test_query_and_stats_leave_a_document_folder_unchanged(tmp_path):
    folder = copy_corpus(tmp_path / "docs")
    before = snapshot(folder)
    run = noderag("query", folder, QUESTIONS[0])
    assert run.returncode == 3
    assert_one_line_error(run, "not a noderag workspace")
    assert noderag("stats", folder).returncode == 3
    assert noderag("stats", folder, "--verify").returncode == 3
    assert noderag("query", folder / "vessmouth.md", QUESTIONS[0]).returncode == 3
    assert snapshot(folder) == before


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


DAMAGE = {
    "nodes.parquet truncated": ("nodes.parquet", _truncate),
    "edges.parquet emptied": ("edges.parquet", lambda p: p.write_bytes(b"")),
    "vectors.faiss missing": ("vectors.faiss", Path.unlink),
    "vectors.faiss truncated": ("vectors.faiss", _truncate),
    "walk matrix truncated": ("walk_indices.npy", _truncate),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_build_file_is_named_and_index_repairs_it(case, built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    name, damage = DAMAGE[case]
    damage(build_file(workspace, name))
    for command in (["query", workspace, QUESTIONS[0], "--context-only"], ["stats", workspace],
                    ["stats", workspace, "--json"]):
        run = noderag(*command)
        assert run.returncode == 3, (command, run.stdout)
        assert_one_line_error(run, name, "is damaged", "noderag index")
    repaired = index(workspace, SAMPLE_CORPUS).json()
    ran = {s for s, info in repaired["stages"].items() if not info["skipped"]}
    assert ran == {"assemble"}  # nothing before the build is redone
    assert_same_tables(workspace, built)
    assert noderag("query", workspace, QUESTIONS[0], "--context-only").returncode == 0


def test_a_bit_flip_is_found_by_verify_and_repaired_by_index(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    _flip(build_file(workspace, "nodes.parquet"))
    assert noderag("stats", workspace).returncode == 0  # the size is right: only checksums tell
    run = noderag("stats", workspace, "--verify")
    assert run.returncode == 3
    assert_one_line_error(run, "nodes.parquet", "checksum", "noderag index")
    repaired = index(workspace, SAMPLE_CORPUS).json()
    assert {s for s, info in repaired["stages"].items() if not info["skipped"]} == {"assemble"}
    assert_same_tables(workspace, built)
    assert noderag("stats", workspace, "--verify").returncode == 0


def test_a_damaged_pointer_or_stage_file_is_named(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    (workspace / "CURRENT").write_text("../../etc\n")
    run = noderag("query", workspace, QUESTIONS[0], "--context-only")
    assert run.returncode == 3
    assert_one_line_error(run, "CURRENT", "is damaged", "noderag index")
    _truncate(workspace / "stages" / "decompose.nodes.parquet")
    repaired = index(workspace, SAMPLE_CORPUS).json()
    ran = {s for s, info in repaired["stages"].items() if not info["skipped"]}
    assert "decompose" in ran and repaired["stages"]["decompose"]["cached"] == 17  # from the cache
    assert_same_tables(workspace, built)


def _garble_pages(path: Path) -> None:
    """Overwrite the middle third of a database with noise: the size stays right, the b-trees break."""
    data = bytearray(path.read_bytes())
    third = len(data) // 3
    data[third: 2 * third] = bytes((i * 151 + 7) % 256 for i in range(third))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _garble_pages], ids=["truncated", "garbled"])
def test_a_damaged_cache_is_salvaged(damage, built, second_corpus, second_built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    cache = workspace / "cache.sqlite"
    damage(cache)
    if damage is _garble_pages:  # the size is right: only SQLite's own check finds it
        verify = noderag("stats", workspace, "--verify")
        assert verify.returncode == 3
        assert_one_line_error(verify, "cache.sqlite", "is damaged")
    run = index(workspace, second_corpus, "--exact")
    warning = [line for line in run.stderr.splitlines() if "cache.sqlite" in line]
    assert len(warning) == 1 and "was damaged" in warning[0] and "kept" in warning[0], run.stderr
    assert list(workspace.glob("cache.sqlite.damaged-*"))  # kept beside it, under a new name
    assert_same_tables(workspace, second_built)
    assert noderag("stats", workspace, "--verify").returncode == 0
    again = index(workspace, second_corpus, "--exact").json()  # the salvaged cache is a sound one
    assert all(info["skipped"] for info in again["stages"].values())


def test_a_workspace_of_the_older_layout_names_the_command_that_moves_it(built, tmp_path):
    """A workspace written before generations (final tables at the top level) is not read as it is:
    `query` and `stats` say, in one line, which command moves it; that `index` moves it without
    redoing stage work, and then it answers as a fresh build does."""
    workspace = copy_workspace(built, tmp_path / "ws")
    generation = build_file(workspace, "")
    for name in ("nodes.parquet", "edges.parquet", "vectors.faiss", "documents.parquet"):
        shutil.copy(generation / name, workspace / name)
    shutil.copy(generation / "documents.parquet", workspace / "stages" / "similarity.documents.parquet")
    shutil.rmtree(workspace / "generations")
    (workspace / "CURRENT").unlink()
    (workspace / "stages" / "chunk.documents.parquet").unlink()
    state = json.loads((workspace / "manifest.json").read_text())
    del state["stages"]["assemble"]
    del state["checksum"]  # the older layout wrote none
    (workspace / "manifest.json").write_text(json.dumps(state))
    for command in (("query", workspace, "Who founded Vessmouth?"), ("stats", workspace)):
        refused = noderag(*command)
        assert refused.returncode == 3
        assert_one_line_error(refused, "before generations", f"noderag index {workspace} --input")
    moved = index(workspace, SAMPLE_CORPUS).json()
    ran = {s for s, info in moved["stages"].items() if not info["skipped"]}
    assert ran <= {"chunk", "similarity", "assemble"}, ran
    assert_same_tables(workspace, built)
    assert not (workspace / "nodes.parquet").exists()
    assert answers(workspace) == answers(built)


def test_query_during_a_first_build_says_so(tmp_path):
    """Before any build is complete there is nothing to answer from; a query says why, at once: a
    first build still running (the real lock an `index` run holds, taken here), or one that died."""
    import fcntl

    workspace = tmp_path / "ws"
    killed = index(workspace, SAMPLE_CORPUS, env={"NODERAG_TEST_KILL_AT": "decompose:3"}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    died = noderag("query", workspace, QUESTIONS[0], "--context-only")
    assert died.returncode == 3
    assert_one_line_error(died, "did not finish", "noderag index")
    with open(workspace / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        running = noderag("query", workspace, QUESTIONS[0], "--context-only")
    assert running.returncode == 3
    assert_one_line_error(running, "being indexed for the first time")


def test_a_generation_writes_arrays_and_arrow_files_as_numpy_and_arrow_would_and_records_their_checksums(tmp_path):
    """`GenerationWriter` writes an array from its own memory (header, then the array's bytes) and
    an Arrow file straight to disk instead of encoding either in memory first: the files must be
    what `np.save` and Arrow's IPC writer make (the query maps them), for any dtype, shape and
    layout, and the manifest's size and checksum those of the file."""
    import hashlib
    import io

    import numpy as np
    import pyarrow as pa

    from noderag_cli.generation import GenerationWriter

    writer = GenerationWriter(tmp_path / "g", "g")
    arrays = {"small": np.arange(10, dtype=np.uint16), "empty": np.zeros(0, np.int64),
              "matrix": np.random.default_rng(1).random((5, 3)).astype(np.float32),
              "strided": np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]}
    for name, array in arrays.items():
        writer.array(name, array)
        expected = io.BytesIO()
        np.save(expected, np.ascontiguousarray(array), allow_pickle=False)
        assert (tmp_path / "g" / f"{name}.npy").read_bytes() == expected.getvalue(), name
        assert np.array_equal(np.load(tmp_path / "g" / f"{name}.npy"), array)
    table = pa.table({"text": ["a", "bb", None, "ccc"]})
    writer.arrow("texts", table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as ipc:
        ipc.write_table(table)
    assert (tmp_path / "g" / "texts.arrow").read_bytes() == sink.getvalue().to_pybytes()
    for file, info in writer.files.items():
        data = (tmp_path / "g" / file).read_bytes()
        assert info == {"bytes": len(data), "blake2b": hashlib.blake2b(data, digest_size=16).hexdigest()}, file
