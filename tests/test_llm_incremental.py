"""Incremental indexing with an LLM engine pays only for what changed.

The engine is litellm against our fault-injecting OpenAI-compatible server on 127.0.0.1, in
its deterministic "rich" mode (a valid reply derived from each request's input: one unit
per sentence, capitalised words as entities), so
the same request always gets the same answer and a fresh build can be compared with an
update table for table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_same_tables, index
from llm_support.fault_server import FaultServer, _task_of

DOCS = ["greyling_medal.md", "sound_maritime_society.txt", "history/penrake_brothers.md", "vessmouth.md"]


@pytest.fixture
def server():
    with FaultServer(default="rich") as srv:
        yield srv


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "fault.yaml"
    path.write_text(yaml.safe_dump({"llm": {"engine": "litellm", "model": "openai/fault-model", "api_base": url,
                                            "timeout_seconds": 10, "retries": 2, "concurrency": 4}}))
    return path


def _requests(server: FaultServer) -> list[tuple[str, str]]:
    """(task, request body) of every task call the server saw, the connection check left out."""
    return [(_task_of(r.body), json.dumps(r.body["messages"], sort_keys=True))
            for r in server.completions() if _task_of(r.body)]


def test_an_update_asks_the_llm_only_about_what_changed(server, tmp_path):
    folder = tmp_path / "docs"
    for name in DOCS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE_CORPUS / name, folder / name)
    config = _config(tmp_path, server.url)
    ws = tmp_path / "ws"
    index(ws, folder, "--config", config)
    first = _requests(server)
    assert {task for task, _ in first} >= {"decompose", "attributes", "community_elements"}
    assert sum(task == "decompose" for task, _ in first) == len(DOCS)

    # change one document: only its chunk is decomposed again
    changed = folder / "vessmouth.md"
    changed.write_text(changed.read_text() + "\nThe harbour master's office moved to the Custom House in 1911.\n")
    server.reset()
    index(ws, folder, "--config", config)
    second = _requests(server)
    assert sum(task == "decompose" for task, _ in second) == 1
    assert not set(second) & set(first), "an update re-sent a request whose reply is cached"
    assert len(second) < len(first) / 2, f"{len(second)} calls to update one document of {len(DOCS)}"

    # nothing changed: no task call at all
    server.reset()
    index(ws, folder, "--config", config)
    assert _requests(server) == []

    # a document removed, then brought back: its decomposition is a paid reply, and comes from the cache
    removed = (folder / "greyling_medal.md").read_bytes()
    (folder / "greyling_medal.md").unlink()
    index(ws, folder, "--config", config)
    (folder / "greyling_medal.md").write_bytes(removed)
    server.reset()
    index(ws, folder, "--config", config)
    assert not [task for task, _ in _requests(server) if task == "decompose"]

    # and the update equals a fresh build of the final folder (same deterministic replies)
    fresh = tmp_path / "fresh"
    index(fresh, folder, "--config", config)
    assert_same_tables(ws, fresh)


def test_new_prompts_are_not_served_old_decompositions(monkeypatch):
    from noderag_cli.engines import prompts

    before = prompts.engine_name("openai/fault-model")
    prompts.prompts_digest.cache_clear()
    monkeypatch.setattr(prompts, "PROMPTS_VERSION", prompts.PROMPTS_VERSION + 1)
    try:
        assert prompts.engine_name("openai/fault-model") != before
    finally:
        prompts.prompts_digest.cache_clear()


def test_rate_limiting_is_shown_logged_bounded_and_summed_up(tmp_path):
    """A server that answers every task call with 429: the progress says so while it waits, the
    log records each wait, each item gives up after llm.rate_limit_wait_seconds, and the run's
    summary says how long it waited."""
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(SAMPLE_CORPUS / "greyling_medal.md", docs / "greyling_medal.md")
    with FaultServer(default="429:1") as server:
        config = tmp_path / "fault.yaml"
        config.write_text(yaml.safe_dump({"llm": {"engine": "litellm", "model": "openai/fault-model",
                                                  "api_base": server.url, "timeout_seconds": 10, "retries": 0,
                                                  "rate_limit_wait_seconds": 3}}))
        run = index(tmp_path / "ws", docs, "--config", config, expect=None)
    assert run.returncode in (1, 4), run.stderr
    assert "rate-limited by the server, waiting 1 s; 1 wait(s) so far" in run.stderr
    log = (tmp_path / "ws" / "noderag.log").read_text()
    assert log.count("rate-limited by the server, waiting") >= 3
    if run.returncode == 1:  # the items gave up after their waits, counted as failures
        summary = run.json()
        assert summary["rate_limited"]["waits"] >= 3 and summary["rate_limited"]["seconds"] >= 3
        assert "rate-limited by the server: waited" in run.stderr
        assert summary["failures"] >= 1
