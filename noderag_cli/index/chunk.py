"""Stage 1: cut every document of the scan (scan.py) into token-bounded chunks.

Documents are tracked by relative path and content hash, so the stage's fingerprint
changes only when the folder's content does. Text and Markdown are read by the scan; PDF, Word,
PowerPoint, Excel, HTML and EPUB files by their reader (`noderag_cli/readers`) on the worker
processes, which turns them into Markdown with where each part came from. A file that cannot be
read is skipped with a reason (status `skipped` in `documents.parquet`: unreadable, empty,
binary, a format without a reader) or, when its reader failed on it (encrypted, damaged, no
text layer, over a limit), `failed`: counted as a failed item, so the run exits 1 and the next
run tries it again.

Chunks are cut at paragraph, then sentence boundaries, then token offsets for text with no
boundaries at all (a 5 MB line). Each chunk keeps its character span in the document's text
(`start`, `end`; text as read, with "\r\n" as "\n") and `location`: the pages, slides or sheets
and the sections (headings) it spans, as JSON. An update re-cuts only new and changed documents,
and re-reads a changed PDF or Word file only: extractions are cached by content and reader.
"""

from __future__ import annotations

import bisect
import json
import os
import re
from dataclasses import dataclass, field

import pyarrow as pa

from .. import nlp, readers
from ..cache import EXTRACT, Cache
from ..config import ChunkConfig
from ..executor import Executor
from ..files import json_digest
from ..graph import chunk_id, document_id
from ..readers import contained
from .scan import ScannedFile, read_text_file

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
        ("start", pa.int64()),  # where the chunk starts in its document's text (characters)
        ("end", pa.int64()),  # and where it ends
        ("location", pa.string()),  # JSON: {"pages": [..]} / {"slides": [..]} / {"sheets": [..]}, "sections": [..]
    ]
)


TEXT_BATCH = 1024  # text documents cut per batch of work: a batch is worth sending to a worker


def document_title(text: str, markdown: bool) -> str:
    """The first Markdown heading; else (not Markdown) the first line when it reads as a title."""
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            return nlp.strip_markdown(line)
        if markdown:
            return ""
        if len(line) <= 120 and not re.search(r"[.!?]$", line):
            return line
        return ""
    return ""


Piece = tuple[str, int, int, int, list]  # text, tokens, start, end (in the document's text), layout (`_pack`)


def _paragraph_spans(text: str) -> list[tuple[str, int, int]]:
    """The blank-line separated blocks of a text, stripped, with their spans."""
    spans, position = [], 0
    for gap in [*re.finditer(r"\n\s*\n", text), None]:
        end = gap.start() if gap is not None else len(text)
        segment = text[position:end]
        stripped = segment.strip()
        if stripped:
            start = position + len(segment) - len(segment.lstrip())
            spans.append((stripped, start, start + len(stripped)))
        if gap is not None:
            position = gap.end()
    return spans


def _located(parts: list[str], text: str, start: int) -> list[tuple[str, int, int]]:
    """Each part (a piece of `text[start:]`, in order) with its span, found from where the last ended."""
    spans, cursor = [], start
    for part in parts:
        at = text.find(part, cursor)
        at = cursor if at < 0 else at
        spans.append((part, at, at + len(part)))
        cursor = at + len(part)
    return spans


def chunk_texts(texts: list[str], max_tokens: int, overlap_tokens: int = 0) -> list[list[Piece]]:
    """Each text's chunks with their tokens, spans and layouts (`_pack`): greedy packing of
    paragraphs (then sentences, then token pieces) up to max_tokens. Token counts for all texts go
    to the tokenizer together (a call per document cost more than the counting in an update of
    short documents).

    With overlap, a chunk starts with the last whole pieces of the one before, as many as
    fit in `overlap_tokens` (at most half a chunk), so overlap never cuts a sentence.
    """
    texts = [t.replace("\r\n", "\n") for t in texts]
    paragraphs = [_paragraph_spans(t) for t in texts]
    sizes = iter(nlp.count_tokens([p for group in paragraphs for p, _, _ in group]))
    pieces: list[list[tuple[str, int | None, int, int]]] = []
    for text, group in zip(texts, paragraphs, strict=True):
        own: list[tuple[str, int | None, int, int]] = []
        for paragraph, start, end in group:
            size = next(sizes)
            if size <= max_tokens:
                own.append((paragraph, size, start, end))
                continue
            parts = [piece for sentence in nlp.split_sentences(paragraph) for piece in nlp.token_split(sentence, max_tokens)]
            own.extend((piece, None, a, b) for piece, a, b in _located(parts, text, start))
        pieces.append(own)
    split_sizes = iter(nlp.count_tokens([p for own in pieces for p, size, _, _ in own if size is None]))
    pieces = [[(p, next(split_sizes) if size is None else size, a, b) for p, size, a, b in own] for own in pieces]
    overlap_tokens = min(overlap_tokens, max_tokens // 2)
    chunks = [_pack(own, max_tokens, overlap_tokens) for own in pieces]
    counts = iter(nlp.count_tokens([c[0] for own in chunks for c in own]))
    return [[(c, next(counts), a, b, layout) for c, a, b, layout in own] for own in chunks]


def _pack(pieces: list[tuple[str, int, int, int]], max_tokens: int, overlap_tokens: int) -> list[tuple]:
    """Chunks as (text, start, end, layout): the pieces joined by blank lines, the span from the
    first piece's start to the last's end, and per piece (its start in the document, its offset
    in the chunk's text), to carry a position from one to the other."""
    chunks: list[tuple] = []
    current: list[tuple[str, int, int, int]] = []
    current_tokens = 0
    fresh = False  # current holds a piece not yet in any chunk

    def close() -> None:
        layout, offset = [], 0
        for piece, _, start, _ in current:
            layout.append((start, offset))
            offset += len(piece) + 2
        chunks.append(("\n\n".join(p for p, _, _, _ in current), current[0][2], current[-1][3], layout))

    for piece in pieces:
        size = piece[1]
        if current and fresh and current_tokens + size + 1 > max_tokens:
            close()
            carried: list[tuple[str, int, int, int]] = []
            carried_tokens = 0
            for old in reversed(current):
                if carried_tokens + old[1] + 1 > overlap_tokens:
                    break
                carried.insert(0, old)
                carried_tokens += old[1] + 1
            current, current_tokens = carried, carried_tokens
            while current and current_tokens + size + 1 > max_tokens:
                current_tokens -= current.pop(0)[1] + 1
        current.append(piece)
        current_tokens += size + 1
        fresh = True
    if current and fresh:
        close()
    return chunks


MARK_KINDS = ("pages", "slides", "sheets", "sections")
Marks = dict[str, tuple[list[int], list, list[int]]]  # per kind: starts (sorted), values, where each ends


def document_marks(text: str, parts: list[tuple[int, str, int | str]]) -> Marks:
    """The reader's pages, slides or sheets and the Markdown headings (sections) of a document,
    each kind sorted by offset with where each ends: found once per document, so that placing its
    chunks (`location`) costs a binary search each, not a pass over the whole text."""
    bounds = [(offset, kind, value) for offset, kind, value in parts] + \
        [(offset, "sections", heading) for offset, heading in readers.sections(text)]
    marks: Marks = {}
    for kind in MARK_KINDS:
        found = sorted((offset, value) for offset, k, value in bounds if k == kind)
        if found:
            starts = [offset for offset, _ in found]
            marks[kind] = (starts, [value for _, value in found], starts[1:] + [len(text) + 1])
    return marks


def location(marks: Marks, start: int, end: int, layout: list[tuple[int, int]]) -> str:
    """Where the chunk spanning [start, end) of a document's text lies, as JSON: per kind (the
    reader's pages, slides or sheets; the Markdown headings as sections; `document_marks`) the
    values in effect over it, each as [where it starts in the chunk's text, value]; the first at 0,
    the one in effect where the chunk starts. A search narrows a unit's place with them (`place_of`)."""
    found: dict[str, list] = {}
    for kind in MARK_KINDS:
        if kind not in marks:
            continue
        starts, values, ends = marks[kind]
        first = bisect.bisect_right(ends, start)  # the first mark still in effect at `start`
        last = bisect.bisect_left(starts, end)  # marks from here on start at or after the chunk's end
        for number in range(first, last):
            found.setdefault(kind, []).append([_in_chunk(max(starts[number], start), layout), values[number]])
    return json.dumps(found, ensure_ascii=False, separators=(",", ":"))


def _in_chunk(position: int, layout: list[tuple[int, int]]) -> int:
    """A position in the document's text as a position in the chunk's text."""
    base, offset = layout[0]
    for start, at in layout:
        if start > position:
            break
        base, offset = start, at
    return offset + max(position - base, 0)


def place_of(marks: dict[str, list], first: int, last: int) -> dict[str, list]:
    """The values of a chunk's marks (`location`) in effect over [first, last) of its text."""
    found = {}
    for kind, entries in marks.items():
        values = [value for number, (offset, value) in enumerate(entries)
                  if offset < max(last, first + 1) and (number + 1 == len(entries) or entries[number + 1][0] > first)]
        if values:
            found[kind] = list(dict.fromkeys(values))
    return found


CHUNKER_VERSION = 5  # of how a document's text is cut into chunks
Chunk = tuple[str, int, str, int, int, str]  # text, tokens, chunk id, start, end, location (JSON)


@dataclass
class DocumentChunks:
    """A document cut into chunks; or why its reader failed on it (`failure`). `fresh`: the
    reader's result, to be cached, when it was read in this run."""

    title: str = ""
    chunks: list[Chunk] = field(default_factory=list)
    failure: str = ""
    fresh: tuple[str, str, list] | None = None
    skipped: str = ""  # why its reader found no document in it (binary data, one endless line)


def chunking_key(file: ScannedFile, max_tokens: int, overlap_tokens: int, reader_identity: dict) -> tuple:
    """What a document's chunks depend on: its bytes, the chunk settings, its format (the title
    rule) and, for a format read by a reader, that reader's identity (library versions). A key
    within one run (the last run's chunks are matched to this run's files by it), never stored:
    a tuple, which costs nothing to make, not a digest, which an update made for every document twice."""
    reader = json.dumps(reader_identity.get(file.reader), sort_keys=True) if file.extracted else None
    return CHUNKER_VERSION, file.content_hash, max_tokens, overlap_tokens, file.reader, reader


def chunking_settings(max_tokens: int, overlap_tokens: int) -> bytes:
    """The chunks table's mark of how it was cut: only a table with the same mark is reused."""
    return json.dumps([CHUNKER_VERSION, max_tokens, overlap_tokens]).encode()


def extraction_key(file: ScannedFile, reader_identity: dict) -> str:
    """The cache key of a document's extracted text: its bytes and its reader's identity."""
    return json_digest(["extract", file.content_hash, file.reader, reader_identity.get(file.reader)])


def reader_identities(files: list[ScannedFile]) -> dict[str, dict]:
    """Per format among `files` read by a reader, the reader's identity (`readers.identity`)."""
    suffixes: dict[str, str] = {}
    for file in files:
        if file.extracted and file.reader not in suffixes:
            suffixes[file.reader] = os.path.splitext(file.path)[1].lower()
    return {name: readers.identity([suffix]) for name, suffix in suffixes.items()}


def previous_chunks(documents: pa.Table | None, chunks: pa.Table | None, files: list[ScannedFile], max_tokens: int,
                    overlap_tokens: int, reader_identity: dict) -> dict[tuple, DocumentChunks]:
    """The last run's chunks of each document still in `files`, by `chunking_key`, when they were
    cut the way this run cuts them: an update re-cuts (and re-reads) only new and changed documents."""
    if documents is None or chunks is None or \
            (chunks.schema.metadata or {}).get(b"noderag-chunking") != chunking_settings(max_tokens, overlap_tokens):
        return {}
    columns = ("doc_id", "text", "tokens", "chunk_id", "start", "end", "location")
    pieces: dict[str, list[Chunk]] = {}
    for doc, text, tokens, chunk, start, end, where in zip(*(chunks[c].to_pylist() for c in columns), strict=True):
        pieces.setdefault(doc, []).append((text, tokens, chunk, start, end, where))  # rows come in ordinal order
    by_path = {f.path: f for f in files}
    found = {}
    for doc, path, title, content_hash, status in zip(
            *(documents[c].to_pylist() for c in ("doc_id", "path", "title", "content_hash", "status")), strict=True):
        file = by_path.get(path)
        kept = status == "failed" and doc in pieces  # kept at its last content while unreadable
        if (status == "indexed" or kept) and file is not None and file.content_hash == content_hash:
            found[chunking_key(file, max_tokens, overlap_tokens, reader_identity)] = DocumentChunks(title, pieces.get(doc, []))
    return found


def document_chunks(
    files: list[ScannedFile], settings: ChunkConfig, previous: dict[tuple, DocumentChunks] | None = None,
    executor: Executor | None = None, cache: Cache | None = None,
) -> list[DocumentChunks]:
    """Each file's chunks: the last run's when the document and the settings are unchanged
    (`previous_chunks`), else cut on the `executor`'s workers, after its reader read it there (or
    from the `cache`, where an earlier run stored what the reader gave; fresh reads are stored as
    each batch returns, so a killed run keeps them)."""
    previous = previous or {}
    identity = reader_identities(files)
    files = list(files)
    out: list[DocumentChunks | None] = []
    todo: list[int] = []
    for position, file in enumerate(files):
        key = chunking_key(file, settings.chunk_tokens, settings.overlap_tokens, identity)
        if file.kept:  # unreadable now: its last chunks stay, as a failed item (`scan.keep_last_content`)
            last = previous.get(key, DocumentChunks())
            out.append(DocumentChunks(last.title, last.chunks, failure=f"{file.reason}; its last content stays in the "
                                      "build until it can be read"))
        elif file.reason or (file.text is None and not file.extracted and not file.deferred):
            out.append(DocumentChunks())
        elif key in previous:
            out.append(previous[key])
        elif file.deferred:  # unchanged since the scan that read it, but its chunks are not at hand
            files[position] = read_text_file(file, settings.max_file_bytes)
            if files[position].reason:  # changed (or gone) since the scan
                out.append(DocumentChunks(failure=files[position].reason))
            else:
                out.append(None)
                todo.append(position)
        else:
            out.append(None)
            todo.append(position)
    keys = {p: extraction_key(files[p], identity) for p in todo if files[p].extracted}
    stored = cache.get_many(EXTRACT, list(keys.values())) if cache is not None and keys else {}
    texts = [p for p in todo if not files[p].extracted]
    batches = [texts[i : i + TEXT_BATCH] for i in range(0, len(texts), TEXT_BATCH)] + [[p] for p in todo if files[p].extracted]
    limits = (settings.extract_seconds, settings.extract_memory_mb, settings.extract_expanded_mb)
    jobs = [([_work_item(files[p], keys.get(p, ""), stored) for p in batch], settings.chunk_tokens,
             settings.overlap_tokens, limits) for batch in batches]

    def keep(job, results: list[DocumentChunks]) -> None:
        fresh = [(item[-1], _dump(r.fresh)) for item, r in zip(job[0], results, strict=True) if r.fresh is not None]
        if cache is not None and fresh:
            cache.put_many(EXTRACT, fresh)

    def lost(job, why: str) -> list[DocumentChunks]:
        return [DocumentChunks(failure=why) for _ in job[0]]

    try:
        for batch, entries in zip(batches, (executor or Executor()).map(chunk_batch, jobs, keep, lost), strict=True):
            for position, entry in zip(batch, entries, strict=True):
                out[position] = entry
    finally:
        contained.close()  # the one this process started for batches it read itself
    return out


def _work_item(file: ScannedFile, key: str, stored: dict[str, bytes]) -> tuple:
    """What a worker needs of a file: its text, or its path and hash and any stored extraction
    (and the key that extraction is stored under)."""
    return (file.absolute, file.reader, file.text, file.content_hash, _load(stored[key]) if key in stored else None, key)


def _dump(extracted: tuple[str, str, list]) -> bytes:
    return json.dumps(extracted, ensure_ascii=False).encode()


def _load(blob: bytes) -> tuple[str, str, list]:
    text, title, parts = json.loads(blob)
    return text, title, [tuple(part) for part in parts]


def chunk_batch(job: tuple) -> list[DocumentChunks]:
    """A worker's share of `document_chunks`: each document read (a text file's text as given; a
    file a reader reads from its path, unless a stored extraction came with it), then cut."""
    items, max_tokens, overlap_tokens, (seconds, memory_mb, expanded_mb) = job
    read: list[tuple[str, str, list] | DocumentChunks] = []
    for absolute, kind, text, content_hash, stored, _ in items:
        if text is not None:
            read.append((text, document_title(text, kind == "markdown"), []))
        elif stored is not None:
            read.append(stored)
        else:
            read.append(_extract(absolute, content_hash, readers.Limits(seconds, memory_mb, expanded_mb)))
    done = [entry for entry in read if not isinstance(entry, DocumentChunks)]
    cut = iter(chunk_texts([text for text, _, _ in done], max_tokens, overlap_tokens))
    results = []
    for (_, _, text_given, _, stored, _), entry in zip(items, read, strict=True):
        if isinstance(entry, DocumentChunks):
            results.append(entry)
            continue
        text, title, parts = entry
        marks = document_marks(text, parts)
        chunks = [(piece, tokens, chunk_id(piece), start, end, location(marks, start, end, layout))
                  for piece, tokens, start, end, layout in next(cut)]
        fresh = entry if text_given is None and stored is None else None
        results.append(DocumentChunks(title, chunks, fresh=fresh))
    return results


def _extract(absolute: str, content_hash: str, limits: readers.Limits) -> tuple[str, str, list] | DocumentChunks:
    """A document read by its reader, in a process held to `limits` (`readers.contained`): (Markdown,
    title, parts), or DocumentChunks with the failure."""
    try:
        extracted = contained.extract(absolute, limits, content_hash)
    except readers.NotADocument as err:
        return DocumentChunks(skipped=str(err))
    except readers.Unreadable as err:
        return DocumentChunks(failure=str(err))
    title = extracted.title or document_title(extracted.text, True)
    return extracted.text, title, [list(part) for part in extracted.parts]


def run(files: list[ScannedFile], settings: ChunkConfig, previous: dict[tuple, DocumentChunks] | None = None,
        executor: Executor | None = None, cache: Cache | None = None) -> tuple[pa.Table, pa.Table, dict]:
    """Documents and chunks tables for the scanned files (the chunks table marked with how it was
    cut, for the next run's `previous_chunks`), and counts: documents read by a reader in this run,
    read from the cache, and failed."""
    docs = {name: [] for name in DOCUMENT_SCHEMA.names}
    chunks = {name: [] for name in CHUNK_SCHEMA.names}
    cut = document_chunks(files, settings, previous, executor, cache)
    counts = {"extracted": 0, "failed": 0}
    for file, entry in zip(files, cut, strict=True):
        doc = document_id(file.path)
        pieces = entry.chunks
        counts["extracted"] += entry.fresh is not None
        counts["failed"] += bool(entry.failure)
        if entry.failure:
            status, reason = "failed", entry.failure
        elif pieces:
            status, reason = "indexed", ""
        else:
            status, reason = "skipped", file.reason or entry.skipped or "no text after cleaning"
        for name, value in zip(DOCUMENT_SCHEMA.names,
                               [doc, file.path, entry.title, file.content_hash, file.size, status, reason, len(pieces)],
                               strict=True):
            docs[name].append(value)
        chunks["chunk_id"] += [c[2] for c in pieces]
        chunks["doc_id"] += [doc] * len(pieces)
        chunks["ordinal"] += range(len(pieces))
        chunks["title"] += [entry.title] * len(pieces)
        chunks["text"] += [c[0] for c in pieces]
        chunks["tokens"] += [c[1] for c in pieces]
        chunks["start"] += [c[3] for c in pieces]
        chunks["end"] += [c[4] for c in pieces]
        chunks["location"] += [c[5] for c in pieces]
    marked = CHUNK_SCHEMA.with_metadata({"noderag-chunking": chunking_settings(settings.chunk_tokens,
                                                                             settings.overlap_tokens)})
    return pa.Table.from_pydict(docs, schema=DOCUMENT_SCHEMA), pa.Table.from_pydict(chunks, schema=marked), counts
