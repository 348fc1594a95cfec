"""Arrays a graph-wide stage may hold in memory up to a budget (`executor.memory_mb`); past it,
arrays in memory-mapped files under the workspace (`Workspace.spill_dir`), spilled rather than
swapped.

A spilled array is a shared mapping of a file: what the stage writes into it goes to the page
cache, which the kernel writes out and frees when memory runs short, and `trim` unmaps its pages
from the process between two blocks of work, so the process holds only what the current block
touches. The arrays hold the same values either way: a stage's tables do not depend on the
budget. A file is unlinked as soon as it is mapped, so none is left behind however the run ends;
the folder goes at `close` (or, after a kill, at the next stage's `Spill`).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import shutil
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

MB = 1_000_000
SHARD_WIDTH = 3  # leading characters of a key that name its shard: an id's type letter, "_" and first hex digit
SHARD_FLUSH_ROWS = 1 << 18  # rows gathered before they are filed: pieces of some thousand rows each
AUTO_SHARE = 0.25  # of the machine's memory: the budget of `executor.memory_mb: auto`


def budget_mb(setting: str | float) -> float:
    """The budget a setting of `executor.memory_mb` gives: "auto", a quarter of this machine's
    physical memory (enough that nothing spills below some hundreds of thousands of passages on
    a laptop); else the number (0: no limit)."""
    if setting != "auto":
        return float(setting)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * AUTO_SHARE / MB


def _remove(path: Path) -> None:
    """A folder and what it holds, or anything else of that name (a file, a link, a FIFO), unfollowed."""
    try:
        folder = stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return
    if folder:
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink()


def release(array: np.ndarray) -> None:
    """Unmap a spilled array's pages from this process (nothing for an array in memory): they stay
    in the page cache and the file, read back when touched again."""
    if isinstance(array, np.memmap):
        with contextlib.suppress(AttributeError, ValueError, OSError):
            array._mmap.madvise(mmap.MADV_DONTNEED)


class Spill:
    _count = itertools.count()  # names its files: several spills of one process share the folder

    def __init__(self, folder: Path | None, budget_mb: float):
        """`budget_mb`: megabytes of arrays this spill keeps in memory (0: no limit, nothing
        spilled; `budget_mb` reads the setting); past it, arrays are files in `folder`."""
        self.folder = Path(folder) if folder is not None else None
        self.budget = int(budget_mb * MB) if folder is not None else 0
        self.held = 0  # bytes of the arrays made in memory
        self.spilled = 0  # bytes of the arrays made in files
        self._maps: list[np.memmap] = []
        if self.folder is not None:  # a killed run's (the caller holds the workspace lock), or whatever
            _remove(self.folder)  # else holds the name: a link is removed, never followed

    @classmethod
    def none(cls) -> Spill:
        """No budget: every array in memory (a function called without a stage's spill)."""
        return cls(None, 0)

    @classmethod
    def always(cls, folder: Path) -> Spill:
        """Every array in a file: for arrays a run holds across its stages when it is not expected
        to fit its budget (an embedder's vectors, `VectorMemory`)."""
        spill = cls(folder, 0)
        spill.budget = -1  # below any size
        return spill

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised array, in memory while the budget allows it, else in a file."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if not self.budget or self.held + size <= self.budget or size == 0:
            self.held += size
            return np.empty(shape, dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{os.getpid()}-{next(self._count)}"
        handle = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:  # its blocks taken now: a full disk is an error here (ENOSPC, which `index` reports), not a
            os.posix_fallocate(handle, 0, size)  # crash when a page is first written
            array = np.memmap(path, dtype=dtype, mode="r+", shape=shape)
        finally:
            os.close(handle)
            path.unlink()  # the mapping keeps the file's blocks
        self._maps.append(array)
        self.spilled += size
        return array

    def full(self, shape: tuple[int, ...], value, dtype) -> np.ndarray:
        """An array of `value`, its pages let go once written when it is spilled."""
        array = self.empty(shape, dtype)
        array[...] = value
        self.trim()
        return array

    def trim(self) -> None:
        """Unmap the spilled arrays' pages from this process: they stay in the page cache (and the
        file), to be read back when touched again."""
        for array in self._maps:
            release(array)

    def close(self) -> None:
        """Forget the spilled arrays (their files go with the last reference to them)."""
        self._maps.clear()
        if self.folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)

    @property
    def spilled_mb(self) -> float:
        return round(self.spilled / MB, 1)


class Shards:
    """Rows of one schema filed by the first `SHARD_WIDTH` characters of a key, appended as they
    come, and given back a shard at a time in the order of those characters: when a table is to
    be sorted by the key (or grouped by it), each shard sorted (or grouped) alone, one after the
    other, gives the same rows while holding a shard instead of the table. The rows go to a file
    in `folder` (unlinked at once: nothing is left behind however the run ends; read back by
    memory mapping, its pages the page cache's), or stay in memory without a folder."""

    _count = itertools.count()

    def __init__(self, folder: Path | None, schema: pa.Schema):
        self.schema = schema
        self._gathered: list[tuple[pa.Table, pa.Array]] = []
        self._gathered_rows = 0
        self._pieces: dict[str, list] = {}  # shard -> its pieces: (offset, size) in the file, or tables
        self._file = None
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{os.getpid()}-shards-{next(self._count)}"
            self._file = open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600), "w+b")
            path.unlink()
        self._bytes = 0  # in the file

    def add(self, table: pa.Table, key: pa.Array | pa.ChunkedArray) -> None:
        """File `table`'s rows by `key` (a value per row)."""
        if table.num_rows:
            self._gathered.append((table, key))
            self._gathered_rows += table.num_rows
            if self._gathered_rows >= SHARD_FLUSH_ROWS:
                self.flush()

    def flush(self) -> None:
        """File the rows gathered so far (before `shards` is read from two threads)."""
        if not self._gathered:
            return
        table = pa.concat_tables([table for table, _ in self._gathered]).cast(self.schema)
        key = pa.chunked_array([chunk for _, k in self._gathered
                                for chunk in (k.chunks if isinstance(k, pa.ChunkedArray) else [k])], pa.string())
        self._gathered, self._gathered_rows = [], 0
        shard = pc.dictionary_encode(pc.utf8_slice_codeunits(key, 0, SHARD_WIDTH)).combine_chunks()
        codes = shard.indices.to_numpy()
        order = np.argsort(codes, kind="stable")  # within a shard, rows stay in the order they came
        table = table.take(pa.array(order))
        bounds = np.r_[0, np.cumsum(np.bincount(codes, minlength=len(shard.dictionary)))]
        for code, name in enumerate(shard.dictionary.to_pylist()):
            piece = table.slice(bounds[code], bounds[code + 1] - bounds[code])
            if self._file is None:
                self._pieces.setdefault(name, []).append(piece)
                continue
            for batch in piece.to_batches():
                message = batch.serialize()
                self._pieces.setdefault(name, []).append((self._file.tell(), message.size))
                self._file.write(message)
                self._bytes += message.size

    def shards(self, also: Iterable[str] = ()) -> Iterator[tuple[str, pa.Table]]:
        """Each shard's name and rows (in the order they were added), in the order of the names,
        with an empty table for each name in `also` that has no rows; what the process holds of a
        shard read from the file is let go when the next is asked for. Can be read again until
        `close`."""
        self.flush()
        whole = mapped = None
        if self._file is not None and self._bytes:
            self._file.flush()
            whole = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
            mapped = pa.py_buffer(whole)
        for name in sorted(set(self._pieces) | set(also)):
            pieces = self._pieces.get(name, [])
            if self._file is None:
                yield name, pa.concat_tables([self.schema.empty_table(), *pieces])
                continue
            yield name, pa.Table.from_batches([pa.ipc.read_record_batch(mapped.slice(offset, size), self.schema)
                                               for offset, size in pieces], self.schema)
            if whole is not None:  # the shard's pages unmapped from the process, still in the page cache and
                with contextlib.suppress(AttributeError, ValueError, OSError):  # the file: what the caller
                    whole.madvise(mmap.MADV_DONTNEED)  # holds of them is read back if touched

    def close(self) -> None:
        """Let go of the file (its blocks go with the last mapping of them)."""
        self._gathered, self._pieces = [], {}
        if self._file is not None:
            self._file.close()
            self._file = None
