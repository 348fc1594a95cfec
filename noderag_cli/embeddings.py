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
from pathlib import Path

import numpy as np

from .config import ConfigError, EmbeddingConfig
from .workspace import Cache

POOLING = "pool-own-tokens"  # part of the cache key: vectors pooled otherwise are not mixed in
POOL_TOKENS = 65_536  # tokens gathered at a time


def mean_pool(model, texts: list[str]) -> np.ndarray:
    """Mean of each text's token vectors (a text without tokens gets zeros)."""
    table = model.embedding
    out = np.zeros((len(texts), table.shape[1]), np.float32)
    model.tokenizer.no_padding()
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


class Embedder:
    def __init__(self, config: EmbeddingConfig, cache: Cache | None = None):
        self.config = config
        self.cache = cache
        self.model_id = f"{config.backend}:{config.model}:{config.dim}"
        self._cache_id = f"{self.model_id}:{POOLING}" if config.backend == "wordllama" else self.model_id
        self._model = None

    @property
    def dim(self) -> int:
        return self.config.dim

    def _load(self):
        if self._model is None and self.config.backend == "wordllama":
            import wordllama
            from wordllama import WordLlama

            package = Path(wordllama.__file__).parent
            try:
                self._model = WordLlama.load(
                    config=self.config.model, dim=self.config.dim, cache_dir=package, disable_download=True
                )
            except (FileNotFoundError, ValueError, KeyError) as err:
                bundled = sorted(p.stem for p in (package / "weights").glob("*.safetensors"))
                raise ConfigError(
                    f"embedding model {self.config.model} with dim {self.config.dim} is not bundled with wordllama "
                    f"(bundled: {', '.join(bundled)}); nothing is downloaded at run time"
                ) from err
        return self._model

    def _compute(self, texts: list[str]) -> np.ndarray:
        if self.config.backend == "litellm":
            from .engines.llm import litellm_embed

            return litellm_embed(texts, self.config)
        return mean_pool(self._load(), texts)

    def embed_query(self, text: str) -> np.ndarray:
        """One L2-normalised vector, uncached: the query path's hot call."""
        vector = self._compute([text])[0].astype(np.float32)
        norm = np.linalg.norm(vector)
        return vector / norm if norm else vector

    def embed(self, texts: list[str]) -> np.ndarray:
        """L2-normalised float32 vectors, one row per text, cached."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        keys = [hashlib.blake2b(f"{self._cache_id}\x1f{t}".encode(), digest_size=16).hexdigest() for t in texts]
        found = self.cache.get_many("embedding", keys) if self.cache else {}
        missing = {}
        for row, key in enumerate(keys):
            blob = found.get(key)
            if blob is not None:
                out[row] = np.frombuffer(blob, dtype=np.float32)
            else:
                missing.setdefault(key, []).append(row)
        if missing:
            todo_keys = list(missing)
            todo_texts = [texts[missing[k][0]] for k in todo_keys]
            for start in range(0, len(todo_texts), 4096):
                part = self._compute(todo_texts[start : start + 4096])
                norms = np.linalg.norm(part, axis=1, keepdims=True)
                part = part / np.where(norms == 0, 1, norms)
                batch = []
                for key, vector in zip(todo_keys[start : start + 4096], part, strict=True):
                    out[missing[key]] = vector
                    batch.append((key, vector.astype(np.float32).tobytes()))
                if self.cache:
                    self.cache.put_many("embedding", batch)
        return out
