"""The litellm engine against real servers: our fault-injecting one and llama.cpp with a tiny model.

No mocking of litellm: every engine call goes through litellm's HTTP client to a server on
127.0.0.1. `devtools/fault_server.py` scripts failures per request; the llama.cpp tests
need `tests/llm_support/install_llm_server.sh` to have run (they skip without it, and fail
when the environment variable CI is set).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from devtools.fault_server import FaultServer, llm_section, max_in_window  # noqa: E402
from devtools.ports import free_port  # noqa: E402
from noderag_cli.cache import Cache  # noqa: E402
from noderag_cli.config import EmbeddingConfig, LLMConfig  # noqa: E402
from noderag_cli.engines import prompts  # noqa: E402
from noderag_cli.engines.base import AttributeInput, ChunkInput, CommunityInput, Element, Failure, Unit  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# litellm's own pydantic models warn on first use; the engine filters that, but pytest resets
# warning filters for every test and litellm builds those models lazily in a later one
pytestmark = pytest.mark.filterwarnings(r"ignore:Items? '.*' on TypedDict class:UserWarning")


def _need_litellm():
    # find_spec, not import: litellm must first be imported by the engine, which sets it up offline
    if importlib.util.find_spec("litellm") is None:
        message = "litellm is not installed (pip install -e '.[llm]')"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)


_need_litellm()
from noderag_cli.cache import LLM as CACHE_NS  # noqa: E402
from noderag_cli.embeddings import Embedder  # noqa: E402
from noderag_cli.engines.litellm_import import load_litellm  # noqa: E402
from noderag_cli.engines.llm import EngineError, LiteLLMEngine  # noqa: E402
from noderag_cli.engines.pricing import (  # noqa: E402
    count_tokens,
    estimate_cost,
    price_of,
    prompt_token_bound,
    prompt_tokens_for,
)

CHUNKS = [
    ChunkInput("c1", (
        "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. "
        "In 1903 she shared the Nobel Prize in Physics with Pierre Curie and Henri Becquerel. "
        "She later won the Nobel Prize in Chemistry in 1911 for discovering polonium and radium."
    ), "Marie Curie"),
    ChunkInput("c2", (
        "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris. "
        "It was designed by the engineering company of Gustave Eiffel and built between 1887 and 1889 "
        "as the entrance to the 1889 World's Fair."
    ), "Eiffel Tower"),
    ChunkInput("c3", (
        "The Danube is the second-longest river in Europe. It flows through Vienna, Bratislava, "
        "Budapest and Belgrade before it reaches the Black Sea in Romania."
    ), "Danube"),
]


@pytest.fixture
def cache(tmp_path):
    store = Cache(tmp_path / "cache.sqlite")
    yield store
    store.close()


@pytest.fixture
def server():
    with FaultServer() as srv:
        yield srv


def engine_for(srv: FaultServer, cache: Cache, window_seconds: float = 60.0, **settings) -> LiteLLMEngine:
    values = {**llm_section(srv.url), "timeout_seconds": 5.0,
              "retries": 3, "concurrency": 4, "max_output_tokens": 256, "context_window": 4096}
    values.update(settings)
    return LiteLLMEngine(LLMConfig(**values), cache, window_seconds=window_seconds, backoff_base=0.05, backoff_max=0.4)


def requests_for(srv: FaultServer, marker: str) -> list:
    return [r for r in srv.completions() if marker in json.dumps(r.body)]


def total(engine: LiteLLMEngine, field: str) -> float:
    return sum(getattr(s, field) for s in engine.stats.by_task.values())


# --------------------------------------------------------------------------- parsing (no server)
GOOD = {"units": [{"text": "Ada met Bob.", "entities": ["Ada", "Bob"],
                   "relations": [{"source": "Ada", "relation": "met", "target": "Bob"}]}]}


@pytest.mark.parametrize("reply", [
    json.dumps(GOOD),
    "Here you go:\n```json\n" + json.dumps(GOOD, indent=2) + "\n```\nAnything else?",
    "Sure. " + json.dumps(GOOD) + " I hope this helps {not json}.",
    repr(GOOD),  # single quotes, Python literal
    json.dumps(GOOD).replace("]}]}", "],}],}"),  # trailing commas
    json.dumps(GOOD["units"]),  # bare list for the one-field object
    '{"semantic_units": [{"text": "Ada met Bob.", "entities": "Ada, Bob", "relations": [["Ada", "met", "Bob"]]}]}',
])
def test_tolerant_parse_accepts_common_deviations(reply):
    units = prompts.result_of("decompose", prompts.parse_reply("decompose", reply))
    assert units == [Unit("Ada met Bob.", ("Ada", "Bob"), (("Ada", "met", "Bob"),))]


@pytest.mark.parametrize("reply, fragment", [
    (json.dumps(GOOD)[:40], "not complete JSON"),
    ('{"result": "nothing"}', "units"),
    ('{"units": []}', "units"),
    ("I cannot do that.", "no JSON"),
    ("", "empty"),
])
def test_unusable_replies_raise_reply_error_for_the_model(reply, fragment):
    with pytest.raises(prompts.ReplyError, match=fragment):
        prompts.parse_reply("decompose", reply)


def test_parse_details():
    # a truncated outer object never yields one of its inner fragments
    cut = '{"answer": {"type": "x", "text": "y"}, "more": ['
    with pytest.raises(prompts.ReplyError, match="not complete"):
        prompts.parse_reply("answer", cut)
    assert "cut off" in str(pytest.raises(prompts.ReplyError, prompts.parse_reply, "answer", cut, True).value)
    assert prompts.parse_reply("answer", "Paris is the capital.").answer == "Paris is the capital."
    assert prompts.parse_reply("query_entities", '["Ada", "ada", " Bob "]').entities == ["Ada", "Bob"]
    unit = prompts.to_units(prompts.parse_reply("decompose", json.dumps(
        {"units": [{"text": "A  met\nB.", "entities": [], "relations": [{"subject": "A", "predicate": "met", "object": "B"}]}]})))
    assert unit == [Unit("A met B.", ("A", "B"), (("A", "met", "B"),))]
    elements = prompts.result_of("community_elements", prompts.parse_reply(
        "community_elements", "{'elements': [{'keyword': 'Radioactivity research', 'summary': 'Curie led it.'}]}"))
    assert elements == [Element("Radioactivity research", "Curie led it.")]


def test_one_answer_prompt_and_strict_schemas():
    system = prompts.build_messages("answer", ("q", "ctx"))[0]["content"]
    assert "only the context" in system and "not enough" in system
    for task in prompts.TASKS:
        schema = prompts.json_schema_for(task)
        objects = [schema, *schema.get("$defs", {}).values()]
        for obj in objects:
            assert obj["additionalProperties"] is False
            assert obj["required"] == list(obj["properties"])


def test_engine_module_does_not_import_litellm():
    code = "import sys, noderag_cli.engines.llm, noderag_cli.engines.prompts; print('litellm' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_estimate_cost_and_prompt_tokens():
    counts = prompt_tokens_for("decompose", CHUNKS)
    assert len(counts) == 3 and all(c > 50 for c in counts)
    longer = prompt_tokens_for("decompose", [ChunkInput("x", CHUNKS[0].text * 3, "Marie Curie")])[0]
    assert longer > counts[0]
    assert prompt_tokens_for("answer", [("Who?", "Ada met Bob.")])[0] > 20
    plan = {"decompose": (100, 80_000, 30_000), "answer": (10, 60_000, 2_000)}
    priced = estimate_cost("gpt-4o-mini", plan)
    assert priced["price_known"] and priced["note"] == ""
    assert priced["tasks"]["decompose"]["cost_usd"] > 0
    assert priced["total"]["cost_usd"] == pytest.approx(sum(t["cost_usd"] for t in priced["tasks"].values()))
    assert priced["total"]["calls"] == 110 and priced["total"]["input_tokens"] == 140_000
    unknown = estimate_cost("openai/my-local-model", plan)
    assert not unknown["price_known"] and unknown["note"] == "unknown price"
    assert unknown["total"]["cost_usd"] is None and unknown["tasks"]["answer"]["cost_usd"] is None



def test_token_count_reuses_the_system_prompt_yet_equals_litellms_count():
    # count_tokens counts a task's system prompt once and adds the rest; litellm's own count of
    # the whole request must come out the same, for any routing and message shape the engine sends
    from noderag_cli.engines import prompts

    first = prompts.build_messages("decompose", CHUNKS[0])
    shapes = [
        first,
        prompts.build_messages("decompose", CHUNKS[1]),
        prompts.build_messages("answer", ("Who?", "Ada met Bob.")),
        [*first, {"role": "assistant", "content": '{"units": ['},
         {"role": "user", "content": prompts.correction_message("the reply is not complete JSON")}],
        first[1:],  # no system message
        [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Two system turns."},
         {"role": "user", "content": "Hi"}],
    ]
    lt = load_litellm()
    for model in ("openai/my-local-model", "gpt-4o-mini", "ollama_chat/qwen2.5:7b"):
        for messages in shapes:
            assert count_tokens(model, messages) == int(lt.token_counter(model=model, messages=messages))


def test_token_bound_is_never_below_litellms_count():
    # the engine sends max_tokens from this bound when it shows room for a full reply: it must not undercount
    from noderag_cli.engines import prompts

    texts = ["", "Ada met Bob.", "é漢字😀 “quoted” ß ع\u200b " * 40, "\n\t x1 " * 300, CHUNKS[0].text]
    for model in ("openai/my-local-model", "gpt-4o-mini", "ollama_chat/qwen2.5:7b", "anthropic/claude-3-5-sonnet-20240620"):
        for text in texts:
            for messages in (prompts.build_messages("decompose", ChunkInput("c", text, "T")),
                             prompts.build_messages("answer", (text, text)),
                             [*prompts.build_messages("query_entities", text), {"role": "assistant", "content": text},
                              {"role": "user", "content": prompts.correction_message("no JSON")}]):
                assert prompt_token_bound(model, messages) >= count_tokens(model, messages)


def test_request_keys_are_unchanged_digests_of_the_whole_request(tmp_path):
    # request_key assembles the JSON from cached parts; the keys of existing caches must not move
    from noderag_cli.files import json_digest

    cache = Cache(tmp_path / "c.sqlite")
    inputs = {"decompose": CHUNKS[0], "attributes": AttributeInput("Ada", ("Ada met “Bob”.", "漢字")),
              "community_elements": CommunityInput("k", ("a", "b")), "query_entities": "Who is Ada?",
              "answer": ("Who?", "Ada \\ met \"Bob\".")}
    for structured in (True, False):
        for temperature in (0.0, 0.3):
            engine = LiteLLMEngine(LLMConfig(engine="litellm", model="openai/m", temperature=temperature,
                                             structured_output=structured), cache)
            for task, item in inputs.items():
                messages = prompts.build_messages(task, item)
                whole = {"v": 1, "model": "openai/m", "messages": messages, "temperature": temperature,
                         "max_output_tokens": engine.config.max_output_tokens,
                         "response_format": prompts.response_format_for(task, "json_schema" if structured else "none")}
                assert engine.request_key(task, messages) == json_digest(whole)
    cache.close()


def test_price_lookups_are_remembered_but_unchanged():
    assert price_of("openai/my-local-model", 100, 10) is None
    assert price_of("openai/my-local-model", 200, 20) is None  # remembered as unpriced
    prompt_cost, completion_cost = load_litellm().cost_per_token(model="gpt-4o-mini", prompt_tokens=1234,
                                                             completion_tokens=56)
    assert price_of("gpt-4o-mini", 1234, 56) == pytest.approx(prompt_cost + completion_cost)
    assert price_of("gpt-4o-mini", 1234, 56) == price_of("gpt-4o-mini", 1234, 56)

# --------------------------------------------------------------------------- fault server
pytestmark_llm = pytest.mark.llm


@pytestmark_llm
def test_successes_are_cached_and_a_rerun_makes_no_request(server, cache):
    engine = engine_for(server, cache)
    seen = []
    items = [*CHUNKS, CHUNKS[0]]  # a duplicate rides along with its twin
    results = engine.decompose(items, progress=seen.append)
    assert sum(seen) == 4
    assert all(isinstance(r, list) and r and isinstance(r[0], Unit) for r in results)
    assert results[0] == results[3]
    stats = engine.stats.task("decompose")
    assert (stats.calls, stats.cache_hits, stats.failures) == (3, 1, 0)
    assert len(server.completions()) == 3
    assert stats.input_tokens == sum(r.usage["prompt_tokens"] for r in server.completions())
    assert stats.output_tokens == sum(r.usage["completion_tokens"] for r in server.completions())
    assert engine.price_known is False and stats.cost_usd == 0
    assert cache.count(CACHE_NS) == 3

    again = engine_for(server, cache)
    assert again.decompose(items) == results
    assert len(server.completions()) == 3  # the server saw nothing new
    assert (again.stats.task("decompose").calls, again.stats.task("decompose").cache_hits) == (0, 4)


@pytestmark_llm
def test_max_tokens_is_the_same_with_a_token_bound_or_an_exact_count(server, cache):
    # roomy context: the bound is enough; tight context or a token limit: the exact count decides
    from noderag_cli.engines import prompts

    exact = count_tokens("openai/fault-model", prompts.build_messages("decompose", CHUNKS[0]))
    tight = {"max_output_tokens": 4096 - exact + 50}  # context_window 4096: room for 4096 - exact tokens
    for settings, expected in (({}, 256), (tight, 4096 - exact), ({**tight, "tokens_per_minute": 10**6}, 4096 - exact)):
        server.reset()
        LiteLLMEngine(engine_for(server, cache).config.model_copy(update=settings), Cache(cache.path.with_name(
            f"c{len(settings)}.sqlite"))).decompose([CHUNKS[0]])
        assert [r.body["max_tokens"] for r in server.completions()] == [expected]


@pytestmark_llm
def test_429_with_retry_after_slows_but_succeeds_without_the_retry_budget(server, cache):
    server.script(["429:1", "429:1", "good"], marker="Marie Curie was")
    engine = engine_for(server, cache, retries=0)
    results = engine.decompose(CHUNKS)
    assert all(isinstance(r, list) for r in results), results
    mine = requests_for(server, "Marie Curie was")
    assert [r.status for r in mine] == [429, 429, 200]
    assert mine[1].at - mine[0].at >= 0.95 and mine[2].at - mine[1].at >= 0.95  # Retry-After honoured
    assert engine.stats.task("decompose").failures == 0


@pytestmark_llm
def test_500_is_retried_and_a_spent_budget_is_a_counted_failure(server, cache):
    server.script(["500", "500", "good"], marker="Marie Curie was")
    server.script(["500", "500", "500"], marker="Danube")
    engine = engine_for(server, cache, retries=2)
    first, second, third = engine.decompose(CHUNKS)
    assert isinstance(first, list) and isinstance(second, list)
    assert isinstance(third, Failure) and third.reason.startswith("server error 500")
    assert [r.status for r in requests_for(server, "Danube")] == [500, 500, 500]
    stats = engine.stats.task("decompose")
    assert stats.failures == 1 and stats.calls == 3 + 1 + 3
    assert engine.stats.failure_reasons["server error 500"] == 1
    assert cache.count(CACHE_NS) == 2  # the failure is not cached


@pytestmark_llm
def test_timeouts_are_retried(server, cache):
    server.script(["slow:2.5", "good"], marker="Eiffel")
    server.script(["slow:2.5", "slow:2.5"], marker="Danube")
    engine = engine_for(server, cache, timeout_seconds=1.0, retries=1)
    first, second, third = engine.decompose(CHUNKS)
    assert isinstance(first, list) and isinstance(second, list)
    assert isinstance(third, Failure) and third.reason.startswith("timeout")
    assert len(requests_for(server, "Eiffel")) == 2 and len(requests_for(server, "Danube")) == 2
    assert engine.stats.failure_reasons["timeout"] == 1


@pytestmark_llm
def test_bad_json_gets_one_corrective_retry_then_failure_which_a_rerun_retries(server, cache):
    server.script(["truncated", "wrong_shape"], marker="Marie Curie was")
    server.script(["wrong_shape", "good"], marker="Eiffel")
    engine = engine_for(server, cache)
    first, second, third = engine.decompose(CHUNKS)
    assert isinstance(first, Failure) and first.reason.startswith("invalid reply")
    assert "after one corrective retry" in first.reason
    assert isinstance(second, list) and isinstance(third, list)
    mine = requests_for(server, "Marie Curie was")
    assert len(mine) == 2
    correction = mine[1].body["messages"]
    assert len(correction) == 4 and correction[2]["role"] == "assistant"
    assert "not complete JSON" in correction[3]["content"]  # the model is told what was wrong
    assert len(requests_for(server, "Eiffel")) == 2
    assert engine.stats.task("decompose").failures == 1
    assert engine.stats.failure_reasons["invalid reply"] == 1
    assert cache.count(CACHE_NS) == 2

    before = len(server.completions())
    rerun = engine_for(server, cache)
    results = rerun.decompose(CHUNKS)
    assert all(isinstance(r, list) for r in results)
    assert results[1:] == [second, third]
    assert len(server.completions()) == before + 1  # only the failed item was asked again
    assert (rerun.stats.task("decompose").calls, rerun.stats.task("decompose").cache_hits) == (1, 2)


@pytestmark_llm
def test_a_reply_echoing_the_prompts_example_is_retried_then_a_counted_failure(server, cache):
    server.script(["echo", "echo"], marker="The Danube is")
    server.script(["echo", "good"], marker="Eiffel")
    server.script(["echo"], marker="Marie Curie was")  # it names Marie Curie, but not the example's sentence
    engine = engine_for(server, cache)
    curie, eiffel, danube = engine.decompose(CHUNKS)
    assert isinstance(danube, Failure) and "from the instructions' example" in danube.reason
    correction = requests_for(server, "The Danube is")[1].body["messages"][3]["content"]
    assert "repeats" in correction and "Marie Curie" in correction
    assert isinstance(eiffel, list) and not any("Curie" in " ".join(u.entities) for u in eiffel)
    assert len(requests_for(server, "Eiffel")) == 2
    assert isinstance(curie, list) and len(requests_for(server, "Marie Curie was")) == 2
    assert all(u.text != "Marie Curie won the Nobel Prize in Physics in 1903." for u in curie)
    assert engine.stats.task("decompose").failures == 1

    server.script(["echo", "echo"], marker="Statements:")
    elements = engine.community_elements([CommunityInput(0, ("The Danube flows through Vienna.",
                                                             "Vienna lies on the Danube."))])
    assert isinstance(elements[0], Failure)  # "keyword title" / "one to three sentences" never become nodes


@pytestmark_llm
def test_names_the_chunk_does_not_hold_are_dropped_and_counted(server, cache):
    from devtools.fault_server import FOREIGN_ENTITY

    server.default = "foreign"
    engine = engine_for(server, cache)
    results = engine.decompose(CHUNKS)
    for units in results:
        assert all(FOREIGN_ENTITY not in u.entities for u in units)
        assert all(FOREIGN_ENTITY not in (r[0], r[2]) for u in units for r in u.relations)
        assert units[0].entities  # what the chunk holds stays
    assert engine.stats.task("decompose").ungrounded == 2 * len(CHUNKS)  # the name and its relationship
    ungrounded = engine_for(server, cache, grounding=False)  # the rule can be turned off
    assert any(FOREIGN_ENTITY in units[0].entities for units in ungrounded.decompose(CHUNKS))


@pytestmark_llm
def test_an_attribute_is_grounded_in_its_entity_whatever_the_prompt_template(server, cache, tmp_path):
    """The entity an attribute summary must name is the item's own, not a line of the rendered user
    message: a user's template that opens with the statements grounds it the same as the built-in."""
    folder = tmp_path / "prompts"
    prompts.write_prompts(folder)
    system = prompts.SPECS["attributes"].system
    (folder / "attributes.txt").write_text(f"{system}\n{prompts.USER_MARKER}\n{{statements}}\n\n"
                                           "Write the summary of {entity}.\n")
    item = AttributeInput("Vienna", ("The Danube flows through Vienna.", "Vienna lies on the Danube."))
    own = engine_for(server, cache, prompts=str(folder))  # the good reply names the first name it reads: Danube
    assert own.attributes([item]) == [""] and own.stats.task("attributes").ungrounded == 1
    built_in = engine_for(server, cache)  # its message opens with "Entity: Vienna"
    assert built_in.attributes([item])[0].endswith("of Vienna.") and built_in.stats.task("attributes").ungrounded == 0


@pytestmark_llm
def test_grounding_drops_nothing_from_well_formed_rich_replies(server, cache):
    """The rule's cost on good extractions: every sentence of the sample corpus decomposed by the
    fault server's rich replies (a unit per sentence, its capitalised words as entities)."""
    from noderag_cli.config import ChunkConfig
    from noderag_cli.index.chunk import document_chunks
    from noderag_cli.index.scan import scan

    server.default = "rich"
    files = [f for f in scan(ROOT / "sample_corpus", ChunkConfig(extensions=[".txt", ".md"])) if not f.reason]
    chunks = [ChunkInput(c[2], c[0], entry.title) for entry in document_chunks(files, ChunkConfig()) for c in entry.chunks]
    engine = engine_for(server, cache, concurrency=8)
    results = engine.decompose(chunks)
    entities = sum(len(u.entities) for units in results for u in units)
    assert entities > 300 and engine.stats.task("decompose").failures == 0
    assert engine.stats.task("decompose").ungrounded == 0


@pytestmark_llm
def test_a_reply_cut_off_at_the_output_limit_is_asked_again_with_room_then_names_the_setting(server, cache):
    server.script(["cut_off", "good"], marker="Eiffel")
    server.script(["cut_off", "cut_off"], marker="The Danube is")
    engine = engine_for(server, cache)  # max_output_tokens 256
    _, eiffel, danube = engine.decompose(CHUNKS)
    assert isinstance(eiffel, list)
    assert [r.body["max_tokens"] for r in requests_for(server, "Eiffel")] == [256, 512]
    assert [r.body["max_tokens"] for r in requests_for(server, "The Danube is")] == [256, 512]
    assert isinstance(danube, Failure)
    assert "again at 512" in danube.reason and "llm.max_output_tokens to 1024" in danube.reason
    assert "llm.context_window to at least" in danube.reason

    server.script(["cut_off"], marker="Lisbon")  # no room left in the window: the setting, at once
    tight = engine_for(server, Cache(cache.path.with_name("tight.sqlite")), context_window=512,
                       max_output_tokens=4096)
    result = tight.decompose([ChunkInput("c4", "Lisbon lies on the Tagus.", "Lisbon")])[0]
    assert isinstance(result, Failure) and "the context window leaves" in result.reason
    assert len(requests_for(server, "Lisbon")) == 1


@pytestmark_llm
def test_loose_replies_are_accepted_without_a_correction(server, cache):
    server.script(["fenced"], marker="Marie Curie was")
    server.script(["python"], marker="Eiffel")
    server.script(["prose"], marker="the capital")
    engine = engine_for(server, cache)
    assert all(isinstance(r, list) for r in engine.decompose(CHUNKS[:2]))
    assert engine.answer("What is the capital?", "Paris is the capital.") == "I am sorry, I cannot help with that request."
    assert len(server.completions()) == 3


@pytestmark_llm
def test_structured_output_falls_back_when_the_server_refuses_it(cache):
    with FaultServer(default="refuse_schema") as srv:
        engine = engine_for(srv, cache, concurrency=1)
        results = engine.decompose(CHUNKS)
        assert all(isinstance(r, list) for r in results)
        formats = [r.body.get("response_format") for r in srv.completions()]
        assert formats[0]["type"] == "json_schema" and srv.completions()[0].status == 400
        assert all(f == {"type": "json_object", "schema": prompts.json_schema_for("decompose")} for f in formats[1:])
        assert len(formats) == 4 and engine.stats.task("decompose").failures == 0
    with FaultServer() as srv:
        engine = engine_for(srv, cache, structured_output=False)
        engine.attributes([AttributeInput("Ada", ("Ada met Bob.",))])
        assert "response_format" not in srv.completions()[0].body


@pytestmark_llm
def test_request_limit_holds_in_every_window(server, cache):
    window, limit = 1.0, 4
    engine = engine_for(server, cache, window_seconds=window, requests_per_minute=limit, concurrency=4)
    items = [AttributeInput(f"Entity{i}", (f"Entity{i} did thing {i}.",)) for i in range(12)]
    started = time.monotonic()
    results = engine.attributes(items)
    elapsed = time.monotonic() - started
    assert all(isinstance(r, str) for r in results)
    times = [r.at for r in server.completions()]
    assert len(times) == 12
    assert max_in_window(times, window) <= limit
    assert elapsed >= 2 * window  # 12 requests at 4 per window need at least three windows


@pytestmark_llm
def test_token_limit_holds_in_every_window(server, cache):
    window = 1.0
    engine = engine_for(server, cache, window_seconds=window, tokens_per_minute=400, max_output_tokens=64)
    items = [AttributeInput(f"Entity{i}", (f"Entity{i} did thing {i}.",)) for i in range(8)]
    assert all(isinstance(r, str) for r in engine.attributes(items))
    records = sorted(server.completions(), key=lambda r: r.at)
    for i, first in enumerate(records):
        in_window = [r for r in records[i:] if r.at - first.at < window]
        assert sum(r.usage["total_tokens"] for r in in_window) <= 400
    assert records[-1].at - records[0].at >= window  # the budget did spread the requests


@pytestmark_llm
def test_rate_limit_pause_holds_back_every_worker(server, cache):
    server.script(["429:1"], marker="Entity0 ")
    engine = engine_for(server, cache, concurrency=4)
    items = [AttributeInput(f"Entity{i}", (f"Entity{i} did thing {i}.",)) for i in range(8)]
    assert all(isinstance(r, str) for r in engine.attributes(items))
    records = sorted(server.completions(), key=lambda r: r.at)
    first_429 = next(r for r in records if r.status == 429)
    after = [r for r in records if r.at > first_429.at + 0.5]  # not the ones already on their way
    assert after and min(r.at for r in after) - first_429.at >= 0.95


@pytestmark_llm
def test_configuration_errors_are_one_line_and_come_before_any_call(server, cache, monkeypatch):
    monkeypatch.delenv("NODERAG_TEST_KEY", raising=False)
    engine = engine_for(server, cache, api_key_env="NODERAG_TEST_KEY")
    for attempt in (engine.check_connection, lambda: engine.decompose(CHUNKS)):
        with pytest.raises(EngineError) as err:
            attempt()
        assert "NODERAG_TEST_KEY" in str(err.value) and "\n" not in str(err.value)
    assert server.records == []

    monkeypatch.setenv("NODERAG_TEST_KEY", "sk-secret-value")
    engine_for(server, cache, api_key_env="NODERAG_TEST_KEY").check_connection()
    assert len(server.records) == 1

    server.script(["401", "401"])
    keyed = engine_for(server, cache, api_key_env="NODERAG_TEST_KEY")
    with pytest.raises(EngineError, match=r"rejected the API key from \$NODERAG_TEST_KEY") as err:
        keyed.check_connection()
    assert "sk-secret-value" not in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(EngineError, match="rejected the API key") as err:  # fatal for the batch, not per item
        keyed.attributes([AttributeInput("Ada", ("Ada met Bob.",))])
    assert "sk-secret-value" not in str(err.value)
    assert len(server.records) == 3

    unknown = engine_for(server, cache, model="no-such-provider-model-xyz")
    with pytest.raises(EngineError, match="cannot route model 'no-such-provider-model-xyz'") as err:
        unknown.check_connection()
    assert "\n" not in str(err.value) and len(server.records) == 3

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    unreachable = LiteLLMEngine(LLMConfig(engine="litellm", model="openai/fault-model", timeout_seconds=5,
                                          api_base=f"http://127.0.0.1:{closed_port}/v1"), cache)
    started = time.monotonic()
    with pytest.raises(EngineError, match=f"cannot reach the LLM server at http://127.0.0.1:{closed_port}") as err:
        unreachable.check_connection()
    assert "\n" not in str(err.value) and "sk-secret-value" not in str(err.value)
    assert time.monotonic() - started < 10


@pytestmark_llm
def test_search_time_tasks(server, cache):
    server.script(["wrong_shape", "wrong_shape"], marker="Why")
    server.script(["wrong_shape", "wrong_shape"], marker="Whom")
    engine = engine_for(server, cache)
    assert engine.query_entities("Where did Marie Curie meet Pierre?") == ["Marie", "Curie"]
    assert engine.query_entities("Whom?") == []  # no usable list: search goes on with vectors alone
    assert engine.stats.task("query_entities").failures == 1
    assert engine.answer("Who met?", "Ada met Bob.").startswith("Answer ")
    with pytest.raises(EngineError, match="no usable answer"):
        engine.answer("Why?", "Ada met Bob.")
    batch = engine.answer_batch([("Who met?", "Ada met Bob."), ("When?", "In 1903.")])
    assert batch[0] == engine.answer("Who met?", "Ada met Bob.")  # from the cache
    assert isinstance(batch[1], str)
    elements = engine.community_elements([CommunityInput(1, ("Ada met Bob.", "Bob met Cy."))])[0]
    assert isinstance(elements[0], Element) and elements[0].title.startswith("Theme")


@pytestmark_llm
def test_embeddings_are_normalised_and_cached(server, cache):
    """A model behind litellm, through the one transport: batches of `batch_size`, unit vectors
    cached by model and text, 429s waited out and counted, a dimension mismatch said in words."""
    config = EmbeddingConfig(backend="litellm", model="openai/fault-embed", dim=16, batch_size=2, api_base=server.url)
    texts = ["alpha beta", "gamma", "delta epsilon", "alpha beta"]
    embedder = Embedder(config, cache)
    vectors = embedder.embed(texts)
    assert vectors.shape == (4, 16) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)
    assert np.array_equal(vectors[0], vectors[3])
    calls = len(server.records)
    assert calls == 2  # three distinct texts in batches of two
    assert np.array_equal(Embedder(config, cache).embed(texts), vectors)  # from the cache
    assert len(server.records) == calls
    server.script(["429:1"])
    fresh = Embedder(config)
    assert fresh.embed(["zeta"]).shape == (1, 16) and server.records[-2].status == 429
    stats = fresh._transport.stats.task("embedding")
    assert stats.calls == 2 and stats.rate_limit_waits == 1
    with pytest.raises(EngineError, match="embedding.dim: 16"):
        Embedder(config.model_copy(update={"dim": 32})).embed(["eta"])


# --------------------------------------------------------------------------- llama.cpp with a tiny model
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"



@pytest.fixture(scope="session")
def llama_server(tmp_path_factory):
    """llama-cpp-python's OpenAI-compatible server on a free port, serving SmolLM2-135M."""
    model = Path(os.environ.get("NODERAG_LLM_MODEL", ROOT / ".venv" / "models" / MODEL_FILE))
    python = os.environ.get("NODERAG_LLM_PYTHON", sys.executable)
    problems = []
    if not model.is_file():
        problems.append(f"model {model} is missing")
    probe = subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        problems.append(f"llama-cpp-python[server] is not installed in {python}")
    if problems:
        message = "; ".join(problems) + " (run tests/llm_support/install_llm_server.sh PYTHON MODEL_DIR)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    port = free_port()
    log = tmp_path_factory.mktemp("llama") / "server.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [python, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
             "--n_ctx", "2048", "--n_threads", str(min(2, os.cpu_count() or 1)), "--verbose", "False"],
            stdout=out, stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if process.poll() is not None:
                pytest.fail(f"llama.cpp server exited with {process.returncode}: {log.read_text()[-800:]}")
            try:
                with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama.cpp server did not answer /v1/models within 120 s: {log.read_text()[-800:]}")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture
def proxy(llama_server):
    """A counting proxy in front of llama.cpp: records every request and the usage it reported."""
    with FaultServer(upstream=llama_server) as srv:
        yield srv


def tiny_engine(proxy: FaultServer, cache: Cache, **settings) -> LiteLLMEngine:
    values = {"engine": "litellm", "model": "openai/smollm2", "api_base": proxy.url, "timeout_seconds": 120.0,
              "retries": 1, "concurrency": 2, "max_output_tokens": 256, "context_window": 2048}
    values.update(settings)
    return LiteLLMEngine(LLMConfig(**values), cache, backoff_base=0.1, backoff_max=1.0)


def _check_items(results, kind_ok) -> int:
    failures = 0
    for result in results:
        if isinstance(result, Failure):
            assert result.reason.strip()
            failures += 1
        else:
            assert kind_ok(result), result
    return failures


def _units_ok(units) -> bool:
    return bool(units) and all(isinstance(u, Unit) and u.text and all(len(r) == 3 and all(r) for r in u.relations)
                               for u in units)


def _run_all_tasks(engine: LiteLLMEngine) -> tuple[list, int]:
    attribute_items = [
        AttributeInput("Marie Curie", ("Marie Curie shared the 1903 Nobel Prize in Physics with Pierre Curie.",
                                       "Marie Curie won the Nobel Prize in Chemistry in 1911.")),
        AttributeInput("Paris", ("The Eiffel Tower stands on the Champ de Mars in Paris.",
                                 "The 1889 World's Fair took place in Paris.")),
    ]
    community = [CommunityInput(0, ("Marie Curie won two Nobel Prizes.", "Pierre Curie worked with Marie Curie.",
                                    "Radium and polonium were discovered by Marie Curie."))]
    questions = ["Which prizes did Marie Curie win?", "Through which cities does the Danube flow?"]
    outputs = [
        engine.decompose(CHUNKS),
        engine.attributes(attribute_items),
        engine.community_elements(community),
        engine.query_entities_batch(questions),
        engine.answer_batch([(questions[0], CHUNKS[0].text), (questions[1], CHUNKS[1].text)]),
    ]
    failures = _check_items(outputs[0], _units_ok)
    failures += _check_items(outputs[1], lambda s: isinstance(s, str) and s.strip())
    failures += _check_items(outputs[2], lambda els: els and all(isinstance(e, Element) and e.title and e.description
                                                                 for e in els))
    failures += _check_items(outputs[3], lambda names: isinstance(names, list) and all(isinstance(n, str) and n
                                                                                      for n in names))
    failures += _check_items(outputs[4], lambda s: isinstance(s, str) and s.strip())
    return outputs, failures


@pytestmark_llm
def test_tiny_model_runs_every_task_and_a_rerun_is_all_cache_hits(proxy, cache):
    engine = tiny_engine(proxy, cache)
    engine.check_connection()
    outputs, failures = _run_all_tasks(engine)
    stats = engine.stats
    assert total(engine, "failures") == failures == sum(stats.failure_reasons.values())
    served = [r for r in proxy.completions() if r.status == 200]
    assert served, "the server answered nothing"
    assert total(engine, "input_tokens") == sum(r.usage["prompt_tokens"] for r in served)
    assert total(engine, "output_tokens") == sum(r.usage["completion_tokens"] for r in served)
    assert total(engine, "calls") + total(engine, "connection_checks") == len(proxy.completions())  # all counted
    assert engine.price_known is False and total(engine, "cost_usd") == 0

    requests_before = len(proxy.completions())
    again = tiny_engine(proxy, cache)
    outputs_again, failures_again = _run_all_tasks(again)
    if failures == 0:
        assert len(proxy.completions()) == requests_before  # the server saw no new request
        assert total(again, "calls") == 0
        assert outputs_again == outputs
        assert total(again, "cache_hits") == 3 + 2 + 1 + 2 + 2
    else:  # only failed items are asked again; every success came from the cache
        assert total(again, "cache_hits") == 10 - failures
        assert len(proxy.completions()) - requests_before == total(again, "calls") <= 2 * failures * 2


@pytestmark_llm
def test_tiny_model_without_structured_output(proxy, cache):
    """Free-form replies from a 135M model: often wrong, never stored as content when unusable."""
    engine = tiny_engine(proxy, cache, structured_output=False, max_output_tokens=192)
    units = engine.decompose(CHUNKS[:2])
    names = engine.query_entities_batch(["Who designed the Eiffel Tower?", "When did Marie Curie win?"])
    failures = _check_items(units, _units_ok) + _check_items(names, lambda n: isinstance(n, list))
    assert total(engine, "failures") == failures
    assert all("response_format" not in r.body for r in proxy.completions())
    served = [r for r in proxy.completions() if r.status == 200]
    assert total(engine, "input_tokens") == sum(r.usage["prompt_tokens"] for r in served)
    assert total(engine, "output_tokens") == sum(r.usage["completion_tokens"] for r in served)
    assert cache.count(CACHE_NS) == 4 - failures
