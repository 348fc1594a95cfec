"""Documents in other formats, read as Markdown with where each part of it came from.

The chunk stage is the only caller: it hands a file to `extract` (on a worker process) and gets
back `Extracted`, Markdown text (headings as `#` lines, which are the chunker's section
boundaries; lists as `- ` lines; tables as Markdown tables) and its `parts`: from which offset on
the text is on a given page (PDF), slide (PPTX) or sheet (XLSX). Sections (the nearest heading)
are found in the Markdown itself, for every format (`sections`). Nothing after chunking knows
formats exist: it sees the text and the location columns of the chunks.

One module per family, each a `Reader` in `READERS` by suffix:

| suffixes | reader | library (licence) |
|---|---|---|
| .txt .md .markdown .rst | text | none: read as UTF-8 text by the scan |
| .pdf | pdf (text layer; no OCR) | pypdfium2 (Apache-2.0 / BSD-3; PDFium, BSD-3) |
| .docx | docx | python-docx (MIT) |
| .pptx | pptx | python-pptx (MIT) |
| .xlsx .xlsm | xlsx | openpyxl (MIT) |
| .html .htm .xhtml | html | beautifulsoup4 (MIT) with lxml (BSD-3), markdownify (MIT) |
| .epub | epub | the standard library's zipfile, beautifulsoup4 and lxml, markdownify |

A file a reader cannot use raises `Unreadable` with the reason a user reads ("encrypted PDF
(password-protected)", "no text layer; OCR is not supported", "expands to 2,000 MB"). `Limits`
holds what one extraction may spend (time, memory, the size an archive may expand to). The
indexing run reads each document in a process of its own that the kernel holds to them
(`contained.py`): no library's quadratic or greedy path inside one parse can pass them. Readers
also check the time between pages, slides, sheets and files (`Limits.check`), to stop with the
reason before the kernel must.

A reader gets the document as an open file, never its path: `extract` opens the path once, without
blocking and only as a regular file (a FIFO or a device put in a document's place since the scan is
refused, never read), and checks that its bytes are still those the scan hashed.
"""

from __future__ import annotations

import hashlib
import io
import os
import posixpath
import re
import stat
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import BinaryIO

TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".rst")
MAX_LINE_CHARS = 1_000_000
"""A document with a longer line is not read: that is a data dump or minified file, not prose, and
chunking and decomposing it as text would take minutes and fill the graph with noise (the scan
applies it to text files, `extract` to what a reader gives)."""
MAX_CONTROL_SHARE = 0.05
"""Of a reader's text, the share of control characters (and U+FFFD, the mark of undecodable bytes)
from which it is binary data, not a document: what the scan skips as binary among text files."""


class Unreadable(Exception):
    """A document this reader cannot turn into text; the message is the reason shown to the user."""


class NotADocument(Unreadable):
    """A file that holds no document to read (binary data, a dump of one endless line): skipped, as
    the scan skips such text files, not failed (no later run would read it otherwise)."""


@dataclass
class Extracted:
    """A document as Markdown, its title ("" for none) and where its parts came from: from each
    `(offset, kind, value)` on, the text is on that page / slide / sheet (`kind` "pages", "slides"
    or "sheets", the names `query --json` uses)."""

    text: str
    title: str = ""
    parts: list[tuple[int, str, int | str]] = field(default_factory=list)


@dataclass
class Limits:
    """What one extraction may spend: `seconds` of work, `memory_mb` of memory beyond what its
    process held when it started (the kernel's address-space limit on the reader's process,
    `contained.py`), and for archives (DOCX, PPTX, XLSX, EPUB) `expanded_mb` of uncompressed members."""

    seconds: float = 120.0
    memory_mb: int = 1024
    expanded_mb: int = 512
    started: float = field(default_factory=time.monotonic)

    def check(self) -> None:
        if time.monotonic() - self.started > self.seconds:
            raise Unreadable(self.over_time())

    def over_time(self) -> str:
        return f"extraction took over {self.seconds:g} s (chunk.extract_seconds)"

    def over_memory(self) -> str:
        return f"extraction needed over {self.memory_mb:,} MB of memory (chunk.extract_memory_mb)"

    def check_archive(self, handle: BinaryIO, kind: str) -> zipfile.ZipFile:
        """The archive opened, once its members are known to expand within `expanded_mb`. Its
        members are read through `bounded_member`, which holds them to what they declare."""
        try:
            archive = zipfile.ZipFile(handle)
            total = sum(member.file_size for member in archive.infolist())
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            raise Unreadable(f"damaged or not a {kind} file ({_first_line(err)})") from None
        if total > self.expanded_mb * 1_000_000:
            archive.close()
            raise Unreadable(f"its compressed contents expand to {total / 1e6:,.0f} MB, over chunk.extract_expanded_mb "
                             f"({self.expanded_mb:,} MB): a zip bomb, or a file too large to read")
        return archive


def bounded_member(archive: zipfile.ZipFile, name: str) -> bytes:
    """A member's bytes, inflated in steps: a member that inflates past the size it declares is
    stopped there (zipfile alone inflates up to 2 GB in one step before its CRC check fails)."""
    info = archive.getinfo(name)
    parts, total = [], 0
    with archive.open(info) as member:
        while block := member.read(1 << 20):
            total += len(block)
            if total > info.file_size:
                raise Unreadable(f"damaged archive: member {name} inflates past the {info.file_size:,} bytes it declares")
            parts.append(block)
    return b"".join(parts)


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:160] if text else type(err).__name__


@dataclass(frozen=True)
class Reader:
    name: str  # the format, as `index --dry-run` counts files
    read: Callable[[BinaryIO, Limits], Extracted] | None  # None: text, read by the scan itself
    libraries: tuple[str, ...] = ()  # distributions whose versions can change the text it gives


def _lazy(module: str, function: str) -> Callable[[BinaryIO, Limits], Extracted]:
    """A reader function imported on first use: a run without PDFs never imports PDFium."""

    def read(handle: BinaryIO, limits: Limits) -> Extracted:
        from importlib import import_module

        return getattr(import_module(f"{__name__}.{module}"), function)(handle, limits)

    return read


_WEB = ("beautifulsoup4", "lxml", "markdownify")
READERS: dict[str, Reader] = {
    **{suffix: Reader("markdown" if suffix in (".md", ".markdown") else "text", None) for suffix in TEXT_SUFFIXES},
    ".pdf": Reader("pdf", _lazy("pdf", "read_pdf"), ("pypdfium2",)),
    ".docx": Reader("docx", _lazy("office", "read_docx"), ("python-docx",)),
    ".pptx": Reader("pptx", _lazy("office", "read_pptx"), ("python-pptx",)),
    ".xlsx": Reader("xlsx", _lazy("office", "read_xlsx"), ("openpyxl",)),
    ".xlsm": Reader("xlsx", _lazy("office", "read_xlsx"), ("openpyxl",)),
    ".html": Reader("html", _lazy("web", "read_html"), _WEB),
    ".htm": Reader("html", _lazy("web", "read_html"), _WEB),
    ".xhtml": Reader("html", _lazy("web", "read_html"), _WEB),
    ".epub": Reader("epub", _lazy("web", "read_epub"), _WEB),
}
VERSION = 2  # of the readers' own rules (how headings, lists, tables and boilerplate are written)


def reader_for(path: str) -> Reader | None:
    return READERS.get(posixpath.splitext(path)[1].lower())  # not a Path per file: a scan asks for every file


def identity(suffixes: list[str]) -> dict:
    """What decides the text the readers of these suffixes give: their rules' version and the
    versions of the libraries they use (a library missing says so). Part of the chunk stage's
    settings, so an upgrade that changes extracted text re-runs the chunk stage, and re-reads
    only the documents of the formats whose libraries changed (`chunking_key`)."""
    libraries = sorted({lib for s in suffixes if (r := READERS.get(s)) is not None for lib in r.libraries})
    return {"version": VERSION, "libraries": {lib: library_version(lib) for lib in libraries}}


def library_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "missing"


def open_document(path: str, content_hash: str | None = None) -> BinaryIO:
    """The document at `path` opened for its reader: only a regular file (opened without blocking, so
    a FIFO put in its place is refused, not waited on), held in memory, and when `content_hash` is
    given, with the bytes the scan hashed. Unreadable says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise Unreadable(f"unreadable: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise Unreadable("no longer a regular file (replaced since the scan); run index again")
        try:
            data = handle.read()
        except OSError as err:
            raise Unreadable(f"unreadable: {err.strerror or err}") from None
    if content_hash is not None and hashlib.blake2b(data, digest_size=16).hexdigest() != content_hash:
        raise Unreadable("changed while it was being indexed; run index again")
    return io.BytesIO(data)


def extract(path: str, limits: Limits, content_hash: str | None = None) -> Extracted:
    """The document at `path` read by the reader of its suffix (`open_document` opens it); Unreadable
    says why not. In this process: an indexing run calls `contained.extract`, which calls this in a
    process the kernel holds to `limits`."""
    reader = reader_for(path)
    if reader is None or reader.read is None:
        raise Unreadable("not a format with a reader")
    handle = open_document(path, content_hash)
    try:
        extracted = reader.read(handle, limits)
    except Unreadable:
        raise
    except ImportError as err:
        raise Unreadable(f"the {reader.name} reader's library is missing ({err.name}): reinstall noderag-cli") from None
    except MemoryError:
        raise Unreadable(limits.over_memory()) from None
    except Exception as err:  # a library's own error on a file it cannot parse: the file is damaged
        raise Unreadable(f"damaged or unsupported {reader.name} file ({type(err).__name__}: {_first_line(err)})") from None
    lead = len(extracted.text) - len(extracted.text.lstrip())
    text = extracted.text.strip()
    if not text:
        raise Unreadable("no text in it")
    check_text(text)
    parts = [(max(offset - lead, 0), kind, value) for offset, kind, value in extracted.parts]
    return Extracted(text, extracted.title, parts)


_CONTROL = re.compile("[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufffd]")


def check_text(text: str) -> None:
    """Unreadable for what a reader gave that is no document: a line over `MAX_LINE_CHARS` (a dump,
    not prose), or binary data decoded as text (`MAX_CONTROL_SHARE`)."""
    longest = max(map(len, text.split("\n"))) if len(text) > MAX_LINE_CHARS else 0
    if longest > MAX_LINE_CHARS:
        raise NotADocument(f"a line of {longest:,} characters (over {MAX_LINE_CHARS:,}): not prose; add line breaks "
                           "to index it")
    sample = text[:1_000_000]
    share = len(_CONTROL.findall(sample)) / max(len(sample) - sample.count(" "), 1)
    if share > MAX_CONTROL_SHARE:
        raise NotADocument(f"binary content ({share:.0%} of its characters are control or undecodable ones): not a "
                           "document")


_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


def sections(text: str) -> list[tuple[int, str]]:
    """(offset, heading) of every Markdown heading: from there on, the text is in that section."""
    return [(m.start(), m.group(2).strip()) for m in _HEADING.finditer(text)]


TABLE_ROWS = 40
"""Rows per Markdown table: a longer table is cut into tables of this many rows, each under the
header row again, so a chunk holds whole rows with the header that says what they are."""


def markdown_table(rows: list[list[str]]) -> str:
    """Rows of cells as Markdown tables, the first row as the header (see `TABLE_ROWS`); cells on
    one line, pipes escaped."""
    rows = [[" ".join(str(cell).split()).replace("|", "\\|") for cell in row] for row in rows]
    width = max((len(row) for row in rows), default=0)
    if not width:
        return ""
    rows = [row + [""] * (width - len(row)) for row in rows]
    head = ["| " + " | ".join(rows[0]) + " |", "|" + " --- |" * width]
    body = ["| " + " | ".join(row) + " |" for row in rows[1:]]
    groups = [body[i:i + TABLE_ROWS] for i in range(0, len(body), TABLE_ROWS)] or [[]]
    return "\n\n".join("\n".join(head + group) for group in groups)
