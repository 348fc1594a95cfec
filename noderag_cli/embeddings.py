"""Text embeddings: the bundled `wordllama` model by default (weights ship in its wheel,
loaded from the package folder with downloads disabled), a model behind litellm by config (its
requests through `engines/transport.py`, the one way to a model: key, retries, 429 waits,
accounting).

Every vector goes through the workspace cache keyed by model and text, so nothing is
embedded twice: not in a resumed run, not in an incremental update.

The bundled model is a token-embedding table, mean-pooled. We pool each text over exactly its
own tokens (wordllama's `embed` pools over padded batches, whose summation order depends on the
longest text in the batch), so a text's vector is the same bits whichever texts it is embedded
with: a fresh build and an update agree exactly, and no time goes into padding.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import nlp
from .cache import EMBEDDING, Cache
from .config import EmbeddingConfig
from .errors import ConfigError, EngineError, SpendingCapError, WorkspaceError
from .executor import Executor
from .ivf import STORED_DTYPE, in_parallel, on_stored_grid
from .spill import Spill, release

POOLING = "pool-own-tokens"  # part of the cache key: vectors pooled otherwise are not mixed in
STORED = "fp16"  # part of a vector's identity: rounded to the precision a build stores (ivf.on_stored_grid)
EMBED_BATCH = 4096  # texts per batch of work
POOL_TOKENS = 4096  # tokens gathered at a time: 4 MB of vectors stay in cache (65,536 took 50% longer)
# a model behind litellm: its requests' retry policy and how many are in flight at once
REMOTE = {"retries": 5, "rate_limit_wait": 600.0, "timeout": 120.0, "concurrency": 4}


def mean_pool(model, texts: list[str]) -> np.ndarray:
    """Mean of each text's token vectors (a text without tokens gets zeros), pooled on every core
    (each text alone, so the threads change no bit)."""
    table = model.embedding
    out = np.zeros((len(texts), table.shape[1]), np.float32)
    if model.tokenizer is nlp._tokenizer():
        ids = nlp.token_ids(texts)
    else:
        ids = [encoding.ids for encoding in model.tokenizer.encode_batch(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    ranges, start = [], 0
    while start < len(texts):
        stop, tokens = start, 0
        while stop < len(texts) and (stop == start or tokens + lengths[stop] <= POOL_TOKENS):
            tokens += lengths[stop]
            stop += 1
        ranges.append((start, stop))
        start = stop

    def pool(bounds: tuple[int, int]) -> None:
        start, stop = bounds
        rows = np.flatnonzero(lengths[start:stop]) + start
        if len(rows):
            token_ids = np.fromiter(itertools.chain.from_iterable(ids[start:stop]), np.int64, int(lengths[start:stop].sum()))
            np.clip(token_ids, 0, len(table) - 1, out=token_ids)
            offsets = np.r_[0, np.cumsum(lengths[rows])[:-1]]
            out[rows] = np.add.reduceat(table[token_ids], offsets, axis=0) / lengths[rows, None].astype(np.float32)

    in_parallel(pool, ranges) if len(ranges) > 1 else [pool(r) for r in ranges]
    return out


@dataclass
class TokenTable:
    """A static embedding model: one vector per token id, and the tokenizer that gives the ids."""

    embedding: np.ndarray  # (vocabulary, dim) float32
    tokenizer: object  # tokenizers.Tokenizer


_MODELS: dict[tuple[str, int], TokenTable] = {}  # loaded bundled models, per process
_LOADING = threading.Lock()


def load_model(config: EmbeddingConfig) -> TokenTable:
    """The bundled token-embedding table (float32) and its tokenizer, read straight from the
    wordllama wheel's files (importing wordllama and letting it load a second copy of the
    tokenizer would add its loading time to every run's start-up); loaded once per process, by
    whichever thread asks first (`Embedder` starts loading it ahead)."""
    key = (config.model, config.dim)
    if key not in _MODELS:
        with _LOADING:
            if key not in _MODELS:
                _MODELS[key] = _read_model(config)
    return _MODELS[key]


def _read_model(config: EmbeddingConfig) -> TokenTable:
    from safetensors import safe_open

    package = nlp.wordllama_folder()
    weights = package / "weights" / f"{config.model}_{config.dim}.safetensors"
    tokenizer_file = package / "tokenizers" / f"{config.model}_tokenizer_config.json"
    if not weights.is_file() or not tokenizer_file.is_file():
        bundled = sorted(p.stem for p in (package / "weights").glob("*.safetensors"))
        raise ConfigError(
            f"embedding model {config.model} with dim {config.dim} is not bundled with wordllama "
            f"(bundled: {', '.join(bundled)}); nothing is downloaded at run time"
        )
    with safe_open(str(weights), framework="np", device="cpu") as handle:
        table = np.ascontiguousarray(handle.get_tensor("embedding.weight").astype(np.float32))
    if tokenizer_file.name == nlp.TOKENIZER_FILE:
        tokenizer = nlp._tokenizer()  # the one tokenizer: loaded once per process
    else:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        tokenizer.no_padding()
        tokenizer.no_truncation()
    return TokenTable(table, tokenizer)


def _load_ahead(config: EmbeddingConfig) -> None:
    """load_model on a thread (reading and widening the table release the GIL); a model that
    cannot be loaded says so when it is used, not here."""
    def load() -> None:
        try:
            load_model(config)
        except Exception:  # noqa: BLE001 - reported by the first real use
            pass

    threading.Thread(target=load, name="load-embedding-model", daemon=True).start()


def normalised(vectors: np.ndarray) -> np.ndarray:
    """Unit rows, rounded to the precision a build stores them in."""
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return on_stored_grid(vectors / np.where(norms == 0, 1, norms))


def embed_bundled(job: tuple[EmbeddingConfig, list[str]]) -> np.ndarray:
    """L2-normalised vectors of texts with the bundled model, in the half precision they are on
    (exact, and half the bytes to send back): an executor worker's share of `Embedder.embed`, or
    the whole of it in this process."""
    config, texts = job
    return normalised(mean_pool(load_model(config), texts)).astype(STORED_DTYPE)


def remote_transport(config: EmbeddingConfig):
    """The transport to an embedding model behind litellm (no request or token limit of its own)."""
    from .engines.base import EngineStats
    from .engines.transport import Transport
    from .limiter import SlidingWindowLimiter

    return Transport(config.model, setting="embedding", api_base=config.api_base, api_key_env=config.api_key_env,
                     stats=EngineStats(), limiter=SlidingWindowLimiter(None, None),
                     price=config.price_per_million_tokens, **REMOTE)


def remote_vectors(transport, texts: list[str], config: EmbeddingConfig) -> np.ndarray:
    """Vectors of `texts` from a model behind litellm, `config.batch_size` texts per request, as
    the model gives them (not normalised); EngineError (one line) when the model cannot be asked
    or gives vectors of another dimension than `config.dim`."""
    from .engines.litellm_import import load_litellm
    from .engines.transport import CAP_REACHED, _CallFailed

    auth = transport.auth()  # a missing key or an unroutable model, before any request
    lt = load_litellm()
    stats = transport.stats.task("embedding")

    async def one(batch: list[str]) -> np.ndarray:
        response = await transport.send(stats, 0, lambda: lt.aembedding(
            model=config.model, input=batch, timeout=transport.timeout, num_retries=0, max_retries=0, **auth),
            task="embedding", cost_tokens=(sum(nlp.count_tokens(batch)), 0))
        data = sorted(response.data, key=lambda d: d["index"] if isinstance(d, dict) else d.index)
        vectors = np.asarray([d["embedding"] if isinstance(d, dict) else d.embedding for d in data], dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[0] != len(batch):
            raise EngineError(f"embedding model {config.model} returned {len(data)} vectors for {len(batch)} texts")
        if vectors.shape[1] != config.dim:
            raise EngineError(f"embedding model {config.model} returns {vectors.shape[1]}-dimensional vectors "
                              f"but embedding.dim is {config.dim}; set embedding.dim: {vectors.shape[1]}")
        return vectors

    async def run(_report) -> list[np.ndarray]:
        return await asyncio.gather(*(one(texts[i : i + config.batch_size])
                                      for i in range(0, len(texts), config.batch_size)))

    try:
        return np.concatenate(transport.run(run))
    except _CallFailed as err:
        if err.category == CAP_REACHED:
            raise SpendingCapError(transport.cap.stopped_message()) from None
        raise EngineError(f"embedding with {config.model} at {transport.where()} failed: "
                          f"{transport.safe(str(err))}") from None


def model_id(config: EmbeddingConfig) -> str:
    """What names a model's vectors in a workspace (its manifest's `embedding.model`)."""
    return f"{config.backend}:{config.model}:{config.dim}"


def check_embedding(workspace, recorded: str | None, wanted: str) -> None:
    """A workspace's vectors are searched and extended only with the model that made them
    (`recorded`, None before the first build): the one refusal of another."""
    if recorded and recorded != wanted:
        raise WorkspaceError(f"workspace {workspace} holds vectors of the embedding model {recorded}, the config asks "
                             f"for {wanted}: search it with its own model, or index into a new workspace for another")


MEMORY_BLOCK = 65_536  # rows of a block of an embedder's memory


class VectorMemory:
    """An embedder's vectors by text, in half precision: a sorted array of 16-byte digests of the
    texts with each one's row, and the rows in blocks of `MEMORY_BLOCK` (a block given whole, as
    the last build's mapped vectors, is held as given). 24 bytes a vector besides its 512, where
    a dict of the texts to a numpy row each holds some 900 and keeps every text alive (2 GB more
    at a million passages' five million vectors). The digests added lately wait in a dict until
    they are a quarter of the sorted ones, then are sorted in: a stage that adds a few texts at
    each of many calls (the offline engine's attributes) does not sort the whole array each time."""

    def __init__(self, dim: int):
        self.dim = dim
        self._spill: Spill | None = None  # where the blocks go when not in memory (`hold_in_files`)
        self.clear()

    def hold_in_files(self, folder: Path) -> None:
        """The blocks in files under `folder` (`spill.Spill.always`), each one's pages let go from
        the process once written or read: for a run not expected to fit its memory budget, which
        holds these vectors through four stages. The blocks made before (an update's vectors taken
        back from the last build while the folder was scanned) are moved there; one given whole
        (the last build's mapped file) stays as it is."""
        self._spill = Spill.always(folder)
        for number, block in enumerate(self._blocks):
            if number not in self._given:
                self._blocks[number] = self._spill.empty(block.shape, block.dtype)
                self._blocks[number][...] = block
                release(self._blocks[number])

    @property
    def spilled_mb(self) -> float:
        return self._spill.spilled_mb if self._spill is not None else 0.0

    def clear(self) -> None:
        if self._spill is not None:
            self._spill.close()
        self._keys = np.zeros(0, "S16")  # sorted
        self._rows = np.zeros(0, np.int64)  # per key, its row
        self._recent: dict[bytes, int] = {}  # digests not sorted in yet, and their rows
        self._blocks: list[np.ndarray] = []
        self._starts: list[int] = []  # the first row of each block
        self._given: set[int] = set()  # the blocks given whole (`add`), not made here
        self._open = 0  # rows free at the end of the last block (0: it is full, or one given whole)
        self.size = 0

    @staticmethod
    def digests(texts: list[str]) -> np.ndarray:
        return np.frombuffer(b"".join(hashlib.blake2b(t.encode("utf-8", "surrogatepass"), digest_size=16).digest()
                                      for t in texts), "S16")

    def find(self, keys: np.ndarray) -> np.ndarray:
        """Per digest, its row, -1 where none is held."""
        rows = np.full(len(keys), -1, np.int64)
        if len(self._keys):
            at = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
            rows = np.where(self._keys[at] == keys, self._rows[at], -1)
        if self._recent:
            unsorted = np.flatnonzero(rows < 0)
            rows[unsorted] = [self._recent.get(key, -1) for key in keys[unsorted].tolist()]
        return rows

    def _index(self, keys: np.ndarray, rows: np.ndarray) -> None:
        self._recent.update(zip(keys.tolist(), rows.tolist(), strict=True))  # bytes: injective on 16 bytes
        if len(self._recent) > max(MEMORY_BLOCK, len(self._keys) // 4):
            merged = np.concatenate([self._keys, np.array(list(self._recent), "S16")])
            order = np.argsort(merged, kind="stable")
            self._keys = merged[order]
            self._rows = np.concatenate([self._rows, np.fromiter(self._recent.values(), np.int64,
                                                                 len(self._recent))])[order]
            self._recent = {}

    def add(self, keys: np.ndarray, vectors: np.ndarray, whole: bool = False) -> None:
        """Hold `vectors` for the distinct `keys` (none held yet); `whole`: as one block as given
        (a mapped file stays mapped), else copied into blocks."""
        vectors = np.asarray(vectors).astype(STORED_DTYPE, copy=False)
        self._index(keys, self.size + np.arange(len(keys), dtype=np.int64))
        if whole:
            self._given.add(len(self._blocks))
            self._blocks.append(vectors)
            self._starts.append(self.size)
            self._open = 0
            self.size += len(vectors)
            return
        done = 0
        while done < len(vectors):
            if not self._open:
                shape = (MEMORY_BLOCK, self.dim)
                self._blocks.append(self._spill.empty(shape, STORED_DTYPE) if self._spill else
                                    np.empty(shape, STORED_DTYPE))
                self._starts.append(self.size)
                self._open = MEMORY_BLOCK
            block, used = self._blocks[-1], MEMORY_BLOCK - self._open
            part = vectors[done : done + self._open]
            block[used : used + len(part)] = part
            release(block)
            self._open -= len(part)
            done += len(part)
            self.size += len(part)

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The vectors of `rows`, stacked."""
        out = np.empty((len(rows), self.dim), STORED_DTYPE)
        starts = np.asarray(self._starts, np.int64)
        block = np.searchsorted(starts, rows, "right") - 1
        order = np.argsort(block, kind="stable")
        bounds = np.searchsorted(block[order], np.arange(len(starts) + 1))
        for number, (low, high) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if high > low:
                picked = order[low:high]
                out[picked] = self._blocks[number][rows[picked] - starts[number]]
                release(self._blocks[number])
        return out


class Embedder:
    def __init__(self, config: EmbeddingConfig, cache: Cache | None = None, executor: Executor | None = None,
                 cap=None):
        """`cap`: the run's spending cap (engines/transport.SpendingCap), for a model behind litellm."""
        self.config = config
        self.cache = cache
        self.executor = executor
        self.model_id = model_id(config)
        # what a model's reply is cached under: the model and, for the bundled one, how it is pooled
        self._computed_id = f"{self.model_id}:{POOLING}" if config.backend == "wordllama" else self.model_id
        self.vector_id = f"{self._computed_id}:{STORED}"  # what decides the bits of a vector embed() returns
        # the vectors of this run's texts, in the half precision they are on (exact), until the embed stage
        self._memory = VectorMemory(config.dim)
        self._transport = None  # to a model behind litellm, made on its first request
        self.cap = cap
        self.computed = 0  # vectors embed() computed (not found in memory or cache)
        if config.backend == "wordllama":
            _load_ahead(config)

    @property
    def dim(self) -> int:
        return self.config.dim

    def _compute(self, texts: list[str]) -> np.ndarray:
        if self.config.backend == "litellm":
            if self._transport is None:
                self._transport = remote_transport(self.config)
                self._transport.cap = self.cap
            return remote_vectors(self._transport, texts, self.config)
        return mean_pool(load_model(self.config), texts)

    def embed_query(self, text: str) -> np.ndarray:
        """One L2-normalised vector, uncached: the query path's hot call."""
        vector = self._compute([text])[0].astype(np.float32)
        norm = np.linalg.norm(vector)
        return vector / norm if norm else vector

    def forget(self) -> None:
        """Let go of the vectors in memory (once the embed stage has written them all)."""
        self._memory.clear()

    def hold_in_files(self, folder: Path) -> None:
        """The vectors this embedder holds from now on in files under `folder`, not in the process
        (`VectorMemory.hold_in_files`)."""
        self._memory.hold_in_files(folder)

    @property
    def spilled_mb(self) -> float:
        """Megabytes of vectors this embedder has held in files (`hold_in_files`)."""
        return self._memory.spilled_mb

    def remember(self, keys: np.ndarray, vectors: np.ndarray) -> None:
        """Take vectors this embedder made earlier (same `vector_id`) into its memory, by the
        digests of their texts (`VectorMemory.digests`), so that they are not looked up in the
        cache again."""
        distinct_keys, first = np.unique(keys, return_index=True)
        first = np.sort(first[self._memory.find(distinct_keys) < 0])  # each text not held yet, once
        if len(first) == len(keys):
            self._memory.add(keys, vectors, whole=True)  # as given: a mapped file stays mapped
        elif len(first):
            self._memory.add(keys[first], np.asarray(vectors)[first])

    def cache_key(self, text: str) -> str:
        return hashlib.blake2b(f"{self._computed_id}\x1f{text}".encode(), digest_size=16).hexdigest()

    def embed(self, texts: list[str], dtype=np.float32) -> np.ndarray:
        """L2-normalised vectors on the stored (half-precision) grid, one row per text, as `dtype`
        (float32, or STORED_DTYPE: the rows as held, half the memory): from this embedder's memory
        (the stages of one run ask for the same texts, and an update's unchanged nodes come with
        the last build's vectors), else computed (`embed_ahead`)."""
        return self.embed_with_digests(texts, dtype)[1]

    def embed_with_digests(self, texts: list[str], dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
        """`embed`, with the digests of the texts (`VectorMemory.digests`) it found them by."""
        if not texts:
            return np.zeros(0, "S16"), np.zeros((0, self.dim), dtype=dtype)
        keys = self.embed_ahead(texts)
        return keys, self._memory.take(self._memory.find(keys)).astype(dtype, copy=False)

    def embed_ahead(self, texts: list[str]) -> np.ndarray:
        """The vectors of `texts` into this embedder's memory (their digests returned, which
        `embed` looks them up by): for a stage that has the texts at hand before a later one asks
        for them (a build's every unit and chunk would otherwise be copied into one float32 array,
        1 GB at 200,000 passages, only to be dropped).
        The bundled model's vectors are computed on the executor's workers and never cached: they
        cost less to compute than to read back, and the build holds them once. A model behind
        litellm is paid per call: its vectors go through the workspace cache."""
        if self.cache is not None and self.cache.recording and self.config.backend != "wordllama":
            self.cache.touch(EMBEDDING, map(self.cache_key, dict.fromkeys(texts)))  # memory's too: still needed
        keys = VectorMemory.digests(texts)
        absent = np.flatnonzero(self._memory.find(keys) < 0)
        at = absent[np.sort(np.unique(keys[absent], return_index=True)[1])]  # each text once, in order
        missing = [texts[i] for i in at.tolist()]
        missing_keys = keys[at]
        if missing and self.config.backend == "wordllama":
            batches = [(self.config, missing[i : i + EMBED_BATCH]) for i in range(0, len(missing), EMBED_BATCH)]
            for start, vectors in zip(range(0, len(missing), EMBED_BATCH),
                                      (self.executor or Executor()).map(embed_bundled, batches), strict=True):
                self._memory.add(missing_keys[start : start + EMBED_BATCH], vectors)
            self.computed += len(missing)
        elif missing:
            cache_keys = [self.cache_key(t) for t in missing]
            found = self.cache.get_many(EMBEDDING, cache_keys) if self.cache else {}
            fresh, held, blobs = [], [], []
            for position, (text, key) in enumerate(zip(missing, cache_keys, strict=True)):
                blob = found.get(key)
                if blob is None:
                    fresh.append((text, key, position))
                else:
                    held.append(position)
                    blobs.append(blob)
            if held:  # cached before rounding
                self._memory.add(missing_keys[held], np.frombuffer(b"".join(blobs), np.float32).reshape(len(held), -1))
            for start in range(0, len(fresh), EMBED_BATCH):
                part = fresh[start : start + EMBED_BATCH]
                vectors = normalised(self._compute([text for text, _, _ in part]))
                self.computed += len(part)
                self._memory.add(missing_keys[[position for _, _, position in part]], vectors.astype(STORED_DTYPE))
                if self.cache:
                    self.cache.put_many(EMBEDDING, [(key, v.tobytes()) for (_, key, _), v in zip(part, vectors, strict=True)])
        return keys
