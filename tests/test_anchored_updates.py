"""Incremental updates (the default, `index.update: incremental`): an update keeps the attributes and
community elements of the last full build (the anchor) whose texts changed little, and its
communities, so it pays about what changed; it is deterministic, resumes after a SIGKILL to the
same bytes, makes every new text searchable at once, drops a deleted document from every node's
sources, says how stale its summaries are, and turns into a full build (a fresh build's tables)
past `index.rebuild_after` or on `--rebuild`. Both engines: the offline one, and litellm against
the fault server on 127.0.0.1 (its deterministic "rich" replies).
"""

from __future__ import annotations

import json
import shutil
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import SAMPLE_CORPUS, assert_same_tables, build_file, copy_workspace, index, noderag

from devtools.fault_server import FaultServer, llm_section, task_of
from noderag_cli.graph import document_id

NEW_DOCUMENT = """# The Korven Institute

The Korven Institute is a research library in Vessmouth, founded in 1902 by Edda Marrow.
Its reading room holds the papers of the Sound Maritime Society and the logbooks of the Calder Point Shipworks.
Every spring the institute lends its archive to the Vessmouth Lantern Festival.
"""
ANCHOR_FILES = ("attribute_summaries.parquet", "community_summaries.parquet", "anchor_chunks.parquet",
                "similarity_centroids.parquet", "semantic_centroids.parquet")


def change(folder: Path) -> None:
    """One document added, one changed (a sentence more), one deleted: about a sixth of the chunks."""
    (folder / "korven_institute.md").write_text(NEW_DOCUMENT)
    vessmouth = folder / "vessmouth.md"
    vessmouth.write_text(vessmouth.read_text() + "\nThe Korven Institute opened its Vessmouth reading room in 1911.\n")
    (folder / "greyling_medal.md").unlink()


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("anchored")
    corpus = root / "corpus"
    shutil.copytree(SAMPLE_CORPUS, corpus)
    (corpus / "questions.jsonl").unlink()
    index(root / "ws", corpus)
    return corpus, root / "ws"


def updated(base, tmp_path: Path, name: str, *extra, env: dict | None = None, expect: int | None = 0):
    """A copy of the base workspace updated to the changed folder: (workspace, folder, run)."""
    corpus, workspace = base
    folder = tmp_path / f"{name}-corpus"
    if not folder.exists():
        shutil.copytree(corpus, folder)
        change(folder)
    ws = copy_workspace(workspace, tmp_path / name)
    return ws, folder, index(ws, folder, *extra, env=env, expect=expect)


def build_bytes(workspace: Path) -> dict[str, bytes]:
    """Every file of the current build but its manifest (which names the generation)."""
    folder = build_file(workspace, "")
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"
            and not p.name.startswith(".")}


def test_an_incremental_update_keeps_summaries_is_deterministic_and_reports_staleness(base, tmp_path):
    ws, folder, run = updated(base, tmp_path, "one")
    stages = run.json()["stages"]
    for stage in ("attributes", "communities"):
        assert stages[stage]["update"].startswith("incremental ("), stages[stage]
    # deterministic: the same base and the same change give the same bytes, every file of the build
    again, _, _ = updated(base, tmp_path, "two")
    assert build_bytes(ws) == build_bytes(again)

    # it kept summaries: some attribute differs from what a fresh build of the folder writes
    fresh = tmp_path / "fresh"
    index(fresh, folder)
    def attributes(workspace):
        rows = pq.read_table(build_file(workspace, "nodes.parquet"), columns=["id", "type", "text"]).to_pylist()
        return {r["id"]: r["text"] for r in rows if r["type"] == "A"}
    kept, rewritten = attributes(ws), attributes(fresh)
    # the anchor's entities keep their attributes until the next full build samples the bridges again
    assert kept.keys() - rewritten.keys() <= attributes(base[1]).keys() and kept.keys() & rewritten.keys()
    stale_texts = [i for i in kept.keys() & rewritten.keys() if kept[i] != rewritten[i]]
    report = noderag("stats", ws, "--json").json()["anchor"]
    # stale: kept although its texts changed (the offline engine's summary of the new texts may be the same)
    assert report["stale_attributes"] == stages["attributes"]["stale"] >= len(stale_texts) > 0
    assert report["stale_communities"] == stages["communities"]["stale"] > 0
    chunks = pq.read_table(build_file(ws, "anchor_chunks.parquet"))["chunk_id"].to_pylist()
    assert chunks == pq.read_table(build_file(base[1], "anchor_chunks.parquet"))["chunk_id"].to_pylist()
    assert 0.05 < report["changed_share"] <= 0.25
    shown = noderag("stats", ws)
    assert f"{report['changed_share']:.1%} of the chunks changed" in shown.stdout
    assert f"{report['stale_attributes']:,} attributes" in shown.stdout

    # nothing to do: every stage skipped
    rerun = index(ws, folder).json()["stages"]
    assert all(info["skipped"] for info in rerun.values()), rerun


def test_new_content_is_searchable_at_once_and_a_deleted_document_is_gone(base, tmp_path):
    ws, _, _ = updated(base, tmp_path, "ws")
    nodes = pq.read_table(build_file(ws, "nodes.parquet")).to_pylist()
    gone, added = document_id("greyling_medal.md"), document_id("korven_institute.md")
    assert not any(gone in n["doc_ids"] for n in nodes), "a node still cites the deleted document"
    units = [n for n in nodes if n["type"] == "S" and added in n["doc_ids"]]
    assert units and all(n["vector_row"] >= 0 for n in units)
    hit = noderag("query", ws, "Who founded the Korven Institute, and when?", "--json", "--context-only")
    assert hit.returncode == 0, hit.stderr
    context = json.loads(hit.stdout)["nodes"]
    assert any("Edda Marrow" in n["text"] and "korven_institute.md" in n["documents"] for n in context)
    assert not any("greyling_medal.md" in n["documents"] for n in context)


@pytest.mark.parametrize("kill_at", ["attributes:commit", "communities:1", "assemble:publish"])
def test_a_killed_incremental_update_resumes_to_the_same_bytes(base, tmp_path, kill_at):
    whole, _, _ = updated(base, tmp_path, "whole")
    ws, folder, killed = updated(base, tmp_path, "killed", env={"NODERAG_TEST_KILL_AT": kill_at}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    index(ws, folder)
    assert build_bytes(ws) == build_bytes(whole)


def test_past_rebuild_after_and_on_rebuild_the_run_is_a_full_build(base, tmp_path):
    corpus, _ = base
    strict = tmp_path / "strict.yaml"
    strict.write_text(yaml.safe_dump({"index": {"rebuild_after": 0.05}}))
    ws, folder, run = updated(base, tmp_path, "strict", "--config", strict)
    update = run.json()["stages"]["attributes"]["update"]
    assert update.startswith("full build (") and "over index.rebuild_after" in update, update
    fresh = tmp_path / "fresh"
    index(fresh, folder)
    assert_same_tables(ws, fresh)
    assert noderag("stats", ws, "--json").json()["anchor"] == {"changed_share": 0.0, "stale_attributes": 0,
                                                               "stale_communities": 0}

    ws, folder, _ = updated(base, tmp_path, "rebuilt")
    plan = noderag("index", ws, "--input", folder, "--rebuild", "--dry-run", "--json").json()
    assert plan["stages"]["attributes"] == "run: a full build was asked (--rebuild)"
    run = index(ws, folder, "--rebuild").json()["stages"]
    assert run["attributes"]["update"] == run["communities"]["update"] == "full build (--rebuild)"
    assert run["decompose"]["skipped"]
    assert_same_tables(ws, fresh)
    assert build_bytes(ws)["anchor_chunks.parquet"] == build_bytes(fresh)["anchor_chunks.parquet"]


def test_a_damaged_anchor_makes_the_update_a_full_build_that_names_it(base, tmp_path):
    corpus, workspace = base
    ws = copy_workspace(workspace, tmp_path / "damaged")
    anchor = build_file(ws, "attribute_summaries.parquet")
    data = bytearray(anchor.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: the size stays, the checksum differs
    anchor.write_bytes(bytes(data))
    verify = noderag("stats", ws, "--verify")
    assert verify.returncode == 3 and "attribute_summaries.parquet" in verify.stderr
    folder = tmp_path / "corpus"
    shutil.copytree(corpus, folder)
    change(folder)
    update = index(ws, folder).json()["stages"]["attributes"]["update"]
    assert update.startswith("full build (workspace file ") and "attribute_summaries.parquet" in update, update
    fresh = tmp_path / "fresh"
    index(fresh, folder)
    assert_same_tables(ws, fresh)


def test_a_killed_rebuild_is_finished_by_the_next_run(base, tmp_path):
    ws, folder, _ = updated(base, tmp_path, "incremental")  # stale summaries to write anew
    killed = index(ws, folder, "--rebuild", env={"NODERAG_TEST_KILL_AT": "communities:start"}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    assert json.loads((ws / "manifest.json").read_text())["rebuild_pending"] is True
    plan = noderag("index", ws, "--input", folder, "--dry-run", "--json").json()
    assert plan["stages"]["communities"].startswith("run: ")
    resumed = index(ws, folder).json()["stages"]  # no --rebuild: the manifest remembers it
    assert resumed["communities"]["update"] == "full build (--rebuild)"
    assert "rebuild_pending" not in json.loads((ws / "manifest.json").read_text())
    fresh = tmp_path / "fresh"
    index(fresh, folder)
    assert_same_tables(ws, fresh)


def test_exact_is_for_one_run_and_equals_a_fresh_build(base, tmp_path):
    ws, folder, run = updated(base, tmp_path, "exact", "--exact")
    assert run.json()["stages"]["communities"]["update"] == "full build (exact mode)"
    fresh = tmp_path / "fresh"
    index(fresh, folder)
    assert_same_tables(ws, fresh)
    assert "update: incremental" in (ws / "config.yaml").read_text()  # the workspace's config is unchanged


# with an LLM engine -------------------------------------------------------------------------


@pytest.fixture
def server():
    with FaultServer(default="rich") as srv:
        yield srv


def _asked(server: FaultServer) -> list[str]:
    return [task_of(r.body) for r in server.completions() if task_of(r.body)]


def test_an_incremental_update_with_an_llm_asks_less_than_an_exact_one(server, tmp_path):
    folder = tmp_path / "corpus"
    shutil.copytree(SAMPLE_CORPUS, folder)
    (folder / "questions.jsonl").unlink()
    config = tmp_path / "fault.yaml"
    config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10, "retries": 2,
                                              "concurrency": 4, "price_per_million_tokens": {"input": 1.0}}}))
    base = tmp_path / "base"
    index(base, folder, "--config", config)
    full = _asked(server)
    change(folder)

    asked, plans = {}, {}
    for mode in ("incremental", "exact"):
        ws = copy_workspace(base, tmp_path / mode)
        extra = ("--exact",) if mode == "exact" else ()
        plans[mode] = noderag("index", ws, "--input", folder, "--config", config, "--dry-run", "--json",
                              *extra).json()["llm"]
        server.reset()
        run = index(ws, folder, "--config", config, "--max-cost", "1", *extra)
        asked[mode] = _asked(server)
        assert run.json()["stages"]["attributes"]["update"].startswith("incremental" if mode == "incremental"
                                                                       else "full build")
    summaries = ("attributes", "community_elements")
    # the changed chunks are decomposed in both modes; the incremental update asks fewer summaries
    assert asked["incremental"].count("decompose") == asked["exact"].count("decompose") == 2
    assert sum(asked["incremental"].count(t) for t in summaries) < sum(asked["exact"].count(t) for t in summaries)
    assert len(asked["incremental"]) < len(full) / 2
    # the dry run estimates each mode's update within 30% (issue 38; an edited chunk stands in as the
    # model's reply to its earlier text and its new sentences decomposed offline)
    for mode in ("incremental", "exact"):
        assert abs(plans[mode]["total"]["calls"] - len(asked[mode])) <= 0.3 * len(asked[mode]), (mode, plans[mode])
    assert plans["incremental"]["total"]["calls"] < plans["exact"]["total"]["calls"]

    # deterministic with the LLM engine too
    again = copy_workspace(base, tmp_path / "again")
    index(again, folder, "--config", config)
    assert build_bytes(again) == build_bytes(tmp_path / "incremental")


def test_a_new_node_takes_only_the_room_the_anchors_texts_left():
    """A community's request shows attributes, then its best-connected units, within its token
    budget; in an incremental update the texts its kept elements were written from come first, so a
    new unit with more edges does not push them out (the elements stay kept), and takes the room a
    unit that left frees."""
    import numpy as np
    import pyarrow as pa

    from noderag_cli.graph import Graph
    from noderag_cli.index.communities import shown_members

    # one community: units S1-S3 (the anchor showed S1 and S2, the budget fits two), S9 new with the most edges
    ids = ["S1", "S2", "S3", "S9", "N1", "N2", "N3"]
    nodes = pa.table({"id": ids, "type": [i[0] for i in ids]})
    edges = pa.table({"source": ["S1", "S2", "S3", "S9", "S9", "S9"], "target": ["N1", "N1", "N2", "N1", "N2", "N3"],
                      "weight": [1.0] * 6})
    graph = Graph.from_tables(nodes, edges)
    membership, tokens = np.zeros(len(ids), np.int64), np.full(len(ids), 10)
    before = np.isin(np.array(ids), ["S1", "S2"])
    shown = [ids[i] for i in shown_members(graph, membership, tokens, 20)[0][1]]
    assert shown[0] == "S9"  # a full build: the best-connected first
    assert [ids[i] for i in shown_members(graph, membership, tokens, 20, before)[0][1]] == ["S1", "S2"]
    before = np.isin(np.array(ids), ["S1"])  # S2 changed: the new unit takes its room
    assert [ids[i] for i in shown_members(graph, membership, tokens, 20, before)[0][1]] == ["S1", "S9"]
