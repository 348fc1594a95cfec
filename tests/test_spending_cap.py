"""The spending cap (issue 28): `llm.max_cost_usd` / `index --max-cost`. Against the fault server
(a real HTTP server on 127.0.0.1), priced through the config: it is not a model litellm knows."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_one_line_error, assert_same_tables, index, noderag

from devtools.fault_server import FaultServer, llm_section

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
    section = {**llm_section(server.url), "timeout_seconds": 10,
               **({"price_per_million_tokens": PRICE} if price else {}), **llm}
    config.write_text(yaml.safe_dump({"llm": section}))
    return str(config)


def _cost(record) -> float:
    """What one request was billed, at PRICE (embeddings bill their input alone)."""
    return (record.usage.get("prompt_tokens", 0) * PRICE["input"]
            + record.usage.get("completion_tokens", 0) * PRICE["output"]) / 1e6


def _spent(records) -> float:
    return sum(_cost(r) for r in records)


def _paid(server) -> list:
    return [r for r in server.records if r.status == 200 and r.path.endswith(("/chat/completions", "/embeddings"))]


def _within_cap(server, cap: float) -> None:
    """The spend passes the cap, if at all, by no more than the dearest single request."""
    paid = _paid(server)
    assert _spent(paid) <= cap + max(map(_cost, paid)), (_spent(paid), cap, max(map(_cost, paid)))


def _embedding_config(tmp_path, server, cap: float | None = None, **llm) -> str:
    """The offline engine with embeddings behind litellm, priced (and capped, with `cap`)."""
    config = tmp_path / "embed.yaml"
    config.write_text(yaml.safe_dump({
        "embedding": {"backend": "litellm", "model": "openai/fault-embed", "api_base": server.url, "dim": 16,
                      "batch_size": 8, "price_per_million_tokens": {"input": PRICE["input"]}},
        "llm": {"engine": "offline", **({"max_cost_usd": cap} if cap else {}), **llm}}))
    return str(config)


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
        assert first
        _within_cap(server, cap)
        server.reset()
        index(tmp_path / "ws", docs, "--config", config, "--max-cost", "1000")
        second = server.completions()
        asked_twice = _asked(first) & _asked(second)
        assert second and not asked_twice
        server.reset()
        index(tmp_path / "uncapped", docs, "--config", config)
    assert_same_tables(tmp_path / "ws", tmp_path / "uncapped")


def test_priced_embeddings_counted_ten_times_over_stop_at_the_cap(tmp_path, docs):
    """H12: a provider that counts ten times the bundled tokenizer's tokens: the first embedding
    request shows it, and the run stops within one request of the cap (it spent 2.3 times the cap)."""
    with FaultServer(token_factor=10) as server:
        index(tmp_path / "full", docs, "--config", _embedding_config(tmp_path, server))
        full = _spent(_paid(server))
        server.reset()
        cap = full * 0.4
        run = index(tmp_path / "ws", docs, "--config", _embedding_config(tmp_path, server, cap), expect=1)
        assert_one_line_error(run, "spending cap", "--max-cost")
        _within_cap(server, cap)


def test_the_dry_run_prices_paid_embeddings_and_gives_its_verdict(tmp_path, docs):
    """H15: with the offline engine and priced embeddings, --dry-run shows their cost and whether it
    fits the cap, as the real run's refusal does."""
    with FaultServer() as server:
        config = _embedding_config(tmp_path, server)
        plan = json.loads(noderag("index", tmp_path / "ws", "--input", docs, "--config", config, "--dry-run",
                                  "--max-cost", "0.000001", "--json").stdout)
        assert plan["llm"]["tasks"]["embedding"]["calls"] > 0 and plan["llm"]["total"]["cost_usd"] > 0
        assert plan["llm"]["spending_cap"]["fits"] is False
        run = index(tmp_path / "ws", docs, "--config", config, "--max-cost", "0.000001", expect=2)
        assert_one_line_error(run, "estimated at", "spending cap")


@pytest.mark.parametrize("value", ["inf", "1e308", "nan"])
def test_caps_and_prices_that_are_no_numbers_are_refused(tmp_path, docs, value):
    """H15: an infinite, absurd or missing-number cap or price is a one-line error, exit 2."""
    with FaultServer() as server:
        run = index(tmp_path / "ws", docs, "--config", _config(tmp_path, server), "--max-cost", value, expect=2)
        assert_one_line_error(run, "max_cost_usd")
        config = tmp_path / "price.yaml"
        config.write_text(f"llm: {{engine: litellm, model: openai/fault-model, api_base: '{server.url}', "
                          f"price_per_million_tokens: {{input: {'.inf' if value == 'inf' else value}}}}}\n")
        run = index(tmp_path / "ws", docs, "--config", config, "--dry-run", expect=2)
        assert_one_line_error(run, "price_per_million_tokens")


def test_reasoning_billed_past_the_output_limit_stops_within_a_request_of_the_cap(tmp_path, docs):
    """H13: every reply bills 50,000 hidden reasoning tokens past max_output_tokens (the run spent
    eight times its cap): the first reply of each task shows it, and the spend stays within one
    request of the cap."""
    with FaultServer(default="reasoning:50000") as server:
        cap = 0.10
        config = _config(tmp_path, server, max_output_tokens=512)
        plan = json.loads(noderag("index", tmp_path / "ws", "--input", docs, "--config", config, "--dry-run",
                                  "--json").stdout)
        assert plan["llm"]["total"]["cost_usd"] < cap  # it starts: the estimate fits
        run = index(tmp_path / "ws", docs, "--config", config, "--max-cost", str(cap), expect=1)
        assert_one_line_error(run, "spending cap")
        _within_cap(server, cap)


@pytest.mark.parametrize("concurrency", [1, 8, 32])
def test_a_run_that_costs_less_than_its_cap_finishes_in_one_run(tmp_path, docs, concurrency):
    """H14: the cap reserved every request's worst case times the requests in flight, so a run at
    concurrency 32 stopped after 5 requests ($0.004 of $0.13), and at 8 a cap of 1.1 times the
    estimate needed 6 runs for a build that cost 46% of it: now it finishes at once."""
    with FaultServer(default="rich") as server:
        config = _config(tmp_path, server, concurrency=concurrency)
        cap = _estimate(tmp_path, docs, config) * 1.1
        index(tmp_path / "ws", docs, "--config", config, "--max-cost", f"{cap:.6f}")
        assert 0 < _spent(_paid(server)) < cap


def test_the_cap_holds_for_both_kinds_of_spending_at_once(tmp_path, docs):
    """Priced embeddings and an LLM, a provider counting ten times the tokens, concurrency 32: one
    cap over both, within one request."""
    with FaultServer(default="rich", token_factor=10) as server:
        config = tmp_path / "both.yaml"
        config.write_text(yaml.safe_dump({
            "embedding": {"backend": "litellm", "model": "openai/fault-embed", "api_base": server.url, "dim": 16,
                          "batch_size": 8, "price_per_million_tokens": {"input": PRICE["input"]}},
            "llm": {**llm_section(server.url), "timeout_seconds": 10,
                    "concurrency": 32, "price_per_million_tokens": PRICE}}))
        index(tmp_path / "full", docs, "--config", config)
        cap = _spent(_paid(server)) * 0.5
        server.reset()
        run = index(tmp_path / "ws", docs, "--config", config, "--max-cost", f"{cap:.6f}", expect=1)
        assert_one_line_error(run, "spending cap")  # it started: estimated with our count, a tenth of the bill
        _within_cap(server, cap)
