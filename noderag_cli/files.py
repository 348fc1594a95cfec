"""Files written atomically and deterministically, and content digests: what every module that
writes a workspace file uses, so a reader never sees half a file and the same table gives the
same bytes. Which files exist and what they are called is `workspace`'s business."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError


def fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _file_mode() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


FILE_MODE = _file_mode()  # what open() would give: other users may read a workspace the umask lets them


def atomic_write_bytes(path: Path, *parts: bytes | pa.Buffer | memoryview) -> None:
    """`parts`, one after the other, as the file at `path` (`atomic_write_with`)."""
    def write(tmp: str) -> None:
        with open(tmp, "wb") as handle:
            for data in parts:
                handle.write(data)

    atomic_write_with(path, write)


DICTIONARY_ENCODED = frozenset({"type", "kind", "status", "stage", "reason",  # a handful of distinct values
                                "tokens", "community", "weight",  # small numbers, often repeated
                                "chunk_ids.list.element", "doc_ids.list.element", "target", "chunk"})
"""Columns dictionary-encoded in parquet: a handful of distinct values, or ids each repeated many
times in no order that run-length encoding would catch (a node's chunks and documents, an edge's
second end): a third smaller. For other ids and texts the encoder's attempt only costs time."""


ROW_NUMBERS = {"candidates.list.element": "DELTA_BINARY_PACKED"}
"""Parquet encodings of lists of row numbers: the similarity lists' candidates, vector rows each in
about 80 lists, are written as differences bit-packed to the width they need. Against a dictionary
(the same bits, a fifth smaller than plain): at 100,000 passages the lists' file takes 122 MB
against 116, and is written in 1.2 s against 2.2 and read in 0.4 s against 0.9 (an update reads the
last lists and writes new ones)."""


SORTED_IDS = {"id": "DELTA_BYTE_ARRAY", "source": "DELTA_LENGTH_BYTE_ARRAY"}
"""Parquet encodings of the id columns a table is sorted by (a node table's ids, an edge table's
first ends): each id written as what it shares with the one before and the rest, or with its
length apart, then compressed. At 20,000 passages the workspace's parquet tables take 2 MB less
(0.2x the raw text) for the same writing time, and read faster."""


PROSE = frozenset({"text", "name", "title", "texts.list.element"})
PROSE_LEVEL = 5
"""zstd's level for the columns of prose; Arrow's default 1 for the rest. At 20,000 passages the
workspace's parquet tables take 152 -> 141 MB (nodes.parquet 24.0 -> 19.7) for one second more of
writing in a 90 s build; ids and numbers gain nothing from higher levels (hex ids lose 10%)."""


ROW_GROUP = 1 << 23
"""Rows per parquet row group. A dictionary-encoded column keeps one dictionary per group, so an
id repeated across groups is stored once per group: at 200,000 passages the edges' second ends
(2.4 million distinct ids among 16 million edges) made edges.parquet 159 MB in Arrow's default
groups of 1,048,576 rows, 102 MB in groups of this size (97 in one group, read on one thread)."""


def _parquet_options(schema: pa.Schema) -> dict:
    """The writer's settings for a table of `schema`: deterministic bytes for the same table (no
    statistics timestamps, fixed compression)."""
    paths = [name for field in schema for name in
             ((f"{field.name}.list.element",) if pa.types.is_list(field.type) else (field.name,))]
    return dict(compression="zstd", write_statistics=False, store_schema=True,
                compression_level={path: PROSE_LEVEL if path in PROSE else 1 for path in paths},
                use_dictionary=[path for path in paths if path in DICTIONARY_ENCODED],
                column_encoding={**{field.name: SORTED_IDS[field.name] for field in schema
                                    if field.name in SORTED_IDS and pa.types.is_string(field.type)},
                                 **{path: ROW_NUMBERS[path] for path in paths if path in ROW_NUMBERS}},
                dictionary_pagesize_limit=1 << 28)


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    """The file's bytes for `table`: Arrow's buffer, not a copy of it as `bytes`, so a large
    table's file is held once while it is written."""
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=ROW_GROUP, **_parquet_options(table.schema))
    return sink.getvalue()


def write_parquet_parts(path: Path, schema: pa.Schema, parts: Iterable[pa.Table]) -> None:
    """The tables `parts` one after the other as one parquet file at `path`, each part a chunk of
    its columns (the chunks' bounds move the pages' bounds: the same parts give the same bytes),
    holding a row group at a time (at most `ROW_GROUP` rows) instead of the whole table."""
    def write(tmp: str) -> None:
        with pq.ParquetWriter(tmp, schema, **_parquet_options(schema)) as writer:
            held: list[pa.Table] = []
            rows, written = 0, False
            for part in parts:
                part = part.combine_chunks()
                while part.num_rows:
                    taken = part.slice(0, ROW_GROUP - rows)
                    part = part.slice(taken.num_rows)
                    held.append(taken)
                    rows += taken.num_rows
                    if rows == ROW_GROUP:
                        writer.write_table(pa.concat_tables(held), row_group_size=ROW_GROUP)
                        held, rows, written = [], 0, True
            if rows or not written:  # an empty table is one empty group, as `write_parquet` writes it
                writer.write_table(pa.concat_tables(held or [schema.empty_table()]), row_group_size=ROW_GROUP)

    atomic_write_with(path, write)


def write_parquet(path: Path, table: pa.Table) -> None:
    atomic_write_bytes(path, parquet_bytes(table))


def as_read_back(table: pa.Table) -> pa.Table | None:
    """`table` as `pq.read_table` gives it back from `write_parquet`'s file: one row group, so one
    chunk per column. None where the file would read back otherwise (more than one row group, or
    a column too large for one chunk): the reader then decodes the file."""
    if table.num_rows > ROW_GROUP:
        return None
    try:
        table = table.combine_chunks()
    except (pa.ArrowInvalid, pa.ArrowCapacityError):
        return None
    if not any(pa.types.is_nested(field.type) for field in table.schema):
        return table
    return table.cast(pa.schema([field.with_type(_as_read_back(field.type)) for field in table.schema],
                                metadata=table.schema.metadata))


def _as_read_back(kind: pa.DataType) -> pa.DataType:
    """A type as parquet gives it back: a list's items are named "element" (the format's name)."""
    if pa.types.is_list(kind):
        return pa.list_(pa.field("element", _as_read_back(kind.value_type), kind.value_field.nullable))
    if pa.types.is_struct(kind):
        return pa.struct([field.with_type(_as_read_back(field.type)) for field in kind])
    return kind


def write_parquets(tables: dict[Path, pa.Table]) -> None:
    """Each table to its file (`write_parquet`), on a thread each up to the cores: a file is encoded
    on one thread, and Arrow lets go of the interpreter while it encodes, so a stage's several
    outputs are written in about the time of the largest."""
    if len(tables) <= 1:
        for path, table in tables.items():
            write_parquet(path, table)
        return
    with ThreadPoolExecutor(min(len(tables), os.cpu_count() or 1)) as pool:
        for job in [pool.submit(write_parquet, path, table) for path, table in tables.items()]:
            job.result()


def atomic_write_with(path: Path, write: Callable[[str], None], make_folder: bool = True) -> None:
    """`write(name)` into a temporary file beside `path`, flushed to disk, then renamed over `path`:
    a reader sees the old file or the new one, never a part (faiss.write_index takes a name). The
    rename replaces `path` itself, never what a link there leads to."""
    if make_folder:
        path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.close(fd)
        write(tmp)
        os.chmod(tmp, FILE_MODE)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def check_output(path: Path, option: str) -> Path | None:
    """InputError (one line) unless `path` is a file the user may have a command write: its folder
    exists (none is made), and it is absent, a regular file (replaced atomically), or a special file
    such as /dev/null or a FIFO (written through, never replaced). A symbolic link is refused when it
    leads to a regular file or nowhere: replacing its target, or the link, would not be what was
    named. Returns the special file to write through, or None for an atomic replace."""
    path = Path(path)
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as err:
        raise InputError(f"{option} {path}: {err.strerror or err}") from None
    if mode is not None and stat.S_ISLNK(mode):
        try:
            target_mode = os.stat(path).st_mode
        except OSError:
            target_mode = None
        if target_mode is None or stat.S_ISREG(target_mode) or stat.S_ISDIR(target_mode):
            raise InputError(f"{option} {path} is a symbolic link (to {os.readlink(path)}): name the file itself; "
                             "outputs never replace a link or write through one to a file")
        mode = target_mode
    if mode is not None and stat.S_ISDIR(mode):
        raise InputError(f"{option} {path} is a folder; it names a file")
    if mode is not None and stat.S_ISBLK(mode):
        raise InputError(f"{option} {path} is a block device; outputs never write to one")
    if mode is not None and not stat.S_ISREG(mode):
        return path  # a character device or a FIFO: written through
    if not path.parent.is_dir():
        raise InputError(f"{option} {path}: folder {path.parent} does not exist (outputs never create folders)")
    return None


def write_output(path: Path, write: Callable[[BinaryIO], None], option: str) -> None:
    """`write(handle)` to a file the user named (`check_output` says which may be): a regular file
    through a temporary file beside it, renamed over it; a special file written through. InputError
    (one line) for what cannot be written, e.g. a full device."""
    path = Path(path)
    through = check_output(path, option)
    try:
        if through is None:
            atomic_write_with(path, lambda tmp: _write_named(tmp, write), make_folder=False)
            return
        fd = os.open(through, os.O_WRONLY | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "wb") as handle:
            write(handle)
    except OSError as err:
        raise InputError(f"cannot write {option} {path}: {err.strerror or err}") from None


def _write_named(name: str, write: Callable[[BinaryIO], None]) -> None:
    with open(name, "wb") as handle:
        write(handle)


def npy_parts(array: np.ndarray) -> tuple[bytes, memoryview]:
    """The bytes of `np.save(array)` as its header and a view of the array's own memory: a large
    array is written without a copy of it."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    return header.getvalue(), memoryview(array.reshape(-1).view(np.uint8))


def write_arrow(path: str | Path, table: pa.Table) -> None:
    """An uncompressed Arrow IPC file, written straight to `path`: opened by memory mapping, read
    without decoding."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)


def bytes_digest(*parts: bytes | pa.Buffer | memoryview) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for data in parts:
        digest.update(data)
    return digest.hexdigest()


def file_digest(path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_digests(paths: list[Path]) -> list[str]:
    """`file_digest` of each path, on a thread each up to the cores: hashlib lets go of the
    interpreter while it hashes a block, and a stage's outputs (or a build's files) are checked
    together, a gigabyte or more at 100,000 passages."""
    if len(paths) <= 1:
        return [file_digest(path) for path in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(file_digest, paths))


def json_digest(obj) -> str:
    return digest_text(json.dumps(obj, sort_keys=True))


def digest_text(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
