"""`noderag query` on the indexed sample corpus: retrieval, budgets, JSON shape, batch mode, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import assert_one_line_error, noderag

from noderag_cli import api
from noderag_cli.config import load_config
from noderag_cli.graph import entity_id

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "sample_corpus"
QUESTIONS = [json.loads(line) for line in (CORPUS / "questions.jsonl").read_text().splitlines() if line.strip()]



@pytest.fixture(scope="module")
def workspace(built) -> Path:
    """The session's sample_corpus build (conftest.built); search and ablate only read it."""
    return built


@pytest.fixture(scope="module")
def session(workspace):
    return api.open_workspace(workspace)


def test_questions_retrieve_their_supporting_documents(session):
    recalls = []
    for item in QUESTIONS:
        result = session.retrieve(item["question"])
        reached = {d for node in result.nodes if node.type in "TSAR" for d in node.documents}
        gold = item["supporting_documents"]
        recalls.append(sum(d in reached for d in gold) / len(gold))
        assert any(d in reached for d in gold), item["question"]
    assert sum(recalls) / len(recalls) >= 0.8


def test_entry_points_contain_the_exact_match_entities(session):
    result = session.retrieve("Which ship did the person after whom the Greyling Medal is named command?")
    assert entity_id("Greyling Medal") in result.entry_points["exact"]
    assert "Greyling Medal" in result.query_entities
    assert result.entry_points["vector"], "vector entry points expected"


@pytest.mark.parametrize("budget", [50, 200, 1000, 4000])
def test_context_never_exceeds_the_budget_and_never_shows_names(session, budget):
    params = session.retriever.config.search.model_copy(update={"budget_tokens": budget})
    for item in QUESTIONS[:8]:
        result = session.retrieve(item["question"], params)
        assert result.context_tokens <= budget
        assert all(node.type in ("T", "S", "A", "H", "R") for node in result.nodes)
        assert len({node.id for node in result.nodes}) == len(result.nodes)


def test_no_sentence_appears_twice_in_the_context(session):
    from noderag_cli.search.context import sentence_keys

    for budget in (1000, 4000):
        params = session.retriever.config.search.model_copy(update={"budget_tokens": budget})
        for item in QUESTIONS:
            seen: set[str] = set()
            for node in session.retrieve(item["question"], params).nodes:
                keys = sentence_keys(node.text)
                assert seen.isdisjoint(keys), (item["question"], node.id)
                seen |= keys


def test_similarity_weight_is_a_per_call_setting_of_the_walk(session):
    """Walking the similarity edges (the paper's weight 1) reaches other nodes than the structural
    walk (the default, 0), with the same workspace opened once."""
    retriever = session.retriever
    assert retriever.config.search.similarity_weight == 0.0
    paper = retriever.config.search.model_copy(update={"similarity_weight": 1.0})
    differs = 0
    for item in QUESTIONS:
        default = [n.id for n in session.retrieve(item["question"]).nodes]
        walked = [n.id for n in session.retrieve(item["question"], paper).nodes]
        differs += default != walked
    assert differs
    assert len(retriever.build.walk_matrix(0.0).indices) < len(retriever.build.walk_matrix(1.0).indices)


def test_cross_nodes_are_the_best_of_everything_the_walk_reached(session):
    """walk_similarity ranks every retrievable node of the support: the cross nodes of each type are
    its quota best by sqrt(walk) x similarity, computed here the long way with full dot products."""
    import numpy as np

    from noderag_cli.node_types import TYPE_CODE
    from noderag_cli.search.ppr import shallow_ppr, uniform_start

    r = session.retriever
    params = r.config.search
    for item in QUESTIONS:
        query = r.embed_question(item["question"])
        exact, vector, _, _ = r.entry_points(item["question"], params, query)
        entries = np.union1d(exact, vector).astype(np.int64)
        support, mass = shallow_ppr(r.build.walk_matrix(params.similarity_weight), entries, params.ppr_alpha,
                                    params.ppr_iterations)
        rows, scores = r.select(support, mass, entries, uniform_start(entries), params, query)
        walk = dict(zip(support.tolist(), mass.tolist(), strict=True))
        for e in entries.tolist():
            walk[e] = max(walk[e] - params.ppr_alpha / len(entries), 0.0)
        candidates = [n for n in support.tolist() if r.build.types[n] in "TSAHR"]
        embedded = [n for n in candidates if r.build.vector_side.vector_of_node[n] >= 0]
        cosine = {n: max(float(r.build.vector_side.vectors[r.build.vector_side.vector_of_node[n]] @ query), 0.0) for n in embedded}
        mean = sum(cosine.values()) / len(cosine)
        score = {n: np.sqrt(walk[n]) * cosine.get(n, mean * 0.5) * (params.chunk_weight if r.build.types[n] == "T" else 1)
                 for n in candidates}
        got = dict(zip(rows.tolist(), scores.tolist(), strict=True))
        for node_type, quota in params.quotas().items():
            ranked = sorted((n for n in candidates if r.build.types[n] == node_type and n not in entries and score[n] > 0),
                            key=lambda n: (-score[n], n))
            assert set(ranked[:quota]) <= set(got), node_type
            for n in ranked[:quota]:
                # the search's cosines are float32 dot products: off by up to ~1e-6 in absolute terms,
                # which is more than 1e-5 relative for a node almost orthogonal to the question
                assert got[n] == pytest.approx(score[n], rel=1e-5, abs=np.sqrt(walk[n]) * 2e-6), (n, cosine.get(n))
        assert all(r.build.type_codes[n] <= TYPE_CODE["R"] for n in got)


def test_a_questions_cosines_are_computed_once_with_the_same_bits(session):
    """The second round reuses the first round's cosines (search/vectors.QuestionCosines): each
    call gives exactly what computing every row again gives, overlapping, in any order, any number
    of calls."""
    import numpy as np

    from noderag_cli.search.vectors import QuestionCosines

    side = session.retriever.build.vector_side
    query = session.retriever.embed_question(QUESTIONS[0]["question"])
    rng = np.random.default_rng(3)
    n = len(side.vector_of_node[side.vector_of_node >= 0])
    memo = QuestionCosines(side, query)
    for size in (n // 3, n // 2, n // 4):
        rows = np.sort(rng.choice(n, size, replace=False))
        assert np.array_equal(memo(rows), side.cosines(query, rows))
        shuffled = rng.permutation(rows)
        assert np.array_equal(memo(shuffled), side.cosines(query, shuffled))
    assert np.array_equal(memo(np.zeros(0, np.int64)), np.zeros(0, np.float32))


def test_context_is_deterministic_and_grouped_by_type(session):
    first = session.retrieve(QUESTIONS[0]["question"]).as_dict()
    second = session.retrieve(QUESTIONS[0]["question"]).as_dict()
    first.pop("timings"), second.pop("timings")
    assert first == second
    order = "HASRT"
    ranks = [order.index(node["type"]) for node in first["nodes"]]
    assert ranks == sorted(ranks)


def _check_shape(payload: dict) -> None:
    assert set(payload) >= {"question", "answer", "context_tokens", "nodes", "entry_points", "timings"}
    assert isinstance(payload["context_tokens"], int)
    assert set(payload["entry_points"]) == {"exact", "vector", "bridge"}
    assert isinstance(payload["timings"]["retrieval_ms"], float | int)
    for node in payload["nodes"]:
        assert set(node) >= {"id", "type", "score", "text", "documents"}
        assert node["type"] in "TSAHR" and isinstance(node["documents"], list)
        assert all(isinstance(d, str) and (CORPUS / d).is_file() for d in node["documents"])


def test_json_output_has_the_documented_shape(workspace):
    run = noderag("query", str(workspace), QUESTIONS[1]["question"], "--json", "--budget", "800")
    assert run.returncode == 0, run.stderr
    payload = json.loads(run.stdout)
    _check_shape(payload)
    assert payload["answer"].startswith("[offline extractive answer]")
    assert payload["context_tokens"] <= 800


def test_context_only_skips_the_answer(workspace):
    run = noderag("query", str(workspace), QUESTIONS[2]["question"], "--json", "--context-only")
    payload = json.loads(run.stdout)
    assert payload["answer"] is None and payload["nodes"]


def test_batch_mode_matches_one_by_one(workspace, tmp_path):
    batch = tmp_path / "q.jsonl"
    batch.write_text("\n".join(json.dumps({"question": q["question"], "id": i}) for i, q in enumerate(QUESTIONS[:4])))
    run = noderag("query", str(workspace), "--questions", str(batch), "--context-only", "--budget", "600")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert [line["question"] for line in lines] == [q["question"] for q in QUESTIONS[:4]]
    for line, item in zip(lines, QUESTIONS[:4], strict=True):
        single = json.loads(noderag("query", str(workspace), item["question"], "--json", "--context-only",
                                    "--budget", "600").stdout)
        assert [n["id"] for n in line["nodes"]] == [n["id"] for n in single["nodes"]]
        _check_shape(line)


def test_a_question_that_matches_nothing_gives_an_empty_result(workspace):
    run = noderag("query", str(workspace), "xqzv blorf wibble", "--json", "--context-only")
    assert run.returncode == 0
    payload = json.loads(run.stdout)
    assert payload["nodes"] == [] and payload["context_tokens"] == 0


@pytest.mark.parametrize("question, message", [("", "empty"), ("   ", "empty"), ("why " * 25_000, "limit")])
def test_bad_questions_get_one_line_errors(workspace, question, message):
    run = noderag("query", str(workspace), question)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_never_indexed_or_half_indexed_workspaces_are_refused(tmp_path):
    run = noderag("query", str(tmp_path / "nothing"), "Who founded Vessmouth?")
    assert run.returncode == 3 and "not found" in run.stderr and "Traceback" not in run.stderr
    half = tmp_path / "half"
    api.index(half, CORPUS, stop_after="decompose")
    run = noderag("query", str(half), "Who founded Vessmouth?")
    assert run.returncode == 3 and "did not finish" in run.stderr and "Traceback" not in run.stderr


def test_a_different_embedding_model_is_refused(workspace, tmp_path):
    config = tmp_path / "other.yaml"
    config.write_text(yaml.safe_dump({"embedding": {"dim": 64}}))
    run = noderag("query", str(workspace), "Who founded Vessmouth?", "--config", str(config))
    assert run.returncode == 3
    assert_one_line_error(run, "wordllama:l2_supercat:256", "wordllama:l2_supercat:64")  # the same words as `index`


def test_missing_question_file_and_malformed_lines(workspace, tmp_path):
    run = noderag("query", str(workspace), "--questions", str(tmp_path / "none.jsonl"))
    assert run.returncode == 2 and "not found" in run.stderr
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"question": "Who founded Vessmouth?"}\nnot json\n{"nope": 1}\n')
    run = noderag("query", str(workspace), "--questions", str(mixed), "--context-only")
    assert run.returncode == 1
    assert [json.loads(line).get("error") is None for line in run.stdout.splitlines()] == [True, False, False]
    assert "line 2:" in run.stderr and "line 3:" in run.stderr


@pytest.mark.parametrize("content", ["", "\n\n", 'not json\n{"question": "  "}\n'])
def test_a_question_file_without_a_usable_question_is_refused(workspace, tmp_path, content):
    path = tmp_path / "questions.jsonl"
    path.write_text(content)
    run = noderag("query", str(workspace), "--questions", str(path))
    assert run.returncode == 2 and "no usable question" in run.stderr and "Traceback" not in run.stderr
    assert json.loads(run.stdout)["exit_code"] == 2  # --questions output is JSON lines, errors included


def test_a_search_only_config_keeps_the_workspace_embedding(tmp_path):
    ws = tmp_path / "ws"
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({"embedding": {"batch_size": 64}}))
    api.index(ws, CORPUS, config=load_config(config))
    search_only = tmp_path / "search.yaml"
    search_only.write_text(yaml.safe_dump({"search": {"budget_tokens": 300}}))
    run = noderag("query", str(ws), "Who founded Vessmouth?", "--json", "--context-only", "--config", str(search_only))
    assert run.returncode == 0, run.stderr
    assert 0 < json.loads(run.stdout)["context_tokens"] <= 300


@pytest.mark.parametrize("value", [-1, "abc", "1e400", ".nan"])
def test_a_search_weight_that_is_no_finite_number_at_or_above_zero_is_a_one_line_error(workspace, tmp_path, value):
    config = tmp_path / "weights.yaml"
    config.write_text(f"search: {{question_words_weight: {value}}}\n")
    run = noderag("query", str(workspace), "Who founded Vessmouth?", "--config", str(config))
    assert run.returncode == 2 and "search.question_words_weight" in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_an_embedding_model_that_is_not_bundled_is_a_one_line_error(tmp_path):
    config = tmp_path / "dim64.yaml"
    config.write_text(yaml.safe_dump({"embedding": {"dim": 64}}))
    run = noderag("index", str(tmp_path / "ws"), "--input", str(CORPUS), "--config", str(config))
    assert run.returncode == 2 and "not bundled" in run.stderr and "Traceback" not in run.stderr


def test_compiled_and_numpy_search_agree_to_the_bit(session, workspace):
    """The vector side's kernels (compiled, the API's default) and numpy (one-shot CLI questions)
    give the same nodes, scores and order, for the default search and the paper's variants."""
    plain = api.open_workspace(workspace, compiled=False)
    assert plain.retriever.build.vector_side.kernels is None and session.retriever.build.vector_side.kernels is not None
    base = session.retriever.config.search
    settings = [{}, {"budget_tokens": 300}, {"similarity_weight": 1.0}, {"ppr_iterations": 1}, {"cross_s": 3, "cross_r": 0},
                {"rank": "ppr"}, {"ppr_variant": "lazy"}, {"use_exact": False}, {"second_round_chunks": 0},
                {"second_round_chunks": 3, "budget_tokens": 500}, {"exact_share": None}, {"document_diversity": 1.0}]
    for update in settings:
        params = base.model_copy(update=update)
        for item in QUESTIONS:
            fast, slow = session.retrieve(item["question"], params), plain.retrieve(item["question"], params)
            assert [(n.id, n.score) for n in fast.nodes] == [(n.id, n.score) for n in slow.nodes], (update, item)


def test_the_int8_scan_finds_the_exact_top_k(session, monkeypatch):
    import numpy as np

    from noderag_cli.search import vectors as vectors_module
    from noderag_cli.search.retriever import SCANNED

    r = session.retriever
    rng = np.random.default_rng(2)
    queries = [r.embed_question(item["question"]) for item in QUESTIONS]
    queries += [q / np.linalg.norm(q) for q in rng.normal(size=(20, r.build.vector_side.vectors.shape[1])).astype(np.float32)]
    for k in (1, 5, 10, 40):
        for query in queries:
            rows, scores = r.build.vector_side.search(query, k, SCANNED)
            flat_rows, flat_scores = r.build.vector_side.search(query, k, SCANNED, r.build.vector_side.similarities(query))
            assert rows.tolist() == flat_rows.tolist() and np.array_equal(scores, flat_scores)
    # with too few candidates to prove the answer, the exact scan takes over: same result
    monkeypatch.setattr(vectors_module, "SCAN8_CANDIDATES", 0)
    proved = 0
    for query in queries:
        proved += r.build.vector_side._scan8_top(query, 10) is not None
        assert r.build.vector_side.search(query, 10, SCANNED)[0].tolist() == \
            r.build.vector_side.search(query, 10, SCANNED, r.build.vector_side.similarities(query))[0].tolist()
    assert proved < len(queries)
