"""Where the per-document and per-chunk work of indexing runs: on this machine's cores, or as Ray
tasks on a cluster (`executor.kind: ray`, see `ray_executor.py`).

A stage hands `Executor.map` a module-level function and a list of batches; the results come back
in the batches' order, whatever ran them and in whatever order they finished, so a stage's output
never depends on where its work ran. Locally the batches go to worker processes (one per core
unless `executor.workers` says otherwise), started through a fork server: a clean process that
imported the package once, so a worker starts in milliseconds and inherits none of the run's
threads, open files or the workspace lock. Work too small to be worth a pool runs in this
process: fewer than `POOL_BATCHES_PER_WORKER` batches per worker, since starting a pool (the fork
server importing the package, each worker loading its models) costs about as much as that much work
(docs/benchmarks.md, the incremental update).

A worker that dies (killed by the out-of-memory killer, or by hand) breaks the pool, not the run:
the batches that had not returned run again in a new pool, and if that pool breaks too, one at a
time, so that the batch that kills its worker is found. That batch is given up (`map`'s `lost`
says what stands for its results; without it the run stops with `WorkerLostError`, one line) and
the others go on.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import multiprocessing
import os
import select
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import pyarrow as pa

from . import ivf
from .config import ExecutorConfig
from .errors import WorkerLostError
from .spill import budget_mb

PRELOAD = ["noderag_cli.index.chunk", "noderag_cli.index.decompose", "noderag_cli.engines.offline",
           "noderag_cli.embeddings"]
POOL_BATCHES_PER_WORKER = 2


def local_workers(config: ExecutorConfig) -> int:
    """The number of worker processes: `executor.workers`, or one per core this process may use."""
    return config.workers or ivf.cores()


def _end_with(driver: int) -> None:
    """End this worker as soon as the indexing process `driver` ends: a run killed outright
    (SIGKILL, an OOM kill) must not leave workers computing batches nobody will read, for as long
    as a batch takes. A thread waits on a pidfd of the driver (Linux); elsewhere a worker ends
    after its batch, when it finds the driver gone."""
    if not hasattr(os, "pidfd_open"):
        return
    try:
        handle = os.pidfd_open(driver)
    except ProcessLookupError:  # already gone
        os._exit(1)
    except OSError:  # no pidfds here (an old kernel, a sandbox): ends after its batch, as elsewhere
        return

    def wait() -> None:
        select.select([handle], [], [])
        os._exit(1)

    threading.Thread(target=wait, name="end-with-driver", daemon=True).start()


def _worker_start(driver: int) -> None:
    """Each worker computes alone on its core: no thread pools of its own in the tokenizer, BLAS or
    `ivf.in_parallel`; and it ends with the indexing process that started it."""
    _end_with(driver)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from threadpoolctl import threadpool_limits

    threadpool_limits(1)
    ivf.use_threads(1)


class Executor:
    """Runs a function over batches on local worker processes (or in this process)."""

    remote = False  # a cluster's executor (ray_executor.py) runs an LLM engine's calls on its workers too

    def __init__(self, workers: int = 1):
        self.workers = max(1, workers)
        self._pool: ProcessPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"{self.workers} local process{'es' if self.workers > 1 else ''}"

    def _get_pool(self) -> ProcessPoolExecutor:
        if self._pool is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload(PRELOAD)
            self._pool = ProcessPoolExecutor(self.workers, mp_context=context, initializer=_worker_start,
                                             initargs=(os.getpid(),))
        return self._pool

    def map(self, function: Callable[[Any], Any], batches: Sequence[Any],
            done: Callable[[Any, Any], None] | None = None, lost: Callable[[Any, str], Any] | None = None) -> list:
        """function(batch) for every batch, results in the batches' order; `done(batch, result)` is
        called in this process as each result arrives, in that order too. A batch whose worker died
        every time it ran (module docstring) gets `lost(batch, why)` as its result, or, without
        `lost`, stops the run (`WorkerLostError`)."""
        if self.workers <= 1 or len(batches) < POOL_BATCHES_PER_WORKER * self.workers:
            results = []
            for batch in batches:
                results.append(function(batch))
                if done:
                    done(batch, results[-1])
            return results
        results: list = [None] * len(batches)
        finished = [False] * len(batches)
        emitted = 0

        def settle(position: int, result: Any) -> None:
            nonlocal emitted
            results[position], finished[position] = result, True
            while emitted < len(batches) and finished[emitted]:
                if done:
                    done(batches[emitted], results[emitted])
                emitted += 1

        pending = list(range(len(batches)))
        for _ in range(2):  # all together, then once more in a new pool after a worker died
            futures = [(position, self._get_pool().submit(function, batches[position])) for position in pending]
            pending = []
            for position, future in futures:
                try:
                    result = future.result()
                except BrokenProcessPool:
                    pending.append(position)
                    continue
                settle(position, result)
            if not pending:
                return results
            self.close()
        for position in pending:  # one at a time: the batch whose worker dies is the one that kills it
            try:
                result = self._get_pool().submit(function, batches[position]).result()
            except BrokenProcessPool:
                self.close()
                why = "its worker process died three times while running it (killed: out of memory?)"
                if lost is None:
                    raise WorkerLostError("a worker process died three times on the same work (killed: out of "
                                          "memory?); run the command again to go on from what finished") from None
                result = lost(batches[position], why)
            settle(position, result)
        return results

    def release(self) -> None:
        """End the worker processes until the next `map`: between stages, idle workers would keep
        the memory of the stage they served while the graph-wide stages need it most."""
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def make_executor(config: ExecutorConfig) -> Executor:
    """The executor a config names."""
    if config.kind == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(config)
    return Executor(local_workers(config))


_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)
_GLIBC_DEFAULTS = ((_M_TRIM_THRESHOLD, 128 * 1024), (_M_MMAP_MAX, 65536), (_M_ARENA_MAX, 0))
_kept_below_mb: float | None = None  # while an index run keeps freed memory (`keeping_freed_memory`)


@contextlib.contextmanager
def keeping_freed_memory(ceiling_mb: float) -> Iterator[None]:
    """For an index run that should fit (`keeping_memory_if_it_fits`): memory the process
    frees stays in it for reuse while the process holds less than `ceiling_mb`
    (`executor.memory_mb`; 0: no limit), instead of going back to the system; past it,
    `release_memory` and `trim_heap` give it back as before.

    A page the system hands out again is zeroed first, and in a virtual machine whose host takes
    back the guest's free memory (a balloon, free page reporting) it is fetched from the host as
    well, many times the cost of reusing a page the process still holds (docs/scale.md, "Freed
    memory kept for reuse"). A build frees and allocates many gigabytes (whole tables copied,
    merged and sorted stage after stage), and an update more than its share of it. So, glibc
    (where it is the allocator) takes no memory by mmap and trims none by itself (a large freed
    array stays for the next one), with at most one arena per core, and Arrow's tables come from
    the same heap (its system pool) rather than mimalloc's, which gives freed pages back within
    milliseconds. When the run ends, glibc's defaults and Arrow's pool are set back."""
    global _kept_below_mb
    libc = _glibc()
    if libc is None:
        yield
        return
    pool = pa.default_memory_pool()
    for parameter, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_ARENA_MAX, ivf.cores())):
        libc.mallopt(parameter, value)
    pa.set_memory_pool(pa.system_memory_pool())
    _kept_below_mb = ceiling_mb or float("inf")
    try:
        yield
    finally:
        _kept_below_mb = None
        pa.set_memory_pool(pool)
        for parameter, value in _GLIBC_DEFAULTS:
            libc.mallopt(parameter, value)
        trim_heap()


PEAK_PER_INPUT = 75
"""Peak memory of an offline build per byte of its input text (3.8 GB for the 51 MB of 100,000
passages, 6.7 GB for the 103 MB of 200,000: docs/benchmarks-scale.md)."""
KEPT_GROWTH = 1.4
"""A build's peak with the memory it frees kept over its peak without (4.9-5.0 against 3.5-3.8 GB at
100,000 passages, 8.5 against 6.6 GB at 200,000)."""


def memory_fits(input_bytes: int, memory_mb: str | float) -> bool:
    """Whether a run's peak, with the memory it frees kept, should stay under `executor.memory_mb`,
    judged from the size of its input (the same input, the same choice: a build's memory grows
    with its corpus, `PEAK_PER_INPUT`, `KEPT_GROWTH`). The choice is made before the stages: a
    process only finds itself over the budget once it is."""
    budget = budget_mb(memory_mb)
    return not budget or PEAK_PER_INPUT * KEPT_GROWTH * input_bytes / 1e6 <= budget


def keeping_memory_if_it_fits(input_bytes: int, memory_mb: str | float) -> contextlib.AbstractContextManager:
    """`keeping_freed_memory` for a run that `memory_fits`; otherwise nothing: the run gives freed
    memory back at once, its peak as low as it can be."""
    return keeping_freed_memory(budget_mb(memory_mb)) if memory_fits(input_bytes, memory_mb) \
        else contextlib.nullcontext()


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """glibc, where it is this process's C library (its malloc is what `mallopt` and `malloc_trim` tune)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            return libc
    return None


def _keeping() -> bool:
    """Whether freed memory stays in the process now: within `keeping_freed_memory`, below its ceiling."""
    if _kept_below_mb is None:
        return False
    try:
        with open("/proc/self/statm") as handle:
            resident = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return False
    return resident < _kept_below_mb * 1_000_000


def release_memory() -> None:
    """Give freed memory back to the system: glibc's heap and Arrow's pool keep freed pages for
    reuse, and between stages that was as much again as the process still used (at 32,000
    passages, 1.3 GB resident before the similarity stage, 0.7 GB after this); results unpickled
    from workers live in glibc's heap, which Arrow's pool (mimalloc) does not reuse. Called before
    each stage, and inside one where its largest tables are let go; within `keeping_freed_memory`
    only past its ceiling. (No `gc.collect()`: it freed nothing here, and cost 20 ms a call at
    MuSiQue size.)"""
    from . import nlp  # not at import: workers import this module

    nlp.token_ids.words.clear()  # the tokenizer's memory of words (up to a million): a stage's own
    if _keeping():
        return
    pa.default_memory_pool().release_unused()
    trim_heap()


def trim_heap() -> None:
    """Give glibc's freed pages back (all its arenas): numpy temporaries of up to 32 MB come from
    the arenas once glibc has raised its mmap threshold, and the blocks of a long multi-threaded
    step, freed, otherwise stay resident until the step ends (at 200,000 passages the similarity
    stage's search held 2 GB more in a whole build than alone). Within `keeping_freed_memory`, only
    past its ceiling."""
    libc = _glibc()
    if libc is not None and not _keeping():
        libc.malloc_trim(0)


def tree_resident_mb(root: int | None = None) -> float:
    """Resident memory of a process (this one by default) and all its descendants (its workers),
    in MB (Linux; 0 where /proc is missing): what a stage holds, as progress shows it."""
    root = os.getpid() if root is None else root
    parents, sizes = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return 0.0
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            parents[int(entry)] = int(fields[1])
            sizes[int(entry)] = int(fields[21]) * page
        except (OSError, IndexError, ValueError):
            continue
    total = 0
    for pid, size in sizes.items():
        walker = pid
        while walker not in (0, 1) and walker != root:
            walker = parents.get(walker, 0)
        if walker == root:
            total += size
    return total / 1e6
