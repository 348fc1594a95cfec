"""PDF: the text layer, page by page, through PDFium (pypdfium2); no OCR.

- Lines that recur on many pages (running headers and footers, "Page 12 of 80": digits ignored
  when comparing) are left out, from the pages that hold anything else.
- A line in a larger font than the body text, short and without a closing full stop, is a
  heading (`#` to `###` by size): the chunker cuts sections there.
- A line ending in a hyphen joins the next; lines join into paragraphs, which end at a short line
  that closes a sentence.
- Every page starts a part, so a chunk knows the pages it spans.
A document with no text on any page is a scan: "no text layer; OCR is not supported".
"""

from __future__ import annotations

import re
from collections import Counter
from typing import BinaryIO

from . import Extracted, Limits, Unreadable

REPEATED_SHARE = 0.5  # of the pages (at least 3) a line must be on to be a running header or footer
HEADING_SCALE = 1.15  # font size over the body's from which a short line is a heading
MAX_HEADING_WORDS = 14
_DIGITS = re.compile(r"\d+")
_SENTENCE_END = re.compile(r"[.!?:;][\"'\u201d\u2019)]*$")


def read_pdf(handle: BinaryIO, limits: Limits) -> Extracted:
    import pypdfium2 as pdfium
    import pypdfium2.raw as raw

    try:
        document = pdfium.PdfDocument(handle.read())
    except pdfium.PdfiumError as err:
        message = str(err)
        if "password" in message.lower():
            raise Unreadable("encrypted PDF (password-protected): not read") from None
        raise Unreadable(f"damaged or not a PDF ({message.splitlines()[0][:120]})") from None
    try:
        pages = []  # per page: [(line, font size)]
        for number in range(len(document)):
            limits.check()
            page = document[number]
            textpage = page.get_textpage()
            text = textpage.get_text_range()
            lines, position = [], 0
            for line in text.split("\r\n"):
                size = raw.FPDFText_GetFontSize(textpage.raw, position) if line.strip() else 0.0
                position += len(line) + 2
                lines.append((line.replace("\x02", "-").rstrip(), size))
            textpage.close()
            page.close()
            pages.append(lines)
        title = (document.get_metadata_dict().get("Title") or "").strip()
        title = "" if title.casefold() in ("untitled", "untitled document") else title
    finally:
        document.close()
    if not any(line.strip() for lines in pages for line, _ in lines):
        raise Unreadable("no text layer; OCR is not supported")
    return _markdown(pages, title)


def _markdown(pages: list[list[tuple[str, float]]], title: str) -> Extracted:
    running = _running_lines(pages)
    sizes = Counter()
    for lines in pages:
        for line, size in lines:
            if line.strip():
                sizes[round(size, 1)] += len(line)
    body = sizes.most_common(1)[0][0] if sizes else 0.0
    heading_sizes = sorted({round(s, 1) for s in sizes if s >= body * HEADING_SCALE}, reverse=True)
    text, parts = "", []
    for number, lines in enumerate(pages, 1):
        parts.append((len(text), "pages", number))
        blocks, paragraph = [], []
        short = 0.6 * _typical_length(lines)
        # a running line goes where the page says something else: a page of nothing else keeps it
        dropped = running if any(line.strip() and _DIGITS.sub("#", line.strip()) not in running
                                 for line, _ in lines) else set()
        for line, size in lines:
            stripped = line.strip()
            if not stripped or _DIGITS.sub("#", stripped) in dropped:
                if not stripped and paragraph:
                    blocks.append(" ".join(paragraph))
                    paragraph = []
                continue
            level = heading_sizes.index(round(size, 1)) + 1 if round(size, 1) in heading_sizes else 0
            if level and len(stripped.split()) <= MAX_HEADING_WORDS and not stripped.endswith("."):
                if paragraph:
                    blocks.append(" ".join(paragraph))
                    paragraph = []
                blocks.append("#" * min(level, 3) + " " + stripped)
                continue
            if paragraph and paragraph[-1].endswith("-") and stripped[:1].islower():
                paragraph[-1] = paragraph[-1][:-1] + stripped
            else:
                paragraph.append(stripped)
            if _SENTENCE_END.search(stripped) and len(stripped) < short:
                blocks.append(" ".join(paragraph))
                paragraph = []
        if paragraph:
            blocks.append(" ".join(paragraph))
        if blocks:
            text += "\n\n".join(blocks) + "\n\n"
    return Extracted(text, title, parts)


def _running_lines(pages: list[list[tuple[str, float]]]) -> set[str]:
    """Lines (digits as '#') on at least `REPEATED_SHARE` of the pages, and on at least three."""
    if len(pages) < 3:
        return set()
    seen = Counter()
    for lines in pages:
        seen.update({_DIGITS.sub("#", line.strip()) for line, _ in lines if line.strip() and len(line.split()) <= 12})
    least = max(3, REPEATED_SHARE * len(pages))
    return {line for line, count in seen.items() if count >= least}


def _typical_length(lines: list[tuple[str, float]]) -> float:
    lengths = sorted(len(line) for line, _ in lines if line.strip())
    return lengths[len(lengths) // 2] if lengths else 0.0
