"""Hostile and broken documents (issue 37, H1-H5, H9, H17): each reader runs in a process the
kernel holds to `chunk.extract_memory_mb` and `chunk.extract_seconds`, chunking stays linear in a
document's length, a killed worker costs one document at most, and a file swapped after the scan
is refused, not waited on. The bombs are generated here (devtools/documents.py), never stored."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml
from conftest import REPO, index, noderag

from devtools import documents as make
from noderag_cli import readers
from noderag_cli.index import chunk

NOTE = "# Notes\n\nThe ferry to Skarra leaves twice a day from the north quay.\n"


def _config(tmp_path: Path, workers: int | None = None, **chunk_settings) -> Path:
    body: dict = {"chunk": chunk_settings}
    if workers:
        body["executor"] = {"workers": workers}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _statuses(ws: Path) -> dict[str, tuple[str, str]]:
    listed = noderag("stats", ws, "--json", "--documents").json()["documents"]["list"]
    return {d["path"]: (d["status"], d.get("reason", "")) for d in listed}


def _peak_rss_mb(*args) -> tuple[subprocess.CompletedProcess, float]:
    """`noderag ARGS` run under a parent that reports the peak resident memory of any process of the
    run's tree it waited for (the index process, its workers and their reader processes)."""
    script = ("import resource, subprocess, sys; done = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
              "sys.stderr.write(done.stderr); print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); "
              "sys.exit(done.returncode)")
    done = subprocess.run([sys.executable, "-c", script, sys.executable, "-m", "noderag_cli.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=REPO, env={**os.environ, "NO_COLOR": "1"}, timeout=600)
    return done, int(done.stdout.strip().splitlines()[-1]) / 1024


def test_a_word_file_that_expands_in_memory_is_stopped_at_the_memory_limit(tmp_path):
    """H1: 1.5 MB on disk, 150 MB of XML that python-docx parses into gigabytes: the kernel stops
    the reader at its limit, the run goes on with the rest of the folder."""
    docs = tmp_path / "docs"
    docs.mkdir()
    make.write_docx_bomb(docs / "bomb.docx", 150)
    (docs / "notes.md").write_text(NOTE)
    done, peak = _peak_rss_mb("index", tmp_path / "ws", "--input", docs, "--config",
                              _config(tmp_path, extract_memory_mb=256))
    assert done.returncode == 1, done.stderr
    assert "bomb.docx: extraction needed over 256 MB of memory (chunk.extract_memory_mb)" in done.stderr
    assert "Traceback" not in done.stderr
    assert peak < 1200, f"peak {peak:.0f} MB: the parse was not stopped at its limit"  # unbounded: over 2 GB
    assert _statuses(tmp_path / "ws")["notes.md"][0] == "indexed"


def test_archives_and_pdfs_that_inflate_are_stopped(tmp_path):
    """H1: an archive member that declares 1 KB and inflates 600 MB, and a PDF content stream that
    inflates 600 MB: each a one-line failure within the memory limit."""
    lying = tmp_path / "lying.epub"
    make.write_lying_zip(lying, "META-INF/container.xml", 1000, 600)
    pdf = tmp_path / "bomb.pdf"
    make.write_pdf_bomb(pdf, 600)
    from noderag_cli.readers import contained

    for path in (lying, pdf):
        try:
            contained.extract(str(path), readers.Limits(60, 200, 512))
        except readers.Unreadable as err:
            assert "\n" not in str(err)
            assert any(word in str(err) for word in ("damaged", "memory", "crashed")), err
        else:
            raise AssertionError(f"{path.name} was read")
    import resource

    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024 < 200 + 1000  # the readers' peak


def test_a_page_that_takes_too_long_is_stopped_where_it_is(tmp_path):
    """H2: one page of 400,000 text runs: PDFium's text load takes seconds on it, and the limit
    stops it inside that one call (no check between pages could)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    make.write_pdf_runs(docs / "runs.pdf", 400_000)
    (docs / "notes.md").write_text(NOTE)
    started = time.monotonic()
    run = index(tmp_path / "ws", docs, "--config", _config(tmp_path, extract_seconds=0.3), expect=1)
    lines = [line for line in run.stderr.splitlines() if "runs.pdf" in line]
    assert len(lines) == 1 and "runs.pdf: extraction took over 0.3 s (chunk.extract_seconds)" in lines[0], run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - started < 120
    assert _statuses(tmp_path / "ws")["runs.pdf"][0] == "failed"


def test_chunking_places_each_chunk_without_rescanning_the_document(monkeypatch):
    """H3: a document's headings are found once, whatever the number of its chunks (they were found
    again for every chunk: quadratic in the document's length), and each chunk is placed as a scan
    of every heading would place it."""
    parts = make.sections(7, 60)
    text = "# Report\n\n" + "\n\n".join(f"## {h}\n\n" + "\n\n".join(p) for h, p in parts)
    calls = []
    original = readers.sections
    monkeypatch.setattr(readers, "sections", lambda t: calls.append(1) or original(t))
    [cut] = chunk.chunk_batch(([("x.md", "markdown", text, "hash", None, "")], 64, 0, (120, 1024, 512)))
    assert len(cut.chunks) > 50 and len(calls) == 1
    headings = original(text)
    for _, _, _, start, end, where in cut.chunks:
        sections = [value for _, value in json.loads(where)["sections"]]
        expected = [h for number, (offset, h) in enumerate(headings)
                    if offset < end and (headings[number + 1][0] if number + 1 < len(headings) else len(text) + 1) > start]
        assert sections == expected


def test_a_reader_that_gives_one_endless_line_is_skipped(tmp_path):
    """H3: the guard against a line of over a million characters holds for what a reader gives,
    as for a text file (a one-line HTML page of 1.2 MB of words)."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "dump.html").write_text("<html><body><p>" + "harbour " * 150_000 + "</p></body></html>")
    (docs / "notes.md").write_text(NOTE)
    index(tmp_path / "ws", docs)
    status, reason = _statuses(tmp_path / "ws")["dump.html"]
    assert status == "skipped" and "a line of 1,199,999 characters" in reason


def test_a_long_paragraph_is_cut_at_spaces_within_the_budget():
    """H3: a paragraph with no sentence boundary (megabytes of one-line text) is cut at spaces in
    one pass; a word longer than a chunk is cut inside, each piece within the budget."""
    from noderag_cli import nlp

    text = " ".join(["harbour", "river", "ship", "x" * 3000, "medal"] * 400)
    pieces = nlp.token_split(text, 100)
    assert all(count <= 100 for count in nlp.count_tokens(pieces))
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    assert all(not p.startswith(("arbour", "iver")) for p in pieces)  # whole words where words fit


def test_a_workbook_declaring_the_whole_grid_reads_at_once(tmp_path):
    """H4: a 5 KB workbook of two cells declaring A1:XFD1048576 (the reader padded every empty cell
    of it, 50 s of CPU) is read under a 5-second limit."""
    docs = tmp_path / "docs"
    docs.mkdir()
    make.write_xlsx_declaring(docs / "wide.xlsx")
    index(tmp_path / "ws", docs, "--config", _config(tmp_path, extract_seconds=5))
    assert _statuses(tmp_path / "ws")["wide.xlsx"][0] == "indexed"


def _processes() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds, command line) of every process."""
    found = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError):
            continue
        found[int(pid)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick, command)
    return found


def _kill_slow_readers_workers(stop: threading.Event, killed: list[int], once: bool = False) -> None:
    """Kill (SIGKILL, as the out-of-memory killer would) the indexing worker whose reader process
    has worked for over half a second: in these folders only the slow PDF takes that long. A reader
    process is a child of a worker, a worker a child of the fork server: three processes in a line
    whose command is the fork server's."""
    while not stop.is_set() and not (once and killed):
        table = _processes()
        for parent, cpu, command in table.values():
            grandparent = table.get(parent, (0, 0, ""))[0]
            if cpu > 0.5 and "forkserver" in command and all(
                    "forkserver" in table.get(p, (0, 0, ""))[2] for p in (parent, grandparent)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(parent, signal.SIGKILL)
                    killed.append(parent)
        time.sleep(0.02)


def test_a_worker_killed_while_reading_costs_that_document_only(tmp_path):
    """H5: the worker reading one PDF is killed every time it reads it: that document is a one-line
    failure, the pool goes on, and every other document of the folder is indexed."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for number in range(8):
        make.write_pdf(docs / f"report{number}.pdf", f"Report {number}", make.sections(number, 3))
    make.write_pdf_runs(docs / "victim.pdf", 200_000, pages=6)  # read for seconds: time to be seen working
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_slow_readers_workers, args=(stop, killed), daemon=True)
    watcher.start()
    try:
        run = index(tmp_path / "ws", docs, "--config", _config(tmp_path, workers=2), expect=1)
    finally:
        stop.set()
        watcher.join()
    assert killed, "no worker was seen reading victim.pdf"
    assert "Traceback" not in run.stderr and "BrokenProcessPool" not in run.stderr
    assert "victim.pdf: its worker process died three times while running it (killed: out of memory?)" in run.stderr
    statuses = _statuses(tmp_path / "ws")
    assert statuses.pop("victim.pdf")[0] == "failed"
    assert {status for status, _ in statuses.values()} == {"indexed"} and len(statuses) == 8


def test_a_worker_killed_once_is_replaced_and_nothing_is_lost(tmp_path):
    """H5: one worker killed once mid-read: the unfinished batches run again in a new pool and
    every document is indexed, exit 0."""
    docs = tmp_path / "docs"
    docs.mkdir()
    for number in range(6):
        make.write_pdf(docs / f"report{number}.pdf", f"Report {number}", make.sections(number, 3))
    make.write_pdf_runs(docs / "slow.pdf", 200_000, pages=6)
    stop, killed = threading.Event(), []
    watcher = threading.Thread(target=_kill_slow_readers_workers, args=(stop, killed, True), daemon=True)
    watcher.start()
    try:
        run = index(tmp_path / "ws", docs, "--config", _config(tmp_path, workers=2))
    finally:
        stop.set()
        watcher.join()
    assert "Traceback" not in run.stderr
    assert len(killed) == 1, "no worker was seen reading slow.pdf"
    assert {status for status, _ in _statuses(tmp_path / "ws").values()} == {"indexed"}


def test_a_document_swapped_for_a_fifo_or_a_device_after_the_scan_is_refused(tmp_path):
    """H9: between the scan and the read, a .docx becomes a FIFO, then a link to /dev/zero: the read
    is refused at once (it waited forever on the FIFO, and read /dev/zero without end)."""
    from noderag_cli.config import ChunkConfig
    from noderag_cli.index.scan import scan

    docs = tmp_path / "docs"
    docs.mkdir()
    make.write_docx(docs / "minutes.docx", "Minutes", [("March", ["The board approved a crane."])])
    for swap in ("fifo", "device"):
        found = scan(docs, ChunkConfig())
        (docs / "minutes.docx").unlink()
        if swap == "fifo":
            os.mkfifo(docs / "minutes.docx")
        else:
            os.symlink("/dev/zero", docs / "minutes.docx")
        script = ("import sys, pickle; from noderag_cli.index.chunk import document_chunks; "
                  "from noderag_cli.config import ChunkConfig; "
                  "print(document_chunks(pickle.loads(sys.stdin.buffer.read()), ChunkConfig())[0].failure)")
        import pickle

        done = subprocess.run([sys.executable, "-c", script], input=pickle.dumps(list(found)), capture_output=True,
                              cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.decode().strip() == "no longer a regular file (replaced since the scan); run index again"
        (docs / "minutes.docx").unlink()
        make.write_docx(docs / "minutes.docx", "Minutes", [("March", ["The board approved a crane."])])


def test_what_is_no_document_is_skipped_and_odd_markup_is_read(tmp_path):
    """H17: random bytes named .html (or as an EPUB chapter) are skipped as binary, as the same
    bytes as .txt are; an EPUB whose package document has a DTD is read; no "]>" of an internal
    subset reaches the text; a short PDF repeating one line on every page keeps that line."""
    import random
    import zipfile

    docs = tmp_path / "docs"
    docs.mkdir()
    noise = random.Random(3).randbytes(20_000)
    (docs / "noise.html").write_bytes(noise)
    (docs / "noise.txt").write_bytes(noise)
    make.write_epub(docs / "book.epub", "Book", [("The flood", ["The flood of 1703 carried away the old pier."])])
    with zipfile.ZipFile(docs / "book.epub") as source:
        members = [(info, source.read(info)) for info in source.infolist()]
    with zipfile.ZipFile(docs / "book.epub", "w") as archive:
        for info, data in members:
            if info.filename.endswith(".opf"):
                data = data.replace(b"<package", b'<!DOCTYPE package [ <!ENTITY pub "Acme"> ]>\n<package', 1)
            archive.writestr(info, data)
    (docs / "subset.html").write_text('<!DOCTYPE html [ <!ENTITY pub "Acme"> ]><html><body><p>The lighthouse '
                                      "at Tallis was lit in 1841.</p></body></html>")
    make.write_pdf(docs / "repeat.pdf", "", [("", ["Only this line repeats."])] * 3)
    index(tmp_path / "ws", docs)
    statuses = _statuses(tmp_path / "ws")
    assert statuses["noise.txt"][0] == "skipped"
    assert statuses["noise.html"][0] == "skipped" and "binary" in statuses["noise.html"][1]
    assert statuses["book.epub"][0] == statuses["subset.html"][0] == statuses["repeat.pdf"][0] == "indexed"
    texts = " ".join(node["text"] for node in noderag("query", tmp_path / "ws", "When was the lighthouse at Tallis lit?",
                                                      "--json", "--budget", "2000").json()["nodes"])
    assert "]>" not in texts and "1841" in texts
    from noderag_cli.readers import contained

    assert "Only this line repeats." in contained.extract(str(docs / "repeat.pdf"), readers.Limits()).text


def test_a_failure_no_rerun_can_fix_is_reported_once(tmp_path):
    """H19: the offline engine fails the same way on every run ("community too small for a
    high-level element"): the run that meets it says so once and exits 0; no later run retries it
    or exits 1 for it; stats lists it apart from the failures a rerun retries."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "one.md").write_text("# Note\n\nSkarra sails.\n")  # one unit: a community of one text
    first = index(tmp_path / "ws", docs)
    assert "item(s) have no result with the offline" in first.stderr and "failed" not in first.stderr
    again = index(tmp_path / "ws", docs)
    assert "no result" not in again.stderr and json.loads(again.stdout)["failures"] == 0
    shown = noderag("stats", tmp_path / "ws", "--documents")
    assert "items with no result" in shown.stdout and "retried by the next" not in shown.stdout
