"""The one way to a model: every chat and embedding request goes through a `Transport`.

What it owns, once for every caller (the LLM engine's tasks, the embedding client, the
connection check):
- litellm, imported on first use (`load_litellm`; seconds of import, never at module import);
- one asyncio loop in a daemon thread shared by the process (`_LoopThread`) and one thread for
  cache commits (`_CacheWriter`);
- the key from the environment variable the config names (never from a file), routing, and the
  request parameters they give (`Transport.auth`);
- admission: at most `concurrency` requests in flight, each start admitted by a sliding-window
  limiter on requests and tokens per minute (`limiter.py`);
- retries: 429s wait (Retry-After honoured, else exponential backoff with jitter) and pause the
  limiter, until one request has waited `rate_limit_wait` seconds in total; each wait is counted,
  logged ("noderag.llm") and shown through `notice`; timeouts, connection errors and 5xx use
  `retries` attempts with backoff; a rejected key or an unknown model stops with `EngineError`;
- accounting per task (`TaskStats`): calls sent, tokens from each response's usage, cost from
  the config's price or litellm's local price table (`pricing.py`; an unpriced model sets
  `price_known = False`);
- the run's spending cap (`SpendingCap`, shared by a run's transports): a request is sent only
  when its estimated cost, learnt from how the provider billed its task's earlier replies, fits in
  what the cap leaves.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import email.utils
import logging
import os
import queue
import random
import re
import socket
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..cache import Cache
from ..config import Price
from ..errors import EngineError
from ..limiter import SlidingWindowLimiter
from .base import Advance, EngineStats, TaskStats
from .litellm_import import load_litellm
from .pricing import price_of

_log = logging.getLogger("noderag.llm")


def _one_line(text: Any, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


_CLASS_PREFIX = re.compile(r"\b(?:litellm\.)?[A-Za-z_]+(?:Error|Exception)\s*(?::|-)\s+")


def _first_line(err: BaseException) -> str:
    """The gist of an error: its first line without the chain of class-name prefixes litellm adds."""
    text = _CLASS_PREFIX.sub("", str(err).strip()).replace("Error code: ", "HTTP ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return _one_line(lines[0] if lines else type(err).__name__, 200)


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

    def run(self, make: Callable[[Callable[[int], None]], Awaitable[Any]], progress: Advance | None = None) -> Any:
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


# --------------------------------------------------------------------------- spending cap
CAP_REACHED = "spending cap"
"""The failure category of a request not sent because it could pass the cap."""


class SpendingCap:
    """What one run may spend, shared by its transports (which all send from one loop). Each request
    is admitted against estimates of its cost (`Transport._estimate`): `high`, at the most its task's
    earlier replies were billed (tokens counted by the provider against ours, output billed
    including hidden reasoning), and `expected`, at what they were billed on average.

    - A task's first request goes alone: until a reply says how the provider counts and bills, no
      second one of that task is in flight.
    - Requests go together while what was spent, what the requests in flight may cost at most, and
      this one's `high` fit in the limit; past that, each waits for the requests in flight.
    - With nothing in flight, one request goes when what was spent and its `expected` fit; else the
      run stops there (`refused`), its paid work kept.

    So a run whose real cost is under the limit finishes, and the spend passes the limit, if ever, by
    about the cost of the last request sent (the most a request could be billed beyond its estimate)."""

    def __init__(self, limit_usd: float):
        self.limit_usd = limit_usd
        self.spent_usd = 0.0
        self.refused = 0  # requests not sent: the run stops once its in-flight work is kept
        self._reserved = 0.0  # the `high` estimates of the requests in flight
        self._in_flight = 0
        self._busy: dict[str, int] = {}  # requests in flight per task
        self._changed: asyncio.Condition | None = None

    async def admit(self, task: str, calibrated: bool, high: float, expected: float) -> float | None:
        """What is reserved for a request about to be sent (its `high`), or None: not sent, the cap is
        reached. Waits while the rules (class docstring) say to wait."""
        if self._changed is None:
            self._changed = asyncio.Condition()
        async with self._changed:
            while True:
                alone_first = calibrated or not self._busy.get(task)
                if alone_first and self.spent_usd + self._reserved + high <= self.limit_usd:
                    break
                if self._in_flight:
                    await self._changed.wait()
                    continue
                if self.spent_usd + expected <= self.limit_usd:
                    break
                self.refused += 1
                return None
            self._reserved += high
            self._in_flight += 1
            self._busy[task] = self._busy.get(task, 0) + 1
            return high

    async def release(self, task: str, reserved: float) -> None:
        """A request admitted with `reserved` is back (its cost, if any, already charged)."""
        async with self._changed:
            self._reserved -= reserved
            self._in_flight -= 1
            self._busy[task] -= 1
            self._changed.notify_all()

    def charge(self, cost_usd: float) -> None:
        self.spent_usd += cost_usd

    def stopped_message(self) -> str:
        return (f"stopped at the spending cap: spent ${self.spent_usd:.4f} of ${self.limit_usd:.4f}, and the next "
                "request could pass it; what was paid for is kept: run `noderag index` again with a higher "
                "--max-cost (or llm.max_cost_usd) to go on")


@dataclass
class _Billed:
    """How a task's replies were billed against what was sent: input tokens the provider counted per
    token of ours (some count several times as many), and output tokens billed (hidden reasoning
    included, which can pass the requested limit)."""

    replies: int = 0
    input_ratio_max: float = 0.0
    input_ratio_sum: float = 0.0
    output_max: int = 0
    output_sum: int = 0

    def add(self, counted_input: int, billed_input: int, billed_output: int) -> None:
        ratio = billed_input / counted_input if counted_input else 1.0
        self.replies += 1
        self.input_ratio_max = max(self.input_ratio_max, ratio)
        self.input_ratio_sum += ratio
        self.output_max = max(self.output_max, billed_output)
        self.output_sum += billed_output


# --------------------------------------------------------------------------- routing
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


# --------------------------------------------------------------------------- the transport
class Transport:
    """Requests to one model: its key, routing, admission, retries and accounting (see the module
    docstring). `setting` names the config section ("llm", "embedding") in messages; `stats`
    receives each task's accounting. `send` runs on the shared loop (`_LoopThread`)."""

    NOTICE_SECONDS = 10.0

    def __init__(self, model: str, *, setting: str, api_base: str | None, api_key_env: str | None,
                 retries: int, rate_limit_wait: float, timeout: float, concurrency: int,
                 limiter: SlidingWindowLimiter, stats: EngineStats, context_window: int | None = None,
                 backoff_base: float = 1.0, backoff_max: float = 60.0, price: Price | None = None):
        self.model = model
        self.setting = setting
        self.api_base = api_base
        self.api_key_env = api_key_env
        self.timeout = timeout
        self.concurrency = concurrency
        self.context_window = context_window
        self.limiter = limiter
        self.stats = stats
        self.policy = _Policy(retries, rate_limit_wait, backoff_base, backoff_max)
        self.notice: Callable[[str], None] | None = None  # where waits on the server are shown (the CLI's progress)
        self.price = price  # the config's, over litellm's table
        self.price_known: bool | None = None
        """None until a call was priced; False once a call's model had no price (its cost counted 0)."""
        self.cap: SpendingCap | None = None  # the run's, set by the run
        self._billed: dict[str, _Billed] = {}  # per task, for the cap's estimates
        self._last_notice = float("-inf")
        self._waits = 0  # every 429 waited out, the connection check's too
        self._semaphore: asyncio.Semaphore | None = None
        self._provider: str | None = None

    def api_key(self) -> str | None:
        """The key from `api_key_env`; EngineError naming the variable when it is missing."""
        env = self.api_key_env
        if env:
            value = os.environ.get(env, "").strip()
            if not value:
                raise EngineError(f"environment variable {env} (named by {self.setting}.api_key_env) is not set; "
                                  f"export it with the API key for {self.model}")
            return value
        return None

    def safe(self, text: str) -> str:
        """`text` without the API key, should a provider echo it in an error."""
        env = self.api_key_env
        key = os.environ.get(env, "").strip() if env else ""
        return text.replace(key, "***") if len(key) >= 4 else text

    def route(self) -> str:
        if self._provider is None:
            self._provider = route_model(self.model, self.api_base)
        return self._provider

    def where(self) -> str:
        return self.api_base or f"the {self.route()} API"

    def auth(self) -> dict:
        """The request parameters of address and key; EngineError for a missing key or a model
        litellm cannot route (checked before any network traffic)."""
        key = self.api_key()
        provider = self.route()
        params: dict[str, Any] = {}
        if self.api_base:
            params["api_base"] = self.api_base
        if key is not None:
            params["api_key"] = key
        elif provider == "openai" and self.api_base and not os.environ.get("OPENAI_API_KEY"):
            params["api_key"] = "no-key"  # local OpenAI-compatible servers want none; the SDK wants one
        if provider in ("ollama", "ollama_chat") and self.context_window:
            params["num_ctx"] = self.context_window
        return params

    def run(self, make: Callable[[Callable[[int], None]], Awaitable[Any]], progress: Advance | None = None) -> Any:
        """`make(report)` run on the shared loop, `report(n)` reaching `progress` in this thread."""
        return _LoopThread.get().run(make, progress)

    async def send(self, stats: TaskStats, tokens: int, call: Callable[[], Awaitable[Any]],
                   refused_format: Callable[[], bool] | None = None, *, task: str = "",
                   cost_tokens: tuple[int, int] | None = None) -> Any:
        """`call()`'s response, through admission and retries (see the module docstring), accounted
        in `stats`; `tokens` is what the request may use at most (the limiter's reservation).
        `refused_format()`, when a server refuses the requested response format, says whether a
        weaker format was chosen (the request is then sent again). Under a spending cap, `task` and
        `cost_tokens` (input tokens as counted here, the output asked for at most) are what its cost
        is estimated from (`SpendingCap`). `_CallFailed` when given up on this request; EngineError
        when no request to this model can work."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.concurrency)
        attempts = 0
        waited = 0.0
        while True:
            async with self._semaphore:
                reserved = await self._admit(task, cost_tokens or (tokens, 0))
                try:
                    reservation = await self.limiter.acquire(tokens)
                    stats.calls += 1
                    try:
                        response = await asyncio.wait_for(call(), self.timeout + 10)
                    except Exception as err:  # classified below; anything unknown becomes an item failure
                        error: Exception | None = err
                    else:
                        error = None
                        in_tok, out_tok = self.account(stats, response)
                        if cost_tokens is not None:
                            self._billed.setdefault(task, _Billed()).add(cost_tokens[0], in_tok, out_tok)
                finally:
                    if self.cap is not None:
                        await self.cap.release(task, reserved)
            if error is None:
                self.limiter.settle(reservation, in_tok + out_tok or tokens)
                return response
            kind = _classify(error)
            self.limiter.settle(reservation, 0 if kind == "rate_limit" else tokens)
            if kind == "rate_limit":
                if waited >= self.policy.rate_limit_wait:
                    raise _CallFailed("rate limited", f"still 429 after waiting {waited:.0f} s in total "
                                                      f"({self.setting}.rate_limit_wait_seconds)")
                delay = min(self.policy.honour(retry_after_seconds(error), stats.rate_limit_waits + 1),
                            self.policy.rate_limit_wait - waited + 0.01)
                waited += delay
                self._waiting(stats, delay)
                self.limiter.pause(delay)
                continue
            if kind == "refused_format" and refused_format is not None and refused_format():
                _log.info("server refused the response format (%s)", _first_line(error))
                continue
            if kind == "fatal_auth":
                source = f"${self.api_key_env}" if self.api_key_env else "the provider's default variable"
                raise EngineError(self.safe(f"the provider rejected the API key from {source} for {self.model}: "
                                            f"{_first_line(error)}"))
            if kind == "fatal_model":
                raise EngineError(self.safe(f"model '{self.model}' not found: {_first_line(error)}"))
            if kind == "context":
                raise _CallFailed("input too long", _first_line(error))
            if kind == "refused_format":  # no weaker format to try: judge it by its status
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

    async def _admit(self, task: str, cost_tokens: tuple[int, int]) -> float:
        """A request admitted by the cap (what it reserved); `_CallFailed` when the cap refuses it."""
        if self.cap is None:
            return 0.0
        calibrated, high, expected = self._estimate(task, *cost_tokens)
        reserved = await self.cap.admit(task, calibrated, high, expected)
        if reserved is None:
            raise _CallFailed(CAP_REACHED, f"${self.cap.spent_usd:.4f} of ${self.cap.limit_usd:.4f} spent")
        return reserved

    def _estimate(self, task: str, input_tokens: int, output_tokens: int) -> tuple[bool, float, float]:
        """(whether a reply of `task` was billed yet, the most and the expected cost of a request of
        `input_tokens` counted here asking for at most `output_tokens`), from how the task's earlier
        replies were billed; before any, the tokens as they are."""
        billed = self._billed.get(task)

        def cost(tokens_in: float, tokens_out: float) -> float:
            return price_of(self.model, int(tokens_in + 0.999), int(tokens_out + 0.999), self.price) or 0.0

        if billed is None:
            first = cost(input_tokens, output_tokens)
            return False, first, first
        return (True, cost(input_tokens * billed.input_ratio_max, billed.output_max),
                cost(input_tokens * billed.input_ratio_sum / billed.replies, billed.output_sum / billed.replies))

    def _waiting(self, stats: TaskStats, delay: float) -> None:
        """Count, log and show one wait on a 429 (shown at the first and then every NOTICE_SECONDS)."""
        stats.rate_limit_waits += 1
        stats.rate_limit_seconds += delay
        self._waits += 1
        message = f"rate-limited by the server, waiting {delay:.0f} s; {self._waits} wait(s) so far"
        _log.info("%s (%s)", message, self.model)
        now = time.monotonic()
        if self.notice is not None and now - self._last_notice >= self.NOTICE_SECONDS:
            self._last_notice = now
            self.notice(message)

    def account(self, stats: TaskStats, response: Any, charge: bool = True) -> tuple[int, int]:
        """Tokens and cost of one response into `stats` (and, with `charge`, onto the cap): (input
        tokens, output tokens), as the provider billed them."""
        usage = getattr(response, "usage", None)
        in_tok = int(getattr(usage, "prompt_tokens", 0) or 0)
        out_tok = int(getattr(usage, "completion_tokens", 0) or 0)
        stats.input_tokens += in_tok
        stats.output_tokens += out_tok
        cost = price_of(self.model, in_tok, out_tok, self.price)
        if cost is None:
            self.price_known = False
        else:
            stats.cost_usd += cost
            if self.cap is not None and charge:
                self.cap.charge(cost)
            if self.price_known is None:
                self.price_known = True
        return in_tok, out_tok
