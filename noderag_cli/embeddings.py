"""Text embeddings: the bundled `wordllama` model by default (weights ship in its wheel,
loaded from the package folder with downloads disabled), litellm by config.

Every vector goes through the workspace cache keyed by model and text, so nothing is
embedded twice: not in a resumed run, not in an incremental update.

The bundled model is a token-embedding table, mean-pooled. We pool each text over exactly its
own tokens (wordllama's `embed` pools over padded batches, whose summation order depends on the
longest text in the batch), so a text's vector is the same bits whichever texts it is embedded
with: a fresh build and an update agree exactly, and no time goes into padding.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass

import numpy as np

from . import nlp
from .config import ConfigError, EmbeddingConfig
from .workspace import Cache

POOLING = "pool-own-tokens"  # part of the cache key: vectors pooled otherwise are not mixed in
POOL_TOKENS = 4096  # tokens gathered at a time: 4 MB of vectors stay in cache (65,536 took 50% longer)


def mean_pool(model, texts: list[str], remembered: bool = False) -> np.ndarray:
    """Mean of each text's token vectors (a text without tokens gets zeros). `remembered`: take
    the token ids from the one tokenizer's memory (indexing counted most of these texts already)."""
    table = model.embedding
    out = np.zeros((len(texts), table.shape[1]), np.float32)
    if remembered and model.tokenizer is nlp._tokenizer():
        ids = nlp.token_ids(texts)
    else:
        ids = [encoding.ids for encoding in model.tokenizer.encode_batch(texts, add_special_tokens=False)]
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    start = 0
    while start < len(texts):
        stop, tokens = start, 0
        while stop < len(texts) and (stop == start or tokens + lengths[stop] <= POOL_TOKENS):
            tokens += lengths[stop]
            stop += 1
        rows = np.flatnonzero(lengths[start:stop]) + start
        if len(rows):
            token_ids = np.fromiter(itertools.chain.from_iterable(ids[start:stop]), np.int64, int(lengths[start:stop].sum()))
            np.clip(token_ids, 0, len(table) - 1, out=token_ids)
            offsets = np.r_[0, np.cumsum(lengths[rows])[:-1]]
            sums = np.add.reduceat(table[token_ids], offsets, axis=0)
            out[rows] = sums / lengths[rows, None].astype(np.float32)
        start = stop
    return out


@dataclass
class TokenTable:
    """A static embedding model: one vector per token id, and the tokenizer that gives the ids."""

    embedding: np.ndarray  # (vocabulary, dim) float32
    tokenizer: object  # tokenizers.Tokenizer


class Embedder:
    def __init__(self, config: EmbeddingConfig, cache: Cache | None = None):
        self.config = config
        self.cache = cache
        self.model_id = f"{config.backend}:{config.model}:{config.dim}"
        # what decides a vector's bits: the model and, for the bundled one, how it is pooled
        self.vector_id = f"{self.model_id}:{POOLING}" if config.backend == "wordllama" else self.model_id
        self._model = None
        self._memo: dict[str, np.ndarray] = {}  # text -> vector, for the life of this embedder
        self.computed = 0  # vectors embed() computed (not found in memory or cache)

    @property
    def dim(self) -> int:
        return self.config.dim

    def _load(self):
        """The bundled token-embedding table (float32) and its tokenizer, read straight from the
        wordllama wheel's files: importing wordllama and letting it load a second copy of the
        tokenizer would add ~0.2 s to every run."""
        if self._model is None and self.config.backend == "wordllama":
            from safetensors import safe_open

            package = nlp.wordllama_folder()
            weights = package / "weights" / f"{self.config.model}_{self.config.dim}.safetensors"
            tokenizer_file = package / "tokenizers" / f"{self.config.model}_tokenizer_config.json"
            if not weights.is_file() or not tokenizer_file.is_file():
                bundled = sorted(p.stem for p in (package / "weights").glob("*.safetensors"))
                raise ConfigError(
                    f"embedding model {self.config.model} with dim {self.config.dim} is not bundled with wordllama "
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
            self._model = TokenTable(table, tokenizer)
        return self._model

    def _compute(self, texts: list[str], remembered: bool = False) -> np.ndarray:
        if self.config.backend == "litellm":
            from .engines.llm import litellm_embed

            return litellm_embed(texts, self.config)
        return mean_pool(self._load(), texts, remembered)

    def embed_query(self, text: str) -> np.ndarray:
        """One L2-normalised vector, uncached: the query path's hot call."""
        vector = self._compute([text])[0].astype(np.float32)
        norm = np.linalg.norm(vector)
        return vector / norm if norm else vector

    def remember(self, texts: list[str], vectors: np.ndarray) -> None:
        """Take vectors this embedder made earlier (same `vector_id`) into its memory, so that they
        are not looked up in the cache again."""
        self._memo.update(zip(texts, vectors, strict=True))

    def embed(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 vectors, one row per text: from this embedder's memory (the stages
        of one run ask for the same texts), else the workspace cache, else computed and cached."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        missing = list(dict.fromkeys(t for t in texts if t not in self._memo))
        if missing:
            keys = [hashlib.blake2b(f"{self.vector_id}\x1f{t}".encode(), digest_size=16).hexdigest() for t in missing]
            found = self.cache.get_many("embedding", keys) if self.cache else {}
            fresh = []
            for text, key in zip(missing, keys, strict=True):
                blob = found.get(key)
                if blob is None:
                    fresh.append((text, key))
                else:
                    self._memo[text] = np.frombuffer(blob, dtype=np.float32)
            for start in range(0, len(fresh), 4096):
                part = fresh[start : start + 4096]
                vectors = self._compute([text for text, _ in part], remembered=True)
                self.computed += len(part)
                norms = np.linalg.norm(vectors, axis=1, keepdims=True)
                vectors = (vectors / np.where(norms == 0, 1, norms)).astype(np.float32)
                self._memo.update((text, vector) for (text, _), vector in zip(part, vectors, strict=True))
                if self.cache:
                    self.cache.put_many("embedding", [(key, v.tobytes()) for (_, key), v in zip(part, vectors, strict=True)])
        memo = self._memo
        return np.stack([memo[t] for t in texts])
