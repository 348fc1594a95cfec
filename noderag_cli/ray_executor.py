"""The executor for a Ray cluster (`executor: {kind: ray, address: ...}`): each batch of
per-document or per-chunk work is a Ray task on the cluster, and the graph-wide steps stay in this
process (the driver), as with local workers.

What the cluster needs: the `ray` extra and the same noderag-cli version on every node (the tasks
import it), and for an LLM engine its key variable in the nodes' environment (it is never sent).
A task whose worker dies is run again by Ray (`MAX_RETRIES`); results are taken in the batches'
order, so the tables are the same as a local build's. Ray is imported only here, and only when a
config asks for it.

Test hook (not a feature): when a worker's environment has `NODERAG_TEST_CRASH_ONCE` naming a file
that does not exist yet, the first task to see it creates the file and kills its own worker
process, so tests can watch Ray run it again.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from .config import ExecutorConfig, LLMConfig
from .errors import ConfigError, WorkerLostError

MAX_RETRIES = 3  # runs of a task whose worker died, before the run fails


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError("executor.kind is ray, but Ray is not installed: pip install 'noderag-cli[ray]'") from None
    return ray


class RayExecutor:
    """Runs a function over batches as Ray tasks on an existing cluster."""

    remote = True  # an LLM engine's uncached calls run as tasks too, under `shared_limiter`

    def __init__(self, config: ExecutorConfig):
        ray = _ray()
        _errors_to_stderr()
        self.address = config.address or "auto"
        try:
            if not ray.is_initialized():
                ray.init(address=self.address, log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as err:
            raise ConfigError(f"cannot join the Ray cluster at {self.address}: {str(err).splitlines()[0][:200]} "
                              "(start one with `ray start --head`, or set executor.address)") from None
        self._task = None
        self._limiter: RemoteLimiter | None = None

    def __repr__(self) -> str:
        return f"Ray cluster at {self.address}"

    @property
    def workers(self) -> int:
        return int(_ray().cluster_resources().get("CPU", 1))

    def map(self, function: Callable[[Any], Any], batches: Sequence[Any],
            done: Callable[[Any, Any], None] | None = None, lost: Callable[[Any, str], Any] | None = None) -> list:
        """function(batch) for every batch as a Ray task, results in the batches' order; `done(batch,
        result)` is called here as each result is taken, in that order too. A task whose worker died
        on every one of its tries (Ray retries it) gets `lost(batch, why)` as its result, or, without
        `lost`, stops the run (`WorkerLostError`), as `Executor.map`."""
        ray = _ray()
        if self._task is None:
            self._task = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)(_task)
        pending = [self._task.remote(function, batch) for batch in batches]
        results = []
        for batch, reference in zip(batches, pending, strict=True):
            try:
                results.append(ray.get(reference))
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError):
                why = f"its Ray worker died on each of {MAX_RETRIES + 1} tries (out of memory?)"
                if lost is None:
                    raise WorkerLostError(f"a Ray worker died on each of {MAX_RETRIES + 1} tries of the same work "
                                          "(out of memory?); run the command again to go on from what finished") from None
                results.append(lost(batch, why))
            if done:
                done(batch, results[-1])
        return results

    def shared_limiter(self, llm: LLMConfig) -> RemoteLimiter:
        """The one limiter of this run's LLM calls on the cluster (an actor), made on first use:
        llm.requests_per_minute and llm.tokens_per_minute hold for the whole cluster."""
        if self._limiter is None:
            ray = _ray()
            actor = ray.remote(num_cpus=0)(_SharedLimiter).remote(llm.requests_per_minute, llm.tokens_per_minute)
            self._limiter = RemoteLimiter(actor, llm.requests_per_minute, llm.tokens_per_minute)
        return self._limiter

    def release(self) -> None:
        """Nothing to release between stages: the cluster's workers are Ray's to manage."""

    def close(self) -> None:
        """Leave the cluster (it keeps running for other drivers)."""
        self._limiter = None
        _ray().shutdown()


def _errors_to_stderr() -> None:
    """Ray's driver prints the cluster's error messages (a worker died, ...) to standard output,
    where `--json` output goes; they go to standard error instead. (Ray has no setting for it: its
    printer is replaced where its listener looks it up.)"""
    from ray._private import worker

    printer = worker.print_to_stdstream
    if getattr(printer, "noderag", False):
        return

    def to_stderr(data, ignore_prefix: bool) -> None:
        printer({**data, "is_err": True}, ignore_prefix)

    to_stderr.noderag = True  # type: ignore[attr-defined]
    worker.print_to_stdstream = to_stderr


def _task(function: Callable[[Any], Any], batch: Any) -> Any:
    """One batch of work on a worker (and the crash hook of the module docstring)."""
    marker = os.environ.get("NODERAG_TEST_CRASH_ONCE")
    if marker:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            os._exit(1)
    return function(batch)


class _SharedLimiter:
    """A Ray actor around one `SlidingWindowLimiter`: every worker's requests are admitted here."""

    def __init__(self, max_requests: int | None, max_tokens: int | None, window_seconds: float = 60.0):
        from .limiter import SlidingWindowLimiter

        self.limiter = SlidingWindowLimiter(max_requests, max_tokens, window_seconds)
        self.held: dict[int, object] = {}
        self.issued = 0

    async def acquire(self, tokens: int) -> int:
        reservation = await self.limiter.acquire(tokens)
        self.issued += 1
        self.held[self.issued] = reservation
        return self.issued

    async def settle(self, reservation: int, tokens: int) -> None:
        held = self.held.pop(reservation, None)
        if held is not None:
            self.limiter.settle(held, tokens)

    async def pause(self, seconds: float) -> None:
        self.limiter.pause(seconds)


class RemoteLimiter:
    """What an engine on a worker sees of the shared limiter: the local limiter's interface."""

    def __init__(self, actor, max_requests: int | None, max_tokens: int | None):
        self.actor, self.max_requests, self.max_tokens = actor, max_requests, max_tokens

    @property
    def enabled(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None

    async def acquire(self, tokens: int = 0) -> int:
        return await self.actor.acquire.remote(tokens)

    def settle(self, reservation: int, tokens: int) -> None:
        self.actor.settle.remote(reservation, tokens)

    def pause(self, seconds: float) -> None:
        self.actor.pause.remote(seconds)
