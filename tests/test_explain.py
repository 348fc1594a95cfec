"""How a search reached each node (`via`, `path`) and the page that draws it (`query --html`),
opened in a real headless Chromium (Debian's package, which `make test` installs where it can;
under CI, NODERAG_REQUIRE_BROWSER=1 makes a missing browser a failure instead of a skip)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import assert_one_line_error, build_file, index, noderag

DOCS = {
    "guild.md": "# Mirewood Guild\n\nThe Mirewood Guild is a society of lantern makers in the town of Esterby. "
                "The Mirewood Guild was founded by Orla Penhallow in 1820.\n",
    "penhallow.md": "# Orla Penhallow\n\nOrla Penhallow was a glassblower born in the hamlet of Tresco Vale. "
                    "Orla Penhallow trained under her uncle before she moved to Esterby.\n",
    "weather.md": "# Esterby weather\n\nEsterby has mild winters and wet springs. Fog covers the harbour on most "
                  "autumn mornings.\n",
}
QUESTION = "Where was the founder of the Mirewood Guild born?"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def hand_made(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("explain")
    (root / "docs").mkdir()
    for name, text in DOCS.items():
        (root / "docs" / name).write_text(text)
    index(root / "ws", root / "docs")
    return root / "ws"


def test_via_names_the_entry_points_and_the_walk_and_every_path_follows_edges(hand_made, tmp_path):
    # the walk's own way to each unit: whole chunks would show a passage in their place, and the question's
    # words ("born") would put the founder's passage among the first round's, so her name is no bridge
    units = tmp_path / "units.yaml"
    units.write_text("search: {whole_chunks: 0, question_words_weight: 0}\n")
    run = noderag("query", hand_made, QUESTION, "--json", "--top-k", "1", "--context-only", "--config", units)
    assert run.returncode == 0, run.stderr
    result = run.json()
    shown = {n["id"]: n for n in [*result["nodes"], *result["path_nodes"]]}
    entries = result["entry_points"]
    exact = [n for n in shown.values() if n["via"] == "exact"]
    vector = [n for n in shown.values() if n["via"] == "vector"]
    assert [n["id"] for n in exact] == entries["exact"] and [n["text"] for n in exact] == ["Mirewood Guild"]
    assert [n["id"] for n in vector] == entries["vector"] and len(vector) == 1  # --top-k 1
    walked = [n for n in result["nodes"] if n["via"] == "walk"]
    assert walked and all(n["id"] not in sum(entries.values(), []) for n in walked)
    # the founder's birthplace: from the question's entity, over the founding relation, to the founder
    born = next(n for n in result["nodes"] if "Tresco Vale" in n["text"] and n["type"] == "S")
    assert born["via"] == "walk" and born["path"][0] == exact[0]["id"]
    assert [shown[i]["text"] for i in born["path"] if i[0] == "N"] == ["Mirewood Guild", "Orla Penhallow"]
    assert born["from"] == born["path"][-2] and born["edge"] == "S-N"

    edges = pq.read_table(build_file(hand_made, "edges.parquet"), columns=["source", "target"]).to_pylist()
    pairs = {frozenset((e["source"], e["target"])) for e in edges}
    for node in result["nodes"]:
        path = node["path"]
        assert path[-1] == node["id"] and path[0] in entries["exact"] + entries["vector"]
        assert all(frozenset(step) in pairs for step in zip(path, path[1:], strict=False)), path


def test_a_plain_query_names_how_but_draws_no_paths(hand_made):
    from noderag_cli import api

    with api.open_workspace(hand_made, compiled=False) as session:
        plain = session.ask(QUESTION, answer=False)
        explained = session.ask(QUESTION, answer=False, explain=True)
    assert [n.id for n in plain.nodes] == [n.id for n in explained.nodes]  # explaining changes nothing found
    assert [n.via for n in plain.nodes] == [n.via for n in explained.nodes]
    assert not any(n.path for n in plain.nodes) and all(n.path for n in explained.nodes)


def test_the_page_is_refused_inside_a_workspace_and_on_a_folder(hand_made, tmp_path):
    run = noderag("query", hand_made, QUESTION, "--html", hand_made / "page.html")
    assert run.returncode == 2
    assert_one_line_error(run, "inside workspace")
    assert not (hand_made / "page.html").exists()
    run = noderag("query", hand_made, QUESTION, "--html", tmp_path)
    assert run.returncode == 2
    assert_one_line_error(run, "is a folder")


def _browser():
    if CHROMIUM is None:
        if os.environ.get("NODERAG_REQUIRE_BROWSER"):
            pytest.fail("no chromium on PATH, and NODERAG_REQUIRE_BROWSER is set (CI): the browser tests must run")
        pytest.skip("no chromium on PATH (make test installs Debian's package where it runs as root)")
    from playwright.sync_api import sync_playwright

    return sync_playwright()


def _open(playwright, page_file: Path):
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
        "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"])
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    problems, requests = [], []
    page.on("console", lambda message: problems.append(message.text) if message.type in ("error", "warning") else None)
    page.on("pageerror", lambda error: problems.append(str(error)))
    page.on("request", lambda request: requests.append(request.url))
    page.goto(page_file.as_uri())
    page.wait_for_load_state("load")
    return browser, page, problems, requests


def test_the_page_shows_the_question_its_entities_and_every_kept_node_in_a_real_browser(hand_made, tmp_path):
    page_file = tmp_path / "page.html"
    run = noderag("query", hand_made, QUESTION, "--json", "--html", page_file, "--context-only")
    assert run.returncode == 0, run.stderr
    result = run.json()
    with _browser() as playwright:
        browser, page, problems, requests = _open(playwright, page_file)
        try:
            assert page.locator("h2").inner_text().endswith(QUESTION)
            assert "Mirewood Guild" in page.locator("p.entities").inner_text()
            drawn = set(page.locator("svg g.node").evaluate_all("nodes => nodes.map(n => n.dataset.id)"))
            listed = page.locator("ol.context li").evaluate_all("items => items.map(i => i.dataset.id)")
            assert listed == [n["id"] for n in result["nodes"]]  # the context, in order
            assert {n["id"] for n in result["nodes"]} <= drawn
            assert set(result["entry_points"]["exact"]) <= drawn
            born = next(n for n in result["nodes"] if "Tresco Vale" in n["text"] and n["type"] in ("S", "T"))
            page.locator(f'ol.context li[data-id="{born["id"]}"]').click()
            details = page.locator(".details").inner_text()
            assert "Tresco Vale" in details and "penhallow.md" in details and " > ".join(born["path"]) in details
            shot = page.screenshot()
        finally:
            browser.close()
    assert problems == []
    assert requests == [page_file.as_uri()]  # nothing but the file itself: it works offline
    from io import BytesIO

    from PIL import Image  # (matplotlib's dependency, in the test install)

    colours = Image.open(BytesIO(shot)).convert("RGB").getcolors(maxcolors=1 << 20)
    assert colours is not None and len(colours) > 20  # not blank: text, nodes and edges in many colours


def test_one_page_for_a_file_of_questions(built, tmp_path):
    questions = tmp_path / "q.jsonl"
    asked = ["Who received the Greyling Medal?", "What did the Sound Maritime Society do?"]
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in asked) + "not json\n")
    page_file = tmp_path / "all.html"
    run = noderag("query", built, "--questions", questions, "--html", page_file, "--context-only")
    assert run.returncode == 1  # the bad line
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert all(n["via"] for line in lines[:2] for n in line["nodes"])
    text = page_file.read_text()
    assert all(f'{i + 1}. {q}' in text for i, q in enumerate(asked)) and 'href="#q2"' in text
    with _browser() as playwright:
        browser, page, problems, requests = _open(playwright, page_file)
        try:
            assert page.locator("section.question").count() == 2
            assert page.locator("section#q2 svg g.node").count() > 1
        finally:
            browser.close()
    assert problems == [] and requests == [page_file.as_uri()]



def test_markup_in_a_document_or_a_question_cannot_change_the_page(tmp_path):
    """H16: `<!--<script>` in a document or a question swallowed the rest of the page (one section of
    three shown, clicks dead): the data is written so no text can turn the script parser; U+202E
    (which shows what follows reversed) is shown as its code."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "odd.md").write_text("# Odd guild\n\nThe Odd Guild wrote <!--<script> and </script> in its charter of "
                                 "1820. Its seal reads \u202eenoj kram\u202c in mirror letters.\n")
    index(tmp_path / "ws", docs)
    asked = ["What did the Odd Guild write <!--<script> in?", "What does the seal of the Odd Guild read\u202e?",
             "When was the charter of the Odd Guild written?"]
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question": q}) + "\n" for q in asked))
    page_file = tmp_path / "page.html"
    run = noderag("query", tmp_path / "ws", "--questions", questions, "--html", page_file, "--context-only")
    assert run.returncode == 0, run.stderr
    assert "\u202e" not in page_file.read_text()
    with _browser() as playwright:
        browser, page, problems, requests = _open(playwright, page_file)
        try:
            assert page.locator("section.question").count() == 3
            assert "U+202E" in page.locator("section#q2 h2").inner_text()
            for number in (1, 2, 3):
                page.locator(f"section#q{number} ol.context li").first.click()
                assert "Odd" in page.locator(f"section#q{number} .details").inner_text()
        finally:
            browser.close()
    assert problems == [] and requests == [page_file.as_uri()]
