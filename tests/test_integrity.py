"""Integrity (issue 27): a damaged workspace file never spreads, paid work is never collected, no
output lands inside a workspace, and every message is one line naming the file and the repair.

The damage matrix damages every kind of file a workspace holds (each stage's outputs, a build's
files, the manifest, CURRENT, the cache) in four ways, and checks that `query` answers from an
intact build or exits 3 with the one line, that `stats --verify` fails, and that `index` then
finishes with tables equal to a fresh build of the same folder."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_same_tables, build_file, copy_workspace, index, noderag

from noderag_cli import api
from noderag_cli.index.stages import STAGES

DOCS = ["greyling_medal.md", "sound_maritime_society.txt", "history/penrake_brothers.md"]
QUESTION = "Who founded the Sound Maritime Society?"


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, Path]:
    """(folder, workspace): three documents of the sample corpus, indexed once (copied by each test)."""
    root = tmp_path_factory.mktemp("integrity")
    folder = root / "docs"
    for name in DOCS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE_CORPUS / name, folder / name)
    api.index(root / "ws", folder)
    with sqlite3.connect(root / "ws" / "cache.sqlite") as db:  # the entries into the file itself, out of the WAL
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return folder, root / "ws"


def _files(ws: Path) -> list[str]:
    """Every kind of file a workspace holds, relative to it: stage outputs, a build's, the rest."""
    generation = "generations/" + (ws / "CURRENT").read_text().strip()
    kinds = [f"stages/{stage.name}.{name}" for stage in STAGES for name in stage.files]
    kinds += [f"{generation}/{p.name}" for p in sorted((ws / generation).iterdir()) if not p.name.startswith(".")]
    return kinds + ["manifest.json", "CURRENT", "cache.sqlite"]


def _damage(path: Path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "truncate":
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])
    else:  # one flipped bit in the middle
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))


def _one_line(run) -> None:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr


def _one_kind_each(files: list[str]) -> list[str]:
    """One file of each kind (by suffix and folder): what truncating, emptying or deleting is tried on."""
    seen, kept = set(), []
    for relative in files:
        kind = (relative.split("/")[0], Path(relative).suffix or relative)
        if kind not in seen:
            seen.add(kind)
            kept.append(relative)
    return kept


@pytest.mark.parametrize("how", ["flip", "truncate", "empty", "delete"])
def test_damage_matrix(small, tmp_path, how):
    """Every file flipped; one of each kind truncated, emptied and deleted. The search, the check and
    the repair run in this process (their exit codes: DamagedError is 3); the one-line messages of
    the CLI are checked on a file of each kind."""
    from noderag_cli.errors import NoderagError

    folder, pristine = small
    files = _files(pristine)
    cases = files if how == "flip" else _one_kind_each(files)
    for number, relative in enumerate(cases):
        ws = copy_workspace(pristine, tmp_path / f"{number}")
        target = ws / relative
        if how == "flip" and target.stat().st_size == 0:
            continue
        _damage(target, how)
        try:
            with api.open_workspace(ws, compiled=False) as session:
                assert session.retrieve(QUESTION).nodes  # answers from an intact build...
        except NoderagError as err:
            assert err.exit_code == 3 and "index" in str(err) and "\n" not in str(err), (relative, err)  # ...or says
        if relative != "cache.sqlite" or how not in ("empty", "delete"):  # an empty or absent cache is a new cache
            with pytest.raises(NoderagError) as found:
                api.stats(ws, verify=True)
            assert found.value.exit_code == 3 and relative.split("/")[-1] in str(found.value), relative
        if relative in _one_kind_each(files)[:3] or relative in ("manifest.json", "CURRENT", "cache.sqlite"):
            verify = noderag("stats", ws, "--verify")
            if verify.returncode:
                _one_line(verify)
        api.index(ws, folder)
        api.stats(ws, verify=True)
        assert_same_tables(ws, pristine)


def test_an_interrupted_llm_run_keeps_what_it_paid_for_through_gc(small, tmp_path):
    from devtools.fault_server import FaultServer, llm_section, task_of

    folder, _ = small
    with FaultServer(default="rich") as server:
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"chunk": {"chunk_tokens": 200},
                                          "llm": {**llm_section(server.url), "timeout_seconds": 10, "retries": 1,
                                                  "concurrency": 1}}))
        ws = tmp_path / "ws"
        killed = index(ws, folder, "--config", config, env={"NODERAG_TEST_KILL_AT": "decompose:4"}, expect=None)
        assert killed.returncode == -9
        paid = len([r for r in server.completions() if task_of(r.body) == "decompose"])
        assert paid >= 4
        dry = noderag("gc", ws, "--dry-run", "--json").json()
        assert dry["cache"]["unfinished"]["paid_replies"] >= 4 and dry["cache"]["removed"] == 0
        report = noderag("gc", ws, "--json").json()
        assert report["cache"]["removed"] == 0 and "did not finish" in report["cache"]["skipped"]
        server.reset()
        index(ws, folder, "--config", config)
        chunks = len(api.Workspace(ws).read_table(ws / "stages" / "chunk.chunks.parquet"))
        asked = len([r for r in server.completions() if task_of(r.body) == "decompose"])
        # the replies stored: at least the 4 the kill waited for (replies still in flight when a process is
        # SIGKILLed are lost with it, however many the transport had sent)
        kept = dry["cache"]["unfinished"]["paid_replies"]
        assert 4 <= kept <= paid and asked == chunks - kept  # what the killed run stored is not asked again
        # and once the user asks, it goes: the count is said first
        killed = index(tmp_path / "again", folder, "--config", config, env={"NODERAG_TEST_KILL_AT": "decompose:2"},
                       expect=None)
        report = noderag("gc", tmp_path / "again", "--include-unfinished", "--json").json()
        assert report["cache"]["removed"] >= 2 and report["cache"]["paid_replies"] >= 2


def test_a_damaged_manifest_is_rebuilt_by_index(small, tmp_path):
    folder, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    text = (ws / "manifest.json").read_text()
    digest = json.loads(text)["stages"]["chunk"]["outputs"]
    (ws / "manifest.json").write_text(text.replace(digest, digest[:-1] + ("0" if digest[-1] != "0" else "1")))
    stats = noderag("stats", ws)
    assert stats.returncode == 3
    _one_line(stats)
    assert "manifest.json is damaged (its checksum of itself differs)" in stats.stderr
    assert f"`noderag index {ws} --input {folder}` rebuilds it" in stats.stderr
    assert noderag("query", ws, QUESTION).returncode == 0  # the build itself is intact
    run = index(ws, folder)
    assert "kept as manifest.json.damaged-" in run.stderr
    assert_same_tables(ws, pristine)
    assert noderag("stats", ws, "--verify").returncode == 0


def test_a_build_of_another_format_is_refused_and_index_writes_one_of_this(small, tmp_path):
    """A build written by a noderag whose build layout differs: query and stats name its manifest
    and the command that repairs it; that `index` publishes a build this noderag reads."""
    from noderag_cli.files import json_digest
    from noderag_cli.generation import GENERATION_VERSION

    folder, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    manifest_path = build_file(ws, "manifest.json")
    manifest = json.loads(manifest_path.read_text())
    manifest.pop("checksum")
    manifest["format"] = GENERATION_VERSION + 1
    manifest["checksum"] = json_digest(manifest)
    manifest_path.write_text(json.dumps(manifest))
    for run in (noderag("query", ws, QUESTION), noderag("stats", ws)):
        assert run.returncode != 0
        _one_line(run)
        assert f"a build of format {GENERATION_VERSION + 1}, this noderag reads {GENERATION_VERSION}" in run.stderr
        assert f"`noderag index {ws} --input {folder}`" in run.stderr
    index(ws, folder)
    assert noderag("query", ws, QUESTION).returncode == 0
    assert_same_tables(ws, pristine)


def test_a_damaged_cache_is_salvaged_by_index(small, tmp_path):
    folder, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    cache = ws / "cache.sqlite"
    data = bytearray(cache.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    for offset in range(page + 8, page + 40):  # the first table page's cell pointers: structure, not a value
        data[offset] ^= 0xFF
    cache.write_bytes(bytes(data))
    verify = noderag("stats", ws, "--verify")
    assert verify.returncode == 3
    _one_line(verify)
    assert "cache.sqlite is damaged" in verify.stderr and f"noderag index {ws} --input {folder}" in verify.stderr
    run = index(ws, folder)
    assert "cache.sqlite was damaged" in run.stderr
    assert noderag("stats", ws, "--verify").returncode == 0
    assert_same_tables(ws, pristine)


def test_a_lost_readers_file_is_made_again(small, tmp_path):
    _, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    readers = ws / "generations" / (ws / "CURRENT").read_text().strip() / ".readers"
    readers.unlink()
    run = noderag("query", ws, QUESTION)
    assert run.returncode == 0, run.stderr
    assert readers.is_file()


def test_a_damaged_build_config_is_named_with_its_repair(small, tmp_path):
    folder, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    config = ws / "generations" / (ws / "CURRENT").read_text().strip() / "config.yaml"
    config.write_text(config.read_text().replace("search:", "search: [", 1))
    run = noderag("query", ws, QUESTION)
    assert run.returncode == 3
    _one_line(run)
    assert "config.yaml is damaged" in run.stderr and f"noderag index {ws} --input {folder}" in run.stderr
    api.index(ws, folder)
    assert noderag("query", ws, QUESTION).returncode == 0


def test_a_lost_current_fails_verify_and_is_named(small, tmp_path):
    folder, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    (ws / "CURRENT").unlink()
    for run in (noderag("stats", ws, "--verify"), noderag("query", ws, QUESTION)):
        assert run.returncode == 3
        _one_line(run)
        assert "CURRENT is damaged (missing" in run.stderr and f"noderag index {ws} --input {folder}" in run.stderr


def test_the_connection_check_is_retried_like_any_request(small, tmp_path):
    from devtools.fault_server import FaultServer, llm_section

    folder, _ = small
    with FaultServer(default="good") as server:
        server.script(["503", "500"], marker="Reply with the word OK")
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10, "retries": 3}}))
        run = noderag("query", small[1], QUESTION, "--config", config)
        assert run.returncode == 0, run.stderr
        checks = [r for r in server.completions() if "Reply with the word OK" in json.dumps(r.body)]
        assert [r.status for r in checks] == [503, 500, 200]


def test_every_429_of_a_run_is_counted_the_connection_checks_too(small, tmp_path):
    from devtools.fault_server import FaultServer, llm_section

    folder, _ = small
    with FaultServer(default="good") as server:
        server.script(["429:1", "429:1"], marker="Reply with the word OK")
        server.script(["429:1", "429:1", "429:1"], marker="Maritime")  # task requests
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10}}))
        run = index(tmp_path / "ws", folder, "--config", config)
        scripted = sum(r.status == 429 for r in server.completions())
    assert scripted == 5
    assert json.loads(run.stdout)["rate_limited"]["waits"] == 5


def test_outputs_never_land_inside_a_workspace(small, tmp_path):
    _, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    build = ws / "generations" / (ws / "CURRENT").read_text().strip()
    for args in (["export", ws, "--out", ws / "CURRENT"], ["export", ws, "--format", "csv", "--out", build / "x"],
                 ["ablate", ws, "--questions", SAMPLE_CORPUS / "questions.jsonl", "--out", build, "--variants",
                  "noderag", "--budgets", "300"]):
        run = noderag(*args)
        assert run.returncode == 2
        _one_line(run)
        assert "inside workspace" in run.stderr
    assert noderag("query", ws, QUESTION).returncode == 0 and noderag("stats", ws, "--verify").returncode == 0


def test_question_files_split_lines_on_newlines_only(small, tmp_path):
    questions = tmp_path / "q.jsonl"
    questions.write_bytes("\ufeff".encode() + json.dumps({"question": "Who\u2028founded the society?"}).encode()
                          + b"\r\n" + json.dumps({"question": "A form\x0cfeed?"}).encode().replace(b"\\f", b"\x0c")
                          + b"\n" + json.dumps({"question": QUESTION}).encode() + b"\n")
    run = noderag("query", small[1], "--questions", questions, "--context-only")
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["line"] for line in lines] == [1, 2, 3]  # three lines, whatever their characters
    assert "error" not in lines[0] and "error" in lines[1] and "error" not in lines[2]
    assert run.returncode == 1


def test_a_folder_nested_a_thousand_deep_is_read(tmp_path):
    folder = tmp_path / "docs"
    deep = str(folder)  # deeper than Python's recursion limit, under PATH_MAX
    for _ in range(990):  # a loop: os.makedirs and Path.mkdir(parents=True) recurse
        os.mkdir(deep)
        deep = os.path.join(deep, "n")
    os.mkdir(deep)
    with open(os.path.join(deep, "deep.md"), "w") as note:
        note.write("# Deep\n\nThe deepest note says the ferry leaves at noon.\n")
    try:
        run = index(tmp_path / "ws", folder)
        assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
        answer = json.loads(noderag("query", tmp_path / "ws", "When does the ferry leave?", "--json").stdout)
        assert "noon" in answer["answer"]
    finally:  # pytest's own clean-up (shutil.rmtree) recurses too
        os.remove(os.path.join(deep, "deep.md"))
        while deep != str(folder):
            os.rmdir(deep)
            deep = os.path.dirname(deep)


def test_usage_errors_are_one_line(small):
    for args in (["query"], ["index", small[1], "--bogus"], ["query", small[1], QUESTION, "--budget", "lots"]):
        run = noderag(*args)
        assert run.returncode == 2
        _one_line(run)
        assert "--help" in run.stderr
    run = noderag("query", "--json")
    assert len(run.stdout.strip().splitlines()) == 1 and json.loads(run.stdout)["exit_code"] == 2


def test_gc_dry_run_writes_nothing(small, tmp_path):
    _, pristine = small
    ws = copy_workspace(pristine, tmp_path / "ws")
    with api.Workspace(ws).lock():  # an index run holds the workspace: a dry run still answers
        before = {p: p.stat().st_mtime_ns for p in ws.rglob("*")}
        run = noderag("gc", ws, "--dry-run")
        after = {p: p.stat().st_mtime_ns for p in ws.rglob("*")}
    assert run.returncode == 0, run.stderr
    assert after == before


def test_control_characters_reach_a_terminal_escaped(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "title\x1b]0;pwned\x07.md").write_text("# Escape\n\nThe ferry \x1b[31mleaves\x1b[0m at noon daily.\n")
    index(tmp_path / "ws", folder)
    shown = _on_a_terminal([sys.executable, "-m", "noderag_cli.cli", "query", str(tmp_path / "ws"),
                            "When does the ferry leave?", "--show-context"])
    assert "\x1b]0;" not in shown and "\x1b[31m" not in shown
    assert "\\x1b[31mleaves" in shown
    piped = noderag("query", tmp_path / "ws", "When does the ferry leave?", "--show-context")
    assert "\x1b[31mleaves" in piped.stdout  # a pipe gets the text as it is


def _on_a_terminal(command: list[str]) -> str:
    """What a command prints on a terminal (a pseudo-terminal: the CLI sees a tty)."""
    main, child = pty.openpty()
    process = subprocess.Popen(command, stdin=child, stdout=child, stderr=child, close_fds=True,
                               env={**os.environ, "COLUMNS": "200", "TERM": "dumb"}, cwd=Path(__file__).parents[1])
    os.close(child)
    chunks = []
    while True:
        ready, _, _ = select.select([main], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(main, 65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    process.wait(timeout=60)
    os.close(main)
    return b"".join(chunks).decode("utf-8", "replace")
