"""The spending cap (issue 28): `llm.max_cost_usd` / `index --max-cost`. Against the fault server
(a real HTTP server on 127.0.0.1), priced through the config: it is not a model litellm knows."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_one_line_error, assert_same_tables, index, noderag
from llm_support.fault_server import FaultServer

pytestmark = pytest.mark.llm

PRICE = {"input": 2.0, "output": 8.0}  # USD per million tokens


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for path in sorted(SAMPLE_CORPUS.glob("*.md"))[:4]:
        shutil.copy(path, folder / path.name)
    return folder


def _config(tmp_path, server, price=True, **llm) -> str:
    config = tmp_path / "llm.yaml"
    section = {"engine": "litellm", "model": "openai/fault-model", "api_base": server.url, "timeout_seconds": 10,
               **({"price_per_million_tokens": PRICE} if price else {}), **llm}
    config.write_text(yaml.safe_dump({"llm": section}))
    return str(config)


def _spent(records) -> float:
    return sum(r.usage.get("prompt_tokens", 0) * PRICE["input"] + r.usage.get("completion_tokens", 0) * PRICE["output"]
               for r in records) / 1e6


def _asked(records) -> set[str]:
    """The task requests among `records` (each run's connection check left out)."""
    return {json.dumps(r.body, sort_keys=True) for r in records} - {
        json.dumps(r.body, sort_keys=True) for r in records if "Reply with the word OK" in json.dumps(r.body)}


def _estimate(tmp_path, docs, config) -> float:
    run = noderag("index", tmp_path / "ws", "--input", docs, "--config", config, "--dry-run", "--json")
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout)["llm"]["total"]["cost_usd"]


def test_a_cap_on_a_model_without_a_price_is_refused(tmp_path, docs):
    with FaultServer(default="rich") as server:
        for extra in (["--max-cost", "5"], []):
            config = _config(tmp_path, server, price=False, **({} if extra else {"max_cost_usd": 5}))
            run = index(tmp_path / "ws", docs, "--config", config, *extra, expect=2)
            assert_one_line_error(run, "llm.price_per_million_tokens")
        assert server.completions() == [] and not (tmp_path / "ws").exists()


def test_a_run_estimated_over_its_cap_does_not_start(tmp_path, docs):
    with FaultServer(default="rich") as server:
        config = _config(tmp_path, server)
        estimate = _estimate(tmp_path, docs, config)
        assert estimate > 0
        run = index(tmp_path / "ws", docs, "--config", config, "--max-cost", f"{estimate / 2:.6f}", expect=2)
        assert_one_line_error(run, "estimated at", "spending cap", "--max-cost")
        assert server.completions() == [] and not (tmp_path / "ws").exists()
        plan = json.loads(noderag("index", tmp_path / "ws", "--input", docs, "--config", config, "--dry-run",
                                  "--max-cost", f"{estimate / 2:.6f}", "--json").stdout)
        assert plan["llm"]["spending_cap"]["fits"] is False


def test_a_run_stops_at_its_cap_and_a_raised_cap_goes_on_paying_nothing_twice(tmp_path, docs):
    """Every reply bills 3,000 hidden reasoning tokens, so the spend outruns the estimate: the run
    starts (its estimate fits), stops before the spend passes the cap, keeps every reply it paid
    for, and the rerun with a higher cap asks only what was not asked, to the same tables."""
    with FaultServer(default="reasoning:3000") as server:
        config = _config(tmp_path, server)
        cap = _estimate(tmp_path, docs, config) * 1.5
        stopped = index(tmp_path / "ws", docs, "--config", config, "--max-cost", f"{cap:.6f}", expect=1)
        assert_one_line_error(stopped, "spending cap", "--max-cost")
        assert json.loads(stopped.stdout)["exit_code"] == 1
        first = [r for r in server.completions() if r.status == 200]
        assert first and _spent(first) <= cap
        server.reset()
        index(tmp_path / "ws", docs, "--config", config, "--max-cost", "1000")
        second = server.completions()
        asked_twice = _asked(first) & _asked(second)
        assert second and not asked_twice
        server.reset()
        index(tmp_path / "uncapped", docs, "--config", config)
    assert_same_tables(tmp_path / "ws", tmp_path / "uncapped")
