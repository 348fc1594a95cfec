"""Shared helpers for the indexing tests: build sample_corpus once per session, compare
workspaces table for table; the CLI runner (a real child process) is devtools/cli.py's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from devtools.cli import REPO, Run, assert_one_line_error, noderag  # noqa: F401 (the tests import them from here)

SAMPLE_CORPUS = REPO / "sample_corpus"
FINAL_TABLES = ("nodes.parquet", "edges.parquet")


def index(workspace: Path, folder: Path, *extra, env: dict | None = None, expect: int | None = 0) -> Run:
    run = noderag("index", workspace, "--input", folder, "--json", *extra, env=env)
    if expect is not None:
        assert run.returncode == expect, f"exit {run.returncode}, stderr:\n{run.stderr}\nstdout:\n{run.stdout}"
    return run


def build_file(workspace: Path, name: str) -> Path:
    """A file of the workspace's current build (the generation CURRENT names)."""
    return workspace / "generations" / (workspace / "CURRENT").read_text().strip() / name


def read_bytes(workspace: Path, names=FINAL_TABLES) -> dict[str, bytes]:
    """Files by name: the final tables from the current build, anything else from the workspace folder."""
    return {name: (build_file(workspace, name) if name in FINAL_TABLES else workspace / name).read_bytes()
            for name in names}


def assert_same_tables(a: Path, b: Path) -> None:
    """The node and edge tables of two workspaces are equal, row for row, and byte-identical files."""
    for name in FINAL_TABLES:
        ta, tb = pq.read_table(build_file(a, name)), pq.read_table(build_file(b, name))
        if not ta.equals(tb):
            ra = set(map(lambda r: json.dumps(r, sort_keys=True), ta.to_pylist()))
            rb = set(map(lambda r: json.dumps(r, sort_keys=True), tb.to_pylist()))
            pytest.fail(f"{name} differ: {len(ra - rb)} rows only in {a}, {len(rb - ra)} only in {b}; "
                        f"e.g. {sorted(ra - rb)[:2]} vs {sorted(rb - ra)[:2]}")
        assert build_file(a, name).read_bytes() == build_file(b, name).read_bytes(), \
            f"{name}: equal tables but different bytes"


def manifest(workspace: Path) -> dict:
    return json.loads((workspace / "manifest.json").read_text())


def copy_workspace(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock"))
    return target


def copy_corpus(target: Path) -> Path:
    shutil.copytree(SAMPLE_CORPUS, target)
    return target


@pytest.fixture(scope="session")
def built(tmp_path_factory) -> Path:
    """sample_corpus indexed once, from scratch, through the CLI (human-readable output kept in
    `index-output.txt` beside it for the summary test). Tests must not modify it: copy it."""
    root = tmp_path_factory.mktemp("built")
    workspace = root / "ws"
    run = noderag("index", workspace, "--input", SAMPLE_CORPUS)
    assert run.returncode == 0, run.stderr
    (root / "index-output.txt").write_text(run.stdout)
    (root / "index-stderr.txt").write_text(run.stderr)
    return workspace


@pytest.fixture(scope="session")
def built_again(tmp_path_factory) -> Path:
    """A second, independent build of sample_corpus (another process, another folder)."""
    workspace = tmp_path_factory.mktemp("built-again") / "ws"
    index(workspace, SAMPLE_CORPUS)
    return workspace
