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
import mmap
import os
import shutil
import stat
from pathlib import Path

import numpy as np

MB = 1_000_000
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


class Spill:
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

    def empty(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        """An uninitialised array, in memory while the budget allows it, else in a file."""
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if not self.budget or self.held + size <= self.budget or size == 0:
            self.held += size
            return np.empty(shape, dtype)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{os.getpid()}-{len(self._maps)}"
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
            with contextlib.suppress(AttributeError, ValueError, OSError):
                array._mmap.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Forget the spilled arrays (their files go with the last reference to them)."""
        self._maps.clear()
        if self.folder is not None:
            with contextlib.suppress(OSError):
                os.rmdir(self.folder)

    @property
    def spilled_mb(self) -> float:
        return round(self.spilled / MB, 1)
