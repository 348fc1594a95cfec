"""Documents of every format the readers take, written deterministically from the same sections,
for the tests and the benchmarks: PDF (reportlab, a test extra), DOCX, PPTX, XLSX (the readers'
own libraries, which write as well as read), HTML, EPUB (the standard library's zipfile) and
Markdown. A "section" is (heading, [paragraphs]); every writer puts each section on its own page,
slide, sheet or chapter, so a test knows where each sentence must be found."""

from __future__ import annotations

import datetime
import random
import zipfile
from html import escape
from pathlib import Path

Section = tuple[str, list[str]]
FIXED_TIME = datetime.datetime(2024, 1, 1)

WORDS = ("harbour river ship society medal founder village railway station engine survey chart lighthouse storm "
         "crew captain ferry quay dock tide current shoal beacon pilot cargo mill bridge market").split()


def sections(seed: int, count: int, paragraphs: int = 3, sentences: int = 4) -> list[Section]:
    """`count` sections of made-up prose, the same for the same seed."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 16))).capitalize() + "."

    return [(f"Part {number + 1}: the {rng.choice(WORDS)} {rng.choice(WORDS)}",
             [" ".join(sentence() for _ in range(sentences)) for _ in range(paragraphs)]) for number in range(count)]


def write_markdown(path: Path, title: str, parts: list[Section]) -> None:
    body = [f"# {title}"] + [f"## {heading}\n\n" + "\n\n".join(paragraphs) for heading, paragraphs in parts]
    path.write_text("\n\n".join(body) + "\n", encoding="utf-8")


def write_pdf(path: Path, title: str, parts: list[Section], header: str = "", password: str | None = None,
              table: list[list[str]] | None = None) -> None:
    """A page per section: the heading in a larger font, the paragraphs wrapped; `header` on every
    page's top and "Page N" at its foot; `password` encrypts it."""
    from reportlab.lib.pagesizes import A4
    from reportlab.pdfgen import canvas

    pdf = canvas.Canvas(str(path), pagesize=A4, encrypt=password, invariant=1)
    pdf.setTitle(title)
    for number, (heading, paragraphs) in enumerate(parts, 1):
        if header:
            pdf.setFont("Helvetica", 8)
            pdf.drawString(72, 810, header)
        pdf.setFont("Helvetica", 8)
        pdf.drawString(500, 30, f"Page {number}")
        pdf.setFont("Helvetica-Bold", 15)
        pdf.drawString(72, 770, heading)
        pdf.setFont("Helvetica", 10)
        y = 745
        for paragraph in paragraphs:
            for line in _wrap(paragraph, 95):
                pdf.drawString(72, y, line)
                y -= 13
            y -= 9
        if table and number == 1:
            for row in table:
                pdf.drawString(72, y, "    ".join(row))
                y -= 13
        pdf.showPage()
    pdf.save()


def write_image_pdf(path: Path, pages: int = 2) -> None:
    """A "scan": pages with drawn shapes and no text layer."""
    from reportlab.pdfgen import canvas

    pdf = canvas.Canvas(str(path), invariant=1)
    for _ in range(pages):
        pdf.rect(100, 100, 300, 500, fill=1)
        pdf.showPage()
    pdf.save()


def _wrap(text: str, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return lines + ([line] if line else [])


def write_docx(path: Path, title: str, parts: list[Section], items: list[str] = (),
               table: list[list[str]] | None = None) -> None:
    import docx

    document = docx.Document()
    document.core_properties.title = title
    document.add_heading(title, level=0)
    for heading, paragraphs in parts:
        document.add_heading(heading, level=1)
        for paragraph in paragraphs:
            document.add_paragraph(paragraph)
    for item in items:
        document.add_paragraph(item, style="List Bullet")
    if table:
        grid = document.add_table(rows=len(table), cols=len(table[0]))
        for r, row in enumerate(table):
            for c, value in enumerate(row):
                grid.cell(r, c).text = value
    document.core_properties.created = document.core_properties.modified = FIXED_TIME
    document.save(str(path))


def write_pptx(path: Path, title: str, parts: list[Section]) -> None:
    import pptx

    deck = pptx.Presentation()
    deck.core_properties.title = title
    for heading, paragraphs in parts:
        slide = deck.slides.add_slide(deck.slide_layouts[1])
        slide.shapes.title.text = heading
        frame = slide.placeholders[1].text_frame
        frame.text = paragraphs[0]
        for paragraph in paragraphs[1:]:
            frame.add_paragraph().text = paragraph
    deck.save(str(path))


def write_xlsx(path: Path, title: str, sheets: dict[str, list[list[str]]]) -> None:
    import openpyxl

    workbook = openpyxl.Workbook()
    workbook.properties.title = title
    workbook.remove(workbook.active)
    for name, rows in sheets.items():
        sheet = workbook.create_sheet(name)
        for row in rows:
            sheet.append(row)
    workbook.save(str(path))


def html_page(title: str, parts: list[Section], navigation: bool = True) -> str:
    nav = ("<nav><ul><li><a href='index.html'>Home</a></li><li><a href='next.html'>Next chapter</a></li></ul></nav>"
           if navigation else "")
    body = "".join(f"<h2>{escape(h)}</h2>" + "".join(f"<p>{escape(p)}</p>" for p in ps) for h, ps in parts)
    return (f"<!DOCTYPE html><html><head><title>{escape(title)}</title><script>var tracking = 1;</script>"
            f"<style>p {{ margin: 0 }}</style></head><body>{nav}<main><h1>{escape(title)}</h1>{body}</main>"
            "<footer>Copyright the authors. All rights reserved.</footer></body></html>")


def write_html(path: Path, title: str, parts: list[Section]) -> None:
    path.write_text(html_page(title, parts), encoding="utf-8")


def write_epub(path: Path, title: str, parts: list[Section]) -> None:
    """An EPUB 3 whose chapters are the sections, in order."""
    chapters = [f"chapter{n}.xhtml" for n in range(1, len(parts) + 1)]
    manifest = "".join(f'<item id="c{n}" href="text/{name}" media-type="application/xhtml+xml"/>'
                       for n, name in enumerate(chapters, 1))
    spine = "".join(f'<itemref idref="c{n}"/>' for n in range(1, len(parts) + 1))
    package = ('<?xml version="1.0" encoding="UTF-8"?><package xmlns="http://www.idpf.org/2007/opf" version="3.0" '
               'unique-identifier="id"><metadata xmlns:dc="http://purl.org/dc/elements/1.1/">'
               f'<dc:identifier id="id">noderag-test</dc:identifier><dc:title>{escape(title)}</dc:title>'
               f'<dc:language>en</dc:language></metadata><manifest>{manifest}</manifest><spine>{spine}</spine></package>')
    container = ('<?xml version="1.0"?><container version="1.0" xmlns="urn:oasis:names:tc:opendocument:xmlns:container">'
                 '<rootfiles><rootfile full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/>'
                 '</rootfiles></container>')
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(zipfile.ZipInfo("mimetype", (1980, 1, 1, 0, 0, 0)), "application/epub+zip")
        for name, data in [("META-INF/container.xml", container), ("OEBPS/content.opf", package)] + [
                (f"OEBPS/text/{name}", html_page(heading, [(heading, paragraphs)], navigation=False))
                for name, (heading, paragraphs) in zip(chapters, parts, strict=True)]:
            archive.writestr(zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0)), data)


def write_zip_bomb(path: Path, expanded_mb: int) -> None:
    """A .docx-named archive whose one member expands to `expanded_mb` megabytes of zeros."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        with archive.open("word/document.xml", "w") as member:
            block = b"\0" * 1_000_000
            for _ in range(expanded_mb):
                member.write(block)


# hostile files: small on disk, each built to make a reader spend far more than its size ------------
def write_docx_bomb(path: Path, expanded_mb: int) -> None:
    """A valid Word file whose document.xml is `expanded_mb` megabytes of tiny paragraphs (its
    archive declares that size honestly): parsing it takes many times that in memory."""
    paragraph = b"<w:p><w:r><w:t>ab</w:t></w:r></w:p>"
    template = Path(path).with_suffix(".template.docx")
    write_docx(template, "bomb", [("Part", ["text"])])
    with zipfile.ZipFile(template) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in source.infolist():
            if info.filename != "word/document.xml":
                archive.writestr(info, source.read(info))
                continue
            head, _, tail = source.read(info).partition(b"<w:body>")
            with archive.open(_deflated(info.filename), "w") as member:
                member.write(head + b"<w:body>")
                block = paragraph * (1_000_000 // len(paragraph))
                for _ in range(expanded_mb):
                    member.write(block)
                member.write(b"</w:body>" + tail.partition(b"</w:body>")[2])
    template.unlink()


def write_lying_zip(path: Path, member: str, declared: int, expanded_mb: int) -> None:
    """An archive (EPUB-like) whose member `member` declares `declared` bytes but inflates to
    `expanded_mb` megabytes: its headers lie about the size (the CRC would tell, at the end)."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(_deflated("mimetype"), "application/epub+zip")
        with archive.open(_deflated(member), "w") as out:
            block = b" " * 1_000_000
            for _ in range(expanded_mb):
                out.write(block)
    data = bytearray(Path(path).read_bytes())
    name = member.encode()
    for signature, name_length_at, name_at, size_at in ((b"PK\x03\x04", 26, 30, 22), (b"PK\x01\x02", 28, 46, 24)):
        at = data.find(signature)
        while at >= 0:
            length = int.from_bytes(data[at + name_length_at:at + name_length_at + 2], "little")
            if bytes(data[at + name_at:at + name_at + length]) == name:
                data[at + size_at:at + size_at + 4] = declared.to_bytes(4, "little")
            at = data.find(signature, at + 4)
    Path(path).write_bytes(bytes(data))


def _deflated(name: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, (1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_pdf_bomb(path: Path, expanded_mb: int) -> None:
    """A one-page PDF whose content stream is a flate bomb: `expanded_mb` megabytes of spaces."""
    import zlib

    stream = zlib.compress(b" " * (expanded_mb * 1_000_000), 9)
    _write_pdf_objects(path, [b"<< /Type /Catalog /Pages 2 0 R >>",
                              b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
                              b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R >>",
                              b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream"])


def write_pdf_runs(path: Path, runs: int, pages: int = 1) -> None:
    """A PDF of `pages` pages of `runs` text runs each, each run its own positioned word: text
    extraction on such a page grows faster than the runs (PDFium); more pages make a read longer
    without a longer line."""
    import zlib

    body = b"BT /F1 6 Tf " + b"".join(b"1 0 0 1 %d %d Tm (w%d) Tj " % (10 + i % 90 * 6, 10 + i // 90 % 120 * 6, i % 10)
                                       for i in range(runs)) + b"ET"
    stream = zlib.compress(body, 6)
    font = 3 + 2 * pages
    kids = b" ".join(b"%d 0 R" % (3 + 2 * page) for page in range(pages))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, pages)]
    for page in range(pages):
        objects += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                    b"/Resources << /Font << /F1 %d 0 R >> >> >>" % (4 + 2 * page, font),
                    b"<< /Length %d /Filter /FlateDecode >>\nstream\n" % len(stream) + stream + b"\nendstream"]
    _write_pdf_objects(path, [*objects, b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"])


def _write_pdf_objects(path: Path, objects: list[bytes]) -> None:
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1) + b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    Path(path).write_bytes(bytes(out))


def write_xlsx_declaring(path: Path, dimension: str = "A1:XFD1048576") -> None:
    """A workbook of two cells whose sheet declares the dimension `dimension` (the whole grid)."""
    write_xlsx(path, "wide", {"Sheet": [["name", "value"]]})
    with zipfile.ZipFile(path) as source:
        members = {info.filename: source.read(info) for info in source.infolist()}
    import re as _re

    sheet = next(name for name in members if name.startswith("xl/worksheets/sheet"))
    members[sheet] = _re.sub(rb'<dimension ref="[^"]*"/>', b'<dimension ref="%s"/>' % dimension.encode(), members[sheet])
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(_deflated(name), data)
