"""Indexing on a real Ray cluster on 127.0.0.1: a head and a second node, each a `ray start`
process tree with one CPU. `noderag index` joins it with `executor: {kind: ray, address: ...}`;
the per-document and per-chunk work runs as Ray tasks, the graph-wide steps in the driver.

Checked: the tables equal a local build's byte for byte, with the offline engine and with the LLM
engine (litellm against the fault server's deterministic replies); a task whose worker process
dies (the crash hook in ray_executor.py, set in the cluster's environment) is run again and the
result is unchanged; a killed run resumes from the cache as a local one does; the LLM calls of
tasks on both nodes share one rate limit.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_same_tables, index

from devtools.fault_server import FaultServer, llm_section, task_of
from devtools.ports import free_port

ray = pytest.importorskip("ray", reason="the ray extra is not installed (pip install 'noderag-cli[ray]')")

RAY = str(Path(sys.executable).parent / "ray")
LLM_DOCS = ["greyling_medal.md", "sound_maritime_society.txt", "history/penrake_brothers.md", "vessmouth.md"]



@pytest.fixture(scope="module")
def cluster():
    """(address, crash marker): a head node and a worker node on this machine, stopped afterwards."""
    temp = Path(tempfile.mkdtemp(prefix="nr-ray-", dir="/tmp"))  # Ray's socket paths must stay short
    marker = temp / "crashed-once"
    port = free_port()
    env = {**os.environ, "NODERAG_TEST_CRASH_ONCE": str(marker), "RAY_USAGE_STATS_ENABLED": "0"}
    common = ["--num-cpus", "1", "--object-store-memory", str(200 << 20), "--disable-usage-stats"]
    head = [RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
            "--include-dashboard", "false", "--temp-dir", str(temp), *common]
    node = [RAY, "start", "--address", f"127.0.0.1:{port}", "--node-ip-address", "127.0.0.1", *common]
    try:
        for command in (head, node):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
            assert done.returncode == 0, done.stdout + done.stderr
        yield f"127.0.0.1:{port}", marker
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


def _ray_config(tmp_path: Path, address: str, **sections) -> Path:
    path = tmp_path / f"ray-{len(list(tmp_path.glob('ray-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump({"executor": {"kind": "ray", "address": address}, **sections}))
    return path


def test_offline_index_on_the_cluster_equals_a_local_build(cluster, built, tmp_path):
    address, marker = cluster
    run = index(tmp_path / "ws", SAMPLE_CORPUS, "--config", _ray_config(tmp_path, address))
    assert marker.exists(), "no task's worker was killed: the crash hook did not run"
    assert_same_tables(tmp_path / "ws", built)
    assert run.json()["stages"]["decompose"]["decomposed"] > 0


def _llm(url: str) -> dict:
    return {"llm": {**llm_section(url), "timeout_seconds": 20,
                    "retries": 2, "concurrency": 4}}


def test_llm_index_on_the_cluster_equals_a_local_build_and_resumes(cluster, tmp_path):
    address, _ = cluster
    folder = tmp_path / "docs"
    for name in LLM_DOCS:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE_CORPUS / name, folder / name)
    with FaultServer(default="rich") as server:
        local = tmp_path / "local.yaml"
        local.write_text(yaml.safe_dump(_llm(server.url)))
        index(tmp_path / "local", folder, "--config", local)
        local_calls = sorted(json.dumps(r.body["messages"], sort_keys=True) for r in server.completions()
                             if task_of(r.body))
        server.reset()
        on_cluster = _ray_config(tmp_path, address, **_llm(server.url))
        killed = index(tmp_path / "ws", folder, "--config", on_cluster, env={"NODERAG_TEST_KILL_AT": "attributes:start"},
                       expect=None)
        assert killed.returncode == -9
        decomposed = [r for r in server.completions() if task_of(r.body) == "decompose"]
        assert len(decomposed) == len(LLM_DOCS)
        resumed = index(tmp_path / "ws", folder, "--config", on_cluster).json()
        assert resumed["stages"]["decompose"]["skipped"]
        cluster_calls = sorted(json.dumps(r.body["messages"], sort_keys=True) for r in server.completions()
                               if task_of(r.body))
    assert cluster_calls == local_calls  # the same requests, each once: nothing re-paid after the kill
    assert_same_tables(tmp_path / "ws", tmp_path / "local")


def test_tasks_on_both_nodes_share_one_rate_limit(cluster):
    """Two tasks, pinned to different nodes, each take 6 admissions from the shared limiter (3 per
    1-second window): 12 admissions cannot finish in under 3 windows, as they would with a limiter
    per task."""
    from noderag_cli.ray_executor import RemoteLimiter, _SharedLimiter

    address, _ = cluster
    ray.init(address=address, log_to_driver=False)
    try:
        actor = ray.remote(num_cpus=0)(_SharedLimiter).remote(3, None, 1.0)
        limiter = RemoteLimiter(actor, 3, None)

        @ray.remote(num_cpus=1)
        def admit(shared: RemoteLimiter, count: int) -> list[float]:
            import asyncio

            async def run() -> list[float]:
                times = []
                for _ in range(count):
                    reservation = await shared.acquire(0)
                    times.append(time.time())
                    shared.settle(reservation, 0)
                return times

            return asyncio.run(run())

        nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        assert len(nodes) == 2
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        started = time.time()
        times = ray.get([admit.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                         .remote(limiter, 6) for node in nodes])
        elapsed = time.time() - started
    finally:
        ray.shutdown()
    arrivals = sorted(t for task in times for t in task)
    assert len(arrivals) == 12
    assert elapsed >= 3.0
    for i in range(len(arrivals) - 3):  # no 4 admissions within one window, across both nodes
        assert arrivals[i + 3] - arrivals[i] >= 1.0 - 0.05


def test_documents_are_read_on_the_cluster_as_locally(cluster, tmp_path):
    """A PDF and a Word file are read by the cluster's workers (from the folder's path, which both
    nodes of this machine see) and give the tables a local build gives."""
    from devtools import documents as make

    address, _ = cluster
    folder = tmp_path / "docs"
    folder.mkdir()
    parts = make.sections(3, 3)
    make.write_pdf(folder / "report.pdf", "Harbour Report", parts, header="Harbour Board")
    make.write_docx(folder / "minutes.docx", "Minutes", parts, table=[["Ship", "Tonnage"], ["Heron", "310"]])
    shutil.copy(SAMPLE_CORPUS / "greyling_medal.md", folder / "greyling_medal.md")
    local = index(tmp_path / "local", folder).json()
    remote = index(tmp_path / "ws", folder, "--config", _ray_config(tmp_path, address)).json()
    assert local["stages"]["chunk"]["extracted"] == remote["stages"]["chunk"]["extracted"] == 2
    assert_same_tables(tmp_path / "ws", tmp_path / "local")
