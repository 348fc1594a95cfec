"""A build (a generation): read, with every file checked against its size and checksum, and
written, each file atomically, then committed with its manifest. The workspace (workspace.py)
says where generations live and which one is current.

Also the one message for a damaged workspace file (`damaged`, `repair_hint`): which file, what is
wrong, and the command that repairs it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import DamagedError
from .files import (
    atomic_write_bytes,
    atomic_write_with,
    bytes_digest,
    file_digest,
    file_digests,
    fsync_dir,
    json_digest,
    npy_parts,
    parquet_bytes,
    write_arrow,
    write_parquet_parts,
)

GENERATION_VERSION = 1
"""Of a build's layout (its manifest and which files it holds): a build of another is not read,
and the next `index` writes one of this (the assemble stage's fingerprint holds it)."""
READERS_FILE = ".readers"


def damaged(path: Path, ws_root: Path, detail: str, repair: str) -> DamagedError:
    """The one-line message for a damaged workspace file: which file, what is wrong, what repairs it."""
    try:
        shown = path.relative_to(ws_root).as_posix()
    except ValueError:
        shown = str(path)
    return DamagedError(f"workspace file {ws_root / shown} is damaged ({detail}); {repair}")


@dataclass
class Generation:
    """One build opened for reading: its folder, its manifest, and the shared lock that keeps
    `index` from removing it while this process reads it. Files are named by the store:
    `table(name)` reads `<name>.parquet`, `array(name)` maps `<name>.npy`, `arrow(name)` maps
    `<name>.arrow`, `path(name)` is any other file."""

    ws_root: Path
    name: str
    folder: Path
    manifest: dict
    _lock_fd: int | None = None

    @property
    def meta(self) -> dict:
        """What the search needs to know beside the arrays (`search/prepare.py`)."""
        return self.manifest.get("query", {})

    def path(self, file: str) -> Path:
        return self.folder / file

    def damaged(self, file: str, detail: str) -> DamagedError:
        """The one-line error for a file of this build that cannot be read as it should."""
        return damaged(self.path(file), self.ws_root, detail, repair_hint(self.ws_root, self.manifest.get("input")))

    def table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        file = f"{name}.parquet"
        try:
            return pq.read_table(self.path(file), columns=columns)
        except FileNotFoundError:
            raise self.damaged(file, "missing") from None
        except (OSError, pa.ArrowException, ValueError) as err:
            raise self.damaged(file, f"unreadable: {str(err).splitlines()[0][:120]}") from None

    def array(self, name: str) -> np.ndarray:
        file = f"{name}.npy"
        try:
            # copy-on-write: writeable arrays (as the kernels are compiled for) that share the file's pages
            return np.load(self.path(file), mmap_mode="c", allow_pickle=False)
        except FileNotFoundError:
            raise self.damaged(file, "missing") from None
        except (OSError, ValueError) as err:
            raise self.damaged(file, f"unreadable: {str(err).splitlines()[0][:120]}") from None

    def arrow(self, name: str) -> pa.Table:
        file = f"{name}.arrow"
        try:
            return pa.ipc.open_file(pa.memory_map(str(self.path(file)))).read_all()
        except FileNotFoundError:
            raise self.damaged(file, "missing") from None
        except (OSError, pa.ArrowException, ValueError) as err:
            raise self.damaged(file, f"unreadable: {str(err).splitlines()[0][:120]}") from None

    def check_sizes(self) -> None:
        """Every file the manifest lists is there with its recorded size: a stat per file."""
        for file, info in self.manifest.get("files", {}).items():
            try:
                size = self.path(file).stat().st_size
            except FileNotFoundError:
                raise self.damaged(file, "missing") from None
            if size != info["bytes"]:
                raise self.damaged(file, f"{size:,} bytes, expected {info['bytes']:,}")

    def verify(self, files: tuple[str, ...] | None = None) -> list[str]:
        """One line per file (of `files`, or all) whose checksum differs from the manifest's (or that
        is missing)."""
        problems, hashed = [], []
        for file, info in sorted(self.manifest.get("files", {}).items()):
            if files is not None and file not in files:
                continue
            path = self.path(file)
            if not path.is_file():
                problems.append(f"{path}: missing")
            elif path.stat().st_size != info["bytes"]:
                problems.append(f"{path}: {path.stat().st_size:,} bytes, expected {info['bytes']:,}")
            else:
                hashed.append((path, info["blake2b"]))
        found = file_digests([path for path, _ in hashed])  # the files' sizes match: their contents, together
        problems += [f"{path}: checksum differs from the manifest's"
                     for (path, expected), digest in zip(hashed, found, strict=True) if digest != expected]
        return sorted(problems)

    def close(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def repair_hint(root: Path, input_folder: str | None) -> str:
    folder = input_folder or "FOLDER"
    return f"`noderag index {root} --input {folder}` repairs it (finished work is reused)"


class GenerationWriter:
    """Writes a new generation's files, each atomically, recording size and checksum; `commit`
    writes its manifest last. Nothing reads it until `Workspace.publish` names it in CURRENT."""

    def __init__(self, folder: Path, name: str):
        self.name = name
        self.folder = folder
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / READERS_FILE).touch()
        self.files: dict[str, dict] = {}
        self._lock = threading.Lock()

    def _write(self, file: str, *parts: bytes | pa.Buffer | memoryview) -> None:
        atomic_write_bytes(self.folder / file, *parts)
        self._record(file, sum(memoryview(data).nbytes for data in parts), bytes_digest(*parts))

    def _record(self, file: str, size: int, digest: str) -> None:
        with self._lock:
            self.files[file] = {"bytes": size, "blake2b": digest}

    def table(self, name: str, table: pa.Table) -> None:
        self._write(f"{name}.parquet", parquet_bytes(table))

    def table_parts(self, name: str, schema: pa.Schema, parts: Iterable[pa.Table]) -> None:
        """A table given in parts, written as they come (`files.write_parquet_parts`: a row group
        held at a time), then hashed from its file."""
        path = self.folder / f"{name}.parquet"
        write_parquet_parts(path, schema, parts)
        self._record(path.name, path.stat().st_size, file_digest(path))

    def array(self, name: str, array: np.ndarray) -> None:
        self._write(f"{name}.npy", *npy_parts(array))

    def arrow(self, name: str, table: pa.Table) -> None:
        """Written to its file as it is encoded (no copy of the table in memory), then hashed from it."""
        path = self.folder / f"{name}.arrow"
        atomic_write_with(path, lambda tmp: write_arrow(tmp, table))
        self._record(path.name, path.stat().st_size, file_digest(path))

    def raw(self, file: str, data: bytes) -> None:
        self._write(file, data)

    def link(self, file: str, source: Path) -> None:
        """`source` (a stage's committed output, never written in place) as this generation's `file`:
        a second name for the same bytes, so they are stored once; a copy where the file system
        cannot link."""
        target = self.folder / file
        try:
            os.link(source, target)
        except OSError:
            tmp = target.with_name(f".{target.name}.tmp")
            shutil.copyfile(source, tmp)
            os.replace(tmp, target)
        self._record(file, target.stat().st_size, file_digest(target))

    def commit(self, meta: dict) -> str:
        """Write the manifest (the files' sizes and checksums, and `meta`); returns the digest that
        identifies this build's contents."""
        contents = json_digest(self.files)
        manifest = {"format": GENERATION_VERSION, "name": self.name, "contents": contents, "files": self.files, **meta}
        manifest["checksum"] = json_digest(manifest)  # of itself: a flipped bit in a recorded checksum is found too
        atomic_write_bytes(self.folder / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True).encode())
        fsync_dir(self.folder)
        return contents
