"""The scan: every file under the input folder that the config's extensions, include and exclude
patterns select, read (text and Markdown) or hashed (a format a reader reads on the workers), with
a reason for each one skipped: unreadable, empty, binary, not UTF-8, a line too long, too large, a
symlink out of the folder, a format without a reader. Shown as its own step of `index`.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import readers
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

    @property
    def extracted(self) -> bool:
        """Read by a reader on the workers, not by the scan."""
        return self.reader not in ("text", "markdown")


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

SCAN_PROGRESS = 1000  # files read between two progress reports
MAX_LINE_CHARS = 1_000_000
"""A file with a longer line is skipped: that is a data dump or minified file, not prose, and
chunking and decomposing it as text would take minutes and fill the graph with noise."""


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
        return None, b"", f"unreadable: {err.strerror or err}"
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
        return "", 0, f"unreadable: {err.strerror or err}"
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
    """os.walk(top, followlinks=True) without recursion: (folder, its real path, sub-folders, files)
    top-down, each folder's sub-folders in the order the caller leaves them in the list it was given
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
                (dirs if entry.is_dir() else files).append(entry.name)
                if entry.is_symlink():
                    links.add(entry.name)
            except OSError:
                files.append(entry.name)
        yield root, real, dirs, files
        pending.extend((os.path.join(root, d), os.path.realpath(os.path.join(root, d)) if d in links
                        else os.path.join(real, d)) for d in reversed(dirs))


def scan(folder: Path, settings: ChunkConfig, progress: Callable[[int], None] | None = None) -> ScannedFiles:
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
    """
    folder = Path(folder)
    check_input_folder(folder)
    suffixes = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in settings.extensions}
    seen_dirs: set[str] = set()
    found = ScannedFiles()
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
        found.append(ScannedFile(relative + "/", str(where), None, "", 0, f"folder not readable: {err.strerror or err}"))

    # plain strings, not Path objects: building two Paths per file was half of a scan's time
    for root, real, dirs, files in _walk(str(folder), unreadable_folder):
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
            suffix = os.path.splitext(name)[1].lower()
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
            if not selected(relative, settings.include, settings.exclude):
                found.left_out += 1
                continue
            if suffix not in suffixes:
                found.append(ScannedFile(relative, absolute, None, "", 0, UNSUPPORTED[suffix], suffix.lstrip(".")))
                continue
            if os.path.islink(absolute) and outside(target := os.path.realpath(absolute)):
                found.append(leads_out(relative, absolute, target))
                continue
            reader = readers.reader_for(relative)
            kind = reader.name if reader is not None else "text"
            if reader is not None and reader.read is not None:
                digest, size, reason = _hash_file(absolute, settings.max_document_mb * 1_000_000)
                found.append(ScannedFile(relative, absolute, None, digest, size, reason, kind))
            else:
                text, data, reason = _read_text(absolute, settings.max_file_bytes)
                digest = hashlib.blake2b(data, digest_size=16).hexdigest()
                found.append(ScannedFile(relative, absolute, text, digest, len(data), reason, kind))
            if progress and len(found) % SCAN_PROGRESS == 0:
                progress(SCAN_PROGRESS)
    if progress and len(found) % SCAN_PROGRESS:
        progress(len(found) % SCAN_PROGRESS)
    found.sort(key=lambda f: f.path)
    return found
