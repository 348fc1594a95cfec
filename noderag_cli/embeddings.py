"""Text embeddings: the bundled `wordllama` model by default (weights ship in its wheel,
loaded from the package folder with downloads disabled), litellm by config.

Every vector goes through the workspace cache keyed by model and text, so nothing is
embedded twice: not in a resumed run, not in an incremental update.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from .config import ConfigError, EmbeddingConfig
from .workspace import Cache


class Embedder:
    def __init__(self, config: EmbeddingConfig, cache: Cache | None = None):
        self.config = config
        self.cache = cache
        self.model_id = f"{config.backend}:{config.model}:{config.dim}"
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
        vectors = self._load().embed(texts, norm=True, batch_size=self.config.batch_size)
        return np.asarray(vectors, dtype=np.float32)

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
        keys = [hashlib.blake2b(f"{self.model_id}\x1f{t}".encode(), digest_size=16).hexdigest() for t in texts]
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
