"""Document formats: how fast each reader reads, what a mixed folder costs against the same text
as Markdown, and the memory of indexing one 1,000-page PDF.

    python -m bench.bench_formats [--work bench-out/formats] [--quick]

Every file is generated deterministically (devtools/documents.py); the real documents are the PDFs
and HTML pages this machine ships under /usr/share/doc, where present. Prints Markdown.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from devtools import documents as make
from noderag_cli import readers
from noderag_cli.executor import tree_resident_mb

ROOT = Path(__file__).resolve().parents[1]
REAL_PDFS = [Path("/usr/share/doc/libtasn1-doc/libtasn1.pdf"), Path("/usr/share/doc/shared-mime-info/shared-mime-info-spec.pdf")]
REAL_HTML = Path("/usr/share/doc")


def _write(kind: str, path: Path, number: int, parts: list, rows: list[list[str]]) -> int:
    """One generated file of a format; returns its units (pages, sections, slides or rows)."""
    if kind == "pdf":
        make.write_pdf(path, f"Report {number}", parts, header="Harbour Board")
    elif kind == "docx":
        make.write_docx(path, f"Minutes {number}", parts, table=rows[:20])
    elif kind == "pptx":
        make.write_pptx(path, f"Deck {number}", parts)
    elif kind == "xlsx":
        make.write_xlsx(path, f"Fleet {number}", {"Ships": rows})
        return len(rows)
    elif kind == "html":
        make.write_html(path, f"Chapter {number}", parts)
    else:
        make.write_epub(path, f"Book {number}", parts)
    return len(parts)


FORMATS = ("pdf", "docx", "pptx", "xlsx", "html", "epub")


def _generate(folder: Path, count: int, seed: int = 7) -> dict[str, list[tuple[Path, int]]]:
    """`count` files of every format under folder/<format>/, each with its number of pages,
    slides, rows or sections."""
    made: dict[str, list[tuple[Path, int]]] = {}
    for number in range(count):
        parts = make.sections(seed + number, 6)
        rows = [["Ship", "Tonnage", "Port", "Built"]] + [[f"Ship {seed + number}-{r}", str(100 + r), f"Port {r % 17}",
                                                           str(1850 + r % 90)] for r in range(300)]
        for kind in FORMATS:
            path = folder / kind / f"{kind}{number:03d}.{kind}"
            path.parent.mkdir(parents=True, exist_ok=True)
            units = len(rows) if kind == "xlsx" else len(parts)
            if not path.exists():
                units = _write(kind, path, number, parts, rows)
            made.setdefault(kind, []).append((path, units))
    return made


def _read(path: str) -> int:
    try:
        return len(readers.extract(path, readers.Limits()).text)
    except readers.Unreadable:
        return 0


def throughput(files: list[tuple[Path, int]], workers: int = 2) -> tuple[float, float, float]:
    """(units per second, MB per second, seconds) reading `files` on `workers` processes."""
    started = time.perf_counter()
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_read, [str(p) for p, _ in files]))
    seconds = time.perf_counter() - started
    size = sum(p.stat().st_size for p, _ in files) / 1e6
    return sum(u for _, u in files) / seconds, size / seconds, seconds


def _twins(files: list[Path], folder: Path) -> None:
    """Each file's extracted Markdown as a .md file: the same text, without the reading."""
    folder.mkdir(parents=True, exist_ok=True)
    for path in files:
        target = folder / f"{path.stem}.md"
        if not target.exists():
            target.write_text(readers.extract(str(path), readers.Limits()).text + "\n", encoding="utf-8")


def _index_seconds(folder: Path, runs: int) -> float:
    times = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as scratch:
            started = time.perf_counter()
            done = subprocess.run([sys.executable, "-m", "noderag_cli.cli", "index", str(Path(scratch) / "ws"), "--input",
                                   str(folder), "--json"], capture_output=True, text=True, cwd=ROOT)
            times.append(time.perf_counter() - started)
            if done.returncode != 0:
                raise RuntimeError(f"index {folder} exited {done.returncode}: {done.stderr[-500:]}")
    return statistics.median(times)


def peak_rss_indexing(folder: Path) -> tuple[float, float]:
    """(seconds, peak RSS of the indexing process and its workers together) of one index."""
    with tempfile.TemporaryDirectory() as scratch:
        process = subprocess.Popen([sys.executable, "-m", "noderag_cli.cli", "index", str(Path(scratch) / "ws"),
                                    "--input", str(folder)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        peak = [0.0]
        started = time.perf_counter()

        def watch() -> None:
            while process.poll() is None:
                peak[0] = max(peak[0], tree_resident_mb(process.pid))
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        process.wait()
        watcher.join()
        return time.perf_counter() - started, peak[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / "bench-out" / "formats")
    parser.add_argument("--quick", action="store_true", help="fewer files and one run")
    args = parser.parse_args(argv)
    count, runs = (10, 1) if args.quick else (40, 3)
    made = _generate(args.work / "files", count)
    lines = ["## Document formats", "",
             f"Generated files (devtools/documents.py; {count} of each format, 6 sections each, the spreadsheets 300 "
             "rows), read on 2 processes (`readers.extract`): units are pages (PDF), sections (DOCX, HTML, EPUB), "
             "slides (PPTX) and rows (XLSX).", "",
             "| format | files | MB | units per second | MB per second |", "|---|---|---|---|---|"]
    for kind, files in made.items():
        units, mb, _ = throughput(files)
        lines.append(f"| {kind} | {len(files)} | {sum(p.stat().st_size for p, _ in files) / 1e6:.1f} | {units:,.0f} | "
                     f"{mb:.2f} |")
    real = [p for p in REAL_PDFS if p.is_file()]
    pages = []
    for path in real:
        import pypdfium2

        page_count = len(pypdfium2.PdfDocument(str(path)))
        started = time.perf_counter()
        readers.extract(str(path), readers.Limits())
        pages.append(f"{path} ({page_count} pages): {page_count / (time.perf_counter() - started):,.0f} pages/s")
    html = [p for p in sorted(REAL_HTML.rglob("*.html")) if p.is_file()][:200] if REAL_HTML.is_dir() else []
    if html:
        _, mb, seconds = throughput([(p, 1) for p in html])
        pages.append(f"{len(html)} HTML pages under {REAL_HTML} ({sum(p.stat().st_size for p in html) / 1e6:.1f} MB): "
                     f"{mb:.2f} MB/s on 2 processes")
    lines += ["", "Real documents on this machine: " + ("; ".join(pages) if pages else "none found") + "."]

    mixed = args.work / "mixed"
    if not mixed.exists():
        for kind in ("docx", "pptx", "xlsx", "html", "epub"):
            for path, _ in made[kind]:
                (mixed / kind).mkdir(parents=True, exist_ok=True)
                shutil.copy(path, mixed / kind / path.name)
    twins = args.work / "mixed-md"
    _twins([p for kind in ("docx", "pptx", "xlsx", "html", "epub") for p, _ in made[kind]], twins)
    pdfs, pdf_twins = args.work / "files" / "pdf", args.work / "pdf-md"
    _twins([p for p, _ in made["pdf"]], pdf_twins)
    mixed_s, twins_s = _index_seconds(mixed, runs), _index_seconds(twins, runs)
    pdf_s, pdf_twins_s = _index_seconds(pdfs, runs), _index_seconds(pdf_twins, runs)
    files = sum(1 for _ in mixed.rglob("*.*"))
    lines += ["", f"A folder of {files} files (DOCX, PPTX, XLSX, HTML, EPUB) indexed end to end, offline, against the "
              f"same text as .md files (each file's extracted Markdown), fresh workspaces, median of {runs}: "
              f"{mixed_s:.1f} s against {twins_s:.1f} s, **{mixed_s / twins_s:.2f}x** (target at most 2x). "
              f"{len(made['pdf'])} PDFs: {pdf_s:.1f} s against {pdf_twins_s:.1f} s, {pdf_s / pdf_twins_s:.2f}x."]

    big = args.work / "big-pdf"
    if not (big / "manual.pdf").exists():
        big.mkdir(parents=True, exist_ok=True)
        make.write_pdf(big / "manual.pdf", "Manual", make.sections(99, 1000, paragraphs=4), header="Operator manual")
    seconds, total = peak_rss_indexing(big)
    lines += ["", f"One 1,000-page PDF ({(big / 'manual.pdf').stat().st_size / 1e6:.1f} MB, generated) indexed end to "
              f"end in {seconds:.0f} s: peak RSS of the indexing process and its workers together {total:,.0f} MB "
              "(sampled from /proc every 0.05 s; target at most 1,024 MB)."]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
