"""Each document read in a process the kernel holds to `Limits`: an address-space limit of
`memory_mb` beyond what the process held when it started (`RLIMIT_AS`) and a wall-clock alarm of
`seconds` whose default action ends the process. A library's quadratic or greedy path inside one
parse (a PDF page of 400,000 text runs, an XML member that expands to gigabytes) is stopped
wherever it is, and what the indexing run holds is never at stake: the reader's process fails,
the document is a failed item with the limit named, and the next document gets a fresh process.

One reader process serves the documents of the process that asks (an indexing worker, or the
indexing run itself for small folders), one at a time, started by fork on first use: forking costs
milliseconds, so a folder of small files does not pay a process start per file. It is replaced when
it failed, when its memory grew (`REUSE_GROWTH`), and after `REUSE_DOCUMENTS` documents; it ends
when the process that started it ends (its end of the pipe closes).
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from multiprocessing.connection import Connection, Pipe

from . import Extracted, Limits, NotADocument, Unreadable
from . import extract as extract_here

REUSE_DOCUMENTS = 200
REUSE_GROWTH = 0.25  # of memory_mb: a reader process grown by more is replaced before the next document
PR_SET_PDEATHSIG = 1  # Linux prctl: the signal a process gets when its parent ends
KILL_GRACE = 5.0  # seconds past the limit before the asking process kills a reader that did not stop itself


def _address_space() -> int:
    """This process's address space in bytes (VmSize), 0 when it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[0]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return 0


def _detach(keep: int) -> None:
    """In a new reader process: close every descriptor it inherited but its pipe and the standard
    ones (a workspace lock held open here would outlive a killed run), and end with its parent."""
    os.closerange(3, keep)
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent ended before the request above
        os._exit(0)


def _serve(conn: Connection, memory_mb: int) -> None:
    """The reader process: documents read one at a time until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the asking process's to handle
    signal.signal(signal.SIGALRM, signal.SIG_DFL)  # the alarm ends this process wherever it is
    start = _address_space()
    if start:
        limit = start + memory_mb * 1_000_000
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        path, content_hash, seconds, expanded_mb = request
        limits = Limits(seconds, memory_mb, expanded_mb)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            reply: tuple = ("ok", extract_here(path, limits, content_hash))
        except NotADocument as err:
            reply = ("skipped", str(err))
        except Unreadable as err:
            reply = ("unreadable", str(err))
        except MemoryError:
            reply = ("unreadable", limits.over_memory())
        signal.setitimer(signal.ITIMER_REAL, 0)
        grown = (_address_space() - start) / 1e6 if start else 0.0
        try:
            conn.send((*reply, grown))
        except MemoryError:
            conn.send(("unreadable", limits.over_memory(), float(memory_mb)))
        except (OSError, ValueError):
            return


class _ReaderProcess:
    """The asking process's end of one reader process."""

    def __init__(self, memory_mb: int):
        self.memory_mb = memory_mb
        self.served = 0
        mine, theirs = Pipe()
        pid = os.fork()
        if pid == 0:  # the reader process
            status = 0
            try:
                _detach(theirs.fileno())
                _serve(theirs, memory_mb)
            except BaseException:
                status = 1
            finally:
                os._exit(status)
        theirs.close()
        self.pid, self.conn = pid, mine

    def read(self, path: str, content_hash: str | None, limits: Limits) -> tuple[Extracted | Unreadable, float]:
        """(what the reader gave, or why not, how much its process grew)."""
        self.served += 1
        timed_out = False
        try:
            self.conn.send((path, content_hash, limits.seconds, limits.expanded_mb))
            if self.conn.poll(limits.seconds + KILL_GRACE):
                kind, value, grown = self.conn.recv()
                failure = {"skipped": NotADocument, "unreadable": Unreadable}.get(kind)
                return (value if failure is None else failure(value)), grown
            timed_out = True
        except (EOFError, OSError):
            pass
        return Unreadable(self._ended(limits, timed_out)), float("inf")

    def _ended(self, limits: Limits, timed_out: bool) -> str:
        """Why the reader process gave no reply: it is killed if still running, and its end read."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        _, status = os.waitpid(self.pid, 0)
        self.pid = 0
        number = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
        if timed_out or number == signal.SIGALRM:
            return limits.over_time()
        if number == signal.SIGKILL:
            return f"its reader's process was killed (out of memory? chunk.extract_memory_mb is {limits.memory_mb:,} MB)"
        if number:
            name = signal.Signals(number).name if number in set(signal.Signals) else str(number)
            return (f"its reader crashed ({name}): out of memory under chunk.extract_memory_mb "
                    f"({limits.memory_mb:,} MB), or a damaged file")
        return f"its reader's process ended (exit status {os.WEXITSTATUS(status)})"

    def close(self) -> None:
        if self.pid:
            with contextlib.suppress(OSError, ValueError):
                self.conn.send(None)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            self.pid = 0
        self.conn.close()


_reader: _ReaderProcess | None = None


def extract(path: str, limits: Limits, content_hash: str | None = None) -> Extracted:
    """`readers.extract` in the reader process (module docstring); Unreadable says why not, with
    the limit a document passed."""
    global _reader
    if _reader is not None and (_reader.memory_mb != limits.memory_mb or _reader.served >= REUSE_DOCUMENTS):
        _reader.close()
        _reader = None
    if _reader is None:
        _reader = _ReaderProcess(limits.memory_mb)
    extracted, grown = _reader.read(path, content_hash, limits)
    if isinstance(extracted, Unreadable) or grown > REUSE_GROWTH * limits.memory_mb:
        _reader.close()
        _reader = None
    if isinstance(extracted, Unreadable):
        raise extracted
    return extracted


def close() -> None:
    """End this process's reader process (the next document starts another): its memory is not kept
    past the stage that read with it."""
    global _reader
    if _reader is not None:
        _reader.close()
        _reader = None
