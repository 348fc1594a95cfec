"""`noderag mcp`: the workspace served over stdio, driven by the MCP SDK's own client, as an agent
would (a real server process; the SDK is in the test install)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest
from conftest import REPO, SAMPLE_CORPUS, assert_one_line_error, copy_workspace, noderag

pytest.importorskip("mcp", reason="the MCP SDK (noderag-cli[mcp]) is part of the test install")
from mcp import Client, StdioServerParameters  # noqa: E402

QUESTION = "In which village was the founder of the society that awards the Greyling Medal born?"


def _client(workspace: Path) -> Client:
    return Client(StdioServerParameters(command=sys.executable, args=["-m", "noderag_cli.cli", "mcp", str(workspace)],
                                        cwd=str(REPO)))


async def _call(client: Client, tool: str, **arguments) -> tuple[bool, object]:
    """(failed, the record: `search`'s structured content, the other tools' JSON text; or the error)."""
    result = await client.call_tool(tool, arguments)
    text = result.content[0].text
    if result.is_error:
        return True, text
    return False, result.structured_content if tool == "search" else json.loads(text)


def _query_ids(workspace: Path, budget: int) -> list[str]:
    run = noderag("query", workspace, QUESTION, "--json", "--context-only", "--budget", budget)
    assert run.returncode == 0, run.stderr
    return [n["id"] for n in run.json()["nodes"]]


def test_tools_answer_like_query_and_bad_arguments_are_tool_errors(built):
    async def session():
        async with _client(built) as client:
            assert {t.name for t in (await client.list_tools()).tools} == {"search", "node", "document"}
            failed, found = await _call(client, "search", question=QUESTION, budget_tokens=600)
            assert not failed and [n["id"] for n in found["nodes"]] == _query_ids(built, 600)
            assert all(n["via"] for n in found["nodes"]) and found["answer"] is None
            failed, answered = await _call(client, "search", question=QUESTION, budget_tokens=1000, answer=True)
            assert not failed and "Harlow Ferry" in answered["answer"]  # the workspace's engine: offline here
            first = found["nodes"][0]
            failed, node = await _call(client, "node", node_id=first["id"])
            assert not failed and node["text"] == first["text"] and node["neighbours"]
            failed, document = await _call(client, "document", path="greyling_medal.md")
            assert not failed and any("Greyling" in c["text"] for c in document["chunks"])
            for tool, arguments, words in (("search", {"question": QUESTION, "budget_tokens": -5}, "budget_tokens"),
                                           ("search", {"question": "  "}, "empty"),
                                           ("node", {"node_id": "N_0123456789abcdef"}, "no node"),
                                           ("node", {"node_id": "nonsense"}, "no node"),
                                           ("document", {"path": "nowhere.md"}, "no document")):
                failed, message = await _call(client, tool, **arguments)
                assert failed and words in message, (tool, message)
            failed, again = await _call(client, "search", question=QUESTION, budget_tokens=600)  # still serving
            assert not failed and again["nodes"] == found["nodes"]

    anyio.run(session)


def test_it_keeps_answering_while_index_swaps_the_build_then_answers_from_the_new_one(built, tmp_path):
    workspace = copy_workspace(built, tmp_path / "ws")
    docs = tmp_path / "docs"
    shutil.copytree(SAMPLE_CORPUS, docs)
    (docs / "harlow_ferry.md").write_text("# Harlow Ferry\n\nHarlow Ferry is a village on the Sallow Water. Its "
                                          "ferry was kept by the Penrake family for three generations.\n")

    async def session():
        async with _client(workspace) as client:
            failed, before = await _call(client, "search", question=QUESTION, budget_tokens=800)
            assert not failed
            command = [sys.executable, "-m", "noderag_cli.cli", "index", str(workspace), "--input", str(docs)]
            indexing = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            answered = 0
            while indexing.poll() is None:
                failed, during = await _call(client, "search", question=QUESTION, budget_tokens=800)
                assert not failed and during["generation"] in (before["generation"], during["generation"])
                answered += 1
            assert indexing.returncode == 0, indexing.stderr.read()
            failed, after = await _call(client, "search", question=QUESTION, budget_tokens=800)
            assert not failed and after["generation"] != before["generation"]
            assert [n["id"] for n in after["nodes"]] == _query_ids(workspace, 800)
            failed, document = await _call(client, "document", path="harlow_ferry.md")
            assert not failed and document["generation"] == after["generation"]
            return answered

    assert anyio.run(session) >= 1


def test_without_the_sdk_the_command_names_the_extra(built, tmp_path):
    shadow = tmp_path / "shadow" / "mcp"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    run = noderag("mcp", built, env={"PYTHONPATH": str(shadow.parent)})
    assert run.returncode == 2
    assert_one_line_error(run, "pip install 'noderag-cli[mcp]'")


def _init_lines(calls: int, budget: int = 300) -> list[dict]:
    return [{"jsonrpc": "2.0", "id": 0, "method": "initialize",
             "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "pipe", "version": "1"}}},
            {"jsonrpc": "2.0", "method": "notifications/initialized"}] + [
        {"jsonrpc": "2.0", "id": i, "method": "tools/call",
         "params": {"name": "search", "arguments": {"question": f"{QUESTION} ({i})", "budget_tokens": budget}}}
        for i in range(1, calls + 1)]


def test_requests_piped_in_are_all_answered_and_bad_lines_get_json_rpc_errors(built):
    """H18: `requests | noderag mcp` closes stdin with 20 calls in flight: every call is answered
    before the server exits (it answered 2); a line that is not JSON, or not JSON-RPC, gets the error
    reply JSON-RPC prescribes (it got nothing)."""
    lines = [json.dumps(m) for m in _init_lines(20)] + ["this is not json", json.dumps({"jsonrpc": "2.0", "id": 99})]
    done = subprocess.run([sys.executable, "-m", "noderag_cli.cli", "mcp", str(built)], input="\n".join(lines) + "\n",
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    replies = [json.loads(line) for line in done.stdout.splitlines()]
    answered = {r["id"]: r for r in replies if "result" in r}
    assert set(answered) == set(range(0, 21))
    assert all(not answered[i]["result"].get("isError") for i in range(1, 21))
    errors = {r["id"]: r["error"]["code"] for r in replies if "error" in r}
    assert errors == {None: -32700, 99: -32600}


def test_a_client_that_closes_both_pipes_mid_reply_ends_the_server_quietly(built):
    """H18: the client goes away with replies still to write: no traceback (it printed 90 lines)."""
    server = subprocess.Popen([sys.executable, "-m", "noderag_cli.cli", "mcp", str(built)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    server.stdin.write("".join(json.dumps(m) + "\n" for m in _init_lines(30, 2000)).encode())
    server.stdin.flush()
    assert json.loads(server.stdout.readline())["id"] == 0
    server.stdout.readline()
    server.stdout.close()
    server.stdin.close()
    stderr = server.stderr.read().decode()
    assert server.wait(120) == 0
    assert stderr == "", stderr


def test_search_reads_as_a_context_and_carries_the_record_as_structured_content(built):
    """Issue 36: the text block is the context as a reader reads it (the short answer when asked,
    then each node's text opened by its sources, in order), about 1.3 times the context's tokens at most
    (it was the whole JSON record, 9 times); the record is the structured content, under a declared
    output schema, equal to `query --json`'s."""
    from noderag_cli import nlp

    async def session():
        async with _client(built) as client:
            search = next(t for t in (await client.list_tools()).tools if t.name == "search")
            assert {"nodes", "short_answer", "context_tokens"} <= set(search.output_schema["properties"])
            result = await client.call_tool("search", {"question": QUESTION, "budget_tokens": 1000, "answer": True})
            text, record = result.content[0].text, result.structured_content
            assert text.startswith("Short answer: Harlow Ferry\n") and record["short_answer"] == "Harlow Ferry"
            plain = await client.call_tool("search", {"question": QUESTION, "budget_tokens": 1000})
            text, record = plain.content[0].text, plain.structured_content
            assert [n["id"] for n in record["nodes"]] == _query_ids(built, 1000)
            assert '"id"' not in text and "S_" not in text  # no ids, scores or paths in what the agent reads
            at = [text.index(f"] {node['text']}\n") for node in record["nodes"]]
            assert at == sorted(at)  # node for node, in the record's order, each opened by its sources
            assert nlp.count_tokens([text])[0] <= 1.3 * record["context_tokens"]

    anyio.run(session)
