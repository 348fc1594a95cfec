"""The workspace as a tool for agents: an MCP server over stdio (`noderag mcp WORKSPACE`).

Built on the official MCP Python SDK (the optional extra `noderag-cli[mcp]`). The workspace is
opened once and answers many calls; before each call the server reads CURRENT, and when an
`index` has published a new build it opens that one and closes the old, so a long-running agent
sees updates without a restart (a build being searched is never removed under it: generations).
Read-only, like `query`. Bad arguments (a negative budget, an unknown node) are tool errors the
agent reads; the server keeps running.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from . import api
from .errors import InputError, NoderagError, QueryError
from .workspace import Workspace

NEIGHBOURS_SHOWN = 25
INSTRUCTIONS = ("Search a NodeRAG knowledge graph built from a folder of documents. `search` returns the context "
                "(and optionally an answer) for a question, each node with its documents and how the search reached "
                "it; `node` shows one node and its neighbours; `document` lists a document's text chunks.")


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

    def search(self, question: str, budget_tokens: int | None = None, answer: bool = False) -> dict:
        with self.lock:
            session = self._current()
            params = session.search_settings(**({} if budget_tokens is None else {"budget_tokens": budget_tokens}))
            result = session.ask(question, answer=answer, params=params, explain=True)
            return {"generation": session.generation, **result.as_dict()}

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

    server = MCPServer("noderag", instructions=INSTRUCTIONS, log_level="WARNING")  # stderr stays quiet

    def tool_errors(call):
        try:
            return call()
        except NoderagError as err:
            raise ToolError(str(err)) from None

    @server.tool()
    def search(question: str, budget_tokens: int | None = None, answer: bool = False) -> dict:
        """The context for a question from the workspace's graph: nodes (text, documents, places, how
        the search reached them), in the order an answer reads them. budget_tokens: the context's size
        (the workspace's setting when omitted). answer: also write an answer with the workspace's engine."""
        return tool_errors(lambda: searcher.search(question, budget_tokens, answer))

    @server.tool()
    def node(node_id: str) -> dict:
        """One node by its id (as `search` returns it): its text, documents and places, and its neighbours."""
        return tool_errors(lambda: searcher.node(node_id))

    @server.tool()
    def document(path: str) -> dict:
        """A document's text chunks in order, by its path relative to the indexed folder."""
        return tool_errors(lambda: searcher.document(path))

    return server


def serve(workspace: Path) -> None:
    """Serve the workspace over stdio until the client closes it."""
    searcher = Searcher(workspace)
    try:
        build_server(searcher).run("stdio")
    finally:
        searcher.close()
