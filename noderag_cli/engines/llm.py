"""The LLM engine: NodeRAG's five tasks through litellm, for any provider litellm routes.

What it does for every task item (see `prompts.py` for the prompts and reply shapes):
- looks the request up in the workspace `Cache` (namespace "llm", key: a digest of model,
  messages and the parameters that shape the reply); a hit costs nothing and is counted;
- otherwise calls `litellm.acompletion`, at most `llm.concurrency` at a time, each request
  start admitted by a sliding-window limiter on requests and tokens per minute;
- 429s wait (Retry-After honoured, else exponential backoff with jitter) and pause the limiter for
  every worker: they slow a run, they do not fail it, until one item has waited
  `llm.rate_limit_wait_seconds` in total. Each wait is logged (the workspace's noderag.log during
  `index`), counted in `stats` (waits, seconds) and shown through `notice` (the CLI's progress) at
  the first wait and then at most every NOTICE_SECONDS;
  timeouts, connection errors and 5xx use the normal `llm.retries` budget with backoff;
- asks for structured output (response_format json_schema) when `llm.structured_output`; a server
  that refuses it gets weaker modes for the rest of the run (see `prompts.STRUCTURED_MODES`);
- parses the reply tolerantly; a reply that does not validate is shown back to the model ONCE
  with the problem; if that fails too, the item is a `Failure(reason)`;
- writes each success to the cache as it returns (under the key of the original request, so a
  re-run finds it), committed on a writer thread while the loop sends the next request; an item
  is done only once committed. Failures are never cached: a re-run retries exactly the failed items;
- counts prompt tokens exactly only where the count matters (a tokens-per-minute limit, a prompt
  near the context window); elsewhere an upper bound gives the same max_tokens.
- accounts calls (requests sent), cache hits, failures (reasons counted by category),
  tokens (from each response's `usage`) and cost (litellm's price table; a model without a
  price costs 0 and sets `price_known = False`) per task in `stats`.

`check_connection()` makes one tiny call and raises `EngineError` for a missing key variable, an
unroutable model or an unreachable server; with `check_before_first_call` (the CLI's runs) it is
made before the first request a run sends, and accounted under that request's task, so a run the
cache answers whole sends nothing. Replies are grounded in their input (`grounding.py`).
`query_entities` returns [] and `answer` raises EngineError when the model gives nothing usable;
`query_entities_batch` and `answer_batch` return `Failure`s like the indexing tasks.

Authentication errors, an unknown model (404) or an unknown provider stop the whole batch with
`EngineError` (one line): every other item would fail the same way. Successes written so far
stay in the cache.

The batch methods are synchronous: coroutines run on one private event loop in a daemon thread
(shared by every engine in the process, so litellm's cached async clients always belong to a
live loop), and the progress callback is called in the caller's thread as items finish.

`import litellm` is slow (seconds): it happens inside `load_litellm()`, never at import time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import functools
import hashlib
import json
import logging
import os
import queue
import random
import re
import socket
import threading
import time
import urllib.parse
import warnings
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import EmbeddingConfig, LLMConfig
from ..errors import ConfigError, EngineError
from ..workspace import Cache
from . import grounding, prompts
from .base import (
    AttributeInput,
    ChunkInput,
    CommunityInput,
    Element,
    EngineStats,
    Failure,
    Progress,
    TaskStats,
    Unit,
    identity,
)
from .limiter import SlidingWindowLimiter

CACHE_NS = "llm"
EMBED_NS = "embedding"
CACHE_VERSION = 1
CHECK_TASK = "check_connection"
"""Stats task under which `check_connection`'s one tiny call is accounted."""

_log = logging.getLogger("noderag.llm")
_KEY_HOLE = "\x00messages\x00"


def _one_line(text: Any, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


_CLASS_PREFIX = re.compile(r"\b(?:litellm\.)?[A-Za-z_]+(?:Error|Exception)\s*(?::|-)\s+")


def _first_line(err: BaseException) -> str:
    """The gist of an error: its first line without the chain of class-name prefixes litellm adds."""
    text = _CLASS_PREFIX.sub("", str(err).strip()).replace("Error code: ", "HTTP ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return _one_line(lines[0] if lines else type(err).__name__, 200)


def _root_cause(err: BaseException) -> str:
    """What went wrong at the bottom of an exception chain, briefly (for connection failures)."""
    root = err
    for _ in range(8):
        nxt = root.__cause__ or root.__context__
        if nxt is None:
            break
        root = nxt
    if isinstance(root, ConnectionRefusedError):
        return "connection refused"
    if isinstance(root, OSError) and root.strerror:
        return root.strerror
    return _first_line(root)


# --------------------------------------------------------------------------- litellm import
_LITELLM: Any = None
_IMPORT_LOCK = threading.Lock()


def load_litellm():
    """litellm, imported on first use with its price table local and its chatter off."""
    global _LITELLM
    if _LITELLM is None:
        with _IMPORT_LOCK:
            if _LITELLM is None:
                os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                os.environ.setdefault("LITELLM_LOG", "CRITICAL")
                # its pydantic models warn about ReadOnly TypedDict items, at import and first use
                warnings.filterwarnings("ignore", message=r"Items? '.*' on TypedDict class", category=UserWarning)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import litellm

                litellm.telemetry = False
                litellm.suppress_debug_info = True
                litellm.disable_hf_tokenizer_download = True  # token counts must never hit the network
                for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm", "httpx", "openai"):
                    logging.getLogger(name).setLevel(logging.CRITICAL)
                _LITELLM = litellm
    return _LITELLM


# --------------------------------------------------------------------------- event loop
class _LoopThread:
    """One asyncio loop in a daemon thread, shared by all engines of a process."""

    _instance: _LoopThread | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name="noderag-llm-loop", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @classmethod
    def get(cls) -> _LoopThread:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid() or not cls._instance.thread.is_alive():
                cls._instance = cls()
            return cls._instance

    def run(self, make: Callable[[Callable[[int], None]], Awaitable[Any]], progress: Progress | None = None) -> Any:
        """Run `make(report)` on the loop; `report(n)` reaches `progress` in this thread."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        done = object()
        future = asyncio.run_coroutine_threadsafe(make(events.put), self.loop)  # type: ignore[arg-type]
        future.add_done_callback(lambda _f: events.put(done))
        try:
            while True:
                try:
                    event = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if event is done:
                    break
                if progress is not None:
                    progress(event)
            return future.result()
        except BaseException:
            future.cancel()
            _CacheWriter.drain()
            raise


class _CacheWriter:
    """One thread for the cache writes of every engine of a process.

    A write is a SQLite commit: a few system calls per write and, every few hundred writes, a WAL
    checkpoint with fsync. On this thread the event loop sends the next request meanwhile. The
    item still counts as done only once its write is committed, and an interrupted batch waits
    for the writes already queued, so a killed run re-pays nothing.
    """

    _instance: _CacheWriter | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="noderag-cache")

    @classmethod
    def get(cls) -> _CacheWriter:
        with cls._lock:
            if cls._instance is None or cls._instance.pid != os.getpid():
                cls._instance = cls()
            return cls._instance

    async def put(self, cache: Cache, ns: str, key: str, value: bytes) -> None:
        """Committed when this returns; a cancelled caller does not cancel the write."""
        await asyncio.shield(asyncio.get_running_loop().run_in_executor(self.pool, cache.put, ns, key, value))

    @classmethod
    def drain(cls, timeout: float = 30.0) -> None:
        """Wait for the writes queued so far (after an interrupted batch)."""
        writer = cls._instance
        if writer is not None and writer.pid == os.getpid():
            with contextlib.suppress(Exception):
                writer.pool.submit(int).result(timeout)


# --------------------------------------------------------------------------- on a cluster
CLUSTER_BATCH = 8  # distinct requests per task on a cluster's worker


class _Recorder:
    """The cache of an engine on a cluster's worker: nothing to find, writes kept for the driver."""

    read_only = False

    def __init__(self) -> None:
        self.written: list[tuple[str, bytes]] = []

    def get_many(self, ns: str, keys) -> dict:
        return {}

    def put_many(self, ns: str, items) -> None:
        self.written.extend(items)

    def put(self, ns: str, key: str, value: bytes) -> None:
        self.written.append((key, value))


def remote_batch(job) -> tuple[list, list[tuple[str, bytes]], TaskStats | None, dict]:
    """A cluster worker's share of `LiteLLMEngine._batch_on_cluster`: the items' replies (or
    Failure), the cache entries to write, the task's accounting and its failure reasons."""
    config, task, items, limiter, _ = job
    cache = _Recorder()
    engine = LiteLLMEngine(config, cache, limiter=limiter)  # type: ignore[arg-type]
    values = engine._batch(task, items, None)
    _CacheWriter.drain()
    return values, cache.written, engine.stats.by_task.get(task), dict(engine.stats.failure_reasons)


# --------------------------------------------------------------------------- retries
class _CallFailed(Exception):
    """A request given up on; `category` is what `EngineStats.failure_reasons` counts."""

    def __init__(self, category: str, detail: str = ""):
        super().__init__(f"{category}: {detail}" if detail else category)
        self.category = category


def _status(err: BaseException) -> int | None:
    code = getattr(err, "status_code", None)
    if code is None:
        response = getattr(err, "response", None)
        code = getattr(response, "status_code", None)
    try:
        return int(code) if code is not None else None
    except (TypeError, ValueError):
        return None


def retry_after_seconds(err: BaseException) -> float | None:
    """Seconds asked for by a Retry-After (or retry-after-ms) header on the error's response."""
    header_sets = []
    response = getattr(err, "response", None)
    if response is not None and getattr(response, "headers", None) is not None:
        header_sets.append(response.headers)
    extra = getattr(err, "litellm_response_headers", None)
    if extra is not None:
        header_sets.append(extra)
    for headers in header_sets:
        try:
            lowered = {str(k).lower(): str(v) for k, v in dict(headers).items()}
        except (TypeError, ValueError):
            continue
        if "retry-after-ms" in lowered:
            with contextlib.suppress(ValueError):
                return max(0.0, float(lowered["retry-after-ms"]) / 1000)
        value = lowered.get("retry-after")
        if value:
            try:
                return max(0.0, float(value))
            except ValueError:
                parsed = email.utils.parsedate_tz(value)
                if parsed is not None:
                    return max(0.0, email.utils.mktime_tz(parsed) - time.time())
    return None


def _classify(err: BaseException) -> str:
    """rate_limit | transient | refused_format | bad_request | context | fatal_auth | fatal_model | unexpected"""
    lt = load_litellm()
    status = _status(err)
    if isinstance(err, lt.RateLimitError) or status == 429:
        return "rate_limit"
    if isinstance(err, lt.ContextWindowExceededError):
        return "context"
    if isinstance(err, (lt.AuthenticationError, lt.PermissionDeniedError)) or status in (401, 403):
        return "fatal_auth"
    if isinstance(err, lt.NotFoundError) or status == 404:
        return "fatal_model"
    bad_request = isinstance(err, (lt.BadRequestError, lt.UnprocessableEntityError)) or status in (400, 422)
    if bad_request or status == 500:
        # llama-cpp-python answers an unsupported response_format with a 500 validation error
        text = str(err).lower()
        if any(word in text for word in ("response_format", "json_schema", "response format", "grammar")):
            return "refused_format"
    if bad_request:
        return "bad_request"
    if isinstance(err, (lt.Timeout, lt.APIConnectionError, lt.InternalServerError, lt.ServiceUnavailableError,
                        lt.BadGatewayError, lt.APIError, lt.APIResponseValidationError)):
        return "transient"
    if status is not None and status >= 500:
        return "transient"
    if isinstance(err, (asyncio.TimeoutError, ConnectionError, OSError)):
        return "transient"
    return "unexpected"


def _is_timeout(err: BaseException) -> bool:
    return isinstance(err, (load_litellm().Timeout, asyncio.TimeoutError))


def _is_connection_error(err: BaseException) -> bool:
    """No HTTP exchange happened: refused, unresolvable, reset. litellm sometimes wraps these in a
    500-looking InternalServerError("Connection error."), so the cause chain is read too."""
    lt = load_litellm()
    seen: BaseException | None = err
    for _ in range(6):
        if seen is None:
            break
        if isinstance(seen, (ConnectionError, lt.APIConnectionError)) and not _is_timeout(seen):
            return True
        if type(seen).__name__ in ("ConnectError", "ConnectTimeout", "gaierror"):
            return True
        seen = seen.__cause__ or seen.__context__
    return "connection error" in str(err).lower()


def _transient_category(err: BaseException) -> str:
    if _is_timeout(err):
        return "timeout"
    if _is_connection_error(err):
        return "connection error"
    status = _status(err)
    if status is not None and status >= 500:
        return f"server error {status}"
    return "server error"


@dataclass
class _Policy:
    retries: int
    rate_limit_wait: float  # seconds one item may wait on 429s in total
    backoff_base: float
    backoff_max: float

    def backoff(self, attempt: int) -> float:
        """Exponential backoff with jitter ("equal jitter": half fixed, half random)."""
        delay = min(self.backoff_max, self.backoff_base * (2 ** max(0, attempt - 1)))
        return delay / 2 + random.uniform(0, delay / 2)

    def honour(self, asked: float | None, attempt: int) -> float:
        if asked is None:
            return self.backoff(attempt)
        return min(asked, max(self.backoff_max, 120.0)) + random.uniform(0, 0.05 + 0.05 * asked)


# --------------------------------------------------------------------------- the engine
@dataclass
class _Lookup:
    messages: list[list[dict]]  # each item's request
    results: list[Any]  # each item's result, None where still to ask
    todo: dict[str, list[int]]  # key -> the positions of the items with that request
    hits: int  # items the cache answered


@dataclass
class _Reply:
    text: str
    cut_off: bool
    max_tokens: int = 0  # the output limit the request had
    room: int = 0  # the most the context window left for the reply


class LiteLLMEngine:
    """NodeRAG's LLM tasks through litellm. See the module docstring for the behaviour.

    Keyword-only knobs exist for tests and benchmarks: `window_seconds` (the rate limiter's
    window, 60 s for per-minute limits), `backoff_base`/`backoff_max` (seconds).
    """

    NOTICE_SECONDS = 10.0

    def __init__(
        self,
        config: LLMConfig,
        cache: Cache,
        *,
        window_seconds: float = 60.0,
        backoff_base: float = 1.0,
        backoff_max: float = 60.0,
        limiter=None,
        executor=None,
    ):
        self.config = config
        self.cache = cache
        self.executor = executor  # a cluster's executor (`shared_limiter`): uncached calls run on its workers
        self.model = config.model
        try:
            self.prompts = prompts.prompt_set(config.prompts)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        self.identity = identity(config, self.prompts)
        self.name = self.identity["name"]
        self.stats = EngineStats()
        self.price_known: bool | None = None
        """None until a call was priced; False once a call's model had no price (its cost counted 0)."""
        self.limiter = limiter or SlidingWindowLimiter(config.requests_per_minute, config.tokens_per_minute,
                                                       window_seconds)
        self.policy = _Policy(config.retries, config.rate_limit_wait_seconds, backoff_base, backoff_max)
        self.notice: Callable[[str], None] | None = None  # where waits on the server are shown (the CLI's progress)
        self.check_before_first_call = False  # `check_connection` before the first request (the CLI's runs)
        self._connection_checked = False
        self._last_notice = float("-inf")
        self._structured = "json_schema" if config.structured_output else "none"
        self._semaphore: asyncio.Semaphore | None = None
        self._provider: str | None = None
        self._key_formats: dict[str, dict | None] = {}
        self._key_templates: dict[tuple, tuple[str, str]] = {}

    # -- configuration checks ------------------------------------------------------
    def _api_key(self) -> str | None:
        """The key from `api_key_env`; EngineError naming the variable when it is missing."""
        env = self.config.api_key_env
        if env:
            value = os.environ.get(env, "").strip()
            if not value:
                raise EngineError(f"environment variable {env} (named by llm.api_key_env) is not set; "
                                  f"export it with the API key for {self.model}")
            return value
        return None

    def _safe(self, text: str) -> str:
        """`text` without the API key, should a provider echo it in an error."""
        env = self.config.api_key_env
        key = os.environ.get(env, "").strip() if env else ""
        return text.replace(key, "***") if len(key) >= 4 else text

    def _route(self) -> str:
        if self._provider is None:
            self._provider = route_model(self.model, self.config.api_base)
        return self._provider

    def _request_auth(self) -> dict:
        key = self._api_key()
        provider = self._route()
        params: dict[str, Any] = {}
        if self.config.api_base:
            params["api_base"] = self.config.api_base
        if key is not None:
            params["api_key"] = key
        elif provider == "openai" and self.config.api_base and not os.environ.get("OPENAI_API_KEY"):
            params["api_key"] = "no-key"  # local OpenAI-compatible servers want none; the SDK wants one
        if provider in ("ollama", "ollama_chat"):
            params["num_ctx"] = self.config.context_window
        return params

    def check_connection(self, task: str = CHECK_TASK) -> None:
        """One tiny call before the first request of a run (accounted under `task`: its tokens and
        `connection_checks`); EngineError (one line) when it cannot work. A server at an address
        that refuses connections is found before litellm is even imported."""
        self._connection_checked = True
        _refuses_connections(self.config.api_base)
        auth = self._request_auth()  # key and routing are checked before any network traffic
        where = self.config.api_base or f"the {self._route()} API"
        lt = load_litellm()
        timeout = min(self.config.timeout_seconds, 120.0)  # a local server may first load its model

        async def probe(_report):
            return await lt.acompletion(
                model=self.model, messages=[{"role": "user", "content": "Reply with the word OK."}],
                max_tokens=16, temperature=self.config.temperature, timeout=timeout,
                num_retries=0, max_retries=0, drop_params=True, **auth,
            )

        stats = self.stats.task(task)
        stats.connection_checks += 1
        try:
            response = _LoopThread.get().run(probe)
        except Exception as err:
            kind = _classify(err)
            detail = self._safe(_first_line(err))
            if kind == "rate_limit":
                return  # reachable and authorised, just busy: the run will wait as needed
            if kind == "fatal_auth":
                source = f"${self.config.api_key_env}" if self.config.api_key_env else "the provider's default variable"
                raise EngineError(f"{where} rejected the API key from {source} for model {self.model}: {detail}") from None
            if kind == "fatal_model":
                raise EngineError(f"model '{self.model}' is not served by {where}: {detail}") from None
            if _is_timeout(err):
                raise EngineError(f"no reply from {where} within {timeout:g} s (model {self.model})") from None
            if _is_connection_error(err):
                raise EngineError(f"cannot reach the LLM server at {where}: {_root_cause(err)}") from None
            raise EngineError(f"test call to {self.model} at {where} failed: {detail}") from None
        self._account(stats, response)

    # -- public task methods -----------------------------------------------------------
    def decompose(self, chunks: Sequence[ChunkInput], progress: Progress | None = None) -> list[list[Unit] | Failure]:
        return self._batch("decompose", list(chunks), progress)

    def attributes(self, items: Sequence[AttributeInput], progress: Progress | None = None) -> list[str | Failure]:
        return self._batch("attributes", list(items), progress)

    def community_elements(
        self, items: Sequence[CommunityInput], progress: Progress | None = None
    ) -> list[list[Element] | Failure]:
        return self._batch("community_elements", list(items), progress)

    def query_entities_batch(self, questions: Sequence[str], progress: Progress | None = None) -> list[list[str] | Failure]:
        return self._batch("query_entities", list(questions), progress)

    def answer_batch(self, items: Sequence[tuple[str, str]], progress: Progress | None = None) -> list[str | Failure]:
        """Answers for (question, context) pairs, concurrently (for evaluation runs)."""
        return self._batch("answer", [(q, c) for q, c in items], progress)

    def query_entities(self, question: str) -> list[str]:
        """The question's entities; [] when the model gives no usable list (counted as a failure)."""
        result = self._batch("query_entities", [question], None)[0]
        return [] if isinstance(result, Failure) else result

    def passage(self, question: str) -> str:
        """HyDE's hypothetical passage answering the question; EngineError when none is usable."""
        result = self._batch("passage", [question], None)[0]
        if isinstance(result, Failure):
            raise EngineError(f"no usable passage from {self.model}: {result.reason}")
        return result

    def answer(self, question: str, context: str) -> str:
        """The answer from the context; EngineError when the model gives no usable answer."""
        result = self._batch("answer", [(question, context)], None)[0]
        if isinstance(result, Failure):
            raise EngineError(f"no usable answer from {self.model}: {result.reason}")
        return result

    # -- batch machinery -----------------------------------------------------------------
    def request_key(self, task: str, messages: list[dict]) -> str:
        """Content address of a request: model, messages and the parameters that shape the reply.

        The digest of `json_digest({"v", "model", "messages", "temperature", "max_output_tokens",
        "response_format"})`, with the JSON of everything but the messages made once per task (the
        response_format schema is most of the serialising otherwise): JSON without indent is
        compositional, so the bytes, and the keys of existing caches, are the same.
        """
        head, tail = self._key_template(task, self.config.temperature, self.config.max_output_tokens)
        text = head + json.dumps(messages, sort_keys=True) + tail
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def _key_template(self, task: str, temperature: float, max_output_tokens: int) -> tuple[str, str]:
        """The request key's JSON before and after the messages."""
        found = self._key_templates.get((task, temperature, max_output_tokens))
        if found is None:
            text = json.dumps({
                "v": CACHE_VERSION,
                "model": self.model,
                "messages": _KEY_HOLE,
                "temperature": temperature,
                "max_output_tokens": max_output_tokens,
                "response_format": self._key_format(task),
            }, sort_keys=True)
            head, _, tail = text.partition(json.dumps(_KEY_HOLE))
            found = self._key_templates[(task, temperature, max_output_tokens)] = (head, tail)
        return found

    def _key_format(self, task: str) -> dict | None:
        """The response_format part of `request_key`, built once per task (it is only serialised)."""
        if task not in self._key_formats:
            mode = "json_schema" if self.config.structured_output else "none"
            self._key_formats[task] = prompts.response_format_for(task, mode)
        return self._key_formats[task]

    def _batch(self, task: str, items: list, progress: Progress | None) -> list:
        """Each item's result: from the cache, else asked. A batch the cache answers whole needs
        neither litellm nor the server (an index run with nothing new starts as fast as offline);
        with `check_before_first_call`, the first batch with anything to ask checks the connection."""
        if not items:
            return []
        lookup = self._lookup(task, items)
        if lookup.hits and progress:
            progress(lookup.hits)
        if not lookup.todo:
            return lookup.results
        if self.check_before_first_call and not self._connection_checked:
            self.check_connection(task)
        auth = self._request_auth()  # before any call: missing key / unroutable model
        if self.executor is not None and hasattr(self.executor, "shared_limiter"):
            return self._batch_on_cluster(task, items, lookup, progress)
        load_litellm()
        return _LoopThread.get().run(lambda report: self._abatch(task, lookup, auth, report), progress)

    def _lookup(self, task: str, items: list) -> _Lookup:
        """The items' requests, what the cache already holds (counted as hits), and the rest by key
        (an item repeated in the batch rides along with its first copy, also a hit)."""
        stats = self.stats.task(task)
        messages = [self.prompts.messages(task, item) for item in items]
        keys = [self.request_key(task, m) for m in messages]
        found = self.cache.get_many(CACHE_NS, keys)
        results: list[Any] = [self._from_cache(task, found.get(key), m) for key, m in zip(keys, messages, strict=True)]
        todo: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            if results[index] is None:
                todo.setdefault(key, []).append(index)
        hits = len(items) - sum(len(rows) for rows in todo.values())
        stats.cache_hits += hits + sum(len(rows) - 1 for rows in todo.values())
        return _Lookup(messages, results, todo, hits)

    def _batch_on_cluster(self, task: str, items: list, lookup: _Lookup, progress: Progress | None) -> list:
        """`_batch` with the uncached requests as tasks on a cluster's workers (`remote_batch`),
        each admitted by the cluster's one limiter; cache look-ups, cache writes and accounting
        stay here, so a rerun finds every finished reply as a local run would."""
        stats = self.stats.task(task)
        results = lookup.results
        groups = list(lookup.todo.values())
        limiter = self.executor.shared_limiter(self.config)
        jobs = [(self.config, task, [items[rows[0]] for rows in groups[i : i + CLUSTER_BATCH]], limiter, i)
                for i in range(0, len(groups), CLUSTER_BATCH)]

        def done(job, outcome) -> None:
            values, written, delta, reasons = outcome
            self.cache.put_many(CACHE_NS, written)
            if delta is not None:
                stats.add(delta)
            self.stats.failure_reasons.update(reasons)
            for rows, value in zip(groups[job[4] : job[4] + CLUSTER_BATCH], values, strict=True):
                for row in rows:
                    results[row] = value
            if progress:
                progress(sum(len(rows) for rows in groups[job[4] : job[4] + CLUSTER_BATCH]))

        self.executor.map(remote_batch, jobs, done)
        return results

    async def _abatch(self, task: str, lookup: _Lookup, auth: dict, report: Callable[[int], None]) -> list:
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.config.concurrency)
        stats = self.stats.task(task)
        messages, results, todo = lookup.messages, lookup.results, lookup.todo

        async def one(key: str, rows: list[int]) -> None:
            outcome = await self._item(task, messages[rows[0]], key, auth)
            for row in rows:
                results[row] = outcome
                if isinstance(outcome, Failure):
                    stats.failures += 1
                    self.stats.failure_reasons[outcome.reason.split(":", 1)[0]] += 1
            report(len(rows))

        tasks = [asyncio.ensure_future(one(key, rows)) for key, rows in todo.items()]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for pending in tasks:
                pending.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return results

    def _from_cache(self, task: str, blob: bytes | None, messages: list[dict]) -> Any:
        if blob is None:
            return None
        try:
            reply = prompts.SPECS[task].schema.model_validate(json.loads(blob)["data"])
        except (ValueError, KeyError, TypeError):
            return None  # an entry this version cannot read is simply recomputed
        return self._result(task, reply, messages)

    def _result(self, task: str, reply: Any, messages: list[dict]) -> Any:
        """The item's result from a validated reply: grounded in the item's input (the user message)."""
        result = prompts.result_of(task, reply)
        if not self.config.grounding:
            return result
        result, dropped = grounding.ground(task, result, messages[1]["content"])
        self.stats.task(task).ungrounded += dropped
        return result

    def _parse(self, task: str, reply: _Reply, messages: list[dict]) -> Any:
        """A validated reply, or ReplyError: also for one that echoes the prompt's example."""
        parsed = prompts.parse_reply(task, reply.text, reply.cut_off)
        echo = grounding.echo_of(parsed, messages[0]["content"], messages[1]["content"]) if self.config.grounding \
            else None
        if echo is not None:
            raise prompts.ReplyError(f"it repeats {echo!r} from the instructions' example, which the input does not "
                                     "hold; extract only from the input")
        return parsed

    async def _item(self, task: str, messages: list[dict], key: str, auth: dict) -> Any:
        stats = self.stats.task(task)
        try:
            first = await self._complete(task, messages, auth, stats)
            try:
                reply = self._parse(task, first, messages)
                corrected = False
            except prompts.ReplyError as err:
                if first.cut_off:  # the same request would be cut off again: once more with room to finish
                    return await self._longer(task, messages, key, auth, first)
                retry = [*messages, {"role": "assistant", "content": first.text[:4000]},
                         {"role": "user", "content": prompts.correction_message(str(err))}]
                second = await self._complete(task, retry, auth, stats)
                try:
                    reply = self._parse(task, second, messages)
                except prompts.ReplyError as err2:
                    return Failure(f"invalid reply: {err2} (after one corrective retry)")
                first, corrected = second, True
        except _CallFailed as err:
            return Failure(self._safe(str(err)))
        return await self._keep(task, key, reply, first.text, corrected, messages)

    async def _keep(self, task: str, key: str, reply: Any, text: str, corrected: bool, messages: list[dict]) -> Any:
        """Cache a usable reply (as validated, before grounding) and return the item's result."""
        value = json.dumps({"data": reply.model_dump(mode="json"), "reply": text, "corrected": corrected})
        await _CacheWriter.get().put(self.cache, CACHE_NS, key, value.encode())
        return self._result(task, reply, messages)

    async def _longer(self, task: str, messages: list[dict], key: str, auth: dict, cut: _Reply) -> Any:
        """A reply cut off at its output limit: asked again once with twice the limit (as far as the
        context window allows); if that is cut off too, a failure that names the setting to change."""
        stats = self.stats.task(task)
        prompt = self.config.context_window - cut.room
        advice = (f"raise llm.max_output_tokens to {2 * cut.max_tokens} (and llm.context_window to at least "
                  f"{prompt + 2 * cut.max_tokens}), or lower chunk.chunk_tokens so that inputs are shorter")
        if cut.max_tokens >= cut.room:
            return Failure(f"cut off: the reply reached the {cut.max_tokens} output tokens the context window "
                           f"leaves; {advice}")
        try:
            again = await self._complete(task, messages, auth, stats, min(2 * cut.max_tokens, cut.room))
            reply = self._parse(task, again, messages)
        except _CallFailed as err:
            return Failure(self._safe(str(err)))
        except prompts.ReplyError as err:
            if again.cut_off:
                return Failure(f"cut off: the reply reached the output limit at {cut.max_tokens} tokens and again at "
                               f"{again.max_tokens}; {advice.replace(str(2 * cut.max_tokens), str(2 * again.max_tokens))}")
            return Failure(f"invalid reply: {err} (after a retry with a larger output limit)")
        return await self._keep(task, key, reply, again.text, False, messages)

    async def _complete(self, task: str, messages: list[dict], auth: dict, stats: TaskStats,
                        max_tokens: int | None = None) -> _Reply:
        """One reply, through limiter, semaphore and retries; `_CallFailed` when given up. Its
        output limit: llm.max_output_tokens (or `max_tokens`), at most what the context window leaves."""
        lt = load_litellm()
        prompt_tokens = self._prompt_tokens(messages)
        room = self.config.context_window - prompt_tokens
        if room < 16:
            raise _CallFailed("input too long", f"about {prompt_tokens} prompt tokens for a context window of "
                                                f"{self.config.context_window}")
        max_tokens = min(max_tokens or self.config.max_output_tokens, room)
        attempts = 0
        waited = 0.0
        assert self._semaphore is not None
        while True:
            params: dict[str, Any] = {
                "model": self.model, "messages": messages, "temperature": self.config.temperature,
                "max_tokens": max_tokens, "timeout": self.config.timeout_seconds,
                "num_retries": 0, "max_retries": 0, "drop_params": True, **auth,
            }
            async with self._semaphore:
                reservation = await self.limiter.acquire(prompt_tokens + max_tokens)
                mode = self._structured  # read late: a refusal seen while this request waited counts
                response_format = prompts.response_format_for(task, mode)
                if mode == "json_object_schema":
                    params["extra_body"] = {"response_format": response_format}  # litellm drops unknown keys
                elif response_format is not None:
                    params["response_format"] = response_format
                stats.calls += 1
                try:
                    response = await asyncio.wait_for(lt.acompletion(**params), self.config.timeout_seconds + 10)
                except Exception as err:  # classified below; anything unknown becomes an item failure
                    error: Exception | None = err
                else:
                    error = None
            if error is None:
                in_tok, out_tok = self._account(stats, response)
                self.limiter.settle(reservation, in_tok + out_tok or prompt_tokens + max_tokens)
                choice = response.choices[0]
                text = getattr(choice.message, "content", None) or ""
                return _Reply(text, getattr(choice, "finish_reason", None) == "length", max_tokens, room)
            kind = _classify(error)
            self.limiter.settle(reservation, 0 if kind == "rate_limit" else prompt_tokens)
            if kind == "rate_limit":
                if waited >= self.policy.rate_limit_wait:
                    raise _CallFailed("rate limited", f"still 429 after waiting {waited:.0f} s in total "
                                                      "(llm.rate_limit_wait_seconds)")
                delay = min(self.policy.honour(retry_after_seconds(error), stats.rate_limit_waits + 1),
                            self.policy.rate_limit_wait - waited + 0.01)
                waited += delay
                self._waiting(stats, delay)
                self.limiter.pause(delay)
                continue
            if kind == "refused_format" and mode != "none":
                if self._structured == mode:  # concurrent refusals of the same mode step down once
                    self._structured = prompts.WEAKER_FORMAT[mode]
                    _log.info("server refused response_format %s (%s); using %s", mode,
                              _first_line(error), self._structured)
                continue
            if kind == "fatal_auth":
                source = f"${self.config.api_key_env}" if self.config.api_key_env else "the provider's default variable"
                raise EngineError(self._safe(f"the provider rejected the API key from {source} for {self.model}: "
                                             f"{_first_line(error)}"))
            if kind == "fatal_model":
                raise EngineError(self._safe(f"model '{self.model}' not found: {_first_line(error)}"))
            if kind == "context":
                raise _CallFailed("input too long", _first_line(error))
            if kind == "refused_format":  # even without response_format: judge it by its status
                kind = "transient" if (_status(error) or 0) >= 500 else "bad_request"
            if kind == "bad_request":
                raise _CallFailed("bad request", _first_line(error))
            if kind == "unexpected":
                raise _CallFailed("unexpected error", f"{type(error).__name__}: {_first_line(error)}")
            attempts += 1
            category = _transient_category(error)
            if attempts > self.policy.retries:
                raise _CallFailed(category, f"gave up after {attempts} attempts: {_first_line(error)}")
            delay = self.policy.honour(retry_after_seconds(error), attempts)
            _log.info("%s from %s, retry %d in %.1f s", category, self.model, attempts, delay)
            await asyncio.sleep(delay)

    def _waiting(self, stats: TaskStats, delay: float) -> None:
        """Count, log and show one wait on a 429 (shown at the first and then every NOTICE_SECONDS)."""
        stats.rate_limit_waits += 1
        stats.rate_limit_seconds += delay
        waits = sum(s.rate_limit_waits for s in self.stats.by_task.values())
        message = f"rate-limited by the server, waiting {delay:.0f} s; {waits} wait(s) so far"
        _log.info("%s (%s)", message, self.model)
        now = time.monotonic()
        if self.notice is not None and now - self._last_notice >= self.NOTICE_SECONDS:
            self._last_notice = now
            self.notice(message)

    def _prompt_tokens(self, messages: list[dict]) -> int:
        """The prompt's tokens where the count matters, else an upper bound.

        An exact count tokenises the whole prompt (about 0.1 ms). It matters for a tokens-per-minute
        limit and when the prompt may not leave room for a full reply; otherwise the bound gives
        the same max_tokens and the same checks.
        """
        if self.limiter.max_tokens is None:
            bound = prompt_token_bound(self.model, messages)
            if bound + max(16, self.config.max_output_tokens) <= self.config.context_window:
                return bound
        return count_tokens(self.model, messages)

    def _account(self, stats: TaskStats, response: Any) -> tuple[int, int]:
        usage = getattr(response, "usage", None)
        in_tok = int(getattr(usage, "prompt_tokens", 0) or 0)
        out_tok = int(getattr(usage, "completion_tokens", 0) or 0)
        stats.input_tokens += in_tok
        stats.output_tokens += out_tok
        cost = price_of(self.model, in_tok, out_tok)
        if cost is None:
            self.price_known = False
        else:
            stats.cost_usd += cost
            if self.price_known is None:
                self.price_known = True
        return in_tok, out_tok


# --------------------------------------------------------------------------- helpers for other modules
def _refuses_connections(api_base: str | None) -> None:
    """EngineError when the server at api_base refuses a TCP connection (nothing listens there):
    said in a second, without the seconds litellm takes to import. Behind a proxy, or without an
    address (a provider's API), litellm's own call decides."""
    if not api_base or any(os.environ.get(v) for v in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy",
                                                        "https_proxy", "all_proxy")):
        return
    url = urllib.parse.urlsplit(api_base)
    if not url.hostname:
        return
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=3).close()
    except ConnectionRefusedError:
        raise EngineError(f"cannot reach the LLM server at {api_base}: connection refused") from None
    except OSError:
        return  # unresolvable, timed out...: litellm's call says it in its words


def route_model(model: str, api_base: str | None = None) -> str:
    """The litellm provider of `model`; EngineError when litellm cannot route it."""
    lt = load_litellm()
    try:
        return lt.get_llm_provider(model=model, api_base=api_base)[1]
    except Exception:
        raise EngineError(
            f"litellm cannot route model '{model}': unknown provider; name it as provider/model, "
            "e.g. openai/gpt-4o-mini, ollama_chat/qwen2.5:7b, or openai/NAME with api_base for an "
            "OpenAI-compatible server"
        ) from None


_UNPRICED: set[str] = set()
"""Models litellm's local price table has no price for (the table does not change during a run)."""


def price_of(model: str, input_tokens: int, output_tokens: int) -> float | None:
    """USD for the tokens from litellm's local price table; None when the model has no price.

    The lookup costs about 0.1 ms, so a model found without a price is remembered as such and
    the prices of recent (model, tokens) triples are reused.
    """
    if model in _UNPRICED:
        return None
    cost = _price(model, int(input_tokens), int(output_tokens))
    if cost is None:
        _UNPRICED.add(model)
    return cost


@functools.lru_cache(maxsize=4096)
def _price(model: str, input_tokens: int, output_tokens: int) -> float | None:
    try:
        prompt_cost, completion_cost = load_litellm().cost_per_token(
            model=model, prompt_tokens=input_tokens, completion_tokens=output_tokens
        )
    except Exception:
        return None
    return float(prompt_cost) + float(completion_cost)


def count_tokens(model: str, messages: list[dict]) -> int:
    """Prompt tokens of a request as litellm counts them (tiktoken where the model's tokenizer is unknown).

    litellm's count is additive: a fixed part (which depends only on whether a system message is
    present) plus one term per message. The system prompt is the same for every item of a task,
    so its term is counted once per model and reused; the other messages are counted each time.
    """
    if not _system_first(messages):
        return _count_all(model, messages)
    # count([system, *rest]) = count([system]) + count(rest) - count([]): the fixed part without a
    # system message is in count(rest) and in count([]); the one with it is in count([system])
    return _count_system(model, messages[0]["content"]) + _count_all(model, messages[1:]) - _count_empty(model)


def _system_first(messages: list[dict]) -> bool:
    """A plain system message, then at least one message, none of them a system message."""
    system = messages[0] if messages else None
    return not (system is None or len(messages) == 1 or system.keys() != {"role", "content"}
                or system["role"] != "system" or not isinstance(system["content"], str)
                or any(m.get("role") == "system" for m in messages[1:]))


_MESSAGE_SLACK = 16


def prompt_token_bound(model: str, messages: list[dict]) -> int:
    """At least `count_tokens(model, messages)`, tokenising nothing but the (cached) system prompt.

    In litellm's count a message is a few fixed tokens (3 or 4) plus the tokens of its role and
    content. No token covers less than one byte, so a message's bytes plus 16 bound its term
    (16 also covers tokenizers that add begin and end tokens to each text). Anything else, such
    as a message with a name or non-text content, is counted exactly.
    """
    if not _system_first(messages) or any(
        m.keys() != {"role", "content"} or not isinstance(m["role"], str) or not isinstance(m["content"], str)
        for m in messages[1:]
    ):
        return count_tokens(model, messages)
    return _count_system(model, messages[0]["content"]) + sum(
        _MESSAGE_SLACK + len(m["role"].encode()) + len(m["content"].encode()) for m in messages[1:]
    )


def _count_all(model: str, messages: list[dict]) -> int:
    lt = load_litellm()
    try:
        return int(lt.token_counter(model=model, messages=messages))
    except Exception:
        return int(lt.token_counter(model="gpt-4o-mini", messages=messages))


@functools.lru_cache(maxsize=256)
def _count_system(model: str, content: str) -> int:
    return _count_all(model, [{"role": "system", "content": content}])


@functools.lru_cache(maxsize=64)
def _count_empty(model: str) -> int:
    return _count_all(model, [])


def prompt_tokens_for(task: str, inputs: Sequence[Any], model: str = "gpt-4o-mini",
                      prompt_set: prompts.PromptSet = prompts.BUILT_IN) -> list[int]:
    """Prompt tokens of each task input, with exactly the prompts the engine sends.

    Inputs per task: `decompose` ChunkInput, `attributes` AttributeInput, `community_elements`
    CommunityInput, `query_entities` a question string, `answer` a (question, context) pair.
    Corrective retries are not included (they happen only for bad replies).
    """
    if task not in prompts.SPECS:
        raise ValueError(f"unknown task {task!r}; tasks are {', '.join(prompts.TASKS)}")
    return [count_tokens(model, prompt_set.messages(task, item)) for item in inputs]


def estimate_cost(model: str, calls_by_task: dict[str, tuple[int, int, int]]) -> dict:
    """Cost of a planned run from litellm's local price table.

    `calls_by_task` maps a task to (calls, input tokens, output tokens). Returns
    {"model", "price_known", "tasks": {task: {"calls", "input_tokens", "output_tokens",
    "cost_usd"}}, "total": {... same ...}, "note"}; when the model has no price every cost_usd
    is None and note is "unknown price".
    """
    known = price_of(model, 1000, 1000) is not None
    tasks: dict[str, dict] = {}
    total = {"calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0 if known else None}
    for task, (calls, input_tokens, output_tokens) in calls_by_task.items():
        cost = price_of(model, input_tokens, output_tokens) if known else None
        tasks[task] = {"calls": int(calls), "input_tokens": int(input_tokens),
                       "output_tokens": int(output_tokens), "cost_usd": cost}
        total["calls"] += int(calls)
        total["input_tokens"] += int(input_tokens)
        total["output_tokens"] += int(output_tokens)
        if known and cost is not None:
            total["cost_usd"] += cost
    return {"model": model, "price_known": known, "tasks": tasks, "total": total,
            "note": "" if known else "unknown price"}


# --------------------------------------------------------------------------- embeddings
def embedding_cache_key(config: EmbeddingConfig, text: str) -> str:
    """Same scheme as `embeddings.Embedder`: model id and text, so either finds the other's vectors."""
    model_id = f"{config.backend}:{config.model}:{config.dim}"
    return hashlib.blake2b(f"{model_id}\x1f{text}".encode(), digest_size=16).hexdigest()


def litellm_embed(
    texts: list[str],
    config: EmbeddingConfig,
    cache: Cache | None = None,
    stats: TaskStats | None = None,
    *,
    retries: int = 5,
    timeout: float = 120.0,
    backoff_base: float = 1.0,
) -> np.ndarray:
    """Float32 L2-normalised vectors, one row per text, through `litellm.aembedding`.

    With a `cache`, vectors are looked up and stored (namespace "embedding", key: model + text)
    batch by batch as they return. 429s wait (Retry-After honoured) without using `retries`.
    EngineError when the key variable is missing, the model cannot be routed, the server is
    unreachable after retries, or the vectors do not have `config.dim` dimensions.
    """
    out = np.zeros((len(texts), config.dim), dtype=np.float32)
    if not texts:
        return out
    env = config.api_key_env
    key = None
    if env:
        key = os.environ.get(env, "").strip()
        if not key:
            raise EngineError(f"environment variable {env} (named by embedding.api_key_env) is not set")
    provider = route_model(config.model, config.api_base)
    auth: dict[str, Any] = {}
    if config.api_base:
        auth["api_base"] = config.api_base
    if key:
        auth["api_key"] = key
    elif provider == "openai" and config.api_base and not os.environ.get("OPENAI_API_KEY"):
        auth["api_key"] = "no-key"
    keys = [embedding_cache_key(config, t) for t in texts]
    found = cache.get_many(EMBED_NS, keys) if cache is not None else {}
    todo: dict[str, list[int]] = {}
    for row, k in enumerate(keys):
        blob = found.get(k)
        if blob is not None and len(blob) == 4 * config.dim:
            out[row] = np.frombuffer(blob, dtype=np.float32)
            if stats is not None:
                stats.cache_hits += 1
        else:
            todo.setdefault(k, []).append(row)
    if not todo:
        return out
    policy = _Policy(retries, 600.0, backoff_base, 60.0)
    todo_keys = list(todo)
    lt = load_litellm()

    async def one_batch(batch_keys: list[str]) -> np.ndarray:
        inputs = [texts[todo[k][0]] for k in batch_keys]
        attempts = rate_limited = 0
        waited = 0.0
        while True:
            if stats is not None:
                stats.calls += 1
            try:
                response = await lt.aembedding(model=config.model, input=inputs, timeout=timeout,
                                               num_retries=0, max_retries=0, **auth)
                break
            except Exception as err:
                kind = _classify(err)
                if kind == "rate_limit" and waited < policy.rate_limit_wait:
                    rate_limited += 1
                    delay = policy.honour(retry_after_seconds(err), rate_limited)
                    waited += delay
                    await asyncio.sleep(delay)
                    continue
                if kind == "transient" and attempts < policy.retries:
                    attempts += 1
                    await asyncio.sleep(policy.honour(retry_after_seconds(err), attempts))
                    continue
                where = config.api_base or provider
                raise EngineError(f"embedding with {config.model} at {where} failed: {_first_line(err)}") from None
        data = sorted(response.data, key=lambda d: d["index"] if isinstance(d, dict) else d.index)
        vectors = np.asarray([d["embedding"] if isinstance(d, dict) else d.embedding for d in data], dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(inputs):
            raise EngineError(f"embedding model {config.model} returned {vectors.shape[0]} vectors for {len(inputs)} texts")
        if vectors.shape[1] != config.dim:
            raise EngineError(f"embedding model {config.model} returns {vectors.shape[1]}-dimensional vectors "
                              f"but embedding.dim is {config.dim}; set embedding.dim: {vectors.shape[1]}")
        if stats is not None:
            usage = getattr(response, "usage", None)
            tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
            stats.input_tokens += tokens
            stats.cost_usd += price_of(config.model, tokens, 0) or 0.0
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms == 0, 1, norms)
        if cache is not None:
            cache.put_many(EMBED_NS, [(k, v.astype(np.float32).tobytes()) for k, v in zip(batch_keys, vectors, strict=True)])
        return vectors

    async def run(_report) -> list[np.ndarray]:
        semaphore = asyncio.Semaphore(4)

        async def guarded(batch_keys):
            async with semaphore:
                return await one_batch(batch_keys)

        batches = [todo_keys[i : i + config.batch_size] for i in range(0, len(todo_keys), config.batch_size)]
        return await asyncio.gather(*(guarded(b) for b in batches))

    parts = _LoopThread.get().run(run)
    row_keys = [k for i in range(0, len(todo_keys), config.batch_size) for k in todo_keys[i : i + config.batch_size]]
    for k, vector in zip(row_keys, np.concatenate(parts), strict=True):
        out[todo[k]] = vector
    return out
