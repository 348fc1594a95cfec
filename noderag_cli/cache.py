"""The content-addressed cache (`cache.sqlite`): replies, vectors and token counts a run would
otherwise pay for again; how it is checked for damage and salvaged row by row."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import threading
import time
import zlib
from collections.abc import Iterable
from pathlib import Path

# the namespaces of the cache's keys, each with what its entries hold (docs/workspace.md lists them,
# tests/test_layers.py checks that it does)
SCAN = "scan"
EXTRACT = "extract"
DECOMPOSE = "decompose"
OFFLINE = "offline"
EMBEDDING = "embedding"
LLM = "llm"
NAMESPACES = {
    SCAN: "a file's content hash by its path, size, times and inode, so an unchanged file is not read again",
    EXTRACT: "the text a reader extracted from a PDF, Office, HTML or EPUB document, by its content",
    DECOMPOSE: "each chunk's units, entities and relationships, per engine and chunk",
    OFFLINE: "the offline engine's attributes and community groupings, per input",
    EMBEDDING: "vectors of a model behind litellm, not the bundled model's, which cost less to compute than to read back",
    LLM: "every LLM request's reply",
}

CACHE_TABLE = "CREATE TABLE IF NOT EXISTS kv (ns TEXT, key TEXT, value BLOB, PRIMARY KEY (ns, key))"
COMPRESSED = b"\x00zlib:"  # the prefix of a compressed cache value
CHECKED = b"\x00crc:"  # the prefix of a stored value that carries its CRC-32 (4 bytes) before it


class DamagedValue(ValueError):
    """A stored value whose CRC-32 does not match: read as a miss, never as what it once was."""


def _crc(ns: str, key: str, body: bytes) -> bytes:
    """The CRC-32 of an entry: its namespace and key with its value, so a damaged key is found too."""
    return zlib.crc32(body, zlib.crc32(f"{ns}\x1f{key}\x1f".encode())).to_bytes(4, "big")


def checked(ns: str, key: str, stored: bytes) -> bytes:
    """A stored value without its checksum (a value stored before checksums is taken as it is);
    DamagedValue when the checksum does not match."""
    if not stored.startswith(CHECKED):
        return stored
    body = stored[len(CHECKED) + 4:]
    if _crc(ns, key, body) != stored[len(CHECKED):len(CHECKED) + 4]:
        raise DamagedValue("checksum differs")
    return body


class Cache:
    """Content-addressed key/value store in SQLite, one table, namespaced keys.

    Written as results arrive (each `put_many` commits), so a killed run re-pays nothing. A
    read-only cache (`read_only=True`: opened immutable, puts dropped) serves the commands that
    never write to a workspace.
    """

    def __init__(self, path: Path, read_only: bool = False):
        self.path = path
        self.read_only = read_only
        self._lock = threading.Lock()
        self._touched: dict[str, set[str]] | None = None  # keys asked for or written while recording
        if read_only:
            self._db = sqlite3.connect(read_only_uri(path), uri=True, check_same_thread=False, isolation_level=None)
            return
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(CACHE_TABLE)

    @staticmethod
    def _packed(ns: str, key: str, value: bytes) -> bytes:
        """Values of a few hundred bytes and more are stored compressed (zlib, the fastest level:
        a decomposition's JSON shrinks threefold), marked by a prefix no stored JSON starts with;
        every value carries its CRC-32, so one flipped bit is a miss, not a wrong reply reused."""
        if value.startswith(CHECKED):  # already packed (a salvaged row)
            return value
        if len(value) >= 256 and not value.startswith(COMPRESSED):
            value = COMPRESSED + zlib.compress(value, 1)
        return CHECKED + _crc(ns, key, value) + value

    @staticmethod
    def _unpacked(ns: str, key: str, value: bytes) -> bytes:
        value = checked(ns, key, value)
        return zlib.decompress(value[len(COMPRESSED):]) if value.startswith(COMPRESSED) else value

    def start_recording(self) -> None:
        """From now on remember every key asked for or written (`touch` adds more), until
        `stop_recording`: what one stage run needs from the cache, which `noderag gc` keeps."""
        self._touched = {}

    def stop_recording(self) -> dict[str, set[str]]:
        touched, self._touched = self._touched or {}, None
        return touched

    @property
    def recording(self) -> bool:
        return self._touched is not None

    def touch(self, ns: str, keys: Iterable[str]) -> None:
        """Count keys as needed without reading them (values a run holds in memory already)."""
        if self._touched is not None:
            self._touched.setdefault(ns, set()).update(keys)

    def get_many(self, ns: str, keys: Iterable[str]) -> dict[str, bytes]:
        keys = list(dict.fromkeys(keys))
        self.touch(ns, keys)
        found: dict[str, bytes] = {}
        with self._lock:
            for start in range(0, len(keys), 900):
                part = keys[start : start + 900]
                marks = ",".join("?" * len(part))
                try:
                    rows = self._db.execute(f"SELECT key, value FROM kv WHERE ns=? AND key IN ({marks})", [ns, *part])
                except sqlite3.DatabaseError:
                    if not self.read_only:
                        raise
                    return {}  # a read-only look-up that cannot be answered only misses the cache
                for key, value in rows.fetchall():
                    try:
                        found[key] = self._unpacked(ns, key, value)
                    except (zlib.error, DamagedValue):  # a damaged entry is a miss: computed (or asked) again
                        continue
        return found

    def get(self, ns: str, key: str) -> bytes | None:
        return self.get_many(ns, [key]).get(key)

    def put_many(self, ns: str, items: Iterable[tuple[str, bytes]]) -> None:
        rows = [(ns, key, self._packed(ns, key, value)) for key, value in items]
        self.touch(ns, (key for _, key, _ in rows))
        if not rows or self.read_only:
            return
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO kv VALUES (?, ?, ?)", rows)
            self._db.execute("COMMIT")

    def put(self, ns: str, key: str, value: bytes) -> None:
        self.put_many(ns, [(key, value)])

    def delete_many(self, ns: str, keys: Iterable[str]) -> int:
        """Remove entries; returns how many there were. A recording forgets them: they are not needed."""
        rows = [(ns, key) for key in keys]
        if self._touched is not None and ns in self._touched:
            self._touched[ns].difference_update(key for _, key in rows)
        if not rows or self.read_only:
            return 0
        with self._lock:
            before = self._db.total_changes
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM kv WHERE ns=? AND key=?", rows)
            self._db.execute("COMMIT")
            return self._db.total_changes - before

    def compact(self) -> None:
        """Give the space of removed entries back to the file system (SQLite keeps it otherwise)."""
        if self.read_only:
            return
        with self._lock:
            self._db.execute("VACUUM")

    def count(self, ns: str) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM kv WHERE ns=?", [ns]).fetchone()[0]

    def counts(self) -> dict[str, int]:
        """Entries per namespace (none in a file that holds no cache table: an emptied one)."""
        with self._lock:
            try:
                return dict(self._db.execute("SELECT ns, COUNT(*) FROM kv GROUP BY ns").fetchall())
            except sqlite3.OperationalError:
                return {}

    def close(self) -> None:
        with self._lock:
            self._db.close()


def read_only_uri(path: Path) -> str:
    """An SQLite URI that reads `path` without writing anything beside it. Immutable (no -wal/-shm
    file created, no lock taken) is right only when every write is in the main file; a -wal with
    content (a writer running, or killed) is read with ordinary read-only locking instead."""
    wal = Path(f"{path}-wal")
    pending = wal.is_file() and wal.stat().st_size > 0
    return f"file:{path}?mode=ro{'' if pending else '&immutable=1'}"


def cache_damage(path: Path, thorough: bool = False) -> str | None:
    """Why the cache file cannot be trusted, or None: the header and the page count (a truncated
    file is shorter than its pages), cheap at any size; `thorough` adds SQLite's own quick check
    of the b-trees, which reads every page, and every value's CRC-32 (seconds for a cache of a few
    hundred MB)."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None
    if size == 0:
        return None  # SQLite takes an empty file as a new database
    try:
        with open(path, "rb") as handle:
            header = handle.read(100)
        if len(header) < 100 or not header.startswith(b"SQLite format 3\x00"):
            return "not an SQLite database"
        page_size = int.from_bytes(header[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = int.from_bytes(header[28:32], "big")
        wal = Path(f"{path}-wal")
        if pages and size < pages * page_size and not (wal.is_file() and wal.stat().st_size):
            return f"truncated: {size:,} bytes of {pages * page_size:,}"
        if not thorough:
            return None
        db = sqlite3.connect(read_only_uri(path), uri=True)
        try:
            verdict = db.execute("PRAGMA quick_check(1)").fetchone()[0]
            if verdict != "ok":
                return " ".join(verdict.split())  # SQLite's report, on one line
            damaged = sum(1 for ns, key, value in db.execute("SELECT ns, key, value FROM kv") if not _intact(ns, key, value))
        finally:
            db.close()
        return f"{damaged:,} entries fail their checksum" if damaged else None
    except sqlite3.DatabaseError as err:
        return " ".join(str(err).split())
    except OSError as err:
        return f"unreadable: {err.strerror}"


def _intact(ns: str, key: str, value: bytes) -> bool:
    if not isinstance(value, bytes) or not isinstance(ns, str) or not isinstance(key, str):
        return False  # a row damaged into other types
    try:
        checked(ns, key, value)
    except DamagedValue:
        return False
    return True


def _readable_copy(path: Path, target: Path) -> None:
    """A copy of a damaged database that SQLite will open: whole pages only, and a header whose
    page count is what the file holds (SQLite refuses a file shorter than its header says)."""
    data = bytearray(path.read_bytes())
    if len(data) >= 100 and data.startswith(b"SQLite format 3\x00"):
        page_size = int.from_bytes(data[16:18], "big")
        page_size = 65536 if page_size == 1 else page_size
        pages = len(data) // page_size
        del data[pages * page_size:]
        data[28:32] = pages.to_bytes(4, "big")
    target.write_bytes(bytes(data))


def salvage_cache(path: Path) -> tuple[Path, int]:
    """Copy every row SQLite can still read from a damaged cache into a new one, keep the damaged
    file beside it as `cache.sqlite.damaged-<time>`, and put the new one in its place. Rows are
    read in rowid order; past a row that cannot be read the scan resumes further on, by steps that
    double while they keep failing, so a lost region costs a few look-ups, not one per row."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kept = path.with_name(f"{path.name}.damaged-{stamp}")
    readable, fresh = path.with_name(f".{path.name}.readable"), path.with_name(f".{path.name}.salvage")
    for leftover in (readable, fresh):
        with contextlib.suppress(FileNotFoundError):
            leftover.unlink()
    _readable_copy(path, readable)
    target = Cache(fresh)
    rows = 0
    try:
        source = sqlite3.connect(f"file:{readable}?mode=ro&immutable=1", uri=True)
        position, step = 0, 1
        while step < 1 << 40:
            batch: list[tuple[str, str, bytes]] = []
            progressed = False
            try:
                for rowid, ns, key, value in source.execute(
                        "SELECT rowid, ns, key, value FROM kv WHERE rowid > ? ORDER BY rowid", (position,)):
                    if _intact(ns, key, value):  # an entry that fails its checksum is left behind, as unreadable
                        batch.append((ns, key, value))
                    position, progressed = rowid, True
                    if len(batch) >= 1000:
                        rows += _put_rows(target, batch)
                break  # the end of the table, read without error
            except sqlite3.DatabaseError:
                step = 1 if progressed else step * 2
                position += step
            finally:
                rows += _put_rows(target, batch)
        source.close()
    except sqlite3.DatabaseError:
        pass  # not even the schema could be read: the new cache starts empty
    target.close()
    readable.unlink()
    os.replace(path, kept)
    for suffix in ("-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{kept}{suffix}")
    os.replace(fresh, path)
    return kept, rows


def _put_rows(target: Cache, batch: list[tuple[str, str, bytes]]) -> int:
    count = len(batch)
    for ns in {row[0] for row in batch}:
        target.put_many(ns, [(k, v) for n, k, v in batch if n == ns])
    batch.clear()
    return count
