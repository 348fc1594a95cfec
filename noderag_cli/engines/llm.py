"""The LLM engine: NodeRAG's five tasks through litellm, for any provider litellm routes.

What it does for every task item (see `prompts.py` for the prompts and reply shapes; every
request goes through `transport.Transport`, which owns the key, admission, retries, 429 waits
and accounting):
- looks the request up in the workspace `Cache` (namespace `cache.LLM`, key: a digest of model,
  messages and the parameters that shape the reply); a hit costs nothing and is counted;
- otherwise asks for structured output (response_format json_schema) when
  `llm.structured_output`; a server that refuses it gets weaker modes for the rest of the run
  (see `prompts.STRUCTURED_MODES`);
- parses the reply tolerantly; a reply that does not validate is shown back to the model ONCE
  with the problem; one cut off at its output limit is asked again once with twice the room; if
  that fails too, the item is a `Failure(reason)`;
- writes each success to the cache as it returns (under the key of the original request, so a
  re-run finds it), committed on a writer thread while the loop sends the next request; an item
  is done only once committed. Failures are never cached: a re-run retries exactly the failed items;
- counts prompt tokens exactly only where the count matters (a tokens-per-minute limit, a prompt
  near the context window); elsewhere an upper bound gives the same max_tokens.

`check_connection()` makes one tiny call and raises `EngineError` for a missing key variable, an
unroutable model or an unreachable server; with `check_before_first_call` (the CLI's runs) it is
made before the first request a run sends, and accounted under that request's task, so a run the
cache answers whole sends nothing. Replies are grounded in their input (`grounding.py`).
`query_entities` returns [] and `answer` raises EngineError when the model gives nothing usable;
`query_entities_batch` and `answer_batch` return `Failure`s like the indexing tasks.

Authentication errors, an unknown model (404) or an unknown provider stop the whole batch with
`EngineError` (one line): every other item would fail the same way. Successes written so far
stay in the cache.

The batch methods are synchronous: coroutines run on the transport's one event loop in a daemon
thread, and the progress callback is called in the caller's thread as items finish.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..cache import LLM, Cache
from ..config import LLMConfig
from ..errors import ConfigError, EngineError, SpendingCapError
from ..limiter import SlidingWindowLimiter
from . import grounding, prompts
from .base import (
    Advance,
    AttributeInput,
    ChunkInput,
    CommunityInput,
    Element,
    Engine,
    EngineStats,
    Failure,
    TaskStats,
    Unit,
)
from .identity import identity
from .litellm_import import load_litellm
from .pricing import count_tokens, prompt_token_bound
from .transport import (
    Transport,
    _CacheWriter,
    _CallFailed,
    _refuses_connections,
)

CACHE_VERSION = 1
CHECK_TASK = "check_connection"
CHECK_TOKENS = 64  # what the check call may use at most, reserved with the limiter
"""Stats task under which `check_connection`'s one tiny call is accounted."""

_log = logging.getLogger("noderag.llm")
_KEY_HOLE = "\x00messages\x00"


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


# --------------------------------------------------------------------------- the engine
@dataclass(frozen=True)
class _Request:
    """One item's request: the messages sent, and the item's own text (its prompt variables), which
    its reply is grounded in whatever template the user message was written from."""

    messages: list[dict]
    variables: dict[str, str]

    @property
    def source(self) -> str:
        return "\n".join(self.variables.values())


@dataclass
class _Lookup:
    requests: list[_Request]  # each item's
    results: list[Any]  # each item's result, None where still to ask
    todo: dict[str, list[int]]  # key -> the positions of the items with that request
    hits: int  # items the cache answered


@dataclass
class _Reply:
    text: str
    cut_off: bool
    max_tokens: int = 0  # the output limit the request had
    room: int = 0  # the most the context window left for the reply


class LiteLLMEngine(Engine):
    """NodeRAG's LLM tasks through litellm. See the module docstring for the behaviour.

    Keyword-only knobs exist for tests and benchmarks: `window_seconds` (the rate limiter's
    window, 60 s for per-minute limits), `backoff_base`/`backoff_max` (seconds).
    """

    NOTICE_SECONDS = 10.0
    asks_a_model = True
    cites_context = True

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
        check_connection: bool = False,
        notice: Callable[[str], None] | None = None,
        cap=None,
    ):
        """`check_connection`: the first batch with anything to ask checks the server first (the
        CLI's runs; a run the cache answers whole never imports litellm). `notice`: where waits on
        the server are shown (the run's progress). `cap`: the run's spending cap
        (engines/transport.SpendingCap)."""
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
        self.transport = Transport(
            config.model, setting="llm", api_base=config.api_base, api_key_env=config.api_key_env,
            retries=config.retries, rate_limit_wait=config.rate_limit_wait_seconds, timeout=config.timeout_seconds,
            concurrency=config.concurrency, stats=self.stats, context_window=config.context_window,
            limiter=limiter or SlidingWindowLimiter(config.requests_per_minute, config.tokens_per_minute, window_seconds),
            backoff_base=backoff_base, backoff_max=backoff_max, price=config.price_per_million_tokens)
        self.transport.notice = notice
        self.transport.cap = cap
        self.check_before_first_call = check_connection
        self._connection_checked = False
        self._structured = "json_schema" if config.structured_output else "none"
        self._key_formats: dict[str, dict | None] = {}
        self._key_templates: dict[tuple, tuple[str, str]] = {}

    # -- the transport's state, as callers see it ---------------------------------------
    @property
    def price_known(self) -> bool | None:
        return self.transport.price_known

    @property
    def limiter(self) -> SlidingWindowLimiter:
        return self.transport.limiter

    def check_connection(self, task: str = CHECK_TASK) -> None:
        """One tiny call before the first request of a run (accounted under `task`: its tokens and
        `connection_checks`); EngineError (one line) when it cannot work. A server at an address
        that refuses connections is found before litellm is even imported."""
        self._connection_checked = True
        _refuses_connections(self.config.api_base)
        auth = self.transport.auth()  # key and routing are checked before any network traffic
        where = self.transport.where()
        lt = load_litellm()
        timeout = min(self.config.timeout_seconds, 120.0)  # a local server may first load its model

        def call():
            return lt.acompletion(
                model=self.model, messages=[{"role": "user", "content": "Reply with the word OK."}],
                max_tokens=16, temperature=self.config.temperature, timeout=timeout,
                num_retries=0, max_retries=0, drop_params=True, **auth,
            )

        attempts = TaskStats()  # its calls are not the task's; its 429 waits are the run's

        async def probe(_report):  # the one retry path of every request: a 5xx or a stall is tried again
            return await self.transport.send(attempts, CHECK_TOKENS, call, task=CHECK_TASK,
                                             cost_tokens=(CHECK_TOKENS - 16, 16))

        stats = self.stats.task(task)
        stats.connection_checks += 1
        try:
            response = self.transport.run(probe)
        except EngineError:
            raise  # a rejected key or an unknown model, said by the transport
        except _CallFailed as err:
            detail = self.transport.safe(str(err))
            if err.category == "timeout":
                raise EngineError(f"no reply from {where} within {timeout:g} s (model {self.model}): {detail}") from None
            if err.category == "connection error":
                raise EngineError(f"cannot reach the LLM server at {where}: {detail}") from None
            raise EngineError(f"test call to {self.model} at {where} failed: {detail}") from None
        finally:
            stats.rate_limit_waits += attempts.rate_limit_waits
            stats.rate_limit_seconds += attempts.rate_limit_seconds
        self.transport.account(stats, response, charge=False)  # (charged once, when it came back)

    # -- public task methods -----------------------------------------------------------
    def decompose(self, chunks: Sequence[ChunkInput], progress: Advance | None = None) -> list[list[Unit] | Failure]:
        return self._batch("decompose", list(chunks), progress)

    def attributes(self, items: Sequence[AttributeInput], progress: Advance | None = None) -> list[str | Failure]:
        return self._batch("attributes", list(items), progress)

    def community_elements(
        self, items: Sequence[CommunityInput], progress: Advance | None = None
    ) -> list[list[Element] | Failure]:
        return self._batch("community_elements", list(items), progress)

    def query_entities_batch(self, questions: Sequence[str], progress: Advance | None = None) -> list[list[str] | Failure]:
        return self._batch("query_entities", list(questions), progress)

    def answer_batch(self, items: Sequence[tuple[str, str]], progress: Advance | None = None) -> list[str | Failure]:
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

    def _batch(self, task: str, items: list, progress: Advance | None) -> list:
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
        auth = self.transport.auth()  # before any call: missing key / unroutable model
        if self.executor is not None and self.executor.remote and self.transport.cap is None:
            # (under a spending cap every request is sent from here, where the cap is checked per request)
            return self._batch_on_cluster(task, items, lookup, progress)
        load_litellm()
        results = self.transport.run(lambda report: self._abatch(task, lookup, auth, report), progress)
        if self.transport.cap is not None and self.transport.cap.refused:
            raise SpendingCapError(self.transport.cap.stopped_message())  # after every reply in flight was kept
        return results

    def cached_results(self, task: str, items: Sequence) -> list:
        """Each item's result as the cache holds it, None where it holds none (no request is made)."""
        return self._lookup(task, list(items)).results

    def _lookup(self, task: str, items: list) -> _Lookup:
        """The items' requests, what the cache already holds (counted as hits), and the rest by key
        (an item repeated in the batch rides along with its first copy, also a hit)."""
        stats = self.stats.task(task)
        requests = [_Request(self.prompts.messages(task, item), prompts.SPECS[task].variables(item)) for item in items]
        keys = [self.request_key(task, r.messages) for r in requests]
        found = self.cache.get_many(LLM, keys)
        results: list[Any] = [self._from_cache(task, found.get(key), r) for key, r in zip(keys, requests, strict=True)]
        todo: dict[str, list[int]] = {}
        for index, key in enumerate(keys):
            if results[index] is None:
                todo.setdefault(key, []).append(index)
        hits = len(items) - sum(len(rows) for rows in todo.values())
        stats.cache_hits += hits + sum(len(rows) - 1 for rows in todo.values())
        return _Lookup(requests, results, todo, hits)

    def _batch_on_cluster(self, task: str, items: list, lookup: _Lookup, progress: Advance | None) -> list:
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
            self.cache.put_many(LLM, written)
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
        stats = self.stats.task(task)
        requests, results, todo = lookup.requests, lookup.results, lookup.todo

        async def one(key: str, rows: list[int]) -> None:
            outcome = await self._item(task, requests[rows[0]], key, auth)
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

    def _from_cache(self, task: str, blob: bytes | None, request: _Request) -> Any:
        if blob is None:
            return None
        try:
            reply = prompts.SPECS[task].schema.model_validate(json.loads(blob)["data"])
        except (ValueError, KeyError, TypeError):
            return None  # an entry this version cannot read is simply recomputed
        return self._result(task, reply, request)

    def _result(self, task: str, reply: Any, request: _Request) -> Any:
        """The item's result from a validated reply: grounded in the item's input."""
        result = prompts.result_of(task, reply)
        if not self.config.grounding:
            return result
        result, dropped = grounding.ground(task, result, request.variables)
        self.stats.task(task).ungrounded += dropped
        return result

    def _parse(self, task: str, reply: _Reply, request: _Request) -> Any:
        """A validated reply, or ReplyError: also for one that echoes the prompt's example."""
        parsed = prompts.parse_reply(task, reply.text, reply.cut_off)
        echo = grounding.echo_of(parsed, request.messages[0]["content"], request.source) if self.config.grounding \
            else None
        if echo is not None:
            raise prompts.ReplyError(f"it repeats {echo!r} from the instructions' example, which the input does not "
                                     "hold; extract only from the input")
        return parsed

    async def _item(self, task: str, request: _Request, key: str, auth: dict) -> Any:
        stats = self.stats.task(task)
        messages = request.messages
        try:
            first = await self._complete(task, messages, auth, stats)
            try:
                reply = self._parse(task, first, request)
                corrected = False
            except prompts.ReplyError as err:
                if first.cut_off:  # the same request would be cut off again: once more with room to finish
                    return await self._longer(task, request, key, auth, first)
                retry = [*messages, {"role": "assistant", "content": first.text[:4000]},
                         {"role": "user", "content": prompts.correction_message(str(err))}]
                second = await self._complete(task, retry, auth, stats)
                try:
                    reply = self._parse(task, second, request)
                except prompts.ReplyError as err2:
                    return Failure(f"invalid reply: {err2} (after one corrective retry)")
                first, corrected = second, True
        except _CallFailed as err:
            return Failure(self.transport.safe(str(err)))
        return await self._keep(task, key, reply, first.text, corrected, request)

    async def _keep(self, task: str, key: str, reply: Any, text: str, corrected: bool, request: _Request) -> Any:
        """Cache a usable reply (as validated, before grounding) and return the item's result."""
        value = json.dumps({"data": reply.model_dump(mode="json"), "reply": text, "corrected": corrected})
        await _CacheWriter.get().put(self.cache, LLM, key, value.encode())
        return self._result(task, reply, request)

    async def _longer(self, task: str, request: _Request, key: str, auth: dict, cut: _Reply) -> Any:
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
            again = await self._complete(task, request.messages, auth, stats, min(2 * cut.max_tokens, cut.room))
            reply = self._parse(task, again, request)
        except _CallFailed as err:
            return Failure(self.transport.safe(str(err)))
        except prompts.ReplyError as err:
            if again.cut_off:
                return Failure(f"cut off: the reply reached the output limit at {cut.max_tokens} tokens and again at "
                               f"{again.max_tokens}; {advice.replace(str(2 * cut.max_tokens), str(2 * again.max_tokens))}")
            return Failure(f"invalid reply: {err} (after a retry with a larger output limit)")
        return await self._keep(task, key, reply, again.text, False, request)

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
        params: dict[str, Any] = {
            "model": self.model, "messages": messages, "temperature": self.config.temperature,
            "max_tokens": max_tokens, "timeout": self.config.timeout_seconds,
            "num_retries": 0, "max_retries": 0, "drop_params": True, **auth,
        }
        sent = {"mode": self._structured}

        def call():
            mode = sent["mode"] = self._structured  # read when sent: a refusal seen while this request waited counts
            response_format = prompts.response_format_for(task, mode)
            request = dict(params)
            if mode == "json_object_schema":
                request["extra_body"] = {"response_format": response_format}  # litellm drops unknown keys
            elif response_format is not None:
                request["response_format"] = response_format
            return lt.acompletion(**request)

        def weaker_format() -> bool:
            mode = sent["mode"]
            if mode == "none":
                return False
            if self._structured == mode:  # concurrent refusals of the same mode step down once
                self._structured = prompts.WEAKER_FORMAT[mode]
                _log.info("using response format %s instead of %s", self._structured, mode)
            return True

        response = await self.transport.send(stats, prompt_tokens + max_tokens, call, weaker_format, task=task,
                                             cost_tokens=(prompt_tokens, max_tokens))
        choice = response.choices[0]
        text = getattr(choice.message, "content", None) or ""
        return _Reply(text, getattr(choice, "finish_reason", None) == "length", max_tokens, room)

    def _prompt_tokens(self, messages: list[dict]) -> int:
        """The prompt's tokens where the count matters, else an upper bound.

        An exact count tokenises the whole prompt. It matters for a tokens-per-minute
        limit and when the prompt may not leave room for a full reply; otherwise the bound gives
        the same max_tokens and the same checks.
        """
        if self.limiter.max_tokens is None:
            bound = prompt_token_bound(self.model, messages)
            if bound + max(16, self.config.max_output_tokens) <= self.config.context_window:
                return bound
        return count_tokens(self.model, messages)
