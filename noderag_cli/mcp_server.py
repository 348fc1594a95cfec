"""The workspace as a tool for agents: an MCP server over stdio (`noderag mcp WORKSPACE`).

Built on the official MCP Python SDK (the optional extra `noderag-cli[mcp]`). The workspace is
opened once and answers many calls; before each call the server reads CURRENT, and when an
`index` has published a new build it opens that one and closes the old, so a long-running agent
sees updates without a restart (a build being searched is never removed under it: generations).
Read-only, like `query`. Bad arguments (a negative budget, an unknown node) are tool errors the
agent reads; the server keeps running.

The stdio transport is the SDK's, fed through `_Lines` and `_Output`: a line that is not JSON-RPC
gets the error reply JSON-RPC prescribes (-32700, -32600) instead of silence; when the client
closes stdin, every request already read is answered before the server exits (`requests |
noderag mcp` gets every reply); a client that goes away mid-reply ends the server quietly.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path
from typing import Annotated, Any, TypedDict

from . import api
from .errors import InputError, NoderagError, QueryError
from .workspace import Workspace

NEIGHBOURS_SHOWN = 25
INSTRUCTIONS = ("Search a NodeRAG knowledge graph built from a folder of documents. `search` returns the context "
                "(and optionally an answer) for a question as text to read, each node opened by its sources "
                "([s1]); the full record (ids, scores, places, how the search reached each node) is its structured "
                "content. `node` shows one node and its neighbours; `document` lists a document's text chunks.")


class Searcher:
    """A workspace opened for many calls, following its current build. Calls run one at a time (a
    search takes milliseconds), so a build is never closed under a call that reads it."""

    def __init__(self, workspace: Path):
        self.ws = Workspace(workspace)
        self.lock = threading.Lock()
        self.session = api.open_workspace(workspace, compiled=False)

    def _current(self) -> api.Session:
        """The session on the build CURRENT names now (reopened when an `index` published another);
        called with the lock held."""
        name = self.ws.current_name()
        if name is not None and name != self.session.generation:
            fresh = api.open_workspace(self.ws.root, compiled=False)
            self.session, old = fresh, self.session
            old.close()
        return self.session

    def search(self, question: str, budget_tokens: int | None = None, answer: bool = False) -> tuple[str, dict]:
        """(the context as a reader reads it, the full record)."""
        with self.lock:
            session = self._current()
            params = session.search_settings(**({} if budget_tokens is None else {"budget_tokens": budget_tokens}))
            result = session.ask(question, answer=answer, params=params, explain=True)
            return reading(result), {"generation": session.generation, **result.as_dict()}

    def node(self, node_id: str) -> dict:
        with self.lock:
            session = self._current()
            retriever = session.retriever
            row = retriever.row_of(node_id.strip())
            if row is None:
                raise QueryError(f"no node {node_id!r} in the current build ({session.generation}); node ids come "
                                 "from `search` results")
            node = retriever.node_at(row).as_dict()
            node.pop("score")
            node.pop("via")
            return {"generation": session.generation, **node,
                    "neighbours": [{k: v for k, v in n.as_dict().items() if k in ("id", "type", "text")}
                                   for n in retriever.neighbours(row, NEIGHBOURS_SHOWN)]}

    def document(self, path: str) -> dict:
        with self.lock:
            session = self._current()
            chunks = session.retriever.document_chunks(path)
            if chunks is None:
                raise QueryError(f"no document {path!r} in the current build ({session.generation}); paths are "
                                 "relative to the indexed folder, as `search` results name them")
            return {"generation": session.generation, "document": path,
                    "chunks": [{k: v for k, v in c.as_dict().items() if k in ("id", "text", "locations", "tokens")}
                               for c in chunks]}

    def close(self) -> None:
        with self.lock:
            self.session.close()


SOURCES_SHOWN = 3
"""Sources named in the text per node: a summary joins many passages; the structured content lists all."""


def reading(result) -> str:
    """A search result as an agent reads it: the short answer and the answer when asked, then each
    context node's text on a line of its own, in order, opened by its sources (each named in full
    where it first appears, then by its mark: "[s2] ...", at most `SOURCES_SHOWN`); nothing of ids,
    scores or paths, which the structured content holds, node for node in the same order (an agent
    pays for every character of the text in its own window)."""
    lines = []
    if result.answer is not None:
        if result.short_answer:
            lines.append(f"Short answer: {result.short_answer}")
        lines += [f"Answer: {result.answer}", ""]
    lines.append(f"Context ({len(result.nodes)} nodes, {result.context_tokens} tokens):"
                 if result.nodes else "Context: nothing in the workspace matched this question.")
    named: dict[str, str] = {}  # a source, named in full where it first appears, then by its mark

    def source(name: str) -> str:
        if name in named:
            return named[name]
        named[name] = f"s{len(named) + 1}"
        return f"{named[name]}: {name}"

    for node in result.nodes:
        shown = node.sources[:SOURCES_SHOWN]
        sources = "; ".join(source(name) for name in shown) + \
            (f" +{len(node.sources) - len(shown)} more" if len(node.sources) > len(shown) else "")
        lines.append(f"[{sources}] {node.text}" if sources else node.text)
    return "\n".join(lines).rstrip() + "\n"


class SearchRecord(TypedDict, total=False):
    """The structured content of `search` (its declared output schema): `query --json`'s record."""

    generation: str
    question: str
    answer: str | None
    short_answer: str | None
    context_tokens: int
    query_entities: list[str]
    nodes: list[dict[str, Any]]
    path_nodes: list[dict[str, Any]]
    entry_points: dict[str, list[str]]
    timings: dict[str, float]
    citations: list[dict[str, Any]]
    invalid_citations: int


def require_sdk() -> None:
    """InputError (exit 2, one line) when the MCP SDK is not installed: before the workspace is opened."""
    try:
        import mcp.server.mcpserver  # noqa: F401
    except ImportError:
        raise InputError("`noderag mcp` needs the MCP SDK, an optional extra: pip install 'noderag-cli[mcp]'") from None


def build_server(searcher: Searcher) -> Any:
    """The MCP server exposing `searcher` as three tools."""
    require_sdk()
    from mcp.server.mcpserver import MCPServer
    from mcp.server.mcpserver.exceptions import ToolError
    from mcp_types import CallToolResult, TextContent

    server = MCPServer("noderag", instructions=INSTRUCTIONS, log_level="WARNING")  # stderr stays quiet

    def tool_errors(call):
        try:
            return call()
        except NoderagError as err:
            raise ToolError(str(err)) from None

    def search(question: str, budget_tokens: int | None = None,
               answer: bool = False) -> Annotated[CallToolResult, SearchRecord]:
        """The context for a question from the workspace's graph, as text: each node's text opened by its
        sources ([s1]), in the order an answer reads them (the structured content holds the full
        record: ids, scores, places, how the search reached each node). budget_tokens: the context's
        size (the workspace's setting when omitted). answer: also write an answer with the workspace's
        engine, its short answer first."""
        text, record = tool_errors(lambda: searcher.search(question, budget_tokens, answer))
        return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=record)

    # the annotations as objects (this module's are strings, and the SDK is imported here only)
    search.__annotations__ = {"question": str, "budget_tokens": int | None, "answer": bool,
                              "return": Annotated[CallToolResult, SearchRecord]}
    server.tool()(search)

    @server.tool()
    def node(node_id: str) -> dict:
        """One node by its id (as `search` returns it): its text, documents and places, and its neighbours."""
        return tool_errors(lambda: searcher.node(node_id))

    @server.tool()
    def document(path: str) -> dict:
        """A document's text chunks in order, by its path relative to the indexed folder."""
        return tool_errors(lambda: searcher.document(path))

    return server


DRAIN_SECONDS = 600.0  # after stdin closes, how long requests already read may take to be answered


class _Output:
    """The server's stdout for the SDK's stdio transport: each reply written whole, the requests it
    answers struck from `pending`; a closed pipe (the client gone) ends the serving, quietly."""

    def __init__(self, pending: dict, changed, closed):
        self.pending, self.changed, self.closed = pending, changed, closed

    async def write(self, text: str) -> None:
        import anyio

        if self.closed.is_set():
            return
        try:
            message = json.loads(text)
        except ValueError:
            message = {}
        data = text.encode("utf-8")
        try:
            while data:
                written = await anyio.to_thread.run_sync(os.write, sys.stdout.fileno(), data)
                data = data[written:]
        except OSError:  # EPIPE: nobody reads the replies any more
            self.closed.set()
        if isinstance(message, dict) and "id" in message and ("result" in message or "error" in message):
            self.pending.pop(json.dumps(message["id"]), None)
        self.changed.set()

    async def flush(self) -> None:
        return None

    async def error(self, request_id: Any, code: int, message: str) -> None:
        """A JSON-RPC error reply written by the transport itself (to a line the SDK cannot read)."""
        await self.write(json.dumps({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})
                         + "\n")


class _Lines:
    """The client's stdin for the SDK's stdio transport, line by line: JSON-RPC messages go on, the
    ids of requests are kept in `pending` until answered, a line that is not a message is answered
    with a JSON-RPC error here; at the end of input, lines end only once every pending request has
    its reply (or the client is gone)."""

    def __init__(self, output: _Output, pending: dict, changed, closed):
        self.output, self.pending, self.changed, self.closed = output, pending, changed, closed
        self.stream = os.fdopen(os.dup(sys.stdin.fileno()), "rb", buffering=0)

    def __aiter__(self):
        return self

    async def __anext__(self) -> str:
        import anyio
        import mcp_types as types

        while True:
            raw = await anyio.to_thread.run_sync(self.stream.readline) if not self.closed.is_set() else b""
            if not raw:
                await self._drain()
                raise StopAsyncIteration
            line = raw.decode("utf-8", errors="replace").strip()
            if not line:
                continue
            try:
                message = json.loads(line)
            except ValueError as err:
                await self.output.error(None, -32700, f"Parse error: {err}")
                continue
            try:
                types.jsonrpc_message_adapter.validate_python(message, by_name=False)
            except Exception:
                request_id = message.get("id") if isinstance(message, dict) else None
                await self.output.error(request_id if isinstance(request_id, (str, int)) else None, -32600,
                                        "Invalid Request: not a JSON-RPC 2.0 request, notification or response")
                continue
            if isinstance(message, dict) and "method" in message and "id" in message:
                self.pending[json.dumps(message["id"])] = message["method"]
            elif isinstance(message, dict) and message.get("method") == "notifications/cancelled":
                self.pending.pop(json.dumps((message.get("params") or {}).get("requestId")), None)
            return line

    async def _drain(self) -> None:
        """Wait until every request read has been answered (at most DRAIN_SECONDS)."""
        import anyio

        with anyio.move_on_after(DRAIN_SECONDS):
            while self.pending and not self.closed.is_set():
                self.changed.clear()
                await self.changed.wait()


async def _serve_stdio(server: Any) -> None:
    """`server` (an MCPServer) over this process's stdin and stdout (module docstring)."""
    import anyio
    from mcp.server.stdio import stdio_server

    pending: dict[str, str] = {}

    class _Changed:  # an anyio Event cannot be set twice: one that can be cleared and waited on again
        def __init__(self):
            self.event = anyio.Event()

        def set(self):
            self.event.set()

        def clear(self):
            if self.event.is_set():
                self.event = anyio.Event()

        async def wait(self):
            await self.event.wait()

    changed = _Changed()
    closed = threading.Event()
    output = _Output(pending, changed, closed)
    lines = _Lines(output, pending, changed, closed)
    async with stdio_server(stdin=lines, stdout=output) as (read_stream, write_stream):
        lowlevel = server._lowlevel_server
        await lowlevel.run(read_stream, write_stream, lowlevel.create_initialization_options())


def serve(workspace: Path) -> None:
    """Serve the workspace over stdio until the client closes it."""
    import anyio

    searcher = Searcher(workspace)
    try:
        anyio.run(_serve_stdio, build_server(searcher))
    finally:
        searcher.close()
