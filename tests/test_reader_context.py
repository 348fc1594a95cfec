"""What a reader gets from the context (issue 36): the kind of value a question asks for weighs a
unit up, the best documents' short chunks are shown whole, and neither costs the context a
passage it touched or a token over its budget. On arrays (the functions themselves) and on the
sample corpus's questions through the real search."""

from __future__ import annotations

import json

import numpy as np
import pytest

from noderag_cli import api, nlp
from noderag_cli.engines import extractive
from noderag_cli.node_types import TYPE_CODE
from noderag_cli.search import context

T, S, H = TYPE_CODE["T"], TYPE_CODE["S"], TYPE_CODE["H"]


def test_a_question_asks_for_a_date_or_a_number_and_units_are_weighed_by_it():
    assert nlp.asked_kind("When did the mother of the founder die?") == "date"
    assert nlp.asked_kind("How many sailors did the Gannet Queen rescue?") == "number"
    assert nlp.asked_kind("Who founded the society?") == "name"
    assert nlp.value_kinds("She died on 4 May 1897 at Esterby.") & nlp.VALUE_BITS["date"]
    assert nlp.value_kinds("It rescued 41 sailors.") == nlp.VALUE_BITS["number"]
    assert nlp.value_kinds("It has no value in it.") == 0
    similarity = np.array([0.5, 0.5, 0.5])
    kinds = np.array([nlp.VALUE_BITS["date"] | nlp.VALUE_BITS["number"], nlp.VALUE_BITS["number"], 0], np.uint8)
    assert context.weigh_asked_kind(similarity, kinds, "date", 0.5).tolist() == [0.75, 0.5, 0.5]
    assert context.weigh_asked_kind(similarity, kinds, "number", 0.5).tolist() == [0.75, 0.75, 0.5]
    for asked, weight in (("name", 0.5), ("any", 0.5), ("date", 0.0)):  # the controls: nothing moves
        assert context.weigh_asked_kind(similarity, kinds, asked, weight) is similarity


def _arrays():
    """Rows: 0 T (60 tokens; units 1, 2), 1 S of 0 (20), 2 S of 0 (20), 3 T (200; unit 4), 4 S of 3 (20),
    5 H (30), 6 S of 7 (20), 7 T (50; units 6, 8), 8 S of 7 (20)."""
    codes = np.array([T, S, S, T, S, H, S, T, S], np.int8)
    tokens = np.array([60, 20, 20, 200, 20, 30, 20, 50, 20], np.int32)
    unit_chunk = np.array([-1, 0, 0, -1, 3, -1, 7, -1, 7], np.int32)
    return codes, tokens, unit_chunk


def test_a_best_short_chunk_replaces_its_units_funded_without_dropping_a_passage():
    codes, tokens, unit_chunk = _arrays()
    kept = np.array([1, 4, 5, 6, 8])  # 20 + 20 + 30 + 20 + 20 = 110 tokens
    scores = np.array([0.9, 0.8, 0.5, 0.4, 0.3])
    rows, shown = context.whole_chunks(kept, scores, codes, tokens, unit_chunk, budget=130, documents=1)
    # chunk 0 (60) for unit 1 (20): 40 more, 20 free: the summary H goes (30), never unit 4, chunk 3's only unit
    assert rows.tolist() == [0, 4, 6, 8] and shown.tolist() == [0.9, 0.8, 0.4, 0.3]
    assert tokens[rows].sum() <= 130
    # with less room the summary and then chunk 7's weaker unit fund it; a chunk's only unit never does
    rows, _ = context.whole_chunks(kept, scores, codes, tokens, unit_chunk, budget=110, documents=1)
    assert rows.tolist() == [0, 4, 6] and tokens[rows].sum() <= 110
    rows, _ = context.whole_chunks(kept, scores, codes, tokens, unit_chunk, budget=60, documents=1)
    assert rows.tolist() == kept.tolist()  # nothing may fund it: unchanged


def test_a_node_that_outranks_the_chunks_unit_never_pays_for_the_chunk():
    codes, tokens, unit_chunk = _arrays()
    kept = np.array([1, 4, 5, 6, 8])
    scores = np.array([0.9, 0.8, 0.95, 0.4, 0.3])  # the summary (row 5) ranks above unit 1
    rows, _ = context.whole_chunks(kept, scores, codes, tokens, unit_chunk, budget=130, documents=1)
    assert rows.tolist() == [0, 4, 5, 6]  # chunk 7's weaker unit pays, not the summary
    rows, _ = context.whole_chunks(kept, scores, codes, tokens, unit_chunk, budget=110, documents=1)
    assert rows.tolist() == kept.tolist()  # what is left below unit 1 cannot pay: unchanged


def test_a_long_chunk_or_no_document_leaves_the_context_as_it_was():
    codes, tokens, unit_chunk = _arrays()
    kept, scores = np.array([4, 1]), np.array([0.9, 0.2])
    rows, _ = context.whole_chunks(np.sort(kept), scores[np.argsort(kept)], codes, tokens, unit_chunk, budget=10_000,
                                   documents=1)
    assert rows.tolist() == [1, 4]  # chunk 3 costs ten times its unit: not shown whole
    rows, _ = context.whole_chunks(np.array([1, 4]), np.array([0.2, 0.9]), codes, tokens, unit_chunk, 10_000, 0)
    assert rows.tolist() == [1, 4]
    rows, _ = context.whole_chunks(np.array([1, 4]), np.array([0.2, 0.9]), codes, tokens, unit_chunk, 10_000, 2)
    assert rows.tolist() == [0, 4]  # the second best document's short chunk


@pytest.fixture(scope="module")
def session(built):
    with api.open_workspace(built) as opened:
        yield opened


def test_on_the_sample_questions_every_passage_stays_and_the_budget_holds(session):
    from conftest import SAMPLE_CORPUS

    questions = [json.loads(line)["question"] for line in (SAMPLE_CORPUS / "questions.jsonl").read_text().splitlines()]
    grew = 0
    for question in questions:
        for budget in (300, 600, 1000):
            plain = session.retrieve(question, session.search_settings(budget_tokens=budget, whole_chunks=0))
            whole = session.retrieve(question, session.search_settings(budget_tokens=budget))
            assert whole.context_tokens <= budget
            passages = {d for n in plain.nodes if n.type in "ST" for d in n.documents}
            assert passages <= {d for n in whole.nodes if n.type in "ST" for d in n.documents}
            grew += any(n.type == "T" for n in whole.nodes) and not any(n.type == "T" for n in plain.nodes)
            again = session.retrieve(question, session.search_settings(budget_tokens=budget))
            assert [n.id for n in again.nodes] == [n.id for n in whole.nodes]  # deterministic
    assert grew  # some contexts show a chunk whole that would not have shown it


def test_the_offline_answer_opens_with_its_short_answer(built):
    """The demo question's short answer is the village; a question the context cannot answer gets
    "not found"; `query --json` carries the short answer as its own field."""
    from conftest import noderag

    demo = "In which village was the founder of the society that awards the Greyling Medal born?"
    run = noderag("query", built, demo, "--json", "--budget", "1000")
    assert run.returncode == 0, run.stderr
    answered = run.json()
    assert answered["short_answer"] == "Harlow Ferry"
    assert answered["answer"].startswith("[offline extractive answer] Harlow Ferry. From the context: ")
    assert "Harlow Ferry" in answered["answer"].split("From the context: ", 1)[1]  # the sentence that supports it
    assert len(answered["answer"].split()) <= 60 + 5
    nothing = noderag("query", built, "What is the boiling point of liquid helium on Mars?", "--json").json()
    assert nothing["short_answer"] is None and "Not found in the context" in nothing["answer"]
    assert noderag("query", built, demo, "--json", "--context-only").json()["short_answer"] is None


@pytest.mark.llm
def test_an_llm_built_workspace_is_searched_with_the_same_settings(tmp_path):
    """Both engines: a workspace built through litellm (the fault server's rich replies) is searched
    with the asked kind and whole chunks: within budget, deterministic, and showing a chunk whole."""
    import yaml
    from conftest import SAMPLE_CORPUS, index

    from devtools.fault_server import FaultServer, llm_section

    with FaultServer(default="rich") as server:
        config = tmp_path / "llm.yaml"
        config.write_text(yaml.safe_dump({"llm": {**llm_section(server.url), "timeout_seconds": 10}}))
        index(tmp_path / "ws", SAMPLE_CORPUS, "--config", config)
        questions = [json.loads(line)["question"] for line in (SAMPLE_CORPUS / "questions.jsonl").read_text().splitlines()]
        whole = 0
        with api.open_workspace(tmp_path / "ws") as llm_built:  # its question entities come from the server
            for question in questions:
                for budget in (300, 1000):
                    params = llm_built.search_settings(budget_tokens=budget)
                    first, second = llm_built.retrieve(question, params), llm_built.retrieve(question, params)
                    assert first.context_tokens <= budget
                    assert [(n.id, n.score) for n in first.nodes] == [(n.id, n.score) for n in second.nodes]
                    whole += any(n.type == "T" for n in first.nodes)
    assert whole


def test_question_words_count_by_how_rare_they_are_among_the_candidates():
    import pyarrow as pa

    texts = pa.array(["Maple Hollow: Average annual snowfall at the airfield is 7.4 inches.",
                      "Maple Hollow: Heavy snow fell on the town in 1916.",
                      "Maple Hollow: The town's market is held on Thursdays.",
                      "Snowfalls and averages: none of the words as whole terms.",
                      "Average Town: a subject prefix is not the node's own words.",
                      "The town's average snowfall is low."])
    words = context.QuestionWords("What is the average snowfall in the town?", texts)
    assert words.words == ["average", "snowfall", "town"]
    shares = words.shares(np.arange(5))
    # "town" is held by two of five candidates, "average" and "snowfall" by one each: rarer words weigh more
    assert shares[0] > shares[1] == shares[2] > 0
    assert shares[3] == 0 and shares[4] == 0
    assert np.isclose(words.shares(np.array([5]))[0], 1.0)  # every word ("town's" holds "town")
    scores = np.array([0.1, 0.2, 0.2, 0.3, 0.3])
    codes = np.array([S, S, S, S, H], np.int8)
    assert context.weigh_question_words(scores, np.arange(5), codes, words, 0.0) is scores
    assert context.weigh_question_words(scores, np.arange(5), codes, None, 1.5) is scores
    weighed = context.weigh_question_words(scores, np.arange(5), codes, words, 1.5)
    assert weighed[0] > scores[0] and weighed[3] == scores[3]
    # a summary is not weighed up by the words of the unit it restates: it would push the unit out
    summary = context.weigh_question_words(scores, np.arange(5), np.array([H, S, S, S, S], np.int8), words, 1.5)
    assert summary[0] == scores[0] and summary[1] > scores[1]
    assert context.QuestionWords("Who is it?", texts).shares(np.arange(5)).tolist() == [0.0] * 5  # no words: no change


@pytest.fixture(scope="module")
def snowfall(tmp_path_factory) -> api.Session:
    """A quartet's page names its town; the town's page has two sentences on heavy snow that are
    more like the question than the one that gives the average snowfall, and six other towns'
    pages each report a snow storm."""
    root = tmp_path_factory.mktemp("snowfall")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "linden_quartet.md").write_text(
        "# The Linden Quartet\n\nThe Linden Quartet is a string quartet formed in Maple Hollow in 1988. Its four "
        "players met at a summer school and have recorded the complete quartets of two composers.\n")
    (corpus / "maple_hollow.md").write_text(
        "# Maple Hollow\n\nMaple Hollow is a town in the hills above the river Tamm. Heavy snow in the town is rare: "
        "in the winter of 1916 a storm left the town under 29 inches of snow. Snow fell on the town again in December "
        "2008, a foot of it, and the town's schools closed for a week. The average snowfall in Maple Hollow, recorded by "
        "the volunteers of the rowing club at their boathouse since 1931, is 7.4 inches. The town's market is held on "
        "Thursdays.\n")
    for number, town in enumerate(["Brackwater", "Elmstead", "Corran", "Fallow Cross", "Dunmere", "Gilt"]):
        (corpus / f"town_{number}.md").write_text(
            f"# {town}\n\n{town} is a town on the coast. In the winter of {1950 + number}, a heavy snow event left "
            f"{10 + number} inches of snow on the ground in {town}, and schools were closed for a week. The {town} "
            "ferry runs twice a day.\n")
    api.index(root / "ws", corpus)
    with api.open_workspace(root / "ws") as opened:
        yield opened


def test_the_sentence_that_holds_the_questions_rarer_words_enters_the_context(snowfall):
    question = "What is the average snowfall in the town where the Linden Quartet was formed?"
    for budget in (100, 150):
        weighed = snowfall.retrieve(question, snowfall.search_settings(budget_tokens=budget))
        plain = snowfall.retrieve(question, snowfall.search_settings(budget_tokens=budget, question_words_weight=0.0))
        assert "7.4 inches" in weighed.context_text() and "7.4 inches" not in plain.context_text()
        assert weighed.context_tokens <= budget
    # the controls: what a question asks that the vectors found already stays in the context
    for control, answer in (("When was the Linden Quartet formed?", "1988"), ("What river is Maple Hollow above?", "Tamm"),
                            ("On which day is the market of Maple Hollow held?", "Thursdays")):
        for budget in (40, 100):
            for weight in (0.0, 1.5):
                params = snowfall.search_settings(budget_tokens=budget, question_words_weight=weight)
                assert answer in snowfall.retrieve(control, params).context_text()


def _offline_answer(question: str, sentences: list[tuple[str, str]]) -> extractive.Answer:
    """The offline answer over a hand-made context of units, with the bundled embeddings."""
    from noderag_cli.config import EmbeddingConfig
    from noderag_cli.embeddings import Embedder

    context = "\n".join(f"[S] {text} (from {source})" for text, source in sentences)
    return extractive.answer_parts(question, context, Embedder(EmbeddingConfig()).embed)


BANDS = [("The Larkspurs: The Larkspurs are a rock band from Leeds, formed in 1997.", "larkspurs.md"),
         ("The Larkspurs: Their albums of 2003 and 2004 sold 400,000 copies.", "larkspurs.md"),
         ("Copper Vale: Copper Vale is a rock band, formed in 2006 in Bristol by Ann Moss.", "copper.md"),
         ("Copper Vale: Copper Vale released one album, on which Ann Moss sings.", "copper.md"),
         ("Ann Moss: Ann Moss (born 1979) is a Welsh singer.", "moss.md")]


def test_a_choice_question_is_answered_by_one_of_its_two_things():
    """"Which came first, A or B?" asks for A or B, which the question itself names (other questions
    never answer with what they name): by the earliest year told of each, or by the sentences that
    hold the question's other words. A question with "or" inside is no choice (the control)."""
    assert extractive.choices("Which band was formed first, The Larkspurs or Copper Vale?") == ["The Larkspurs",
                                                                                              "Copper Vale"]
    assert extractive.choices("Which came first the forming of The Larkspurs or the birth of Ann Moss?") == [
        "The Larkspurs", "Ann Moss"]
    assert extractive.choices("Who directed the film that was shot in or around Leland in 1986?") == []
    first = _offline_answer("Which band was formed first, The Larkspurs or Copper Vale?", BANDS)
    assert first.short == "The Larkspurs" and "1997" in first.sentences[0][0]
    assert _offline_answer("Which band was formed last, The Larkspurs or Copper Vale?", BANDS).short == "Copper Vale"
    assert _offline_answer("Which band has a Welsh singer, Copper Vale or The Larkspurs?", BANDS).short == "Copper Vale"


def test_the_short_answer_is_a_name_as_fully_as_the_context_writes_it():
    """A name given in part (a surname when the question asks who, a name without its nickname) is
    completed from the sentence it comes from, then its passage, then the context; a longer name
    that goes on past it (a band named after the singer) is not taken for it, nor one word for a
    surname when the question asks for something else (the controls)."""
    texts = ["The study began with G. Stanley Hall's book of 1904.", "Hall was the first president of the society.",
             'Nicholas Lofton "Nick" Hexum (born 1970) is an American singer.', "He leads The Nick Hexum Quintet."]
    sources = ["a.md", "a.md", "b.md", "b.md"]
    assert extractive._full_name("Hall", 1, texts, sources, True) == "G. Stanley Hall"
    assert extractive._full_name("Hall", 1, texts, sources, False) == "Hall"
    assert extractive._full_name("Nick Hexum", 3, texts, sources, False) == 'Nicholas Lofton "Nick" Hexum'
    assert extractive._full_name("Ann Hexum", 3, texts, sources, False) == "Ann Hexum"  # no name holds its words
    assert extractive._full_name("1904", 0, texts, sources, True) == "1904"  # a value is left as it is
    answer = _offline_answer("Which singer is American, Ann Moss or Nick Hexum?",
                             [(texts[2], "b.md"), ("Ann Moss: Ann Moss (born 1979) is a Welsh singer.", "moss.md")])
    assert answer.short == 'Nicholas Lofton "Nick" Hexum'


def test_a_question_that_asks_who_is_not_answered_with_a_quoted_title():
    """The sentence that answers names the song (quoted) and its writer: "who" asks for the writer;
    asked for the song, the title answers (the control)."""
    sentences = [('"The Hukilau Song" is a song written by Jack Owens in 1948 after attending a luau in Laie.',
                  "song.md"), ("Laie: Laie is a place on the island of Oahu.", "laie.md")]
    assert _offline_answer("Who wrote a song after attending a luau in Laie?", sentences).short == "Jack Owens"
    assert _offline_answer("What song was written after attending a luau in Laie?", sentences).short == \
        "The Hukilau Song"


CHAIN = [("Greyling Medal: The Greyling Medal is given each spring by the Heron Society.", "medal.md"),
         ("Heron Society: The Heron Society was started by Mara Quill.", "heron.md"),
         ("Mara Quill: Mara Quill was born in Harlow Ferry, a village on the river.", "quill.md"),
         ("Linden Guild: The Linden Guild awards a medal to the founder of a society born in a village.", "linden.md"),
         ("Oak Circle: The Oak Circle awards a medal each year to a founder born in a village.", "oak.md")]


def test_the_sentences_after_the_short_answer_complete_its_chain(monkeypatch):
    """After the short answer's sentence, the answer prints the links that lead to it (the medal's
    society, the society's founder) rather than sentences more like the question that belong to no
    chain (the Linden Guild's); with the short answer's own weights it would print one of those. A
    one-link question prints the same either way (the control)."""
    question = "In which village was the founder of the society that awards the Greyling Medal born?"
    answer = _offline_answer(question, CHAIN)
    assert answer.short == "Harlow Ferry"
    assert [source for _, source in answer.sentences] == ["quill.md", "heron.md", "medal.md"]
    control = _offline_answer("Who started the Heron Society?", CHAIN)
    monkeypatch.setattr(extractive, "SUPPORT_WEIGHTS", (extractive.WORD_WEIGHT, extractive.TYPE_WEIGHT,
                                                        extractive.LINK_WEIGHT, extractive.LEVEL_WEIGHT))
    monkeypatch.setattr(extractive, "SUPPORT_LEVEL", extractive.MAX_LEVEL)
    assert "linden.md" in [source for _, source in _offline_answer(question, CHAIN).sentences]
    assert _offline_answer("Who started the Heron Society?", CHAIN) == control
    assert control.short == "Mara Quill" and control.sentences[0][1] == "heron.md"
