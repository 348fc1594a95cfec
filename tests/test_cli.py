"""What scripts rely on, through the real CLI (child processes): verbatim text, one output line per
question line, JSON errors, plain progress off a terminal, help, version, symlinks, export."""

from __future__ import annotations

import csv
import fcntl
import json
import os
import re
import sys
from pathlib import Path

import networkx as nx
import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE_CORPUS, assert_one_line_error, build_file, index, noderag

from noderag_cli import api

TRICKY = ("Gorse Tally is a lighthouse keeper on Skarra. Her log reads root:x:0 and 3:a:1 beside "
          "the marks :x: and :ok:, and the line [bold]Storm[/bold] with [red]tide[/] in brackets.")
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f]")  # escape sequences, carriage returns
BARS = re.compile("[\u2800-\u28ff]|━╸|╺━")  # Rich's spinner frames and bar segments


@pytest.fixture(scope="module")
def tricky(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tricky")
    (folder / "docs").mkdir()
    (folder / "docs" / "gorse_tally.txt").write_text(f"Gorse Tally\n\n{TRICKY}\n")
    (folder / "docs" / "skarra.txt").write_text("Skarra\n\nSkarra is an island village in the outer Grey Sound.\n")
    index(folder / "ws", folder / "docs")
    return folder / "ws"


@pytest.mark.parametrize("flags", [[], ["--show-context"], ["--json"]])
def test_document_text_is_printed_verbatim(tricky, flags):
    run = noderag("query", tricky, "What does the log of Gorse Tally read?", *flags)
    assert run.returncode == 0, run.stderr
    text = "".join(n["text"] for n in run.json()["nodes"]) if "--json" in flags else run.stdout
    for piece in ("root:x:0", "3:a:1", ":x:", ":ok:", "[bold]Storm[/bold]", "[red]tide[/]"):
        assert piece in text, (piece, text)
    assert not any(mark in run.stdout for mark in ("❌", "🆗", "🅰"))


def test_our_own_messages_carry_no_markup(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Skarra is an island village in the outer Grey Sound.\n")
    (docs / "b.txt").write_bytes(b"\x00\x01binary")
    run = noderag("index", tmp_path / "ws", "--input", docs)
    assert run.returncode == 0, run.stderr
    assert "1 file(s) skipped" in run.stdout and "[yellow]" not in run.stdout + run.stderr
    assert "warning: skipped b.txt" in run.stderr


def test_question_lines_map_one_to_one_with_errors_in_words(tricky, tmp_path):
    lines = ['{"question": "Who keeps the lighthouse on Skarra?"}', "not json", '{"question": 5}',
             '{"nope": 1}', "", '["a list"]', '{"question": "   "}', '{"question": "Where is Skarra?"}']
    path = tmp_path / "questions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    run = noderag("query", tricky, "--questions", path, "--context-only")
    assert run.returncode == 1, run.stderr
    out = [json.loads(line) for line in run.stdout.splitlines()]
    assert [o["line"] for o in out] == list(range(1, len(lines) + 1))
    good = {1, 8}
    for item in out:
        assert ("error" in item) == (item["line"] not in good), item
    assert out[0]["question"] == "Who keeps the lighthouse on Skarra?" and out[7]["nodes"]
    errors = {o["line"]: o["error"] for o in out if "error" in o}
    assert "not valid JSON" in errors[2]
    assert errors[3] == '"question" must be text, got a number'
    assert errors[4] == 'no "question" field'
    assert errors[5] == "blank line, no question"
    assert "not a JSON object" in errors[6] and errors[7] == '"question" is empty'
    assert "Error" not in run.stderr and "Traceback" not in run.stderr
    assert f"{path} line 3:" in run.stderr


def test_a_question_file_of_good_lines_exits_zero(tricky, tmp_path):
    path = tmp_path / "questions.jsonl"
    path.write_text('{"question": "Where is Skarra?"}\n{"question": "Who is Gorse Tally?"}\n')
    run = noderag("query", tricky, "--questions", path, "--context-only")
    assert run.returncode == 0 and len(run.stdout.splitlines()) == 2


@pytest.mark.parametrize("args, code, fragment", [
    (["query", "{missing}", "Who?"], 3, "workspace not found"),
    (["index", "{tmp}/ws", "--input", "{missing}"], 2, "input folder not found"),
    (["stats", "{missing}"], 3, "workspace not found"),
    (["export", "{missing}"], 3, "workspace not found"),
    (["query", "{missing}", "Who?", "--budget", "0"], 2, "--budget"),
])
def test_json_errors_are_json_on_stdout_with_the_same_exit_code(tmp_path, args, code, fragment):
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    run = noderag(*args, "--json")
    assert run.returncode == code, run.stderr
    payload = json.loads(run.stdout)
    assert payload["exit_code"] == code and fragment in payload["error"]
    assert "Traceback" not in run.stderr


def test_version_and_help():
    run = noderag("--version")
    assert run.returncode == 0 and re.fullmatch(r"noderag \d+\.\d+\.\d+\S*\n", run.stdout)
    run = noderag("query", "--help")
    assert run.returncode == 0
    assert "Usage: noderag query [OPTIONS] WORKSPACE [QUESTION]" in run.stdout
    assert "--budget TOKENS" in run.stdout and "search.budget_tokens" in run.stdout
    from noderag_cli.config import Config

    assert f"default: ({Config().search.budget_tokens}, or the config" in run.stdout
    assert "<bool>" not in run.stdout and "{" not in run.stdout.split("\n")[0]
    run = noderag("--help")
    for command in ("index", "query", "stats", "ablate", "export", "init", "gc"):
        assert re.search(rf"^  {command}\s", run.stdout, re.MULTILINE), command


def test_no_bars_or_control_characters_off_a_terminal(built, tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Skarra is an island village in the outer Grey Sound.\n")
    runs = [noderag("index", tmp_path / "ws", "--input", docs, env={"COLUMNS": "80"}),
            noderag("stats", built, env={"COLUMNS": "80"}),
            noderag("query", built, "Who founded the Sound Maritime Society?", "--show-context",
                    env={"COLUMNS": "80"})]
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert not CONTROL.search(run.stderr) and not BARS.search(run.stderr), repr(run.stderr[:300])
        assert not CONTROL.search(run.stdout.replace("\n", "")), repr(run.stdout[:300])
    assert "decompose: finished in" in runs[0].stderr
    stats = runs[1].stdout
    assert "…" not in stats, stats  # nothing cut at 80 columns
    assert max(len(line) for line in stats.splitlines()) <= 80


def test_ablate_without_matplotlib_skips_the_png_with_a_note(built, tmp_path):
    """The default install has no matplotlib; this interpreter has it (the test extras), so the
    child process is told it is absent (`sys.modules["matplotlib"] = None`, what Python does for a
    missing package), the one thing simulated here."""
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": "Who founded the Sound Maritime Society?",
                                     "answers": ["Josiah Penrake"]}) + "\n")
    code = ("import sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'noderag'; "
            "from noderag_cli.cli import main; main()")
    import subprocess

    done = subprocess.run([sys.executable, "-c", code, "ablate", str(built), "--questions", str(questions),
                           "--variants", "noderag,naive", "--budgets", "1000", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert "ablation.png not written: matplotlib is not installed" in done.stderr
    assert (tmp_path / "out" / "ablation.csv").is_file() and not (tmp_path / "out" / "ablation.png").exists()


@pytest.fixture()
def linked(tmp_path) -> tuple[Path, Path]:
    outside = tmp_path / "outside"
    (outside / "secrets").mkdir(parents=True)
    (outside / "secrets" / "passwd.txt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (outside / "notes.txt").write_text("Orrin Vale keeps the tide tables of Harlow Ferry.\n")
    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "a.txt").write_text("Skarra is an island village in the outer Grey Sound.\n")
    os.symlink(outside / "secrets", docs / "etc")
    os.symlink(outside / "notes.txt", docs / "notes.txt")
    os.symlink(docs / "a.txt", docs / "sub" / "same.txt")  # stays inside: read
    return docs, tmp_path / "ws"


def indexed_paths(workspace: Path) -> set[str]:
    documents = pq.read_table(build_file(workspace, "documents.parquet")).to_pylist()
    return {row["path"] for row in documents if row["status"] == "indexed"}


def test_symlinks_out_of_the_input_folder_are_skipped_with_a_warning(linked):
    docs, workspace = linked
    run = index(workspace, docs)
    assert "warning: skipped etc/: symlink leads out of the input folder" in run.stderr
    assert "warning: skipped notes.txt: symlink leads out of the input folder" in run.stderr
    assert indexed_paths(workspace) == {"a.txt", "sub/same.txt"}
    texts = " ".join(pq.read_table(build_file(workspace, "nodes.parquet"))["text"].to_pylist())
    assert "root:x:0" not in texts and "Orrin Vale" not in texts
    followed = index(workspace, docs, "--follow-symlinks")
    assert followed.json()["documents"]["new"] == 2
    assert indexed_paths(workspace) == {"a.txt", "sub/same.txt", "etc/passwd.txt", "notes.txt"}


def test_messages_say_what_is_the_case(built, tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a workspace")
    assert_one_line_error(noderag("query", a_file, "Who?"), "is a file, not a workspace folder")
    run = noderag("query", built, "Who founded the Sound Maritime Society?", "--budget", "1", "--context-only")
    assert run.returncode == 0 and "smaller than the smallest matching node" in run.stderr
    half = tmp_path / "half"
    api.index(half, SAMPLE_CORPUS, stop_after="chunk")
    with open(half / ".lock", "a+") as lock:  # this process plays the first build that is still running
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.truncate(0)
        lock.write(str(os.getpid()))
        lock.flush()
        run = noderag("query", half, "Who?")
    assert_one_line_error(run, "being indexed for the first time", f"(pid {os.getpid()})")
    assert run.returncode == 3


def test_export_graphml_loads_back_with_networkx(built, tmp_path):
    target = tmp_path / "graph.graphml"
    run = noderag("export", built, "--format", "graphml", "--out", target, "--json")
    assert run.returncode == 0, run.stderr
    nodes = pq.read_table(build_file(built, "nodes.parquet"))
    edges = pq.read_table(build_file(built, "edges.parquet"))
    documents = pq.read_table(build_file(built, "documents.parquet"))
    path_of = dict(zip(documents["doc_id"].to_pylist(), documents["path"].to_pylist(), strict=True))
    graph = nx.read_graphml(target)
    assert run.json()["nodes"] == graph.number_of_nodes() == nodes.num_rows
    assert run.json()["edges"] == graph.number_of_edges() == edges.num_rows
    for row in nodes.to_pylist():
        data = graph.nodes[row["id"]]
        assert (data["type"], data["name"], data["text"], data["community"], data["tokens"]) == \
               (row["type"], row["name"], row["text"], row["community"], row["tokens"])
        assert data["documents"].split(";") == [path_of[d] for d in row["doc_ids"]]
    for row in edges.to_pylist():
        data = graph.edges[row["source"], row["target"]]
        assert (data["kind"], data["similarity"]) == (row["kind"], row["hnsw"])
        assert data["weight"] == pytest.approx(row["weight"])


def test_export_csv_has_neo4j_headers_and_every_row(built, tmp_path):
    run = noderag("export", built, "--format", "csv", "--out", tmp_path / "csv")
    assert run.returncode == 0, run.stderr
    with open(tmp_path / "csv" / "nodes.csv", newline="", encoding="utf-8") as handle:
        node_rows = list(csv.reader(handle))
    with open(tmp_path / "csv" / "edges.csv", newline="", encoding="utf-8") as handle:
        edge_rows = list(csv.reader(handle))
    assert node_rows[0][:2] == ["id:ID", ":LABEL"]
    assert edge_rows[0][:3] == [":START_ID", ":END_ID", ":TYPE"]
    nodes = pq.read_table(build_file(built, "nodes.parquet"))
    assert len(node_rows) - 1 == nodes.num_rows
    assert len(edge_rows) - 1 == pq.read_table(build_file(built, "edges.parquet")).num_rows
    assert [r[4] for r in node_rows[1:]] == nodes["text"].to_pylist()  # multi-line text survives quoting
    bad = noderag("export", built, "--format", "xml")
    assert_one_line_error(bad, "unknown export format 'xml'")
    assert bad.returncode == 2


def test_init_writes_every_setting_and_the_next_index_uses_it(tmp_path):
    from noderag_cli.config import Config, load_config, preset

    workspace = tmp_path / "ws"
    run = noderag("init", workspace)
    assert run.returncode == 0, run.stderr
    text = (workspace / "config.yaml").read_text()
    assert load_config(workspace / "config.yaml") == Config()
    for section, values in Config().model_dump().items():
        for key in values:
            assert re.search(rf"^  {key}: ", text, re.MULTILINE), f"{section}.{key} missing"
    assert "# token bound of a text chunk" in text
    assert_one_line_error(noderag("init", workspace), "exists", "--force")
    (workspace / "config.yaml").write_text(text.replace("  chunk_tokens: 1024", "  chunk_tokens: 64"))
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text("Skarra is an island village in the outer Grey Sound. " * 30)
    index(workspace, docs)
    assert load_config(build_file(workspace, "config.yaml")).chunk.chunk_tokens == 64
    assert len(pq.read_table(build_file(workspace, "nodes.parquet"), filters=[("type", "=", "T")])) > 1
    assert "# token bound of a text chunk" in (workspace / "config.yaml").read_text()  # still commented

    llm = tmp_path / "llm"
    assert noderag("init", llm, "--llm", "ollama").returncode == 0
    assert load_config(llm / "config.yaml") == preset("ollama")[0]
    assert_one_line_error(noderag("init", tmp_path / "other", "--llm", "bogus"), "unknown --llm preset 'bogus'")


def cache_values(workspace: Path, skip: tuple[str, ...] = ()) -> list[bytes]:
    import sqlite3

    from noderag_cli.cache import Cache

    with sqlite3.connect(workspace / "cache.sqlite") as db:
        rows = db.execute("SELECT ns, key, value FROM kv").fetchall()
    return [Cache._unpacked(ns, key, value) for ns, key, value in rows if ns not in skip]


def test_gc_removes_a_deleted_documents_entries_and_the_next_index_repays_nothing(tmp_path):
    import shutil

    docs = tmp_path / "docs"
    shutil.copytree(SAMPLE_CORPUS, docs)
    workspace = tmp_path / "ws"
    index(workspace, docs)
    (docs / "history" / "penrake_brothers.md").unlink()
    index(workspace, docs, "--exact")  # so that the workspace ends equal to a fresh build (below)
    assert any(b"Harlow Ferry" in v for v in cache_values(workspace))  # the deleted document's text is cached
    (workspace / "stages" / ".chunk.documents.parquet.123.tmp").write_bytes(b"left by a killed run")
    (workspace / "stages" / "hnsw.index.bin").write_bytes(b"a file of an older version")

    dry = noderag("gc", workspace, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert dry.json()["cache"]["removed"] > 0 and len(dry.json()["files"]) == 2
    assert any(b"Harlow Ferry" in v for v in cache_values(workspace))  # a dry run removes nothing

    run = noderag("gc", workspace, "--json")
    assert run.returncode == 0, run.stderr
    report = run.json()
    assert report["cache"]["removed"] == dry.json()["cache"]["removed"] and report["cache"]["skipped"] is None
    assert sorted(report["files"]) == ["stages/.chunk.documents.parquet.123.tmp", "stages/hnsw.index.bin"]
    assert not any(b"Harlow Ferry" in v for v in cache_values(workspace))
    # the scan's entries (a file's size and times with its hash) come as the files age: not work
    kept = len(cache_values(workspace, skip=("scan",)))

    with api.open_workspace(workspace) as session:  # a query holds the build while the next gc runs
        shutil.rmtree(workspace / "stages")  # every stage runs again, from the cache; assemble's inputs come
        rebuilt = index(workspace, docs, "--exact", "--rebuild").json()  # back the same: --rebuild runs it too
        assert all(not info["skipped"] for info in rebuilt["stages"].values())
        assert noderag("gc", workspace, "--json").json()["held_generations"]  # the query's build stays
        assert session.retrieve("Who founded the Sound Maritime Society?").nodes
    assert len(cache_values(workspace, skip=("scan",))) == kept  # nothing was computed again: no new entry
    fresh = tmp_path / "fresh"
    index(fresh, docs)
    assert_same_tables_of(workspace, fresh)
    assert noderag("gc", workspace, "--json").json()["generations"]  # released: now removed


def assert_same_tables_of(a: Path, b: Path) -> None:
    from conftest import assert_same_tables

    assert_same_tables(a, b)


def test_a_dry_run_with_llm_and_embedding_backends_needs_no_network_and_no_key(tmp_path):
    """configs/openai.yaml (chat and embeddings at OpenAI), no key, and every HTTP request sent to a
    closed port: the estimate still comes, with an embedding row, and nothing is written."""
    env = {"HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "OPENAI_API_KEY": ""}
    workspace = tmp_path / "ws"
    run = noderag("index", workspace, "--input", SAMPLE_CORPUS, "--config", REPO / "configs" / "openai.yaml",
                  "--dry-run", "--json", env=env)
    assert run.returncode == 0, run.stderr
    llm = run.json()["llm"]
    assert llm["tasks"]["decompose"]["calls"] > 0 and llm["tasks"]["embedding"]["calls"] >= 1
    assert llm["tasks"]["embedding"]["input_tokens"] > 0
    assert not workspace.exists()


def test_a_query_with_an_unreachable_llm_exits_4_at_once(built, tmp_path):
    import socket
    import time

    import yaml

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    config = tmp_path / "llm.yaml"
    config.write_text(yaml.safe_dump({"llm": {"engine": "litellm", "model": "openai/some-model",
                                              "api_base": f"http://127.0.0.1:{closed}/v1"}}))
    started = time.monotonic()
    run = noderag("query", built, "Who founded the Sound Maritime Society?", "--config", config)
    elapsed = time.monotonic() - started
    assert run.returncode == 4, run.stderr
    assert_one_line_error(run, f"cannot reach the LLM server at http://127.0.0.1:{closed}/v1")
    assert elapsed < 5, f"{elapsed:.1f} s"  # refused before litellm is imported, no retries


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("args", [("stats", "{ws}"), ("stats", "{ws}", "--json"), ("ablate", "--list")])
def test_an_output_that_cannot_be_written_is_one_line_and_exit_1(tricky, args):
    """A full disk behind stdout (/dev/full): one `error:` line on stderr and exit 1, no traceback,
    and the workspace as it was."""
    import subprocess

    before = build_file(tricky, "nodes.parquet").read_bytes()
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "noderag_cli.cli", *(a.format(ws=tricky) for a in args)],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert [line for line in done.stderr.splitlines() if line.startswith("error:")] == \
        ["error: cannot write the output: No space left on device"], done.stderr
    assert build_file(tricky, "nodes.parquet").read_bytes() == before
