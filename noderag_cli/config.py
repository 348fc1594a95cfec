"""One typed configuration, loaded from YAML; every default is written here and nowhere else.

Sections follow the pipeline. A stage's fingerprint includes only the sections it
reads (see `STAGE_SETTINGS`), so changing a search setting never re-runs indexing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import ConfigError


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)  # a weight of 1e400 is no setting but a typo


class ChunkConfig(_Section):
    chunk_tokens: int = Field(1024, ge=16, description="token bound of a text chunk")
    overlap_tokens: int = Field(0, ge=0)
    extensions: list[str] = Field(
        [".txt", ".md", ".markdown", ".rst", ".pdf", ".docx", ".pptx", ".xlsx", ".xlsm", ".html", ".htm", ".xhtml",
         ".epub"], description="the files read (noderag_cli/readers: a format and its reader per suffix)")
    include: list[str] = Field([], description="glob patterns: only files matching one are read (none: every file); "
                               "a pattern with a / matches the path in the folder, one without the file name")
    exclude: list[str] = Field([], description="glob patterns: files matching one are not read")
    max_file_bytes: int = Field(20_000_000, ge=1, description="larger text files are skipped with a warning")
    max_document_mb: int = Field(512, ge=1, description="larger PDF, Office, HTML or EPUB files are skipped with a warning")
    extract_seconds: float = Field(120.0, gt=0, description="time one document's reader may take; a document over it "
                                   "fails with the reason, and the next run tries again")
    extract_memory_mb: int = Field(1024, ge=16, description="memory one document's reader may add (the kernel holds "
                                   "its process to it); a document over it fails with the reason")
    extract_expanded_mb: int = Field(512, ge=1, description="what a DOCX, PPTX, XLSX or EPUB archive may expand to "
                                     "(a zip bomb's few kilobytes expand to gigabytes)")
    follow_symlinks: bool = Field(False, description="read files whose symlinks lead out of the input folder "
                                  "(otherwise skipped with a warning)")


class GraphConfig(_Section):
    betweenness_pivots: int = Field(10, ge=1)
    seed: int = 42
    leiden_resolution: float = Field(1.0, gt=0)
    max_community_tokens: int = Field(3000, ge=100, description="text of a community shown to the engine")
    attribute_max_tokens: int = Field(2000, ge=100, description="S and R text shown per entity attribute")
    summary_leaf_tokens: int = Field(
        3000, ge=50, description="an attribute or a community's elements are written in parts of about this much "
        "text, then from the parts' summaries, so an update rewrites only the parts whose texts changed "
        "(index/summaries.py). The default is at least attribute_max_tokens and max_community_tokens: one request "
        "each, as in the paper; smaller parts pay off only when an update changes few of an entity's texts "
        "(docs/benchmarks.md, incremental update with an LLM engine)")


MAX_PRICE = 100_000.0  # USD per million tokens: more is a typo, not a price
MAX_CAP = 1_000_000.0  # USD: a larger spending cap caps nothing


class Price(_Section):
    """USD per million tokens: for a model litellm's local price table does not know, or to
    override it (a negotiated rate, a local server's running cost)."""

    input: float = Field(ge=0, le=MAX_PRICE, allow_inf_nan=False)
    output: float = Field(0.0, ge=0, le=MAX_PRICE, allow_inf_nan=False)


COST_ONLY = {"price_per_million_tokens", "max_cost_usd"}
"""Settings that change what a run costs or may spend, never what it builds: left out of the
stages' fingerprints and of a build's config."""


class EmbeddingConfig(_Section):
    backend: Literal["wordllama", "litellm"] = "wordllama"
    model: str = "l2_supercat"
    dim: int = Field(256, ge=8)
    batch_size: int = Field(512, ge=1, description="texts per embedding request (litellm backend)")
    api_base: str | None = None
    api_key_env: str | None = None
    price_per_million_tokens: Price | None = Field(None, description="what a litellm embedding model's tokens cost, "
                                                   "over litellm's price table (needed for a spending cap on a model "
                                                   "the table does not price)")


class SimilarityConfig(_Section):
    neighbours: int = Field(
        64, ge=2, le=512,
        description="candidates per node for the similarity edges: the width of an HNSW base layer at M=32 (2M)")
    exact_below: int = Field(
        60_000, ge=0, description="embedded nodes below which every node is scored against every other (exact); "
        "from there candidates come from the clustered index (docs/benchmarks.md: where each is faster)")
    probes: int = Field(16, ge=1, description="clustered index: nearest clusters whose members are a node's "
                        "candidates (more: closer to the exact lists, slower; docs/benchmarks.md)")


class IndexConfig(_Section):
    """How `noderag index` brings a built workspace up to date with a changed folder (docs/usage.md, "Updates")."""

    update: Literal["incremental", "exact"] = Field(
        "incremental", description="incremental: the summaries and communities of the last full build (the anchor) "
        "are kept where their inputs changed little, so an update costs about what changed; exact: an update's "
        "tables equal a fresh build's, at the cost of redoing every summary whose inputs moved (`index --exact`)")
    resummarize_share: float = Field(
        0.25, ge=0, le=1, description="incremental: an attribute or a community's elements are written again once "
        "the texts they were written from changed by more than this share since they were written")
    rebuild_after: float = Field(
        0.25, ge=0, le=1, description="incremental: once this share of the chunks changed since the last full build, "
        "the run is a full build (a new anchor) and says so (`index --rebuild` forces one)")


class LLMConfig(_Section):
    """The engine for the LLM tasks. `offline` needs no model, key or network."""

    engine: Literal["offline", "litellm"] = "offline"
    model: str = "gpt-4o-mini"
    api_base: str | None = None
    api_key_env: str | None = Field(None, description="name of the environment variable holding the key")
    temperature: float = 0.0
    max_output_tokens: int = Field(2048, ge=16)
    context_window: int = Field(16384, ge=512)
    concurrency: int = Field(8, ge=1)
    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    timeout_seconds: float = Field(120.0, gt=0)
    retries: int = Field(5, ge=0)
    rate_limit_wait_seconds: float = Field(
        600.0, gt=0, description="an item gives up after waiting this long in total on the server's 429 replies")
    structured_output: bool = True
    prompts: str | None = Field(None, description="a folder of prompt files, one per task, used instead of the "
                                "built-ins (`noderag init WS --prompts` writes them to start from); relative to this file")
    grounding: bool = Field(True, description="keep only the names, relationships, units and summaries a reply's "
                            "input supports, and retry replies that echo the prompt's example (engines/grounding.py)")
    max_cost_usd: float | None = Field(
        None, gt=0, le=MAX_CAP, allow_inf_nan=False, description="spending cap of one index run (LLM and embedding calls): a run whose estimate is "
        "over it does not start, and one whose spend would pass it stops, its work kept for the next run; "
        "`index --max-cost` sets it for one run")
    price_per_million_tokens: Price | None = Field(
        None, description="what the model's input and output tokens cost, over litellm's price table; a cap on a "
        "model the table does not price needs it")


class SearchConfig(_Section):
    vector_top_k: int = Field(10, ge=0)
    min_similarity: float = Field(0.25, ge=-1, le=1, description="vector entry points below this cosine are dropped")
    ppr_alpha: float = Field(0.5, gt=0, le=1)
    ppr_iterations: int = Field(3, ge=0, description="spec: 2; 3 with a structural walk (docs/benchmarks.md)")
    ppr_variant: Literal["paper", "lazy"] = "paper"
    ppr_min_mass: float = Field(
        2e-6, ge=0, description="approximate (push) PPR: a node spreads only while its edges carry more than this "
        "each on average, and nodes with this much or less are let go after each step; a bounded frontier at any size "
        "(paper: 0; docs/search.md)")
    similarity_weight: float = Field(
        0.0, ge=0, description="weight of the similarity (HNSW) edges in the walk, against 1 for a structural edge; "
        "spec: 1; 0 measured better: similarity already picks the entry points and ranks the result")
    cross_t: int = Field(10, ge=0)
    cross_s: int = Field(30, ge=0, description="spec: 10; 30 measured better with offline units (docs/benchmarks.md)")
    cross_a: int = Field(10, ge=0)
    cross_h: int = Field(10, ge=0)
    cross_r: int = Field(30, ge=0)
    budget_tokens: int = Field(6000, ge=1)
    chunk_weight: float = Field(
        0.3, ge=0, description="walk_similarity: factor on T scores, so whole chunks fill what units leave of the budget")
    rank: Literal["walk_similarity", "ppr"] = Field(
        "walk_similarity", description="ppr: raw PPR scores (the paper); walk_similarity: see search/retriever.py")
    exact_share: float | None = Field(
        0.3, ge=0, le=1, description="share of the walk's start on the entities the question names, each by how "
        "specific it is (rarer names more); the rest on the vector entry points; null: the same on every entry "
        "point (the paper; search/rounds.py)")
    second_round_chunks: int = Field(
        2, ge=0, description="a second walk also starts from the entities named in the chunks of this many of the "
        "first walk's best units, to reach the passages of what the first hop found (0: one round, the paper)")
    second_round_share: float = Field(0.5, gt=0, lt=1, description="share of the second walk's start on those entities")
    document_diversity: float = Field(
        0.4, gt=0, le=1, description="the context takes a node's score times this for every node already taken from "
        "its document, so it covers more passages (1: by score alone, the paper)")
    asked_kind_weight: float = Field(
        0.5, ge=0, description="a unit that holds a value of the kind the question asks for (a date for 'when', a "
        "number for 'how many') counts its similarity 1 + this times (0: off; search/context.py)")
    question_words_weight: float = Field(
        1.5, ge=0, description="walk_similarity: a chosen unit's or chunk's score counts 1 + this times the share "
        "of the question's words it holds, each by how rare it is among them (0: off; search/context.py)")
    whole_chunks: int = Field(
        2, ge=0, description="the best documents (this many) whose chunk costs at most three times the units of it "
        "the context holds are shown as that chunk, in place of its scattered units, funded by summaries, relationships "
        "and the second units of other documents, never by a document's only unit (0: off; search/context.py)")
    use_exact: bool = True
    use_vector: bool = True
    clustered_from: int = Field(
        40_000, ge=0, description="S, A and H vectors from which a build's vector side probes clusters instead of "
        "scanning them all (set when indexing; docs/benchmarks.md: where each is faster)")
    vector_probes: int = Field(32, ge=1, description="clusters whose members are scored, when the build has them")

    def quotas(self) -> dict[str, int]:
        return {"T": self.cross_t, "S": self.cross_s, "A": self.cross_a, "H": self.cross_h, "R": self.cross_r}


class ExecutorConfig(_Section):
    """Where the per-document and per-chunk work runs (noderag_cli/executor.py), and how much memory
    the graph-wide stages' largest arrays may take. It never changes a table, so it is in no
    stage's fingerprint."""

    kind: Literal["local", "ray"] = "local"
    workers: int = Field(0, ge=0, description="local: worker processes; 0 = one per core")
    address: str | None = Field(None, description="ray: the cluster to join (ray://host:10001, host:6379 or auto)")
    memory_mb: Literal["auto"] | float = Field(
        "auto", description="megabytes of its largest arrays a graph-wide stage keeps in memory; past it they are "
        "memory-mapped files under the workspace, which the kernel writes out instead of swapping (the same tables; "
        "noderag_cli/spill.py). A build expected to peak below it also keeps the memory it frees for reuse instead of "
        "giving it back (executor.keeping_freed_memory). auto: a quarter of this machine's memory; 0: no limit")

    @field_validator("memory_mb", mode="before")
    @classmethod
    def _auto_or_megabytes(cls, value):
        if value == "auto" or (isinstance(value, int | float) and not isinstance(value, bool) and value >= 0):
            return value
        raise ValueError("must be auto, 0 (no limit) or a number of megabytes")

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        return {"kind": value} if isinstance(value, str) else value


class Config(_Section):
    chunk: ChunkConfig = ChunkConfig()
    graph: GraphConfig = GraphConfig()
    embedding: EmbeddingConfig = EmbeddingConfig()
    similarity: SimilarityConfig = SimilarityConfig()
    index: IndexConfig = IndexConfig()
    llm: LLMConfig = LLMConfig()
    search: SearchConfig = SearchConfig()
    executor: ExecutorConfig = ExecutorConfig()

    def paid(self) -> list[tuple[str, LLMConfig | EmbeddingConfig]]:
        """(section name, section) of the models this config has a run pay for: those behind litellm."""
        return [(name, section) for name, section, backend in (("llm", self.llm, self.llm.engine),
                                                              ("embedding", self.embedding, self.embedding.backend))
                if backend == "litellm"]


def changed(section: _Section, **changes):
    """A copy of a config section with some settings changed, validated like a config file
    (ConfigError, one line): how the CLI's flags and the ablation variants set search settings."""
    try:
        return type(section).model_validate({**section.model_dump(), **changes})
    except ValidationError as err:
        first = err.errors()[0]
        raise ConfigError(f"invalid setting {'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None


def load_config(path: Path | None = None) -> Config:
    data: dict = {}
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
        except FileNotFoundError as err:
            raise ConfigError(f"config file not found: {path}") from err
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise ConfigError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from err
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must hold a mapping of sections")
    # workspaces indexed before the similarity edges were computed exactly saved an `hnsw` section
    # (m, ef_construction, ef_search); none of it means anything now
    data.pop("hnsw", None)
    llm = data.get("llm")
    if path is not None and isinstance(llm, dict) and isinstance(llm.get("prompts"), str) \
            and not Path(llm["prompts"]).is_absolute():  # a prompt folder is where its config file says
        llm["prompts"] = str((Path(path).resolve().parent / llm["prompts"]).resolve())
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"invalid config at {where}: {first['msg']}") from err


def config_to_yaml(config: Config, build: bool = False, commented: bool = False) -> str:
    """The effective config as written into a workspace. Holds env var names, never their values.
    `build`: as a build carries it, without where its work ran (`executor`) and what it cost
    (`COST_ONLY`), which change nothing in it. `commented`: every setting on its own line with what it means and, where the value is
    not the default, the default (for people who edit it; `noderag init` and the workspace's copy)."""
    data = config.model_dump(mode="json", exclude={"executor": True, "llm": COST_ONLY, "embedding": COST_ONLY}
                             if build else None)
    if not commented:
        return yaml.safe_dump(data, sort_keys=False)
    defaults = Config().model_dump(mode="json")
    lines = [f"# noderag settings: every one with its default unless noted; {CONFIG_HELP}"]
    for section, values in data.items():
        model = type(getattr(config, section))
        doc = model.__dict__.get("__doc__")
        lines.append("")
        if doc:
            lines.extend(f"# {line.strip()}" for line in doc.strip().splitlines())
        lines.append(f"{section}:")
        for key, value in values.items():
            notes = [model.model_fields[key].description or ""]
            if value != defaults[section][key]:
                notes.append(f"default: {_flow(defaults[section][key])}")
            note = "; ".join(n for n in notes if n)
            lines.append(f"  {key}: {_flow(value)}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


CONFIG_HELP = "`noderag index WS` reads this file from the workspace (or --config FILE)."


def _flow(value) -> str:
    """A value as YAML on one line (`[.txt, .md]`, `null`, quoted where a plain scalar would not read back)."""
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 30).strip()[1:-1]


PRESETS = ("openai", "ollama", "openai-compatible")
"""`noderag init --llm NAME`: the settings of presets/NAME.yaml (also in the repository's configs/)."""


def preset(name: str) -> tuple[Config, str]:
    """A preset's config and the comment block at its top (how to start the server, the key...)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown --llm preset '{name}'; valid: {', '.join(PRESETS)}")
    path = Path(__file__).parent / "presets" / f"{name}.yaml"
    text = path.read_text(encoding="utf-8")
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        if "--config configs/" not in line:  # how to use the preset file itself: not what init wrote
            header.append(line.replace(" Only what differs from the defaults is set.", ""))
    return load_config(path), "\n".join(header)
