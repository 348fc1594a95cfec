"""HTML and EPUB: the page's content as Markdown (beautifulsoup4 with lxml, then markdownify).

What a page shows around its content is left out: scripts, styles, navigation, headers, footers,
side bars, forms; where the page marks its content (`<main>`, `<article>`, `role="main"`) only that
is read. Headings stay headings (ATX `#`), lists `- ` items, tables Markdown tables; links keep
their text, images their alt text.

An EPUB is a zip archive: its package document (found through META-INF/container.xml) lists the
chapters in reading order (the spine); each chapter is read as a page, and starts a new section of
the text under its own headings.
"""

from __future__ import annotations

import posixpath
import re
import warnings
from typing import BinaryIO
from urllib.parse import unquote

from . import Extracted, Limits, NotADocument, Unreadable, bounded_member

BOILERPLATE = ("script", "style", "noscript", "template", "nav", "header", "footer", "aside", "form", "iframe",
               "svg", "button", "select", "input", "canvas", "object", "embed")
MAIN = ("main", "article", '[role="main"]')


def read_html(handle: BinaryIO, limits: Limits) -> Extracted:
    markup = handle.read()
    if b"\x00" in markup[:8192] and not markup.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise NotADocument("binary file (NUL bytes)")  # as the scan says of a text file (UTF-16 has a BOM)
    text, title = page_markdown(markup)
    return Extracted(text, title)


_DOCTYPE = re.compile(rb"<!DOCTYPE", re.IGNORECASE)
_SUBSET_END = re.compile(rb"\]\s*>")
PROLOG_BYTES = 65_536  # where a document type declaration is looked for


def without_doctype(markup: bytes) -> bytes:
    """The markup without its document type declaration, internal subset included: the parsers never
    define an entity (no outside file, no expansion), and a subset left in place either ends the
    parse ("no text in it") or shows as "]>" in the text."""
    found = _DOCTYPE.search(markup, 0, PROLOG_BYTES)
    if found is None:
        return markup
    close = markup.find(b">", found.end())
    bracket = markup.find(b"[", found.end(), close if close >= 0 else None)
    if bracket >= 0:
        subset = _SUBSET_END.search(markup, bracket)
        close = subset.end() - 1 if subset else -1
    return markup if close < 0 else markup[:found.start()] + markup[close + 1:]


def page_markdown(markup: bytes | str) -> tuple[str, str]:
    """(Markdown of the page's content, the page's title)."""
    from bs4 import BeautifulSoup, XMLParsedAsHTMLWarning
    from markdownify import MarkdownConverter

    if isinstance(markup, str):
        markup = markup.encode("utf-8")
    with warnings.catch_warnings():  # XHTML read as HTML is what is meant here: no warning to print
        warnings.simplefilter("ignore", XMLParsedAsHTMLWarning)
        soup = BeautifulSoup(without_doctype(markup), "lxml")
    title = " ".join(soup.title.get_text().split()) if soup.title is not None else ""
    for tag in soup(BOILERPLATE):
        tag.decompose()
    root = next((found for selector in MAIN if (found := soup.select_one(selector)) is not None), None)
    root = root or soup.body or soup
    text = MarkdownConverter(heading_style="ATX", bullets="-", strip=["a", "img"]).convert_soup(root)
    text = re.sub(r"\n{3,}", "\n\n", text)
    if not title:
        first = root.find(re.compile(r"^h[1-3]$"))
        title = " ".join(first.get_text().split()) if first is not None else ""
    return text.strip(), title


def read_epub(handle: BinaryIO, limits: Limits) -> Extracted:
    from bs4 import BeautifulSoup

    archive = limits.check_archive(handle, "EPUB")
    with archive:
        names = set(archive.namelist())
        if "META-INF/container.xml" not in names:
            raise Unreadable("damaged or not an EPUB file (no META-INF/container.xml)")
        container = BeautifulSoup(without_doctype(bounded_member(archive, "META-INF/container.xml")), "lxml-xml")
        rootfile = container.find("rootfile")
        package_path = rootfile.get("full-path") if rootfile is not None else None
        if not package_path or package_path not in names:
            raise Unreadable("damaged or not an EPUB file (its package document is missing)")
        package = BeautifulSoup(without_doctype(bounded_member(archive, package_path)), "lxml-xml")
        base = posixpath.dirname(package_path)
        manifest = {item.get("id"): item.get("href") for item in package.find_all("item")}
        title_tag = package.find("dc:title") or package.find("title")
        title = " ".join(title_tag.get_text().split()) if title_tag is not None else ""
        chapters = []
        for itemref in package.find_all("itemref"):
            href = manifest.get(itemref.get("idref"))
            member = posixpath.normpath(posixpath.join(base, unquote(href))) if href else None
            if member in names:
                limits.check()
                chapter, _ = page_markdown(bounded_member(archive, member))
                if chapter:
                    chapters.append(chapter)
    return Extracted("\n\n".join(chapters), title)
