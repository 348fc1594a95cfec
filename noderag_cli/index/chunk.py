"""Stage 1: read the input folder and cut every document into token-bounded chunks.

Documents are tracked by relative path and content hash, so the stage's fingerprint
changes only when the folder's content does. Files that cannot be read as text are
skipped with a reason (they appear in `documents.parquet` with status `skipped`).
Chunks are cut at paragraph, then sentence boundaries, then token offsets for text
with no boundaries at all (a 5 MB line).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from .. import nlp
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


class InputError(RuntimeError):
    """The input folder cannot be indexed at all."""


@dataclass
class ScannedFile:
    path: str
    absolute: Path
    text: str | None
    content_hash: str
    size: int
    reason: str = ""


def _read_text(path: Path, max_bytes: int) -> tuple[str | None, bytes, str]:
    try:
        size = path.stat().st_size
        if size > max_bytes:
            return None, b"", f"larger than chunk.max_file_bytes ({size} > {max_bytes} bytes)"
        data = path.read_bytes()
    except OSError as err:
        return None, b"", f"unreadable: {err.strerror or err}"
    if not data.strip():
        return None, data, "empty file"
    if b"\x00" in data[:8192]:
        return None, data, "binary file (NUL bytes)"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        return None, data, f"not valid UTF-8 (byte {err.start})"
    return text, data, ""


def scan(folder: Path, extensions: list[str], max_bytes: int) -> list[ScannedFile]:
    """Every matching file under folder, recursively, in path order. Follows directory
    symlinks once each, so a symlink loop is walked only once."""
    folder = Path(folder)
    if not folder.exists():
        raise InputError(f"input folder not found: {folder}")
    if not folder.is_dir():
        raise InputError(f"input is not a folder: {folder}")
    if not os.access(folder, os.R_OK | os.X_OK):
        raise InputError(f"input folder is not readable: {folder}")
    suffixes = {e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions}
    seen_dirs: set[str] = set()
    found: list[ScannedFile] = []
    for root, dirs, files in os.walk(folder, followlinks=True, onerror=lambda err: None):
        real = os.path.realpath(root)
        if real in seen_dirs:
            dirs[:] = []
            continue
        seen_dirs.add(real)
        dirs.sort()
        for name in sorted(files):
            absolute = Path(root) / name
            if absolute.suffix.lower() not in suffixes or name.startswith("."):
                continue
            relative = absolute.relative_to(folder).as_posix()
            text, data, reason = _read_text(absolute, max_bytes)
            digest = hashlib.blake2b(data, digest_size=16).hexdigest()
            found.append(ScannedFile(relative, absolute, text, digest, len(data), reason))
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


def chunk_text(text: str, max_tokens: int) -> list[str]:
    """Greedy packing of paragraphs (then sentences, then token pieces) up to max_tokens."""
    pieces: list[str] = []
    for paragraph in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        paragraph = paragraph.strip()
        if not paragraph:
            continue
        if nlp.count_tokens([paragraph])[0] <= max_tokens:
            pieces.append(paragraph)
            continue
        for sentence in nlp.split_sentences(paragraph):
            pieces.extend(nlp.token_split(sentence, max_tokens))
    if not pieces:
        return []
    sizes = nlp.count_tokens(pieces)
    chunks: list[str] = []
    current: list[str] = []
    current_tokens = 0
    for piece, size in zip(pieces, sizes, strict=True):
        if current and current_tokens + size + 1 > max_tokens:
            chunks.append("\n\n".join(current))
            current, current_tokens = [], 0
        current.append(piece)
        current_tokens += size + 1
    if current:
        chunks.append("\n\n".join(current))
    return chunks


def run(files: list[ScannedFile], max_tokens: int) -> tuple[pa.Table, pa.Table]:
    """Documents and chunks tables for the scanned files."""
    docs = {name: [] for name in DOCUMENT_SCHEMA.names}
    chunks = {name: [] for name in CHUNK_SCHEMA.names}
    for file in files:
        doc = document_id(file.path)
        pieces = chunk_text(file.text, max_tokens) if file.text is not None else []
        reason = file.reason or ("" if pieces else "no text after cleaning")
        title = document_title(file.text, file.path) if file.text else ""
        for name, value in zip(
            DOCUMENT_SCHEMA.names,
            [doc, file.path, title, file.content_hash, file.size, "indexed" if pieces else "skipped", reason, len(pieces)],
            strict=True,
        ):
            docs[name].append(value)
        for ordinal, (piece, tokens) in enumerate(zip(pieces, nlp.count_tokens(pieces), strict=True)):
            for name, value in zip(
                CHUNK_SCHEMA.names, [chunk_id(piece), doc, ordinal, title, piece, tokens], strict=True
            ):
                chunks[name].append(value)
    return pa.Table.from_pydict(docs, schema=DOCUMENT_SCHEMA), pa.Table.from_pydict(chunks, schema=CHUNK_SCHEMA)
