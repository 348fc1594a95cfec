"""Stage 1: read the input folder and cut every document into token-bounded chunks.

Documents are tracked by relative path and content hash, so the stage's fingerprint
changes only when the folder's content does. Files that cannot be read as text are
skipped with a reason (they appear in `documents.parquet` with status `skipped`).
Chunks are cut at paragraph, then sentence boundaries, then token offsets for text
with no boundaries at all (a 5 MB line).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .. import nlp
from ..errors import InputError
from ..executor import Executor
from ..files import json_digest
from ..graph import chunk_id, document_id

DOCUMENT_SCHEMA = pa.schema(
    [
        ("doc_id", pa.string()),
        ("path", pa.string()),  # relative to the input folder, "/"-separated
        ("title", pa.string()),  # first Markdown heading, else the first line when it reads as a title
        ("content_hash", pa.string()),
        ("bytes", pa.int64()),
        ("status", pa.string()),  # indexed | skipped | failed
        ("reason", pa.string()),  # why skipped or failed, else ""
        ("chunks", pa.int32()),
    ]
)
CHUNK_SCHEMA = pa.schema(
    [
        ("chunk_id", pa.string()),
        ("doc_id", pa.string()),
        ("ordinal", pa.int32()),
        ("title", pa.string()),
        ("text", pa.string()),
        ("tokens", pa.int32()),
    ]
)


@dataclass
class ScannedFile:
    path: str
    absolute: str
    text: str | None
    content_hash: str
    size: int
    reason: str = ""


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


def scan(folder: Path, extensions: list[str], max_bytes: int,
         progress: Callable[[int], None] | None = None, follow_symlinks: bool = False) -> list[ScannedFile]:
    """Every matching file under folder, recursively, in path order; `progress(n)` every
    `SCAN_PROGRESS` files read.

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
    suffixes = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions}
    seen_dirs: set[str] = set()
    found: list[ScannedFile] = []
    base = os.path.realpath(folder)

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
    for root, dirs, files in os.walk(folder, followlinks=True, onerror=unreadable_folder):
        real = os.path.realpath(root)
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
            if os.path.splitext(name)[1].lower() not in suffixes or name.startswith("."):
                continue
            absolute = os.path.join(root, name)
            relative = prefix + name
            try:
                relative.encode("utf-8")
            except UnicodeEncodeError:
                shown = relative.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
                found.append(ScannedFile(shown, absolute, None, "", 0, "file name is not valid UTF-8"))
                continue
            if os.path.islink(absolute) and outside(target := os.path.realpath(absolute)):
                found.append(leads_out(relative, absolute, target))
                continue
            text, data, reason = _read_text(absolute, max_bytes)
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            found.append(ScannedFile(relative, absolute, text, digest, len(data), reason))
            if progress and len(found) % SCAN_PROGRESS == 0:
                progress(SCAN_PROGRESS)
    if progress and len(found) % SCAN_PROGRESS:
        progress(len(found) % SCAN_PROGRESS)
    return sorted(found, key=lambda f: f.path)


def document_title(text: str, path: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            return nlp.strip_markdown(line)
        if path.lower().endswith(".md"):
            return ""
        if len(line) <= 120 and not re.search(r"[.!?]$", line):
            return line
        return ""
    return ""


def chunk_texts(texts: list[str], max_tokens: int, overlap_tokens: int = 0) -> list[list[tuple[str, int]]]:
    """Each text's chunks with their tokens: greedy packing of paragraphs (then sentences, then
    token pieces) up to max_tokens. Token counts for all texts go to the tokenizer together (a
    call per document cost more than the counting in an update of short documents).

    With overlap, a chunk starts with the last whole pieces of the one before, as many as
    fit in `overlap_tokens` (at most half a chunk), so overlap never cuts a sentence.
    """
    paragraphs = [[p for p in (p.strip() for p in re.split(r"\n\s*\n", t.replace("\r\n", "\n"))) if p] for t in texts]
    sizes = iter(nlp.count_tokens([p for group in paragraphs for p in group]))
    pieces: list[list[tuple[str, int | None]]] = []
    for group in paragraphs:
        own: list[tuple[str, int | None]] = []
        for paragraph in group:
            size = next(sizes)
            if size <= max_tokens:
                own.append((paragraph, size))
                continue
            own.extend((piece, None) for sentence in nlp.split_sentences(paragraph)
                       for piece in nlp.token_split(sentence, max_tokens))
        pieces.append(own)
    split_sizes = iter(nlp.count_tokens([p for own in pieces for p, size in own if size is None]))
    pieces = [[(p, next(split_sizes) if size is None else size) for p, size in own] for own in pieces]
    overlap_tokens = min(overlap_tokens, max_tokens // 2)
    chunks = [_pack(own, max_tokens, overlap_tokens) for own in pieces]
    counts = iter(nlp.count_tokens([c for own in chunks for c in own]))
    return [[(c, next(counts)) for c in own] for own in chunks]


def _pack(pieces: list[tuple[str, int]], max_tokens: int, overlap_tokens: int) -> list[str]:
    chunks: list[str] = []
    current: list[tuple[str, int]] = []
    current_tokens = 0
    fresh = False  # current holds a piece not yet in any chunk
    for piece, size in pieces:
        if current and fresh and current_tokens + size + 1 > max_tokens:
            chunks.append("\n\n".join(p for p, _ in current))
            carried: list[tuple[str, int]] = []
            carried_tokens = 0
            for old, old_size in reversed(current):
                if carried_tokens + old_size + 1 > overlap_tokens:
                    break
                carried.insert(0, (old, old_size))
                carried_tokens += old_size + 1
            current, current_tokens = carried, carried_tokens
            while current and current_tokens + size + 1 > max_tokens:
                current_tokens -= current.pop(0)[1] + 1
        current.append((piece, size))
        current_tokens += size + 1
        fresh = True
    if current and fresh:
        chunks.append("\n\n".join(p for p, _ in current))
    return chunks


CHUNKER_VERSION = 3


def chunking_key(content_hash: str, path: str, max_tokens: int, overlap_tokens: int) -> str:
    """What a document's chunks depend on: its bytes, the chunk settings, and (for the title) its kind."""
    kind = "md" if path.lower().endswith(".md") else "txt"
    return json_digest([CHUNKER_VERSION, content_hash, max_tokens, overlap_tokens, kind])


def chunking_settings(max_tokens: int, overlap_tokens: int) -> bytes:
    """The chunks table's mark of how it was cut: only a table with the same mark is reused."""
    return json.dumps([CHUNKER_VERSION, max_tokens, overlap_tokens]).encode()


def previous_chunks(documents: pa.Table | None, chunks: pa.Table | None, max_tokens: int,
                    overlap_tokens: int) -> dict[str, tuple[str, list[tuple[str, int, str]]]]:
    """The last run's chunks of each document, by `chunking_key`, when they were cut the way this
    run cuts them: an update re-cuts only new and changed documents."""
    if documents is None or chunks is None or \
            (chunks.schema.metadata or {}).get(b"noderag-chunking") != chunking_settings(max_tokens, overlap_tokens):
        return {}
    pieces: dict[str, list[tuple[str, int, str]]] = {}
    for doc, text, tokens, chunk in zip(*(chunks[c].to_pylist() for c in ("doc_id", "text", "tokens", "chunk_id")),
                                        strict=True):
        pieces.setdefault(doc, []).append((text, tokens, chunk))  # rows come in ordinal order
    return {chunking_key(content_hash, path, max_tokens, overlap_tokens): (title, pieces.get(doc, []))
            for doc, path, title, content_hash, status in
            zip(*(documents[c].to_pylist() for c in ("doc_id", "path", "title", "content_hash", "status")), strict=True)
            if status == "indexed"}


def document_chunks(
    files: list[ScannedFile], max_tokens: int, overlap_tokens: int = 0,
    previous: dict[str, tuple[str, list[tuple[str, int, str]]]] | None = None, executor: Executor | None = None,
) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """(title, [(chunk text, tokens, chunk id)]) per file: the last run's when the document and the
    settings are unchanged (`previous_chunks`), else cut on the `executor`'s workers."""
    previous = previous or {}
    out: list[tuple[str, list[tuple[str, int, str]]] | None] = []
    todo = []
    for position, file in enumerate(files):
        key = chunking_key(file.content_hash, file.path, max_tokens, overlap_tokens) if file.text is not None else ""
        if file.text is None:
            out.append(("", []))
        elif key in previous:
            out.append(previous[key])
        else:
            out.append(None)
            todo.append(position)
    batches = [todo[start : start + 256] for start in range(0, len(todo), 256)]
    jobs = [([(files[p].path, files[p].text) for p in batch], max_tokens, overlap_tokens) for batch in batches]
    for batch, entries in zip(batches, (executor or Executor()).map(chunk_batch, jobs), strict=True):
        for position, entry in zip(batch, entries, strict=True):
            out[position] = entry
    return out


def chunk_batch(job: tuple[list[tuple[str, str]], int, int]) -> list[tuple[str, list[tuple[str, int, str]]]]:
    """A worker's share of `document_chunks`: (title, chunks) of each (path, text)."""
    documents, max_tokens, overlap_tokens = job
    pieces = chunk_texts([text for _, text in documents], max_tokens, overlap_tokens)
    return [(document_title(text, path), [(piece, tokens, chunk_id(piece)) for piece, tokens in own])
            for (path, text), own in zip(documents, pieces, strict=True)]


def run(
    files: list[ScannedFile], max_tokens: int, overlap_tokens: int = 0,
    previous: dict[str, tuple[str, list[tuple[str, int, str]]]] | None = None, executor: Executor | None = None,
) -> tuple[pa.Table, pa.Table]:
    """Documents and chunks tables for the scanned files (the chunks table marked with how it was
    cut, for the next run's `previous_chunks`)."""
    docs = {name: [] for name in DOCUMENT_SCHEMA.names}
    chunks = {name: [] for name in CHUNK_SCHEMA.names}
    cut = document_chunks(files, max_tokens, overlap_tokens, previous, executor)
    for file, (title, pieces) in zip(files, cut, strict=True):
        doc = document_id(file.path)
        reason = file.reason or ("" if pieces else "no text after cleaning")
        for name, value in zip(
            DOCUMENT_SCHEMA.names,
            [doc, file.path, title, file.content_hash, file.size, "indexed" if pieces else "skipped", reason, len(pieces)],
            strict=True,
        ):
            docs[name].append(value)
        chunks["chunk_id"] += [c for _, _, c in pieces]
        chunks["doc_id"] += [doc] * len(pieces)
        chunks["ordinal"] += range(len(pieces))
        chunks["title"] += [title] * len(pieces)
        chunks["text"] += [t for t, _, _ in pieces]
        chunks["tokens"] += [n for _, n, _ in pieces]
    marked = CHUNK_SCHEMA.with_metadata({"noderag-chunking": chunking_settings(max_tokens, overlap_tokens)})
    return pa.Table.from_pydict(docs, schema=DOCUMENT_SCHEMA), pa.Table.from_pydict(chunks, schema=marked)
