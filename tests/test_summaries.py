"""Summaries written in parts (issue 28, index/summaries.py): the same texts make the same tree,
and a text added to a large input re-asks one part per level, against the fault server."""

from __future__ import annotations

import random

import pytest

from devtools.fault_server import FaultServer
from noderag_cli import nlp
from noderag_cli.cache import Cache
from noderag_cli.config import LLMConfig
from noderag_cli.engines.base import AttributeInput, Failure
from noderag_cli.engines.llm import LiteLLMEngine
from noderag_cli.index import summaries

TEXTS = [f"Harbour record {i}: the ferry Alder{i} crossed to Vessmouth in {1850 + i}." for i in range(120)]


def _sets(texts, leaf_tokens=100, seed=7) -> set[frozenset[str]]:
    return {frozenset(texts[p] for p in leaf)
            for _, leaf in summaries.leaves(texts, nlp.count_tokens(texts), leaf_tokens, seed)}


def test_the_same_texts_make_the_same_leaves_in_any_order_and_one_more_text_moves_one_leaf():
    shuffled = TEXTS[:]
    random.Random(3).shuffle(shuffled)
    assert _sets(TEXTS) == _sets(shuffled)

    def requests(texts):
        return [[texts[p] for p in leaf] for _, leaf in summaries.leaves(texts, nlp.count_tokens(texts), 100, 7)]

    assert requests(TEXTS) == requests(shuffled)  # each leaf's texts in the same order: the same request
    count = len(_sets(TEXTS))
    assert count > 8 and count & (count - 1) == 0  # a power of two: it moves only when the input doubles
    grown = _sets(TEXTS + ["Harbour record extra: the ferry Birch crossed to Vessmouth in 1990."])
    assert len(_sets(TEXTS) - grown) == 1 and len(grown - _sets(TEXTS)) == 1
    assert summaries.leaves(TEXTS[:3], nlp.count_tokens(TEXTS[:3]), 1000, 7) == [(0, [0, 1, 2])]  # one request


@pytest.mark.llm
def test_a_text_added_to_a_large_input_re_asks_one_part_per_level(tmp_path):
    cache = Cache(tmp_path / "cache.sqlite")
    config = LLMConfig(engine="litellm", model="openai/fault-model", timeout_seconds=5.0, grounding=False)
    with FaultServer(default="good") as server:
        engine = LiteLLMEngine(config.model_copy(update={"api_base": server.url}), cache)

        def attribute(texts: list[str]) -> tuple[str, int]:
            levels = []

            def ask(requests):
                levels.append(len(requests))
                return engine.attributes([AttributeInput("Vessmouth", texts) for _, texts in requests])

            summary = summaries.in_parts([texts], [nlp.count_tokens(texts)], ask, lambda _, s: nlp.split_sentences(s), 100, 7, nlp.count_tokens)
            return summary[0], len(levels)

        first, levels = attribute(TEXTS)
        asked = len(server.completions())
        assert levels >= 3 and asked > len(_sets(TEXTS))  # every leaf, then the levels above them
        assert attribute(TEXTS) == (first, levels) and len(server.completions()) == asked  # all from the cache
        server.reset()
        _, grown_levels = attribute(TEXTS + ["Harbour record extra: the ferry Birch crossed to Vessmouth in 1990."])
        assert grown_levels == levels and len(server.completions()) == levels  # one per level: its leaf, then up
    cache.close()


def test_a_part_of_one_text_goes_up_unasked():
    """A leaf holding one text is not summarised (an engine may refuse so little, as the offline
    engine's community elements do); its text joins the level above."""
    texts = TEXTS[:6]
    asked: list[tuple[str, ...]] = []

    def ask(requests):
        asked.extend(texts for _, texts in requests)
        return [Failure("too small") if len(texts) < 2 else " ".join(texts) for _, texts in requests]

    leaves = summaries.leaves(texts, nlp.count_tokens(texts), 10, 7)
    assert any(len(leaf) == 1 for _, leaf in leaves) and len(leaves) > 1
    result = summaries.in_parts([texts], [nlp.count_tokens(texts)], ask, lambda _, s: nlp.split_sentences(s), 10, 7, nlp.count_tokens)[0]
    assert not isinstance(result, Failure) and all(len(request) > 1 for request in asked)
    assert set(nlp.split_sentences(result)) == set(texts)  # every text reached the top
