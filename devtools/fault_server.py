"""A small OpenAI-compatible server that misbehaves on purpose, for the engine's tests and benchmark.

Threaded stdlib `http.server` on 127.0.0.1, port chosen by the OS. Serves
`GET /v1/models`, `POST /v1/chat/completions` and `POST /v1/embeddings`.

Each request takes its next action from a script:
- `server.script(actions, marker=TEXT)`: the queue for requests whose body contains TEXT
  (deterministic under concurrency: key a queue on a word of one item's input);
- `server.script(actions)`: the global queue, for requests that match no marker queue;
- `server.default`: when the queues are empty.

Actions (strings):
    good             a valid reply for the task (or, with `upstream`, the upstream server's reply)
    429:S            status 429 with `Retry-After: S`
    500, 503, ...    that status (any number but 429 and 401)
    401              status 401, echoing the request's API key in the message
    slow:S           sleep S seconds, then a good reply (to outlast a client timeout)
    truncated        a good reply's JSON cut in half
    wrong_shape      valid JSON of the wrong shape
    prose            plain text, no JSON
    fenced           a good reply inside a ```json fence with chatter around it
    python           a good reply written as a Python literal (single quotes)
    refuse_schema    400 "response_format json_schema not supported" when the request asks for
                     json_schema, else good
    reasoning:N      a rich reply that bills N hidden reasoning tokens more in its usage (as reasoning
                     models do: a run costs more than its estimate)
    rich             replies as a compliant model would shape them: a decomposition with a unit per
                     sentence and its capitalised words as entities; an attribute summary made of the
                     statements up to the prompt's 150 words; up to 5 community elements, each a
                     statement as description
    echo             the example shape of the task's system prompt, verbatim (a model that copies it)
    foreign          a good reply whose first unit also names FOREIGN_ENTITY, which no input holds,
                     with a relationship to it
    cut_off          a good reply cut in half with finish_reason "length" (the output limit reached)
    cite             an answer citing context lines [1], [2] and [99] (the last numbers no line)

`FaultServer(token_factor=N)` bills N times the tokens it would (a provider whose tokenizer counts
many more tokens than the bundled one), in chat and embedding usage alike.

Every request is recorded (`server.records`): arrival time (time.monotonic), path, action,
status, parsed body and the usage figures returned. With `upstream="http://host:port"` good
replies are forwarded to that server (e.g. llama.cpp), which makes this a counting proxy.

    python devtools/fault_server.py --port 8099   # serve until Ctrl-C, all replies good
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from noderag_cli.engines import prompts


@dataclass
class Record:
    at: float
    path: str
    action: str
    status: int = 0
    body: dict = field(default_factory=dict)
    usage: dict = field(default_factory=dict)
    reply: str = ""  # the assistant message of a chat completion answered 200


MODEL = "openai/fault-model"  # as litellm names this server's model


def llm_section(url: str, **settings) -> dict:
    """The `llm` config section that points noderag at this server (the base URL of its /v1), with `settings`."""
    return {"engine": "litellm", "model": MODEL, "api_base": url, **settings}


def task_of(body: dict) -> str | None:
    messages = body.get("messages") or []
    system = next((m.get("content", "") for m in messages if m.get("role") == "system"), "")
    for name, spec in prompts.SPECS.items():  # a built-in prompt, or one a user changed in its first line
        if system == spec.system or spec.system.split("\n", 1)[1] in system:
            return name
    return None


def _user_text(body: dict) -> str:
    messages = body.get("messages") or []
    users = [m.get("content", "") for m in messages if m.get("role") == "user"]
    return users[0] if users else ""


_NOT_NAMES = {"Text", "Title", "Question", "Context", "Entity", "Statements", "The", "A", "An", "It", "In", "She",
              "He", "They", "Who", "Whom", "What", "When", "Where", "Which", "Why", "How"}


def rich_content(body: dict) -> dict:
    """Like good_content, but shaped as a compliant model would answer: a decomposition with one
    unit per sentence of the input and the capitalised words of each as entities (a graph with
    important entities and communities); an attribute summary made of the entity's statements up
    to the prompt's limit of about 150 words; one community element per statement, up to the
    prompt's 5. Still a pure function of the request."""
    task = task_of(body)
    if task == "attributes":
        words = " ".join(_statements(body)).split()
        return {"summary": " ".join(words[:150]) or good_content(body)["summary"]}
    if task == "community_elements":
        elements = [{"title": " ".join(_names(s)[:4]) or s.split()[0], "description": s}
                    for s in _statements(body)[:5]]
        return {"elements": elements or good_content(body)["elements"]}
    if task != "decompose":
        return good_content(body)
    units = []
    for sentence in re.split(r"(?<=[.!?])\s+", _user_text(body))[:40]:
        names = _names(sentence)[:4]
        if len(names) < 2 or len(sentence) < 20:
            continue
        units.append({"text": sentence, "entities": names,
                      "relations": [{"source": names[0], "relation": "relates to", "target": names[1]}]})
    return {"units": units or good_content(body)["units"]}


def _names(text: str) -> list[str]:
    words = [w.strip(".,;:!?()\"'") for w in text.split()]
    return list(dict.fromkeys(w for w in words if w[:1].isupper() and w not in _NOT_NAMES and len(w) > 2))


def _statements(body: dict) -> list[str]:
    """The bullet lines of an attributes or community request."""
    return [line[2:].strip() for line in _user_text(body).splitlines() if line.startswith("- ") and line[2:].strip()]


FOREIGN_ENTITY = "Zanzibar Quillfeather"


def foreign_content(body: dict) -> dict:
    content = good_content(body)
    if task_of(body) == "decompose":
        unit = content["units"][0]
        unit["entities"].append(FOREIGN_ENTITY)
        unit["relations"].append({"source": unit["entities"][0], "relation": "met", "target": FOREIGN_ENTITY})
    return content


def _system_text(body: dict) -> str:
    return next((m.get("content", "") for m in body.get("messages") or [] if m.get("role") == "system"), "")


def good_content(body: dict) -> dict:
    """A valid reply object for the task of the request, derived from its input."""
    task = task_of(body)
    text = _user_text(body)
    tag = hashlib.blake2b(text.encode(), digest_size=3).hexdigest()
    words = [w.strip(".,;:!?()\"'") for w in text.split()]
    names = [w for w in words if w[:1].isupper() and w not in _NOT_NAMES][:3] or ["Alpha", "Beta"]
    if task == "decompose":
        first = names[0]
        last = names[-1] if len(names) > 1 else "Beta"
        return {"units": [{"text": f"{first} is linked to {last} (unit {tag}).", "entities": [first, last],
                           "relations": [{"source": first, "relation": "is linked to", "target": last}]}]}
    if task == "attributes":
        return {"summary": f"Summary {tag} of {names[0]}."}
    if task == "community_elements":
        return {"elements": [{"title": f"Theme {tag}", "description": f"What {', '.join(names)} share."}]}
    if task == "query_entities":
        return {"entities": names[:2]}
    if task == "answer":
        return {"answer": f"Answer {tag}."}
    if task == "passage":
        return {"passage": f"Passage {tag}: {' '.join(names)} are described here."}
    return {"reply": "OK"}


def _usage(body: dict, content: str) -> dict:
    prompt = sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or []) + 3
    completion = max(1, len(content.split()))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class FaultServer:
    def __init__(self, default: str = "good", upstream: str | None = None, embed_dim: int = 16, port: int = 0,
                 token_factor: int = 1):
        self.default = default
        self.token_factor = token_factor  # a provider that counts this many times the tokens it is sent
        self._port = port
        self.upstream = upstream.rstrip("/") if upstream else None
        self.embed_dim = embed_dim
        self.records: list[Record] = []
        self._queues: list[tuple[str | None, deque]] = []
        self._auth = ""
        self._lock = threading.Lock()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # control --------------------------------------------------------------------
    def start(self) -> FaultServer:
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                server._handle(self, "GET")

            def do_POST(self):
                server._handle(self, "POST")

        self._httpd = ThreadingHTTPServer(("127.0.0.1", self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def script(self, actions: list[str], marker: str | None = None) -> None:
        with self._lock:
            for existing_marker, queue in self._queues:
                if existing_marker == marker:
                    queue.extend(actions)
                    return
            self._queues.append((marker, deque(actions)))

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self._queues.clear()

    def completions(self) -> list[Record]:
        with self._lock:
            return [r for r in self.records if r.path.endswith("/chat/completions")]

    def _next_action(self, raw: str) -> str:
        with self._lock:
            for marker, queue in self._queues:
                if marker is not None and marker in raw and queue:
                    return queue.popleft()
            for marker, queue in self._queues:
                if marker is None and queue:
                    return queue.popleft()
            return self.default

    # serving ----------------------------------------------------------------------
    def _send(self, handler: BaseHTTPRequestHandler, status: int, payload: Any, headers: dict | None = None) -> None:
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json")
            handler.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                handler.send_header(key, value)
            handler.end_headers()
            handler.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (a timeout test)

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        arrived = time.monotonic()
        path = handler.path.split("?")[0]
        raw = ""
        body: dict = {}
        if method == "POST":
            length = int(handler.headers.get("Content-Length") or 0)
            raw = handler.rfile.read(length).decode("utf-8", "replace")
            try:
                body = json.loads(raw or "{}")
            except json.JSONDecodeError:
                body = {}
        if method == "GET":
            if path.rstrip("/").endswith("/models"):
                self._send(handler, 200, {"object": "list", "data": [{"id": "fault-model", "object": "model"}]})
            else:
                self._send(handler, 404, {"error": {"message": "not found"}})
            return
        action = self._next_action(raw)
        self._auth = handler.headers.get("Authorization", "")
        record = Record(arrived, path, action, body=body)
        with self._lock:
            self.records.append(record)
        status, payload, headers = self._respond(path, action, body, raw)
        record.status = status
        if isinstance(payload, dict) and isinstance(payload.get("usage"), dict):
            record.usage = payload["usage"]
        if status == 200 and isinstance(payload, dict) and payload.get("choices"):
            record.reply = str((payload["choices"][0].get("message") or {}).get("content") or "")
        self._send(handler, status, payload, headers)

    def _respond(self, path: str, action: str, body: dict, raw: str) -> tuple[int, Any, dict]:
        kind, _, arg = action.partition(":")
        if kind == "429":
            return 429, {"error": {"message": "rate limited", "type": "rate_limit_error"}}, {"Retry-After": arg or "1"}
        if kind == "401":  # echoes the key, as careless providers do: the engine must not repeat it
            key = self._auth.split(" ", 1)[-1]
            return 401, {"error": {"message": f"Incorrect API key provided: {key}", "type": "invalid_request_error"}}, {}
        if kind.isdigit():
            return int(kind), {"error": {"message": f"scripted status {kind}", "type": "server_error"}}, {}
        if kind == "slow":
            time.sleep(float(arg or 5))
            kind = "good"
        if kind == "refuse_schema":
            if (body.get("response_format") or {}).get("type") == "json_schema":
                return 400, {"error": {"message": "response_format json_schema is not supported",
                                       "type": "invalid_request_error"}}, {}
            kind = "good"
        hidden = 0
        if kind == "reasoning":
            hidden, kind = int(arg or 1000), "rich"
        if path.rstrip("/").endswith("/embeddings"):
            return self._embeddings(body)
        if kind == "good" and self.upstream:
            return self._forward(path, raw)
        good = json.dumps(rich_content(body) if kind == "rich" else good_content(body))
        content = {
            "rich": good,
            "good": good,
            "echo": _system_text(body).partition("Shape:\n")[2],
            "foreign": json.dumps(foreign_content(body)),
            "cut_off": good[: max(1, len(good) // 2)],
            "cite": json.dumps({"answer": "Josiah Penrake founded it [1][2], in 1888 [2, 99]."}),
            "truncated": good[: max(1, len(good) // 2)],
            "wrong_shape": json.dumps({"result": "nothing", "items": 3}),
            "prose": "I am sorry, I cannot help with that request.",
            "fenced": f"Sure! Here is the JSON:\n```json\n{good}\n```\nHope this helps.",
            "python": repr(good_content(body)),
        }.get(kind)
        if content is None:
            return 500, {"error": {"message": f"unknown scripted action {action!r}"}}, {}
        usage = {key: value * self.token_factor for key, value in _usage(body, content).items()}
        usage["completion_tokens"] += hidden
        usage["total_tokens"] += hidden
        return 200, {
            "id": "chatcmpl-fault", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model", "fault-model"),
            "choices": [{"index": 0, "finish_reason": "length" if kind == "cut_off" else "stop",
                         "message": {"role": "assistant", "content": content}}],
            "usage": usage,
        }, {}

    def _embeddings(self, body: dict) -> tuple[int, Any, dict]:
        inputs = body.get("input") or []
        if isinstance(inputs, str):
            inputs = [inputs]
        data = []
        for index, text in enumerate(inputs):
            digest = hashlib.blake2b(str(text).encode(), digest_size=self.embed_dim).digest()
            data.append({"object": "embedding", "index": index, "embedding": [b / 255 - 0.5 for b in digest]})
        tokens = sum(len(str(t).split()) for t in inputs) * self.token_factor
        return 200, {"object": "list", "data": data, "model": body.get("model", "fault-embed"),
                     "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, {}

    def _forward(self, path: str, raw: str) -> tuple[int, Any, dict]:
        request = urllib.request.Request(self.upstream + path, data=raw.encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                return response.status, json.loads(response.read()), {}
        except urllib.error.HTTPError as err:
            try:
                payload = json.loads(err.read() or b"{}")
            except json.JSONDecodeError:
                payload = {"error": {"message": f"upstream status {err.code}"}}
            return err.code, payload, {}


def max_in_window(times: list[float], window: float) -> int:
    """The largest number of timestamps inside any half-open window [t, t + window)."""
    times = sorted(times)
    best = 0
    start = 0
    for end, t in enumerate(times):
        while times[start] <= t - window:
            start += 1
        best = max(best, end - start + 1)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--default", default="good")
    parser.add_argument("--upstream")
    args = parser.parse_args()
    server = FaultServer(default=args.default, upstream=args.upstream, port=args.port)
    server.start()
    print(f"fault server at {server.url}  (Ctrl-C to stop)")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
