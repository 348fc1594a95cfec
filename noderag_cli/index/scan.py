"""The scan: every file under the input folder that the config's extensions, include and exclude
patterns select, read (text and Markdown) or hashed (a format a reader reads on the workers), with
a reason for each one skipped: unreadable, empty, binary, not UTF-8, a line too long, too large, a
symlink out of the folder, a format without a reader. Shown as its own step of `index`.

A file whose size, modification and change times, inode and device are those it had when an
earlier scan read it is not read again: its content hash comes from the workspace cache (namespace
"scan"), as make, rsync and restic decide. The change time cannot be set back by a program (a
restored modification time still moves it), and a file changed less than `RECENT_NS` before it was
read is not remembered, so an edit within the file system's clock resolution is read next time.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import readers
from ..cache import SCAN, Cache
from ..config import ChunkConfig
from ..errors import InputError


@dataclass
class ScannedFile:
    path: str
    absolute: str
    text: str | None  # a text file's text; None for a file its reader reads (and for an unreadable one)
    content_hash: str
    size: int
    reason: str = ""
    reader: str = "text"  # the format, as `readers.READERS` names it
    unchanged_key: str = ""  # its "scan" cache entry, when its content hash came from an earlier scan
    remember_key: str = ""  # the entry to write for it, when it was read now (and not changed just before)
    kept: bool = False  # unreadable now, and its last content (content_hash) stays in the build (`keep_last_content`)

    @property
    def unreadable_now(self) -> bool:
        """It is there but could not be read (permissions, an I/O error): maybe not for good, so a
        failed item whose last content stays, never a document that was deleted."""
        return self.reason.startswith((UNREADABLE, FOLDER_UNREADABLE))

    @property
    def extracted(self) -> bool:
        """Read by a reader on the workers, not by the scan."""
        return self.reader not in ("text", "markdown")

    @property
    def scan_key(self) -> str:
        """Its "scan" cache entry, used or written by this scan ("" if neither)."""
        return self.unchanged_key or self.remember_key

    @property
    def deferred(self) -> bool:
        """A text file the scan did not read (unchanged since an earlier scan): read when needed."""
        return bool(self.unchanged_key) and not self.extracted


class ScannedFiles(list):
    """The files a scan found, and how many the include and exclude patterns left out."""

    left_out: int = 0


UNSUPPORTED = {
    ".doc": "the legacy Word format: save it as .docx to index it",
    ".ppt": "the legacy PowerPoint format: save it as .pptx to index it",
    ".xls": "the legacy Excel format: save it as .xlsx to index it",
    ".odt": "OpenDocument text has no reader: save it as .docx to index it",
    ".odp": "OpenDocument slides have no reader: save them as .pptx to index them",
    ".ods": "OpenDocument sheets have no reader: save them as .xlsx to index them",
    ".rtf": "RTF has no reader: save it as .docx to index it",
    ".pages": "Apple Pages has no reader: export it as .docx or PDF to index it",
}
"""Document formats a folder often holds that no reader takes: reported, never passed over in silence."""

UNREADABLE = "unreadable: "  # the reason of a file that is there but could not be read
FOLDER_UNREADABLE = "folder not readable: "
SCAN_PROGRESS = 1000  # files read between two progress reports
RECENT_NS = 2_000_000_000  # a file modified or changed this close to its reading is read again next time
MAX_LINE_CHARS = readers.MAX_LINE_CHARS  # a text file with a longer line is skipped: not prose


def _read_text(path: str, max_bytes: int) -> tuple[str | None, bytes, str]:
    try:
        info = os.stat(path)
        size = info.st_size
        if not stat.S_ISREG(info.st_mode):
            return None, b"", "not a regular file"
        if size > max_bytes:
            return None, b"", f"larger than chunk.max_file_bytes ({size} > {max_bytes} bytes)"
        with open(path, "rb") as handle:
            head = handle.read(8192)
            if b"\x00" in head:  # told by its first block: the rest is never read into memory
                return None, head, "binary file (NUL bytes)"
            data = head + handle.read()
    except OSError as err:
        return None, b"", f"{UNREADABLE}{err.strerror or err}"
    if not data.strip():
        return None, data, "empty file"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        return None, data, f"not valid UTF-8 (byte {err.start})"
    if len(text) > MAX_LINE_CHARS:
        longest = max(len(line) for line in text.splitlines())
        if longest > MAX_LINE_CHARS:
            return None, data, f"a line of {longest:,} characters (over {MAX_LINE_CHARS:,}): not prose; add line breaks to index it"
    return text, data, ""


def content_hash(data: bytes) -> str:
    """A text file's content hash (a file a reader reads is hashed as it streams: `_hash_file`)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def read_text_file(file: ScannedFile, max_bytes: int) -> ScannedFile:
    """A deferred text file read now: with its text, or a reason (unreadable now, or not the bytes
    the scan recorded: changed since)."""
    text, data, reason = _read_text(file.absolute, max_bytes)
    if not reason and content_hash(data) != file.content_hash:
        reason = "changed while it was being indexed; run index again"
    return ScannedFile(file.path, file.absolute, text if not reason else None, file.content_hash, file.size, reason,
                       file.reader)


def _stat_key(absolute: str, info: os.stat_result, reader: str, limit: int) -> str:
    """The "scan" cache key of a file as it stands: what make, rsync and restic compare."""
    named = f"{absolute}\x1f{info.st_size}\x1f{info.st_mtime_ns}\x1f{info.st_ctime_ns}\x1f{info.st_ino}\x1f" \
            f"{info.st_dev}\x1f{reader}\x1f{limit}"
    return hashlib.blake2b(named.encode("utf-8", "surrogateescape"), digest_size=16).hexdigest()


def _hash_file(path: str, max_bytes: int) -> tuple[str, int, str]:
    """(content hash, size, reason) of a file a reader will read, streamed: it is not held in memory."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            return "", 0, "not a regular file"
        if info.st_size > max_bytes:
            return "", info.st_size, f"larger than chunk.max_document_mb ({info.st_size:,} > {max_bytes:,} bytes)"
        digest = hashlib.blake2b(digest_size=16)
        with open(path, "rb") as handle:
            while block := handle.read(1 << 20):
                digest.update(block)
    except OSError as err:
        return "", 0, f"{UNREADABLE}{err.strerror or err}"
    if info.st_size == 0:
        return "", 0, "empty file"
    return digest.hexdigest(), info.st_size, ""


def selected(relative: str, include: list[str], exclude: list[str]) -> bool:
    """Whether the include and exclude patterns keep a file. A pattern with a "/" is matched
    against the path relative to the input folder, one without against the file name (as in
    .gitignore); `*` also crosses folders. No include pattern: every file is included."""
    name = relative.rsplit("/", 1)[-1]

    def matches(pattern: str) -> bool:
        return fnmatch.fnmatchcase(relative if "/" in pattern else name, pattern.strip("/") if "/" in pattern else pattern)

    return (not include or any(matches(p) for p in include)) and not any(matches(p) for p in exclude)


def check_input_folder(folder: Path) -> None:
    """InputError unless folder is an existing, readable directory."""
    folder = Path(folder)
    if not folder.exists():
        raise InputError(f"input folder not found: {folder}")
    if not folder.is_dir():
        raise InputError(f"input is not a folder: {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise InputError(f"input folder is not readable: {folder}")
    try:
        with os.scandir(folder) as entries:
            next(entries, None)
    except OSError as err:
        raise InputError(f"input folder is not readable: {folder} ({err.strerror})") from err


def _walk(top: str, onerror: Callable[[OSError], None]):
    """os.walk(top, followlinks=True) without recursion: (folder, its real path, sub-folders, files,
    the names among them that are symlinks) top-down, each folder's sub-folders in the order the caller leaves them in the list it was given
    (it may prune it). Python's own walk recurses once per level, and a folder nested a thousand
    deep ended it; a real path is resolved only where a link makes it differ."""
    pending = [(top, os.path.realpath(top))]
    while pending:
        root, real = pending.pop()
        try:
            with os.scandir(root) as entries:
                listed = list(entries)
        except OSError as err:
            onerror(err)
            continue
        dirs, files, links = [], [], set()
        for entry in listed:
            try:
                if entry.is_symlink():
                    links.add(entry.name)
                (dirs if entry.is_dir() else files).append(entry.name)
            except OSError:
                files.append(entry.name)
        yield root, real, dirs, files, links
        pending.extend((os.path.join(root, d), os.path.realpath(os.path.join(root, d)) if d in links
                        else os.path.join(real, d)) for d in reversed(dirs))


def scan(folder: Path, settings: ChunkConfig, progress: Callable[[int], None] | None = None,
         memory: Cache | None = None) -> ScannedFiles:
    """Every file under folder with one of `settings.extensions` that the include and exclude
    patterns keep, recursively, in path order; `progress(n)` every `SCAN_PROGRESS` files read.
    Text files are read here; a file a reader reads (PDF, Word...) is hashed, and read by the
    chunk stage on the workers. A document format no reader takes (`UNSUPPORTED`) comes back
    skipped, with what to do about it.

    Hidden files and folders (".name") are left out. Symlinks are followed, each real folder
    once, so a symlink loop is walked only once; a link whose target lies outside the folder
    (a link to /etc, to a home directory) is skipped with a reason naming its target unless
    `follow_symlinks`, so that indexing a folder never reads what its owner did not put in it.
    What cannot be read (a file or a sub-folder: permissions, broken or looping symlinks, binary
    or non-UTF-8 content, a name that is not UTF-8) comes back with a `reason` and no text, to
    be skipped and counted.

    With `memory` (the workspace cache), a file unchanged since an earlier scan read it is not read
    (module docstring): its text, if needed, is read later (`deferred`, `read_text_file`).
    `remember` writes the entries of the files read now.
    """
    started = time.time_ns()
    folder = Path(folder)
    check_input_folder(folder)
    suffixes = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in settings.extensions}
    seen_dirs: set[str] = set()
    found = ScannedFiles()
    pending: list[tuple] = []  # the files to read, or to find unchanged
    base = os.path.realpath(folder)
    follow_symlinks = settings.follow_symlinks

    def outside(real: str) -> bool:
        return not follow_symlinks and real != base and not real.startswith(base + os.sep)

    def leads_out(relative: str, absolute: str, real: str) -> ScannedFile:
        return ScannedFile(relative, absolute, None, "", 0,
                           f"symlink leads out of the input folder (to {real}); --follow-symlinks reads it")

    def unreadable_folder(err: OSError) -> None:
        where = Path(err.filename) if err.filename else folder
        relative = where.relative_to(folder).as_posix() if where != folder else "."
        found.append(ScannedFile(relative + "/", str(where), None, "", 0, f"{FOLDER_UNREADABLE}{err.strerror or err}"))

    # plain strings, not Path objects: building two Paths per file was half of a scan's time
    patterns = bool(settings.include or settings.exclude)
    for root, real, dirs, files, links in _walk(str(folder), unreadable_folder):
        inside = Path(root).relative_to(folder).as_posix()
        if real in seen_dirs or outside(real):
            if real not in seen_dirs:
                found.append(leads_out(inside + "/", root, real))
            dirs[:] = []
            continue
        seen_dirs.add(real)
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        prefix = "" if inside == "." else inside + "/"
        for name in sorted(files):
            suffix = name[name.rfind("."):].lower() if name.rfind(".") > 0 else ""  # os.path.splitext's, for a name
            if name.startswith(".") or (suffix not in suffixes and suffix not in UNSUPPORTED):
                continue
            absolute = os.path.join(root, name)
            relative = prefix + name
            try:
                relative.encode("utf-8")
            except UnicodeEncodeError:
                shown = relative.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                found.append(ScannedFile(shown, absolute, None, "", 0, "file name is not valid UTF-8"))
                continue
            if patterns and not selected(relative, settings.include, settings.exclude):
                found.left_out += 1
                continue
            if suffix not in suffixes:
                found.append(ScannedFile(relative, absolute, None, "", 0, UNSUPPORTED[suffix], suffix.lstrip(".")))
                continue
            if name in links and outside(target := os.path.realpath(absolute)):
                found.append(leads_out(relative, absolute, target))
                continue
            reader = readers.READERS.get(suffix)  # `readers.reader_for`, on the suffix at hand
            kind = reader.name if reader is not None else "text"
            hashed = reader is not None and reader.read is not None
            limit = settings.max_document_mb * 1_000_000 if hashed else settings.max_file_bytes
            try:
                info = os.stat(absolute)
                key = _stat_key(absolute, info, kind, limit) if stat.S_ISREG(info.st_mode) else ""
            except OSError:
                info, key = None, ""  # read below, which says why it cannot be
            pending.append((relative, absolute, kind, hashed, limit, info, key))
    known = memory.get_many(SCAN, [p[-1] for p in pending if p[-1]]) if memory is not None and pending else {}
    reported = 0
    for count, (relative, absolute, kind, hashed, limit, info, key) in enumerate(pending, 1):
        if key in known:
            digest = known[key].decode()
            found.append(ScannedFile(relative, absolute, None, digest, info.st_size, "", kind, unchanged_key=key))
        elif hashed:
            digest, size, reason = _hash_file(absolute, limit)
            found.append(ScannedFile(relative, absolute, None, digest, size, reason, kind))
        else:
            text, data, reason = _read_text(absolute, limit)
            digest = content_hash(data)
            found.append(ScannedFile(relative, absolute, text, digest, len(data), reason, kind))
        settled = info is not None and max(info.st_mtime_ns, info.st_ctime_ns) < started - RECENT_NS
        if key and key not in known and not found[-1].reason and settled:
            found[-1].remember_key = key
        if progress and count % SCAN_PROGRESS == 0:
            progress(SCAN_PROGRESS)
            reported += SCAN_PROGRESS
    if progress and len(found) > reported:
        progress(len(found) - reported)
    found.sort(key=lambda f: f.path)
    return found


def remember(memory: Cache, files: list[ScannedFile]) -> None:
    """Write the "scan" entries of the files this scan read, so that the next scan need not. An
    entry says only what a file held when it looked so, true whatever becomes of the run."""
    memory.put_many(SCAN, [(f.remember_key, f.content_hash.encode()) for f in files if f.remember_key])


def keep_last_content(files: list[ScannedFile], indexed: dict[str, str]) -> list[ScannedFile]:
    """The scan with each document of the last build (`indexed`: path -> content hash) that is there
    but cannot be read now (itself, or its folder) kept at its last content: a failed item of the
    run whose chunks stay in the build, so that a passing permission or I/O problem neither drops a
    document nor has its paid work collected away, and the next run tries it again."""
    folders = [f for f in files if f.unreadable_now and f.path.endswith("/")]
    listed = {f.path for f in files}
    out = []
    for file in files:
        if file.unreadable_now and file.path in indexed:
            file = ScannedFile(file.path, file.absolute, None, indexed[file.path], file.size, file.reason,
                               _reader_name(file.path), kept=True)
        out.append(file)
    for path, content_hash in indexed.items():
        folder = next((f for f in folders if path.startswith(f.path)), None)
        if folder is not None and path not in listed:
            absolute = os.path.join(folder.absolute, path[len(folder.path):])
            out.append(ScannedFile(path, absolute, None, content_hash, 0, folder.reason, _reader_name(path), kept=True))
    return sorted(out, key=lambda f: f.path)


def _reader_name(path: str) -> str:
    reader = readers.reader_for(path)
    return reader.name if reader is not None else "text"
