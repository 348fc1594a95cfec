"""`index --dry-run` with an LLM engine: calls, tokens and cost before anything is spent.

How the estimate is made (also stated in its output): the offline engine indexes the
same folder into a throw-away workspace with the bundled embeddings (seconds; no network, no
key, whatever the config's backends). Decomposition calls are the real chunks, with exactly
the prompts the LLM engine would send; attribute and community calls are those the graph
yields, with their real prompts. A request this workspace's cache answers is answered from it, as
the run would, and not counted; the others are answered by the offline engine, so a fresh
build's graph is the offline one (an LLM-decomposed graph has a similar but not equal number of
important entities and communities) and an update's is the graph it will have where nothing
changed. An incremental update's later stages keep their summaries against the workspace's own
anchor (anchor.py), as the run will, so a summary the run keeps is not counted; an edited chunk
stands in as the model's cached reply to its earlier text plus the offline units of its new
sentences, a new chunk as its offline decomposition. With
embeddings behind litellm, the texts the build would embed (its chunks and the
graph's units, attributes and summaries) in batches of embedding.batch_size. Output tokens are
assumptions per task (OUTPUT_TOKENS), capped by llm.max_output_tokens.
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from pathlib import Path

from .. import nlp
from ..cache import EMBEDDING
from ..config import Config, EmbeddingConfig
from ..embeddings import Embedder
from ..engines import engine_class
from ..engines.base import ChunkInput
from ..engines.offline import OfflineEngine
from ..engines.transport import SpendingCap
from ..errors import BadInputError
from ..executor import Executor
from ..node_types import EMBEDDED_TYPES
from ..workspace import Workspace
from .outputs import ATTRIBUTE_NODES, CHUNKS, COMMUNITY_NODES, DECOMPOSE_NODES
from .pipeline import run_pipeline

# reply size assumptions: decomposition restates a chunk as units with entities and triples
OUTPUT_TOKENS = {"decompose": lambda prompt_tokens: int(prompt_tokens * 0.9), "attributes": lambda _: 180,
                 "community_elements": lambda _: 450}


class _RecordingEngine(OfflineEngine):
    """The offline engine, keeping the inputs of every task it is given. With `replies` (an LLM
    engine over the workspace's cache), an input whose reply is cached gets that reply, as the run
    would, and only the others are kept (and answered offline): an update's later stages then see
    the graph the update will see, and the estimate counts what it will ask.

    An edited chunk (`earlier`: the workspace's chunk at the same place of the same document) is
    answered with the model's cached reply to its earlier text, plus the offline units of the
    sentences it did not hold: what the model drew from the text that stayed still stands, where
    the offline engine's units and entities, worded its own way, would replace every one of them
    and make each summary they reach look changed."""

    pure_decompose = None  # every chunk through `decompose`, to be recorded

    def __init__(self, embedder: Embedder, replies=None, earlier: Callable[[ChunkInput], ChunkInput | None] | None = None):
        super().__init__(embedder)
        self.replies = replies
        self.earlier = earlier
        self.seen: dict[str, list] = {"decompose": [], "attributes": [], "community_elements": []}

    def _answer(self, task: str, items, offline, progress) -> list:
        items = list(items)
        found = self.replies.cached_results(task, items) if self.replies is not None else [None] * len(items)
        todo = [i for i, result in enumerate(found) if result is None]
        self.seen[task].extend(items[i] for i in todo)
        for i, result in zip(todo, offline([items[i] for i in todo]) if todo else [], strict=True):
            found[i] = result
        if progress:
            progress(len(items))
        return found

    def _decompose_edited(self, chunks) -> list:
        """Offline units for new chunks; an edited chunk's: the model's reply to its earlier text
        and the offline units of its new sentences."""
        chunks = list(chunks)
        before = [self.earlier(chunk) if self.earlier else None for chunk in chunks]
        known = [i for i, chunk in enumerate(before) if chunk is not None]
        results: list = [None] * len(chunks)
        for i, result in zip(known, self.replies.cached_results("decompose", [before[i] for i in known]) if known
                             else [], strict=True):
            results[i] = result if isinstance(result, list) else None
        offline, owners = [], []  # new chunks whole, edited chunks' new sentences: one offline call
        for i, chunk in enumerate(chunks):
            if results[i] is not None:
                stayed = set(nlp.split_sentences(before[i].text))
                new = [s for s in nlp.split_sentences(chunk.text) if s not in stayed]
                if not new:
                    continue
                chunk = ChunkInput(chunk.chunk_id, " ".join(new), chunk.title)
            offline.append(chunk)
            owners.append(i)
        for i, units in zip(owners, super().decompose(offline) if offline else [], strict=True):
            results[i] = units if results[i] is None else results[i] + (units if isinstance(units, list) else [])
        return results

    def decompose(self, chunks, progress=None):
        return self._answer("decompose", chunks, self._decompose_edited if self.replies is not None else
                            super().decompose, progress)

    def attributes(self, items, progress=None):
        return self._answer("attributes", items, super().attributes, progress)

    def community_elements(self, items, progress=None):
        return self._answer("community_elements", items, super().community_elements, progress)


def estimate_llm(ws: Workspace, input_folder: Path, config: Config, rebuild: bool = False) -> dict:
    from ..engines import pricing, prompts

    cache = ws.read_only_cache()  # a dry run writes nothing to the workspace
    offline = config.model_copy(update={"llm": config.llm.model_copy(update={"engine": "offline"}),
                                        "embedding": EmbeddingConfig()})  # the bundled model: no network
    replies = None
    counted = engine_class(config.llm).asks_a_model  # the offline engine's work costs nothing
    if cache is not None and counted:
        from ..engines.llm import LiteLLMEngine  # the one engine that asks a model

        replies = LiteLLMEngine(config.llm, cache)
    with tempfile.TemporaryDirectory(prefix="noderag-estimate-") as scratch:
        scratch_ws = Workspace(Path(scratch))
        recorder = _RecordingEngine(Embedder(offline.embedding), replies,
                                    _earlier_chunks(ws, scratch_ws) if replies is not None else None)
        scratch_ws.create()
        try:
            run_pipeline(scratch_ws, Path(input_folder), offline, recorder, recorder.embedder, Executor(),
                         stop_after="communities", rebuild=rebuild, anchor_from=ws)
            embedded = _embedded_texts(scratch_ws, recorder)
        finally:
            scratch_ws.close()

    tasks = {}
    for task, items in recorder.seen.items() if counted else ():
        items = _unique(items)  # (what the cache answers was never recorded)
        prompt_tokens = pricing.prompt_tokens_for(task, items, config.llm.model, prompts.prompt_set(config.llm.prompts)) \
            if items else []
        output = sum(min(OUTPUT_TOKENS[task](t), config.llm.max_output_tokens) for t in prompt_tokens)
        tasks[task] = (len(items), int(sum(prompt_tokens)), int(output))
    priced = pricing.estimate_cost(config.llm.model, tasks, config.llm.price_per_million_tokens) if tasks else \
        {"tasks": {}, "total": {"calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}, "note": ""}
    if config.embedding.backend == "litellm":
        embedder = Embedder(config.embedding, cache)
        keys = [embedder.cache_key(text) for text in embedded]
        cached = cache.get_many(EMBEDDING, keys) if cache is not None else {}
        texts = [text for text, key in zip(embedded, keys, strict=True) if key not in cached]
        tokens = int(sum(nlp.count_tokens(texts))) if texts else 0  # the one tokenizer's count, not the provider's
        batch = config.embedding.batch_size
        cost = pricing.price_of(config.embedding.model, tokens, 0, config.embedding.price_per_million_tokens)
        priced["tasks"]["embedding"] = {"calls": -(-len(texts) // batch), "input_tokens": tokens, "output_tokens": 0,
                                        "cost_usd": cost}
        priced["total"]["calls"] += priced["tasks"]["embedding"]["calls"]
        priced["total"]["input_tokens"] += tokens
        if cost is None or priced["total"]["cost_usd"] is None:
            priced["total"]["cost_usd"] = None
        else:
            priced["total"]["cost_usd"] += cost

    def money(value) -> str:
        return "unknown price" if value is None else f"${value:.4f}"

    return {
        "model": config.llm.model,
        "method": "offline-engine pass over the corpus; decomposition exact, later stages from the offline graph",
        "tasks": {task: {**{k: row[k] for k in ("calls", "input_tokens", "output_tokens")}, "cost": money(row["cost_usd"])}
                  for task, row in priced["tasks"].items()},
        "total": {**{k: priced["total"][k] for k in ("calls", "input_tokens", "output_tokens", "cost_usd")},
                  "cost": money(priced["total"]["cost_usd"])},
        "note": priced.get("note", ""),
    }


def _earlier_chunks(ws: Workspace, scratch: Workspace) -> Callable[[ChunkInput], ChunkInput | None]:
    """For a chunk of this run, the workspace's chunk at the same place (document and ordinal) if
    its text differs: what the model was asked about that place before. Both chunk tables are read
    when first needed (the scratch one exists once the chunk stage ran)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def read(workspace: Workspace) -> list[dict]:
        """The chunk table's rows; none when it is missing or unreadable (the run itself names a
        damaged file; the estimate then decomposes those chunks offline)."""
        try:
            return pq.read_table(CHUNKS.path(workspace), columns=["chunk_id", "doc_id", "ordinal", "title", "text"]
                                 ).to_pylist()
        except (OSError, pa.ArrowException):
            return []

    @functools.cache
    def places() -> dict[str, dict | None]:
        before = {(c["doc_id"], c["ordinal"]): c for c in read(ws)}
        return {c["chunk_id"]: before.get((c["doc_id"], c["ordinal"])) for c in read(scratch)}

    def earlier(chunk: ChunkInput) -> ChunkInput | None:
        old = places().get(chunk.chunk_id)
        return None if old is None or old["text"] == chunk.text else \
            ChunkInput(chunk_id=old["chunk_id"], text=old["text"], title=old["title"])

    return earlier


def _embedded_texts(scratch: Workspace, recorder: _RecordingEngine) -> list[str]:
    """Each distinct text the build would embed: its chunks, and the offline graph's units,
    attributes and high-level elements."""
    import pyarrow.parquet as pq

    texts = [chunk.text for chunk in recorder.seen["decompose"]]
    for output in (DECOMPOSE_NODES, ATTRIBUTE_NODES, COMMUNITY_NODES):  # the text stage's are the chunks
        path = output.path(scratch)
        if path.is_file():
            nodes = pq.read_table(path, columns=["type", "text"]).to_pylist()
            texts += [n["text"] for n in nodes if n["type"] in EMBEDDED_TYPES]
    return list(dict.fromkeys(texts))


def _unique(items: list) -> list:
    """Each distinct task input once (a chunk shared by two documents is one call)."""
    return list({repr(item): item for item in items}.values())


def spending_cap(ws: Workspace, input_folder: Path, config: Config, rebuild: bool = False) -> SpendingCap | None:
    """The run's spending cap (`llm.max_cost_usd`) for the transports to enforce, once the run's
    estimate is known to fit in it. BadInputError (the run does not start) when a paid model has no
    price to count with, or when the estimate is over the cap. None without a cap or a paid model."""
    from ..engines import pricing

    limit = config.llm.max_cost_usd
    paid = config.paid()
    if limit is None or not paid:
        return None
    for section, settings in paid:
        if pricing.price_of(settings.model, 1000, 1000, settings.price_per_million_tokens) is None:
            raise BadInputError(f"a spending cap needs the price of {settings.model}, which litellm's price table "
                                f"does not have: set {section}.price_per_million_tokens (input and output, USD)")
    estimate = estimate_llm(ws, input_folder, config, rebuild)["total"]["cost_usd"]
    if estimate > limit:
        raise BadInputError(f"this run is estimated at ${estimate:.4f}, over the spending cap of ${limit:.4f} "
                            f"(llm.max_cost_usd): raise it with --max-cost {_round_up(estimate * 1.3)}, or see the "
                            "estimate with --dry-run")
    return SpendingCap(limit)


def _round_up(usd: float) -> str:
    """A cap to suggest: two significant figures, rounded up."""
    import math

    if usd <= 0:
        return "0.01"
    step = 10 ** (math.floor(math.log10(usd)) - 1)
    return f"{math.ceil(usd / step) * step:.{max(0, -math.floor(math.log10(step)))}f}"
