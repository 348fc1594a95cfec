"""Multi-hop search and the offline answer (issue 25): each mechanism on a small hand-made corpus whose
second hop it must reach, with a control it must not change; the offline engine's names; the
offline answer on the sample corpus; and the search over an LLM-built graph (fault server)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import scipy.sparse as sp
import yaml
from conftest import SAMPLE_CORPUS, index

from noderag_cli import api, nlp
from noderag_cli.engines import extractive
from noderag_cli.engines.base import ChunkInput
from noderag_cli.engines.offline import decompose_chunk
from noderag_cli.search import rounds
from noderag_cli.search.ppr import WalkMatrix

QUESTION = "In which town was the director of The Glass Orchard born?"
CONTROL = "What do the three sisters inherit in The Glass Orchard?"
DIRECTORS = [("Birch Lantern", "Oren Pask", "Vell"), ("Salt Meadow", "Lisa Morrow", "Brast"),
             ("The Copper Gate", "Tomas Quint", "Corrin"), ("Winter Ferry", "Eda Belden", "Dunmere"),
             ("Quiet Harbour", "Piet Sarro", "Esk"), ("The Long Pier", "Nora Voss", "Farrow"),
             ("Blue Kiln", "Ivo Tamsin", "Gilt"), ("Ash Road", "Rana Ulric", "Holm"),
             ("The Paper Bell", "Sten Drey", "Isby"), ("Night Ferry", "Hale Fenn", "Jarrow"),
             ("Stone Choir", "Juno Galt", "Kest"), ("The Last Mill", "Kai Hesk", "Lorn")]


@pytest.fixture(scope="module")
def films(tmp_path_factory) -> api.Session:
    """A film's page names its director; the director's page says where she was born; twelve other
    films' pages each name a director born in a town, the words the question uses, so a search
    by likeness to the question fills a small budget with them."""
    root = tmp_path_factory.mktemp("films")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "glass_orchard.md").write_text(
        "# The Glass Orchard\n\nThe Glass Orchard is a 1999 drama film directed by Mara Quell. The film follows three "
        "sisters who inherit a failing apple orchard in the hills. It was shot over a single wet summer, and its score "
        "was written by a local brass band.\n")
    (corpus / "mara_quell.md").write_text(
        "# Mara Quell\n\nMara Quell is a film director and screenwriter. Quell was born in Tarnow, a mill town on the "
        "river Sela, in 1961. She studied painting in the capital before she turned to film.\n")
    for number, (film, director, town) in enumerate(DIRECTORS):
        (corpus / f"film_{number}.md").write_text(
            f"# {film}\n\n{film} is a {1990 + number} drama film directed by {director}, who was born in the town of "
            f"{town}. It tells the story of a ferry crew in a hard winter.\n")
    api.index(root / "ws", corpus)
    with api.open_workspace(root / "ws") as session:
        yield session


def _documents(result) -> set[str]:
    return {d for node in result.nodes if node.type in "TSAR" for d in node.documents}


def test_the_second_round_reaches_the_bridge_entitys_own_passage(films):
    one_round = films.ask(QUESTION, params=films.search_settings(budget_tokens=300, second_round_chunks=0))
    two_rounds = films.ask(QUESTION, params=films.search_settings(budget_tokens=300))
    assert "Tarnow" not in one_round.context_text()  # the other directors' towns fill the budget
    assert "Tarnow" in two_rounds.context_text() and "Tarnow" in two_rounds.answer
    bridges = [films.retriever.build.texts[films.retriever.build.ids.tolist().index(i)] for i in two_rounds.entry_points["bridge"]]
    assert "Mara Quell" in bridges
    assert not any(name.isdigit() for name in bridges)  # "1999" names a value, not a passage to go to
    assert two_rounds.context_tokens <= 300


def test_the_second_round_keeps_a_one_hop_answer(films):
    for params in (films.search_settings(budget_tokens=300), films.search_settings(budget_tokens=300,
                                                                                  second_round_chunks=0)):
        result = films.retrieve(CONTROL, params)
        assert "glass_orchard.md" in _documents(result)
        assert "apple orchard" in result.context_text()


def test_document_diversity_spreads_the_context_over_passages(built):
    with api.open_workspace(built) as session:
        for question in ("Who received the Greyling Medal?", "What did the Sound Maritime Society do?"):
            counts = []
            for diversity in (0.4, 1.0):
                result = session.retrieve(question, session.search_settings(budget_tokens=300, document_diversity=diversity,
                                                                           second_round_chunks=0))
                per_document = {}
                for node in result.nodes:
                    if node.type in "TSAR":
                        per_document[node.documents[0]] = per_document.get(node.documents[0], 0) + 1
                counts.append((len(per_document), max(per_document.values())))
            (spread, most), (plain_spread, plain_most) = counts
            assert spread > plain_spread and most < plain_most, (question, counts)


def test_specific_entities_take_the_start():
    # node 0: an entity named by two units; node 1: one named by thirty; nodes 2, 3: vector entry points
    n = 40
    rows = [0, 0] + [1] * 30
    columns = [4, 5] + list(range(6, 36))
    adjacency = sp.coo_matrix((np.ones(len(rows)), (rows, columns)), shape=(n, n)).tocsr()
    walk = WalkMatrix.from_adjacency(adjacency + adjacency.T)
    entries = np.array([0, 1, 2, 3])
    start = rounds.start_shares(walk, entries, np.array([1, 0]), 0.3)
    assert start.sum() == pytest.approx(1.0)
    assert start[0] + start[1] == pytest.approx(0.3) and start[0] > start[1]  # the rarer name weighs more
    assert start[2] == start[3] == pytest.approx(0.35)
    assert rounds.start_shares(walk, entries, np.array([1, 0]), None).tolist() == [0.25] * 4  # the paper
    assert rounds.start_shares(walk, np.array([2, 3]), np.zeros(0, np.int64), 0.3).tolist() == [0.5, 0.5]


def test_the_offline_engine_names_what_a_document_is_about():
    text = ("# Penrake brothers\n\nJosiah Penrake (1821-1896) and Amos Penrake (1824-1880) were shipbuilders. "
            "The brothers were born in Harlow Ferry. Josiah married Ann Lusty in 1849, and Penrake ran the yard.")
    units = decompose_chunk(ChunkInput("c", text, "Penrake brothers"))
    assert all("Josiah Penrake" in u.entities and "Penrake brothers" in u.entities for u in units)
    married = next(u for u in units if "married" in u.text)
    assert {"Josiah", "Josiah Penrake", "Ann Lusty"} <= set(married.entities)  # "Josiah" shortens one name
    assert "Amos Penrake" not in married.entities  # "Penrake" could shorten two: left alone
    # "and" joins two names, not one
    founders = decompose_chunk(ChunkInput("d", "It was founded by Corey Taylor and Denny Harvey in Ohio.", ""))[0]
    assert {"Corey Taylor", "Denny Harvey"} <= set(founders.entities)
    assert "Corey Taylor and Denny Harvey" not in founders.entities
    # a qualified title also names its subject; a chunk that does not open its document has no lead name
    song = decompose_chunk(ChunkInput("e", "Hello Love (song)\nIt was a 1974 single by Hank Snow.", "Hello Love (song)"))
    assert {"Hello Love (song)", "Hello Love"} <= set(song[0].entities)
    later = decompose_chunk(ChunkInput("f", "Mara Quell wrote it. It won a prize.", "The Glass Orchard"))
    assert all("Mara Quell" not in u.entities for u in later[1:])


def test_the_offline_answer_completes_the_chain(built):
    with api.open_workspace(built) as session:
        demo = session.ask("In which village was the founder of the society that awards the Greyling Medal born?",
                           params=session.search_settings(budget_tokens=1000))
        assert demo.answer.startswith(extractive.LABEL)
        assert "Harlow Ferry" in demo.answer and "[history/penrake_brothers.md]" in demo.answer
        assert len(demo.answer.split()) <= extractive.MAX_WORDS + 20  # sentences up to 60 words, with their sources
        for question in ("Which river flows through Paris?", "What is the melting point of tungsten?"):
            assert session.ask(question).answer == extractive.NOT_FOUND


def test_the_offline_answer_quotes_each_passage_once_while_others_remain():
    """Toad Hall's passage is the most like the question in every sentence, but the city is in the
    university's passage: Toad Hall's second sentence gives way to it. The vectors are set by hand
    (cosines 0.95 and 0) so that the cosine alone would quote Toad Hall's passage three times."""
    context = "\n".join([
        "[S] Toad Hall is a residential hall in the Australian National University, opened in 1974. (from toad.md)",
        "[S] Toad Hall is a residential hall for post-graduate students of the Australian National University. "
        "(from toad.md)",
        "[S] Toad Hall is a residential hall whose students come from some 50 countries. (from toad.md)",
        "[S] The Australian National University is a research university located in Canberra. (from anu.md)",
    ])

    def embed(texts: list[str]) -> np.ndarray:
        cosines = [0.0 if text.startswith("The Australian") else 0.95 if text.startswith("Toad") else 1.0
                   for text in texts]  # the question last: 1.0
        return np.array([[c, (1 - c * c) ** 0.5] for c in cosines])

    answer = extractive.answer("Toad Hall is a residential hall in a university located in what Australian city?",
                               context, embed)
    assert "Canberra" in answer and answer.index("[anu.md]") < answer.index("[toad.md]", answer.index("[toad.md]") + 1)


def test_what_the_question_asks_for():
    assert nlp.asked_kind("How many stores are in the state where he lived when he died?") == "number"
    assert nlp.asked_kind("When was the society founded?") == "date"
    assert nlp.asked_kind("In what year did the railway open?") == "date"
    assert nlp.asked_kind("Who founded the observatory?") == "name"
    assert nlp.asked_kind("What kind of university is it?") == "any"


@pytest.mark.llm
def test_an_llm_built_graph_is_searched_the_same_way(tmp_path):
    """A graph from an LLM engine (the fault server's rich replies: one unit per sentence, capitalised
    words as entities) gets the same two rounds: bridges from its own entities, deterministic,
    within budget; and its answer comes from the engine, not the extractive one."""
    from devtools.fault_server import FaultServer, llm_section

    folder = tmp_path / "docs"
    for name in ("greyling_medal.md", "sound_maritime_society.txt", "history/penrake_brothers.md", "vessmouth.md"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SAMPLE_CORPUS / name, folder / name)
    with FaultServer(default="rich") as server:
        config = tmp_path / "fault.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10, "retries": 2}}))
        index(tmp_path / "ws", folder, "--config", config)
        question = "In which village was the founder of the society that awards the Greyling Medal born?"
        results = []
        for compiled in (True, False, True):
            with api.open_workspace(tmp_path / "ws", compiled=compiled) as session:
                params = session.search_settings(budget_tokens=600)
                result = session.retrieve(question, params)
                assert result.context_tokens <= 600
                results.append(([(n.id, n.score) for n in result.nodes], result.entry_points))
        assert results[0] == results[1] == results[2]
        assert results[0][1]["bridge"], "the LLM graph's entities start a second round"
        one_round = api.open_workspace(tmp_path / "ws").retrieve(question, params.model_copy(
            update={"second_round_chunks": 0}))
        assert [n.id for n in one_round.nodes] != [node for node, _ in results[0][0]]
