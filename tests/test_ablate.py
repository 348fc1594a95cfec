"""`noderag ablate`: every variant and baseline on the indexed sample corpus, the metrics on
hand-checked cases, the output files, determinism, the LLM judge (with a fake engine) and bad input."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import build_file, noderag

from noderag_cli import api
from noderag_cli.engines.base import Engine
from noderag_cli.evaluate import ablate, baselines
from noderag_cli.evaluate.ablate import STRATEGIES
from noderag_cli.evaluate.baselines import Setup, StrategySkipped
from noderag_cli.evaluate.metrics import answer_contained, support_recall
from noderag_cli.evaluate.run import evaluate
from noderag_cli.evaluate.variants import _search, iterations_to_converge
from noderag_cli.questions import Question, read_jsonl
from noderag_cli.search.results import Retrieval, RetrievedNode

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "sample_corpus"
QUESTIONS_FILE = CORPUS / "questions.jsonl"
FAST = "noderag,ppr-converge,no-hnsw,naive,lightrag-hybrid,graphrag-local,hipporag"



@pytest.fixture(scope="module")
def workspace(built) -> Path:
    """The session's sample_corpus build (conftest.built); search and ablate only read it."""
    return built


@pytest.fixture(scope="module")
def setup(workspace) -> Setup:
    return Setup(api.open_workspace(workspace).retriever, workspace)


@pytest.fixture(scope="module")
def questions() -> list[Question]:
    items, problems = read_jsonl(QUESTIONS_FILE)
    assert not problems
    return items


# --------------------------------------------------------------------------- strategies
def _stored_reports(workspace: Path) -> dict[str, tuple[str, int]]:
    """Every community report the seed systems keep in the workspace, by the id a context gives it."""
    found = {}
    for path in sorted((workspace / "evaluation").glob("*.parquet")):
        letter = "L" if path.name.startswith("archrag") else "C"
        table = pq.read_table(path, columns=["level", "text", "tokens"]).to_pylist()
        found |= {f"H_{letter}{row['level']}-{r:06d}": (row["text"], row["tokens"]) for r, row in enumerate(table)}
    return found


@pytest.mark.parametrize("name", [n for n in STRATEGIES if n != "hyde"])
def test_every_strategy_returns_well_formed_results_within_budget(setup, questions, name):
    strategy = STRATEGIES[name].build(setup)
    retriever = setup.retriever
    paths = set(retriever.build.document_names.to_pylist())
    reports = _stored_reports(setup.workspace)
    reached = 0
    for budget in (150, 1200):
        for item in questions[:6]:
            result = strategy(item.question, budget)
            assert isinstance(result, Retrieval)
            assert result.context_tokens <= budget
            assert result.timings["retrieval_ms"] > 0
            ids = [node.id for node in result.nodes]
            assert len(ids) == len(set(ids))
            for node in result.nodes:
                assert node.type in "TSAHR" and node.id[0] == node.type
                if node.id in reports:  # a seed system's community report, as the workspace keeps it
                    assert (node.text, node.tokens) == reports[node.id]
                else:
                    assert node.tokens == int(retriever.build.tokens[retriever.build.graph.index_of[node.id]])
                assert node.documents and set(node.documents) <= paths
            reached += bool(result.nodes) and budget > 1000  # sample chunks may not fit in 150 tokens
    assert reached >= 4, f"{name} found nothing for most questions"


def test_hyde_is_skipped_offline_and_searches_chunks_with_an_engine_passage(setup, questions, monkeypatch):
    with pytest.raises(StrategySkipped, match="LLM engine"):
        STRATEGIES["hyde"].build(setup)
    monkeypatch.setattr(Setup, "offline", property(lambda self: False))
    monkeypatch.setattr(baselines, "hypothetical_passage", lambda setup, question: "Harlow Ferry is a village.")
    result = STRATEGIES["hyde"].build(setup)(questions[0].question, 600)
    assert result.nodes and {n.type for n in result.nodes} == {"T"} and result.context_tokens <= 600


def test_variants_change_what_they_say(setup, questions):
    """ppr-converge equals a walk far past convergence; no-exact has no exact entry points;
    ppr-3 is the default."""
    assert iterations_to_converge(0.5, "paper") == 28
    converge, deep = STRATEGIES["ppr-converge"].build(setup), _search(setup.retriever, ppr_iterations=80)
    default, ppr3 = STRATEGIES["noderag"].build(setup), STRATEGIES["ppr-3"].build(setup)
    no_exact = STRATEGIES["no-exact"].build(setup)
    differs = 0
    for item in questions[:8]:
        assert [n.id for n in converge(item.question, 800).nodes] == [n.id for n in deep(item.question, 800).nodes]
        assert [n.id for n in default(item.question, 800).nodes] == [n.id for n in ppr3(item.question, 800).nodes]
        assert no_exact(item.question, 800).entry_points["exact"] == []
        differs += [n.id for n in converge(item.question, 800).nodes] != [n.id for n in default(item.question, 800).nodes]
    assert differs, "deep PPR should change some contexts"


def test_similarity_weight_zero_walks_the_graph_without_similarity_edges(workspace, setup):
    """Weight 0 (no-hnsw, the default) walks exactly the graph without the rows of kind "similarity" and
    without the +1 they gave structural pairs; weight 1 (the paper) walks the whole stored graph."""
    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.parquet as pq
    from test_search_parts import transition

    from noderag_cli.graph import Graph

    retriever = setup.retriever
    edges = pq.read_table(build_file(workspace, "edges.parquet"))
    nodes = pa.table({"id": pa.array(retriever.build.ids.tolist()), "type": pa.array(retriever.build.types.tolist())})
    structural = edges.filter(pc.not_equal(edges["kind"], "similarity"))
    weight = pc.subtract(structural["weight"], structural["hnsw"].cast(pa.float32()))
    structural = structural.set_column(structural.schema.get_field_index("weight"), "weight", weight)
    structural = structural.filter(pc.greater(structural["weight"], 0))
    assert edges.num_rows > structural.num_rows  # the sample graph has similarity edges
    without = transition(Graph.from_tables(nodes, structural).adjacency)
    assert abs(retriever.build.walk_matrix(0.0).as_csr() - without).max() == 0
    assert abs(retriever.build.walk_matrix(1.0).as_csr() - transition(retriever.build.graph.adjacency)).max() < 1e-15
    assert retriever.build.walk_matrix(1.0) is retriever.build.walk_matrix(1.0)  # built once per weight
    no_hnsw, default = STRATEGIES["no-hnsw"].build(setup), STRATEGIES["noderag"].build(setup)
    with_hnsw = _search(retriever, similarity_weight=1.0)
    question = "Which company built the steamer that rescued 41 sailors during the Great Storm of 1871?"
    assert [n.id for n in no_hnsw(question, 800).nodes] == [n.id for n in default(question, 800).nodes]
    assert with_hnsw(question, 800).nodes and np.isfinite([n.score for n in with_hnsw(question, 800).nodes]).all()


# --------------------------------------------------------------------------- metrics on hand-checked cases
def _node(kind: str, text: str, documents: list[str]) -> RetrievedNode:
    return RetrievedNode(f"{kind}_x{len(text)}", kind, 1.0, text, documents, len(text.split()))


def test_metrics_on_hand_checked_cases():
    assert answer_contained("[T] He was born in Harlow Ferry in 1802.", ["Harlow Ferry"])
    assert answer_contained("born in HARLOW   ferry", ["harlow ferry"])  # case and whitespace
    assert answer_contained("the Gannet Queen sailed", ["SS Gannet Queen", "Gannet Queen"])  # an alias
    assert not answer_contained("born in Kestle Cove", ["Harlow Ferry"])
    assert not answer_contained("anything at all", ["", "  "])  # an empty alias matches nothing
    retrieval = Retrieval("q", nodes=[_node("T", "a chunk", ["a.md"]), _node("S", "a unit", ["b.md"]),
                                      _node("H", "a summary", ["c.md"])])
    assert support_recall(retrieval, ["a.md", "c.md"]) == 0.5  # H summarises a community: not support
    assert support_recall(retrieval, ["a.md", "b.md"]) == 1.0
    assert support_recall(retrieval, []) is None

    contexts = {"q1": "Harlow Ferry", "q2": "nothing here", "q3": "yes it is"}
    timings = {"q1": 1.0, "q2": 3.0, "q3": 2.0}

    def strategy(question, budget):
        result = Retrieval(question, nodes=[_node("T", contexts[question], ["a.md"])])
        result.timings["retrieval_ms"] = timings[question]
        return result

    items = [Question("q1", ["harlow ferry"], ["a.md"]), Question("q2", ["Kestle Cove"], ["a.md", "b.md"]),
             Question("q3", ["yes"], [])]
    row = evaluate({"s": strategy}, items, [100])[0]
    assert row["answer_containment"] == 0.5  # the yes/no question is left out
    assert row["support_recall"] == 0.75
    assert row["mean_context_tokens"] == pytest.approx((2 + 2 + 3) / 3, abs=0.1)
    assert row["latency_median_ms"] == 2.0 and row["latency_p95_ms"] == pytest.approx(2.9)


# --------------------------------------------------------------------------- the LLM judge
class FakeEngine(Engine):
    """Answers with the context's first line; judges by looking for the gold answer. (A stand-in for
    an LLM that answers and judges; the rest of the engine interface keeps its defaults.)"""

    def __init__(self):
        self.calls = []

    def answer(self, question, context):
        self.calls.append(question)
        if question == ablate.JUDGE_INSTRUCTION:
            gold = context.split("Gold answer: ")[1].split("\n")[0].split(" | ")
            candidate = context.split("Candidate answer: ")[1]
            return "Correct." if any(g.lower() in candidate.lower() for g in gold) else "incorrect"
        return context.splitlines()[0] if context else "The context is not enough."


def test_judge_answers_with_the_shared_prompt_and_scores_against_gold():
    engine = FakeEngine()
    items = [Question("Where?", ["Harlow Ferry"]), Question("Which ship?", ["SS Gannet Queen", "Gannet Queen"]),
             Question("Who?", ["Wenna Caddick"])]
    retrievals = [Retrieval("Where?", nodes=[_node("S", "Born in Harlow Ferry.", ["a"])]),
                  Retrieval("Which ship?", nodes=[_node("S", "She commanded the Gannet Queen.", ["a"])]),
                  Retrieval("Who?", nodes=[])]
    judged, accuracy = ablate.judge_budget(engine, items, retrievals)
    assert (judged, accuracy) == (3, round(2 / 3, 4))
    assert engine.calls.count(ablate.JUDGE_INSTRUCTION) == 3
    assert [ablate.verdict(r) for r in ("Correct.", "incorrect", "It is not correct", "**correct**", "maybe", None)] \
        == [True, False, False, True, None, None]


def test_answer_with_the_offline_engine_says_judging_needs_an_llm(workspace, questions):
    result = ablate.run_ablation(workspace, questions[:3], ["naive"], [300], answer=True)
    assert ablate.OFFLINE_JUDGE_NOTE in result.notes
    assert all(row["judge_accuracy"] is None and row["judged"] is None for row in result.rows)


# --------------------------------------------------------------------------- the command
def _rows_without_latency(rows):
    return [{k: v for k, v in row.items() if k not in ablate.LATENCY_COLUMNS} for row in rows]


def test_cli_writes_table_json_and_plot_and_two_runs_agree(workspace, tmp_path):
    before = build_file(workspace, "nodes.parquet").stat().st_mtime_ns, (workspace / "manifest.json").read_bytes()
    runs = []
    for name in ("one", "two"):
        done = noderag("ablate", str(workspace), "--questions", str(QUESTIONS_FILE), "--variants", FAST,
                       "--budgets", "300,800", "--out", str(tmp_path / name))
        assert done.returncode == 0, done.stderr
        assert "noderag" in done.stdout and "lightrag-hybrid" in done.stdout
        runs.append(tmp_path / name)
    for folder in runs:
        assert (folder / "ablation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    tables = [list(csv.DictReader((folder / "ablation.csv").open())) for folder in runs]
    assert list(tables[0][0]) == list(ablate.COLUMNS)
    assert len(tables[0]) == len(FAST.split(",")) * 2
    assert _rows_without_latency(tables[0]) == _rows_without_latency(tables[1])
    documents = [json.loads((folder / "ablation.json").read_text()) for folder in runs]
    assert _rows_without_latency(documents[0]["rows"]) == _rows_without_latency(documents[1]["rows"])
    assert documents[0]["questions"] == 25 and documents[0]["budgets"] == [300, 800]
    for row in documents[0]["rows"]:
        assert row["mean_context_tokens"] <= row["budget"]
        assert 0 <= row["answer_containment"] <= 1 and 0 <= row["support_recall"] <= 1
    assert before == (build_file(workspace, "nodes.parquet").stat().st_mtime_ns, (workspace / "manifest.json").read_bytes())


def _one_line_error(done: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    assert done.returncode == code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for needle in needles:
        assert needle in lines[0]


def test_bad_input_gives_one_line_and_a_nonzero_exit(workspace, tmp_path):
    base = [str(workspace), "--questions", str(QUESTIONS_FILE), "--out", str(tmp_path / "out")]
    _one_line_error(noderag("ablate", *base, "--variants", "noderag,bogus"), 2,
                    "unknown variant bogus", "valid: noderag, ppr-1", "hipporag")
    _one_line_error(noderag("ablate", *base, "--budgets", "1000,0"), 2, "0 is not a positive number")
    _one_line_error(noderag("ablate", *base, "--budgets=-500"), 2, "-500 is not a positive number")
    _one_line_error(noderag("ablate", *base, "--budgets", "1k"), 2, "'1k' is not a whole number")
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    _one_line_error(noderag("ablate", str(workspace), "--questions", str(QUESTIONS_FILE), "--out", str(blocker / "out")),
                    2, "is not writable")
    _one_line_error(noderag("ablate", str(workspace), "--questions", str(QUESTIONS_FILE), "--out", str(blocker)),
                    2, "is not a folder")
    _one_line_error(noderag("ablate", str(tmp_path / "nowhere"), "--questions", str(QUESTIONS_FILE),
                            "--out", str(tmp_path / "o2")), 3, "not")
    _one_line_error(noderag("ablate", "--dataset", "musique", "--out", str(tmp_path / "o3")), 2, "--data")


def test_malformed_question_lines_are_reported_and_skipped(workspace, tmp_path):
    lines = QUESTIONS_FILE.read_text().splitlines()[:2]
    bad = tmp_path / "q.jsonl"
    bad.write_text("\n".join([lines[0], "{not json", '{"answers": ["x"]}', lines[1]]) + "\n")
    done = noderag("ablate", str(workspace), "--questions", str(bad), "--variants", "naive", "--budgets", "300",
                   "--out", str(tmp_path / "out"), "--json")
    assert done.returncode == 0, done.stderr
    assert f"{bad}:2:" in done.stderr and f"{bad}:3:" in done.stderr
    result = json.loads(done.stdout)
    assert result["questions"] == 2 and len(result["problems"]) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{broken\n")
    _one_line_error(noderag("ablate", str(workspace), "--questions", str(empty), "--out", str(tmp_path / "o")), 2,
                    "no usable question", "1 malformed")


# --------------------------------------------------------------------------- datasets and the benchmark helper
def _tiny_musique(folder: Path) -> Path:
    folder.mkdir(parents=True)
    passages = [{"title": "Harlow Ferry", "text": "Harlow Ferry is a village on the River Orlen in Dunholt."},
                {"title": "Edwin Penrake", "text": "Edwin Penrake was born in Harlow Ferry. He founded the Sound "
                                                   "Maritime Society in 1851."},
                {"title": "Greyling Medal", "text": "The Greyling Medal is awarded by the Sound Maritime Society."}]
    (folder / "corpus.json").write_text(json.dumps(passages))
    questions = [{"question": "Where was the founder of the society that awards the Greyling Medal born?",
                  "answer": "Harlow Ferry", "answer_aliases": [],
                  "paragraphs": [{"title": p["title"], "paragraph_text": p["text"], "is_supporting": i > 0}
                                 for i, p in enumerate(passages)]}]
    (folder / "questions.json").write_text(json.dumps(questions))
    return folder


def test_dataset_mode_builds_the_workspace_under_out_and_reuses_it(tmp_path):
    data = _tiny_musique(tmp_path / "musique")
    out = tmp_path / "out"
    for _ in range(2):
        done = noderag("ablate", "--dataset", "musique", "--data", str(data), "--out", str(out),
                       "--variants", "noderag,naive", "--budgets", "200", "--json")
        assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["workspace"] == str(out / "musique-workspace") and result["dataset"] == "musique"
    assert {row["strategy"] for row in result["rows"]} == {"noderag", "naive"}
    assert all(row["support_recall"] == 1.0 for row in result["rows"])


def test_dataset_mode_refuses_a_workspace_indexed_from_other_documents(workspace, tmp_path):
    data = _tiny_musique(tmp_path / "musique")
    done = noderag("ablate", str(workspace), "--dataset", "musique", "--data", str(data), "--out", str(tmp_path / "o"))
    _one_line_error(done, 2, "was indexed from", "give another WORKSPACE")


def test_list_names_every_strategy_with_what_it_changes():
    import json
    import os

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "noderag_cli.cli", "ablate", "--list", *extra], capture_output=True,
                              text=True, env={**os.environ, "COLUMNS": "400"}, timeout=120)

    listed = json.loads(run("--json").stdout)
    assert [s["name"] for s in listed] == list(STRATEGIES)
    assert all(s["kind"] and s["description"] for s in listed)
    lines = run().stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(STRATEGIES)
    assert STRATEGIES["no-whole-chunks"].description in " ".join(lines)


def test_ablation_table_and_markdown_for_the_benchmark(tmp_path):
    data = _tiny_musique(tmp_path / "musique")
    rows = ablate.ablation_table("musique", data, tmp_path / "work", budgets=(150, 300))
    names = {row["strategy"] for row in rows}
    assert names == set(STRATEGIES) - {"hyde"}
    assert {row["kind"] for row in rows} == {"noderag", "ablation", "baseline"}
    markdown = ablate.to_markdown(rows)
    assert markdown.startswith("| strategy | kind | budget | answer containment | Δ vs noderag |")
    assert len(markdown.strip().splitlines()) == 2 + len(rows)
    assert "| naive | baseline | 150 |" in markdown


# --------------------------------------------------------------------------- seed systems
SEED_VARIANTS = ("archrag", "archrag-single-layer", "archrag-leiden", "archrag-entity-only",
                 *(f"graphrag-{mode}-c{level}" for mode in ("local", "global") for level in range(4)))


def test_seed_hierarchies_are_kept_in_the_workspace_deterministic_and_built_once(built, tmp_path, monkeypatch):
    """A hierarchy is built on first use and written under evaluation/; a second run reads it back
    (building again would fail here); rebuilt from scratch it is the same bytes. GraphRAG's levels
    nest (each community of a level inside one of the level above); ArchRAG's layers shrink."""
    from conftest import copy_workspace

    from noderag_cli.evaluate import hierarchy

    ws = copy_workspace(built, tmp_path / "ws")
    shutil.rmtree(ws / "evaluation", ignore_errors=True)  # what other tests built in the shared workspace
    first = Setup(api.open_workspace(ws).retriever, ws)
    graphrag, archrag = first.hierarchy("graphrag"), first.hierarchy("archrag")
    files = sorted((ws / "evaluation").glob("*.parquet"))
    assert [f.name.split("-")[0] for f in files] == ["archrag", "graphrag"]
    stored = {f.name: f.read_bytes() for f in files}

    def refuse(*_args, **_kwargs):
        raise AssertionError("rebuilt although the workspace holds it")

    monkeypatch.setattr(hierarchy, "graphrag", refuse)
    monkeypatch.setattr(hierarchy, "archrag", refuse)
    second = Setup(api.open_workspace(ws).retriever, ws)
    again = second.hierarchy("graphrag")
    assert again.text == graphrag.text and np.array_equal(again.vectors, graphrag.vectors)
    assert [x.tolist() for x in again.labels] == [x.tolist() for x in graphrag.labels]
    monkeypatch.undo()

    for f in files:
        f.unlink()
    third = Setup(api.open_workspace(ws).retriever, ws)
    third.hierarchy("graphrag"), third.hierarchy("archrag")
    assert {f.name: f.read_bytes() for f in sorted((ws / "evaluation").glob("*.parquet"))} == stored

    assert graphrag.levels == 4
    for upper, lower in zip(graphrag.labels, graphrag.labels[1:], strict=False):
        for community in np.unique(lower[lower >= 0]).tolist():
            assert len(np.unique(upper[lower == community])) == 1  # nested in one community above
        assert len(np.unique(lower)) >= len(np.unique(upper))
    counts = [len(archrag.at(level)) for level in range(archrag.levels)]
    assert counts and all(b < a for a, b in zip(counts, counts[1:], strict=False))
    top = archrag.at(archrag.levels - 1)[0]
    assert len(archrag.children(top)) >= 1  # the layers are linked


def test_seed_systems_on_tiny_graphs(tmp_path):
    """One document of two sentences (a community or two, communities of one node, empty upper
    levels), and a folder of one sentence: every seed variant answers within its budget, twice alike."""
    for name, text in (("two", "Ada Lovelace met Charles Babbage in London. Babbage built the Difference Engine."),
                       ("one", "Ada Lovelace wrote notes.")):
        folder = tmp_path / f"docs-{name}"
        folder.mkdir()
        (folder / "a.txt").write_text(text + "\n")
        ws = tmp_path / f"ws-{name}"
        assert noderag("index", ws, "--input", folder).returncode == 0
        setup = Setup(api.open_workspace(ws).retriever, ws)
        for variant in SEED_VARIANTS:
            run = STRATEGIES[variant].build(setup)
            for budget in (40, 500):
                result = run("Who did Ada Lovelace meet?", budget)
                assert result.context_tokens <= budget
                assert [n.id for n in result.nodes] == [n.id for n in run("Who did Ada Lovelace meet?", budget).nodes]


def test_a_damaged_or_unwritable_hierarchy_store_costs_a_rebuild_not_the_run(built, tmp_path):
    """A kept hierarchy that cannot be read is rebuilt; a workspace where it cannot be written still
    runs the variant. Each says so in the run's notes."""
    from conftest import copy_workspace

    ws = copy_workspace(built, tmp_path / "ws")
    shutil.rmtree(ws / "evaluation", ignore_errors=True)
    (ws / "evaluation").write_text("not a folder")
    setup = Setup(api.open_workspace(ws).retriever, ws)
    assert setup.hierarchy("archrag").levels >= 1
    assert any("cannot write there" in note for note in setup.notes)
    (ws / "evaluation").unlink()
    Setup(api.open_workspace(ws).retriever, ws).hierarchy("archrag")
    (kept,) = (ws / "evaluation").glob("archrag-*.parquet")
    kept.write_bytes(b"garbage")
    again = Setup(api.open_workspace(ws).retriever, ws)
    assert again.hierarchy("archrag").levels >= 1
    assert again.notes == [f"{kept.name}: unreadable, rebuilt"] and kept.read_bytes() != b"garbage"
