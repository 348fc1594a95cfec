"""`noderag ablate`: every strategy (NodeRAG, its ablations, the baselines) on every question at
every budget, over one workspace, scored with the project's metrics (`evaluate.run.evaluate`).

Outputs, in the output folder: `ablation.csv` and `ablation.json` (the table; the JSON adds the
run's settings, skipped strategies, notes and question-file problems) and `ablation.png`
(`plots.plot_ablation`).

With an LLM engine, `answer=True` also answers every question from every context with the one
shared answer prompt (`engine.answer`) and has the LLM judge each answer against the gold
answers. The judge goes through the same engine answer task (its cache, retries and rate
limits): the judging instruction is the question and the gold and candidate answers are the
context, so no second prompt set needs keeping in step (engines/prompts.py has no judge
prompt). The offline engine's extractive "answers" are not judged.

For the benchmark: `ablation_table(dataset, data_dir, work_dir, budgets)` builds (or reuses)
the dataset's workspace and returns the rows; `to_markdown(rows)` renders them.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import AblationInputError, WorkspaceError
from ..index.stages import Reporter
from ..index.state import Manifest
from ..questions import Question, read_jsonl
from ..search.results import Retrieval
from ..workspace import Workspace, workspace_holding
from .baselines import BASELINES, Setup, Strategy, StrategySkipped, StrategySpec
from .datasets import load_hotpotqa, load_musique
from .run import evaluate
from .seeds import SEEDS
from .variants import VARIANTS

STRATEGIES: dict[str, StrategySpec] = {**VARIANTS, **BASELINES, **SEEDS}
DEFAULT_BUDGETS = (1000, 2000, 4000)
DATASETS = {"musique": load_musique, "hotpotqa": load_hotpotqa}
COLUMNS = ("strategy", "kind", "budget", "questions", "answer_containment", "support_recall", "mean_context_tokens",
           "latency_median_ms", "latency_p95_ms", "judged", "judge_accuracy")
LATENCY_COLUMNS = ("latency_median_ms", "latency_p95_ms")

JUDGE_INSTRUCTION = (
    "Judge the candidate answer in the context against the gold answer. It is correct when it gives the "
    "gold answer or one of its aliases, in any wording. It is incorrect when it gives another answer, "
    "several conflicting answers, or says the context is not enough. Reply with one word: correct or incorrect."
)
OFFLINE_JUDGE_NOTE = ("--answer: judging needs an LLM engine (llm.engine: litellm in the config); the offline "
                      "engine only extracts sentences, so answers were not generated or judged")


# --------------------------------------------------------------------------- input
def parse_budgets(text: str | None) -> list[int]:
    if text is None or not text.strip():
        return list(DEFAULT_BUDGETS)
    budgets = []
    for part in text.split(","):
        part = part.strip()
        try:
            value = int(part)
        except ValueError:
            raise AblationInputError(f"--budgets: '{part}' is not a whole number of tokens "
                                     "(give e.g. --budgets 1000,2000,4000)") from None
        if value <= 0:
            raise AblationInputError(f"--budgets: {value} is not a positive number of tokens")
        budgets.append(value)
    return list(dict.fromkeys(budgets))


def parse_variants(text: str | None) -> list[str]:
    if text is None or not text.strip():
        return list(STRATEGIES)
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        raise AblationInputError(f"unknown variant{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                                 f"valid: {', '.join(STRATEGIES)}")
    return list(dict.fromkeys(names))


def check_output_dir(path: Path) -> Path:
    """Create the output folder if needed and make sure a file can be written in it."""
    path = Path(path)
    if workspace_holding(path) is not None:
        raise AblationInputError(f"--out {path} is inside workspace {workspace_holding(path)}: outputs are never "
                                 "written into a workspace; choose a folder outside it")
    if path.exists() and not path.is_dir():
        raise AblationInputError(f"output folder {path} exists and is not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as err:
        raise AblationInputError(f"output folder {path} is not writable: {err.strerror or err}") from None
    return path


def read_questions(path: Path) -> tuple[list[Question], list[str]]:
    """Our JSONL; malformed lines are reported (with their line numbers) and skipped."""
    from ..errors import QuestionFileError

    try:
        questions, problems = read_jsonl(Path(path))
    except QuestionFileError as err:
        raise AblationInputError(str(err)) from None
    return questions, problems


def dataset_paths(dataset: str, base: Path) -> tuple[Path, Path]:
    """Where a dataset's corpus folder and workspace live under a working folder."""
    return Path(base) / f"{dataset}-corpus", Path(base) / f"{dataset}-workspace"


def prepare_dataset(dataset: str, data_dir: Path, workspace: Path, corpus_dir: Path,
                    config_path: Path | None = None, reporter: Reporter | None = None) -> tuple[list[Question], float]:
    """Write the dataset's corpus (one file per passage, title first) and index it into the workspace,
    which reuses everything already indexed. Returns the questions and the indexing seconds."""
    from ..index.run import index

    if dataset not in DATASETS:
        raise AblationInputError(f"unknown dataset '{dataset}'; valid: {', '.join(DATASETS)}")
    data_dir = Path(data_dir)
    for name in ("corpus.json", "questions.json"):
        if not (data_dir / name).is_file():
            raise AblationInputError(f"--data {data_dir}: no {name} there (expected the {dataset} folder of shared/eval)")
    try:
        questions = DATASETS[dataset](data_dir, Path(corpus_dir))
    except (ValueError, KeyError, TypeError) as err:
        raise AblationInputError(f"{data_dir} is not in the {dataset} format: {type(err).__name__}: {err}") from None
    indexed_from = Manifest.load(Workspace(Path(workspace))).input
    if indexed_from and Path(indexed_from) != Path(corpus_dir).resolve():
        raise AblationInputError(f"workspace {workspace} was indexed from {indexed_from}, not from the {dataset} corpus "
                                 f"{Path(corpus_dir).resolve()}; indexing the dataset into it would replace its "
                                 "documents, so give another WORKSPACE or none")
    started = time.perf_counter()
    index(workspace, corpus_dir, config_path=config_path, reporter=reporter)
    return questions, time.perf_counter() - started


# --------------------------------------------------------------------------- the run
class AblationReporter(Reporter):
    """The indexing reporter plus what an ablation run reports; the CLI draws it with Rich. One
    object serves both, since `ablate --dataset` indexes before it evaluates."""

    def run_started(self, total: int) -> None: ...

    def strategy_started(self, name: str, total: int) -> None: ...

    def note(self, message: str) -> None: ...


@dataclass
class AblationResult:
    rows: list[dict]
    budgets: list[int]
    strategies: dict[str, dict]
    questions: int
    workspace: str
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    dataset: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"workspace": self.workspace, "dataset": self.dataset, "questions": self.questions,
                "budgets": self.budgets, "strategies": self.strategies, "skipped": self.skipped,
                "notes": self.notes, "problems": self.problems,
                "seconds": {k: round(v, 2) for k, v in self.seconds.items()}, "rows": self.rows}


def _capturing(strategy: Strategy, into: dict[int, list[Retrieval]]) -> Strategy:
    def run(question: str, budget: int) -> Retrieval:
        result = strategy(question, budget)
        into.setdefault(budget, []).append(result)
        return result

    return run


def _check_run(names: list[str], budgets: list[int], questions: list[Question]) -> None:
    """A run's inputs checked before anything is opened: one clear error for the first problem."""
    for name in names:
        if name not in STRATEGIES:
            parse_variants(name)  # raises with the list of valid names
    for budget in budgets:
        if budget <= 0:
            raise AblationInputError(f"budget {budget} is not a positive number of tokens")
    if not questions:
        raise AblationInputError("no questions to evaluate")


def run_ablation(workspace: Path, questions: list[Question], names: list[str] | None = None,
                 budgets: list[int] | tuple[int, ...] = DEFAULT_BUDGETS, config_path: Path | None = None,
                 answer: bool = False, progress: AblationReporter | None = None) -> AblationResult:
    """Every named strategy on every question at every budget, over the workspace."""
    from ..engines import make_engine
    from ..search.session import open_workspace

    progress = progress or AblationReporter()
    names, budgets = list(names or STRATEGIES), list(budgets)
    _check_run(names, budgets, questions)
    started = time.perf_counter()
    session = open_workspace(workspace, config_path=config_path)
    retriever = session.retriever
    ws = Workspace(Path(workspace))
    try:
        cache = ws.cache if os.access(ws.root, os.W_OK) else None
    except (OSError, WorkspaceError):
        cache = None
    engine = make_engine(retriever.config, cache, retriever.embedder) \
        if cache is not None and retriever.engine.asks_a_model else None  # replies kept for a re-run
    setup = Setup(retriever, ws.root, cache, engine=engine)
    result = AblationResult(rows=[], budgets=budgets, questions=len(questions), workspace=str(workspace),
                            strategies={n: {"kind": STRATEGIES[n].kind, "description": STRATEGIES[n].description}
                                        for n in names})
    if answer and setup.offline:
        result.notes.append(OFFLINE_JUDGE_NOTE)
        progress.note(OFFLINE_JUDGE_NOTE)
        answer = False
    progress.run_started(len(names) * len(questions) * len(budgets))
    try:
        for name in names:
            spec = STRATEGIES[name]
            try:
                strategy = spec.build(setup)
            except StrategySkipped as err:
                result.skipped[name] = str(err)
                progress.advance(len(questions) * len(budgets))
                continue
            for note in setup.notes:
                progress.note(note)
            result.notes.extend(setup.notes)
            setup.notes.clear()
            captured: dict[int, list[Retrieval]] = {}
            if answer:
                strategy = _capturing(strategy, captured)
            progress.strategy_started(name, len(questions) * len(budgets))
            rows = evaluate({name: strategy}, questions, budgets, progress=progress.advance)
            for row in rows:
                row["kind"] = spec.kind
                row["judged"], row["judge_accuracy"] = None, None
                if answer:
                    row["judged"], row["judge_accuracy"] = judge_budget(setup.engine, questions,
                                                                        captured.get(row["budget"], []))
                result.rows.append({column: row.get(column) for column in COLUMNS})
    finally:
        if cache is not None:
            ws.close()
    result.seconds["run"] = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------- answers and the judge
def _answer_many(engine, items: list[tuple[str, str]]) -> list[str | None]:
    """Answers for (question, context) pairs: concurrently where the engine can; failures are None."""
    from ..engines.base import Failure

    replies = engine.answer_batch(items)
    return [None if isinstance(r, Failure) or r is None else str(r) for r in replies]


def verdict(reply: str | None) -> bool | None:
    """correct -> True, incorrect -> False, anything else -> None (not judged)."""
    if not reply:
        return None
    words = reply.strip().strip(".!\"'`*").casefold().split()
    text = " ".join(words)
    if "incorrect" in text or "not correct" in text:
        return False
    if "correct" in text:
        return True
    return None


def judge_items(questions: list[Question], answers: list[str | None]) -> list[tuple[str, str] | None]:
    items: list[tuple[str, str] | None] = []
    for question, reply in zip(questions, answers, strict=True):
        if reply is None:
            items.append(None)
            continue
        gold = " | ".join(question.answers)
        items.append((JUDGE_INSTRUCTION, f"Question: {question.question}\nGold answer: {gold}\nCandidate answer: {reply}"))
    return items


def judge_budget(engine, questions: list[Question], retrievals: list[Retrieval]) -> tuple[int, float | None]:
    """Answer every question from its context with the shared answer prompt, then judge each answer
    against the gold answers. Returns (answers judged, share judged correct)."""
    answers = _answer_many(engine, [(r.question, r.context_text(numbered=True)) for r in retrievals])
    items = judge_items(questions, answers)
    asked = [item for item in items if item is not None]
    verdicts = [verdict(reply) for reply in _answer_many(engine, asked)] if asked else []
    judged = [v for v in verdicts if v is not None]
    return len(judged), (round(sum(judged) / len(judged), 4) if judged else None)


# --------------------------------------------------------------------------- outputs
def table_csv(rows: list[dict]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(COLUMNS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in COLUMNS})
    return buffer.getvalue()


PNG_SKIPPED = "ablation.png not written: matplotlib is not installed (pip install 'noderag-cli[eval]' adds it)"


def write_outputs(result: AblationResult, out_dir: Path, title: str | None = None) -> dict[str, Path]:
    from ..files import write_output
    from .plots import plot_ablation

    out_dir = check_output_dir(out_dir)
    paths = {"csv": out_dir / "ablation.csv", "json": out_dir / "ablation.json", "png": out_dir / "ablation.png"}
    try:
        if not result.rows:
            paths.pop("png")
        elif importlib.util.find_spec("matplotlib") is None:
            paths.pop("png")
            result.notes.append(PNG_SKIPPED)
        table = table_csv(result.rows).encode()
        write_output(paths["csv"], lambda handle: handle.write(table), "--out")
        result.files = {k: str(v) for k, v in paths.items()}
        summary = json.dumps(result.as_dict(), indent=2).encode()
        write_output(paths["json"], lambda handle: handle.write(summary), "--out")
        if "png" in paths:
            plot_ablation(result.rows, paths["png"], title or _title(result))
    except OSError as err:
        raise AblationInputError(f"cannot write the results to {out_dir}: {err.strerror or err}") from None
    return paths


def _title(result: AblationResult) -> str:
    what = result.dataset or Path(result.workspace).name
    return f"NodeRAG ablations and baselines: {what}, {result.questions} questions"


def to_markdown(rows: list[dict]) -> str:
    """The rows as a Markdown table, with each row's difference to `noderag` at the same budget."""
    reference = {r["budget"]: r for r in rows if r["strategy"] == "noderag"}
    judged = any(r.get("judge_accuracy") is not None for r in rows)
    header = ["strategy", "kind", "budget", "answer containment", "Δ vs noderag", "support recall", "Δ vs noderag",
              "context tokens", "latency median ms", "latency p95 ms"] + (["judge accuracy"] if judged else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]

    def number(value, digits=3):
        return "–" if value is None else f"{value:.{digits}f}"

    def delta(row, key):
        ref = reference.get(row["budget"])
        if ref is None or row["strategy"] == "noderag" or row.get(key) is None or ref.get(key) is None:
            return ""
        return f"{row[key] - ref[key]:+.3f}"

    for row in sorted(rows, key=lambda r: (r["budget"], list(STRATEGIES).index(r["strategy"])
                                           if r["strategy"] in STRATEGIES else 999)):
        cells = [row["strategy"], row.get("kind", ""), str(row["budget"]), number(row.get("answer_containment")),
                 delta(row, "answer_containment"), number(row.get("support_recall")), delta(row, "support_recall"),
                 number(row.get("mean_context_tokens"), 0), number(row.get("latency_median_ms"), 1),
                 number(row.get("latency_p95_ms"), 1)]
        if judged:
            cells.append(number(row.get("judge_accuracy")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- for the benchmark
def ablation_table(dataset: str, data_dir: str | Path, work_dir: str | Path,
                   budgets: tuple[int, ...] | list[int] = (1000, 2000),
                   names: list[str] | None = None, config_path: Path | None = None) -> list[dict]:
    """Rows (see COLUMNS) for NodeRAG full, each ablation and each baseline on a dataset
    ('musique' or 'hotpotqa' in the shared/eval layout), at each budget. The dataset's corpus and
    workspace go to work_dir/<dataset>-corpus and work_dir/<dataset>-workspace and are reused by
    later calls. Strategies that cannot run with the engine (HyDE offline) are left out."""
    corpus, workspace = dataset_paths(dataset, Path(work_dir))
    questions, _ = prepare_dataset(dataset, Path(data_dir), workspace, corpus, config_path)
    return run_ablation(workspace, questions, names, list(budgets), config_path).rows


def run_from_args(workspace: Path | None, questions_file: Path | None, dataset: str | None, data_dir: Path | None,
                  variants: str | None, budgets: str | None, out: Path, config_path: Path | None = None,
                  answer: bool = False, limit: int | None = None,
                  progress: AblationReporter | None = None) -> AblationResult:
    """What `noderag ablate` does, minus the rendering: validate everything first, then run."""
    names = parse_variants(variants)
    budget_list = parse_budgets(budgets)
    if (questions_file is None) == (dataset is None):
        raise AblationInputError("give either --questions FILE (with WORKSPACE) or --dataset NAME --data DIR")
    if dataset is not None and data_dir is None:
        raise AblationInputError("--dataset needs --data DIR (the dataset's folder, e.g. shared/eval/musique)")
    if dataset is None and workspace is None:
        raise AblationInputError("give the WORKSPACE to evaluate with --questions")
    if limit is not None and limit <= 0:
        raise AblationInputError(f"--limit {limit} is not a positive number of questions")
    out = check_output_dir(out)
    problems: list[str] = []
    seconds: dict[str, float] = {}
    if dataset is not None:
        if dataset not in DATASETS:
            raise AblationInputError(f"unknown dataset '{dataset}'; valid: {', '.join(DATASETS)}")
        corpus, default_ws = dataset_paths(dataset, out)
        workspace = workspace or default_ws
        questions, seconds["index"] = prepare_dataset(dataset, data_dir, workspace, corpus, config_path, progress)
    else:
        questions, problems = read_questions(questions_file)
        for problem in problems:
            if progress:
                progress.warn(problem)
    if limit is not None:
        questions = questions[:limit]
    result = run_ablation(workspace, questions, names, budget_list, config_path, answer, progress)
    result.problems, result.dataset = problems, dataset
    result.seconds.update(seconds)
    write_outputs(result, out)
    return result
