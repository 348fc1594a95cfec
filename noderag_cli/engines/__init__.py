"""The engines that do NodeRAG's LLM tasks: the offline engine and litellm's, behind `base.Engine`.
`make_engine` picks the one a config names (each imported only when chosen)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..cache import Cache
    from ..config import Config, LLMConfig
    from ..embeddings import Embedder
    from .base import Engine


def engine_class(llm: LLMConfig) -> type[Engine]:
    """The class of the engine `llm.engine` names, for its declared capabilities before one is made."""
    if llm.engine == "litellm":
        from .llm import LiteLLMEngine

        return LiteLLMEngine
    from .offline import OfflineEngine

    return OfflineEngine


def make_engine(config: Config, cache: Cache | None, embedder: Embedder, executor=None,
                notice: Callable[[str], None] | None = None, cap=None) -> Engine:
    """The engine a config names; with a cluster's `executor`, its LLM calls run on the cluster.
    `notice` shows an LLM engine's waits on the server; `cap` is the run's spending cap."""
    if config.llm.engine == "litellm":
        from .llm import LiteLLMEngine

        # it checks the server before its first request: a run with nothing to ask never calls out
        return LiteLLMEngine(config.llm, cache, executor=executor, check_connection=True, notice=notice, cap=cap)
    from .offline import OfflineEngine

    return OfflineEngine(embedder, cache)
