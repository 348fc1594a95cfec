"""Real folders (issue 26): PDF, Word, PowerPoint, Excel, HTML and EPUB files written by their own
libraries (reportlab for PDF, a test extra), indexed through the real CLI: their text, headings,
tables and pages found, where each node came from in `query --json`, files a reader cannot use
skipped with the reason while the rest is indexed, an unchanged file never read twice, a changed
one read again and the tables equal to a fresh build, and --include/--exclude."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import assert_same_tables, index, noderag

from devtools import documents as make

SHIPS = [["Ship", "Tonnage", "Home port"], ["Gannet Queen", "420", "Vessmouth"], ["Heron", "310", "Dunholt"]]
PAGES = [("Harbour survey", ["The quarrymen of Pellow Ridge cut the granite for the long breakwater in 1881."]),
         ("Dredging", ["The dredger Marlpit deepened the inner channel to four fathoms over two winters."]),
         ("Lights", ["A red lantern on the Tallis beacon marks the end of the breakwater at night."])]
SLIDES = [("Budget", ["Spending on the Orlen bridge rose to nine thousand pounds."]),
          ("Staffing", ["Twelve pilots served the Sallow approaches in the busy season."])]


def _folder(root: Path) -> Path:
    folder = root / "docs"
    (folder / "reports").mkdir(parents=True)
    make.write_pdf(folder / "reports" / "survey.pdf", "Harbour Survey", PAGES, header="Vessmouth Harbour Board")
    make.write_docx(folder / "minutes.docx", "Board Minutes", [("Meeting of March", [
        "The board approved the purchase of a steam crane for the east quay."])], items=["Crane ordered", "Quay paved"],
        table=SHIPS)
    make.write_pptx(folder / "deck.pptx", "Quarterly Review", SLIDES)
    make.write_xlsx(folder / "fleet.xlsx", "Fleet", {"Ships": SHIPS, "Crew": [["Name", "Role"], ["Ada Penhallow", "Pilot"]]})
    make.write_html(folder / "guide.html", "Visitor Guide", [("Opening hours", [
        "The maritime museum opens at nine o'clock from Easter to October."])])
    make.write_epub(folder / "history.epub", "A Short History", [("The great flood", [
        "The flood of 1703 carried away the old wooden pier and the fish market."]),
        ("Rebuilding", ["Masons from Carrow rebuilt the pier in stone by 1710."])])
    (folder / "notes.md").write_text("# Notes\n\nThe ferry to Skarra leaves twice a day.\n")
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _folder(tmp_path_factory.mktemp("formats"))


@pytest.fixture(scope="module")
def workspace(folder, tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("formats-ws") / "ws"
    index(ws, folder)
    return ws


def _query(ws: Path, question: str, budget: int = 600, units: bool = False) -> dict:
    """`query --json`; `units`: without whole chunks (`search.whole_chunks` 0), so a passage's sentences
    are shown as units, each with its own narrowed place."""
    extra = []
    if units:
        config = ws.parent / "units.yaml"
        config.write_text("search: {whole_chunks: 0}\n")
        extra = ["--config", config]
    run = noderag("query", ws, question, "--json", "--budget", str(budget), *extra)
    assert run.returncode == 0, run.stderr
    return run.json()


def _node_with(payload: dict, words: str, types: str = "STAH") -> dict:
    """The context's node holding `words`: a unit or chunk where one holds them (their places are
    their own), else an attribute or summary (the context shows a sentence once)."""
    for node in sorted(payload["nodes"], key=lambda n: "STAH".index(n["type"]) if n["type"] in "STAH" else 9):
        if words in node["text"] and node["type"] in types:
            return node
    pytest.fail(f"no node with {words!r} in the context: {[n['text'][:60] for n in payload['nodes']]}")


def test_every_format_is_indexed_with_its_text(workspace):
    stats = noderag("stats", workspace, "--json", "--documents").json()
    statuses = {d["path"]: d["status"] for d in stats["documents"]["list"]}
    assert statuses == {p: "indexed" for p in ("deck.pptx", "fleet.xlsx", "guide.html", "history.epub", "minutes.docx",
                                                "notes.md", "reports/survey.pdf")}
    for question, words, document in [
            ("Who cut the granite for the breakwater?", "quarrymen of Pellow Ridge", "reports/survey.pdf"),
            ("What did the board approve for the east quay?", "steam crane", "minutes.docx"),
            ("How many pilots served the Sallow approaches?", "Twelve pilots", "deck.pptx"),
            ("When does the maritime museum open?", "maritime museum opens", "guide.html"),
            ("What did the flood of 1703 carry away?", "old wooden pier", "history.epub")]:
        node = _node_with(_query(workspace, question), words)
        assert node["documents"] == [document]
        assert node["locations"][0]["document"] == document and len(node["locations"][0]["content_hash"]) == 32


def test_pages_slides_sheets_and_sections_are_where_a_node_came_from(workspace):
    dredger = _node_with(_query(workspace, "Which dredger deepened the inner channel?", units=True), "dredger Marlpit", "S")
    assert dredger["locations"][0]["pages"] == [2]
    assert dredger["locations"][0]["sections"] == ["Dredging"]  # the page's heading, found by its font size
    shown = _node_with(_query(workspace, "Which dredger deepened the inner channel?"), "dredger Marlpit", "ST")
    assert shown["type"] == "S" and shown["locations"][0]["pages"] == [2]  # a chunk over pages is never shown whole
    bridge = _node_with(_query(workspace, "What did spending on the Orlen bridge rise to?", units=True), "Orlen bridge",
                        "S")
    assert bridge["locations"][0]["slides"] == [1]
    pier = _node_with(_query(workspace, "Who rebuilt the pier in stone?", units=True), "rebuilt the pier", "S")
    assert pier["locations"][0]["sections"] == ["Rebuilding"]
    start, end = pier["locations"][0]["span"]
    assert 0 <= start < end
    answered = _query(workspace, "Which dredger deepened the inner channel?")
    assert "reports/survey.pdf p. 2" in answered["answer"]  # the offline answer names the page


def test_tables_lists_and_sheets_keep_their_cells(workspace):
    row = _node_with(_query(workspace, "What is the tonnage of the Heron?"), "Heron")
    assert "310" in row["text"] and "Tonnage" in row["text"]  # a row says what its numbers are
    sheets = {place.get("sheets", [None])[0] for node in _query(workspace, "Which ship's home port is Dunholt?",
                                                                 2000)["nodes"] for place in node["locations"]}
    assert "Ships" in sheets
    crew = _node_with(_query(workspace, "What is Ada Penhallow's role?"), "Ada Penhallow")
    assert "Pilot" in crew["text"] and crew["locations"][0]["sheets"] == ["Crew"]
    items = _query(workspace, "Was the crane ordered and the quay paved?", 2000)
    assert "Crane ordered" in json.dumps(items) and "Quay paved" in json.dumps(items)


def test_boilerplate_is_left_out(workspace):
    text = noderag("export", workspace, "--format", "csv", "--out", workspace.parent / "csv")
    assert text.returncode == 0, text.stderr
    nodes = (workspace.parent / "csv" / "nodes.csv").read_text()
    for boilerplate in ("Vessmouth Harbour Board", "Page 2", "Next chapter", "All rights reserved", "tracking"):
        assert boilerplate not in nodes, boilerplate  # running headers and footers, navigation, scripts, footers
    assert "reports/survey.pdf pp. 1-3" in nodes  # export writes where nodes came from (their chunks)


def test_unreadable_files_are_skipped_with_their_reason_and_retried(folder, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(folder, docs)
    make.write_pdf(docs / "secret.pdf", "Secret", PAGES[:1], password="s3cret")
    make.write_image_pdf(docs / "scanned.pdf")
    (docs / "broken.docx").write_bytes(b"PK\x03\x04 not a Word file at all")
    make.write_zip_bomb(docs / "bomb.docx", 80)
    (docs / "old.doc").write_bytes(b"\xd0\xcf\x11\xe0 legacy")
    ws = tmp_path / "ws"
    run = index(ws, docs, "--config", _config(tmp_path, extract_expanded_mb=50), expect=1)
    assert "Traceback" not in run.stderr
    for warning in ("secret.pdf: encrypted PDF", "scanned.pdf: no text layer; OCR is not supported",
                    "broken.docx: damaged or not a Word file", "bomb.docx: its compressed contents expand to 80 MB"):
        assert warning in run.stderr, warning
    documents = {d["path"]: d for d in noderag("stats", ws, "--json", "--documents").json()["documents"]["list"]}
    assert documents["secret.pdf"]["status"] == "failed" and "encrypted" in documents["secret.pdf"]["reason"]
    assert documents["old.doc"]["status"] == "skipped" and "save it as .docx" in documents["old.doc"]["reason"]
    assert documents["reports/survey.pdf"]["status"] == "indexed"  # the rest is indexed
    again = index(ws, docs, expect=1)  # tried again: still failing, still said
    assert "secret.pdf: encrypted PDF" in again.stderr
    assert json.loads(again.stdout)["stages"]["chunk"]["extracted"] == 0  # the readable ones are not read again


def test_an_unchanged_file_is_not_read_again_and_a_changed_one_is(folder, tmp_path):
    docs = tmp_path / "docs"
    shutil.copytree(folder, docs)
    ws = tmp_path / "ws"
    first = json.loads(index(ws, docs).stdout)["stages"]["chunk"]
    assert first["extracted"] == 6
    # new chunk settings: every document is cut again, none is read again (the extractions are cached)
    settings = json.loads(index(ws, docs, "--config", _config(tmp_path, chunk_tokens=300)).stdout)["stages"]["chunk"]
    assert settings["skipped"] is False and settings["extracted"] == 0
    # one PDF changed: read again, alone; and the tables equal a fresh build of the folder
    make.write_pdf(docs / "reports" / "survey.pdf", "Harbour Survey", PAGES[:2] + [("Tides", [
        "Spring tides at the Tallis beacon rise nineteen feet."])], header="Vessmouth Harbour Board")
    changed = json.loads(index(ws, docs, "--exact").stdout)["stages"]["chunk"]
    assert changed["extracted"] == 1
    fresh = tmp_path / "fresh"
    index(fresh, docs, "--config", _config(tmp_path, chunk_tokens=300))
    assert_same_tables(ws, fresh)
    assert "nineteen feet" in json.dumps(_query(ws, "How high do spring tides rise at the Tallis beacon?"))


def test_include_and_exclude_choose_what_is_read(folder, tmp_path):
    ws = tmp_path / "ws"
    plan = noderag("index", ws, "--input", folder, "--include", "*.pdf", "--include", "*.md", "--exclude", "notes.md",
                   "--dry-run", "--json")
    assert plan.returncode == 0, plan.stderr
    assert plan.json()["formats"] == {"pdf": 1} and plan.json()["left_out"] == 6
    listed = noderag("index", ws, "--input", folder, "--exclude", "reports/*", "--dry-run")
    assert "files to read: 1 docx, 1 epub, 1 html, 1 markdown, 1 pptx, 1 xlsx; 1 left out" in listed.stdout
    index(ws, folder, "--include", "*.pdf")
    paths = {d["path"] for d in noderag("stats", ws, "--json", "--documents").json()["documents"]["list"]}
    assert paths == {"reports/survey.pdf"}
    index(ws, folder)  # the patterns are kept in the workspace's config
    assert {d["path"] for d in noderag("stats", ws, "--json", "--documents").json()["documents"]["list"]} == paths


def _config(tmp_path: Path, **chunk) -> Path:
    import yaml

    path = tmp_path / f"chunk-{'-'.join(f'{k}{v}' for k, v in chunk.items())}.yaml"
    path.write_text(yaml.safe_dump({"chunk": chunk}))
    return path


def test_a_reader_upgrade_reads_again_only_its_own_format(monkeypatch):
    """The library versions that decide a format's text are part of the chunk stage's settings and
    of the keys of that format's chunks and extractions; a Markdown file's keys never change."""
    from noderag_cli import readers
    from noderag_cli.config import Config
    from noderag_cli.index.chunk import chunking_key, extraction_key
    from noderag_cli.index.pipeline import settings_digest
    from noderag_cli.index.scan import ScannedFile
    from noderag_cli.index.stages import BY_NAME

    pdf = ScannedFile("a.pdf", "/docs/a.pdf", None, "0" * 32, 10, "", "pdf")
    notes = ScannedFile("a.md", "/docs/a.md", "# A\n\ntext", "1" * 32, 10, "", "markdown")
    before = {"pdf": {"version": readers.VERSION, "libraries": {"pypdfium2": "4.30.0"}}}
    after = {"pdf": {"version": readers.VERSION, "libraries": {"pypdfium2": "5.0.0"}}}
    assert chunking_key(pdf, 1024, 0, before) != chunking_key(pdf, 1024, 0, after)
    assert extraction_key(pdf, before) != extraction_key(pdf, after)
    assert chunking_key(notes, 1024, 0, before) == chunking_key(notes, 1024, 0, after)
    chunk, decompose = (settings_digest(Config(), {}, BY_NAME[name]) for name in ("chunk", "decompose"))
    monkeypatch.setattr(readers, "library_version", lambda name: "99.0" if name == "pypdfium2" else "1.0")
    assert settings_digest(Config(), {}, BY_NAME["chunk"]) != chunk  # the chunk stage runs again...
    assert settings_digest(Config(), {}, BY_NAME["decompose"]) == decompose  # ...and only it, by its settings


@pytest.mark.llm
def test_an_llm_answer_cites_pages(workspace, tmp_path):
    """An LLM reads each context line with its place ("(from reports/survey.pdf p. 2)") and its
    citations name them."""
    import yaml

    from devtools.fault_server import FaultServer, llm_section, task_of

    with FaultServer(default="good") as server:
        server.script(["cite"], marker="Cite the context lines")
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10, "retries": 1}}))
        run = noderag("query", workspace, "Which dredger deepened the inner channel?", "--config", config, "--json",
                      "--budget", "300")
        request = [r for r in server.completions() if task_of(r.body) == "answer"][0]
    assert run.returncode == 0, run.stderr
    context = request.body["messages"][1]["content"]
    assert "(from reports/survey.pdf p. 2)" in context
    from noderag_cli.search.results import place_label

    result = run.json()
    by_id = {node["id"]: node for node in result["nodes"]}
    assert result["citations"]
    for citation in result["citations"]:
        places = by_id[citation["id"]]["locations"]
        assert citation["sources"] == list(dict.fromkeys(place_label(p) for p in places))


def test_a_reader_over_its_time_is_stopped_with_the_reason(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    make.write_pdf(docs / "long.pdf", "Long", make.sections(5, 40))
    (docs / "notes.md").write_text("# Notes\n\nThe ferry to Skarra leaves twice a day.\n")
    run = index(tmp_path / "ws", docs, "--config", _config(tmp_path, extract_seconds=0.000001), expect=1)
    assert "long.pdf: extraction took over 1e-06 s (chunk.extract_seconds)" in run.stderr
    statuses = {d["path"]: d["status"] for d in noderag("stats", tmp_path / "ws", "--json", "--documents").json()[
        "documents"]["list"]}
    assert statuses == {"long.pdf": "failed", "notes.md": "indexed"}
