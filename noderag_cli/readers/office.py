"""Office Open XML: Word (python-docx), PowerPoint (python-pptx) and Excel (openpyxl) files.

Each archive's expanded size is checked before a library opens it (`Limits.check_archive`).
- DOCX: paragraphs and tables in body order; "Title" and "Heading N" styles become `#` headings,
  list paragraphs `- ` items (indented by level), tables Markdown tables.
- PPTX: a slide a part: its title as a `#` heading (or "Slide N"), its text frames' paragraphs as
  `- ` items by level, its tables, and its notes.
- XLSX: a sheet a part: its name as a `#` heading and its used cells (values, not formulas) as a
  Markdown table, the first row as the header; empty rows and columns left out.
"""

from __future__ import annotations

from typing import BinaryIO

from . import Extracted, Limits, Unreadable, markdown_table

MAX_SHEET_ROWS = 100_000  # rows read per sheet; more is a data set, not a document
MAX_CELLS = 5_000_000
"""Cells a workbook's rows may span, empty ones between its cells included: more is a data set, or a
file that declares a sheet of a billion cells to make its reader pad them."""


def read_docx(handle: BinaryIO, limits: Limits) -> Extracted:
    import docx
    from docx.table import Table
    from docx.text.paragraph import Paragraph

    limits.check_archive(handle, "Word").close()
    handle.seek(0)
    document = docx.Document(handle)
    title = (document.core_properties.title or "").strip()
    blocks = []
    for count, element in enumerate(document.element.body.iterchildren()):
        if count % 200 == 0:
            limits.check()
        tag = element.tag.rsplit("}", 1)[-1]
        if tag == "p":
            block = _docx_paragraph(Paragraph(element, document))
        elif tag == "tbl":
            table = Table(element, document)
            block = markdown_table([[cell.text for cell in row.cells] for row in table.rows])
        else:
            continue
        if block:
            if block.lstrip().startswith("- ") and blocks and blocks[-1].lstrip().startswith("- "):
                blocks[-1] += "\n" + block  # a list's items stay one list
            else:
                blocks.append(block)
    return Extracted("\n\n".join(blocks), title)


def _docx_paragraph(paragraph) -> str:
    text = " ".join(paragraph.text.split())
    if not text:
        return ""
    style = (paragraph.style.name if paragraph.style is not None else "") or ""
    if style == "Title":
        return f"# {text}"
    if style.startswith("Heading"):
        level = style.removeprefix("Heading").strip()
        return "#" * (min(int(level), 6) if level.isdigit() else 1) + f" {text}"
    properties = paragraph._p.pPr
    numbered = properties is not None and properties.numPr is not None
    if numbered or style.startswith("List"):
        depth = 0
        if numbered and properties.numPr.ilvl is not None:
            depth = int(properties.numPr.ilvl.val or 0)
        return "  " * depth + f"- {text}"
    return text


def read_pptx(handle: BinaryIO, limits: Limits) -> Extracted:
    import pptx

    limits.check_archive(handle, "PowerPoint").close()
    handle.seek(0)
    presentation = pptx.Presentation(handle)
    title = (presentation.core_properties.title or "").strip()
    text, parts = "", []
    for number, slide in enumerate(presentation.slides, 1):
        limits.check()
        parts.append((len(text), "slides", number))
        heading = slide.shapes.title.text_frame.text.strip() if slide.shapes.title is not None else ""
        blocks = [f"# {' '.join(heading.split()) or f'Slide {number}'}"]
        for shape in slide.shapes:
            if shape == slide.shapes.title:
                continue
            if shape.has_text_frame:
                items = ["  " * paragraph.level + "- " + " ".join(paragraph.text.split())
                         for paragraph in shape.text_frame.paragraphs if paragraph.text.strip()]
                if items:
                    blocks.append("\n".join(items))
            if getattr(shape, "has_table", False) and shape.has_table:
                blocks.append(markdown_table([[cell.text for cell in row.cells] for row in shape.table.rows]))
        if slide.has_notes_slide:
            notes = " ".join(slide.notes_slide.notes_text_frame.text.split())
            if notes:
                blocks.append(f"Notes: {notes}")
        text += "\n\n".join(blocks) + "\n\n"
    return Extracted(text, title, parts)


def read_xlsx(handle: BinaryIO, limits: Limits) -> Extracted:
    import openpyxl

    limits.check_archive(handle, "Excel").close()
    handle.seek(0)
    workbook = openpyxl.load_workbook(handle, read_only=True, data_only=True)
    try:
        title = (workbook.properties.title or "").strip()
        text, parts, spanned = "", [], 0
        for sheet in workbook.worksheets:
            limits.check()
            sheet.reset_dimensions()  # rows as the file holds them, not padded to the size it declares
            rows = []
            for number, row in enumerate(sheet.iter_rows(values_only=True)):
                if number >= MAX_SHEET_ROWS:
                    break
                if number % 5000 == 0:
                    limits.check()
                spanned += len(row)
                if spanned > MAX_CELLS:
                    raise Unreadable(f"its rows span over {MAX_CELLS:,} cells: a data set, not a document")
                if row.count(None) == len(row):
                    continue
                cells = ["" if value is None else str(value) for value in row]
                if any(cell.strip() for cell in cells):
                    rows.append(cells)
            used = [c for c in range(max((len(r) for r in rows), default=0)) if any(c < len(r) and r[c].strip() for r in rows)]
            rows = [[row[c] if c < len(row) else "" for c in used] for row in rows]
            parts.append((len(text), "sheets", sheet.title))
            text += f"# {sheet.title}\n\n" + (markdown_table(rows) + "\n\n" if rows else "")
    finally:
        workbook.close()
    return Extracted(text, title, parts)
