"""`noderag index` through litellm against a real model server (llama.cpp serving SmolLM2-135M on
127.0.0.1, behind a counting proxy), end to end through the CLI.

The model is tiny and often wrong: the point is that whatever it says is validated, bad replies
are counted as failures and never stored, the accounting matches the server's usage figures, and
a second run pays for nothing.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import build_file
from test_llm_engine import llama_server, proxy  # noqa: F401  (fixtures: the real server and its counting proxy)

from devtools.cli import Run
from devtools.cli import noderag as run_cli
from devtools.fault_server import task_of
from noderag_cli.engines.grounding import folded, occurs

pytestmark = pytest.mark.llm

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["sound_maritime_society.txt", "history/dunholt.txt"]


def noderag(*args: str) -> Run:
    return run_cli(*args, timeout=900)  # a real model behind the proxy


def task_records(proxy_server):
    return [r for r in proxy_server.completions() if task_of(r.body)]


def test_index_through_litellm_is_validated_accounted_and_cached(proxy, tmp_path):  # noqa: F811
    docs = tmp_path / "docs"
    for name in DOCS:
        (docs / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / "sample_corpus" / name, docs / name)
    config = tmp_path / "llm.yaml"
    config.write_text(yaml.safe_dump({
        "chunk": {"chunk_tokens": 200},
        "graph": {"max_community_tokens": 500, "attribute_max_tokens": 400},
        "llm": {"engine": "litellm", "model": "openai/smollm2", "api_base": proxy.url, "concurrency": 2,
                "max_output_tokens": 160, "context_window": 2048, "timeout_seconds": 120, "retries": 1},
    }))
    ws = tmp_path / "ws"
    first = noderag("index", str(ws), "--input", str(docs), "--config", str(config), "--json")
    assert first.returncode in (0, 1), first.stderr
    assert "Traceback" not in first.stderr

    report = json.loads(noderag("stats", str(ws), "--json").stdout)
    stages = report["stages"]
    records = task_records(proxy)
    assert records, "the engine made no task calls"
    stage_llm = [stages[s].get("llm") or {} for s in ("decompose", "attributes", "communities")]
    assert sum(s.get("calls", 0) for s in stage_llm) == len(records)
    # the tokens of every request, the connection check before the first one included (it is counted there)
    served = proxy.completions()
    assert sum(s.get("connection_checks", 0) for s in stage_llm) == len(served) - len(records) == 1
    assert sum(s.get("input_tokens", 0) for s in stage_llm) == sum(r.usage.get("prompt_tokens", 0) for r in served)
    assert sum(s.get("output_tokens", 0) for s in stage_llm) == sum(r.usage.get("completion_tokens", 0) for r in served)
    assert stages["decompose"]["llm"]["calls"] >= 1

    # whatever was stored is well-formed; failures are counted, not stored
    nodes = pq.read_table(build_file(ws, "nodes.parquet")).to_pylist()
    assert {n["type"] for n in nodes} >= {"T"}
    assert all(n["text"].strip() for n in nodes)
    # grounded: every entity is named in one of the chunks it came from (dunholt.txt names no Marie Curie)
    chunks = {r["chunk_id"]: folded(f"{r['title']}\n{r['text']}")
              for r in pq.read_table(ws / "stages" / "chunk.chunks.parquet").to_pylist()}
    for node in nodes:
        if node["type"] == "N":
            assert any(occurs(node["name"], chunks[c]) for c in node["chunk_ids"]), node["name"]
    assert not any("Marie Curie" in n["text"] for n in nodes)
    failures = pq.read_table(ws / "stages" / "decompose.failures.parquet").to_pylist()
    assert stages["decompose"]["failures"] == len(failures)
    assert all(f["reason"] for f in failures)
    config_text = (ws / "config.yaml").read_text()
    assert "api_key" not in config_text or "api_key_env" in config_text

    # a second run: stages whose inputs are unchanged are skipped and every retried item comes from the cache
    proxy.records.clear()
    second = noderag("index", str(ws), "--input", str(docs), "--config", str(config), "--json")
    assert second.returncode in (0, 1), second.stderr
    retried = len(failures) + sum(1 for s in ("attributes", "communities") if stages[s].get("failures"))
    new_calls = task_records(proxy)
    if retried == 0:
        assert new_calls == []
    else:  # only the items that failed are asked again
        assert len(new_calls) <= sum(s.get("failures", 0) for s in stage_llm) * 2 + retried
