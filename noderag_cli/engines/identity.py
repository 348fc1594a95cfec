"""An engine's identity: what decides its output, computed here and nowhere else.

It keys the decomposition cache and is part of every LLM stage's fingerprint, so that a change
re-runs exactly the work it would change. The prompt set is read only for an LLM engine (the
offline engine's runs never import the prompts).
"""

from __future__ import annotations

from ..config import LLMConfig
from ..errors import ConfigError

OFFLINE_NAME = "offline-v2"  # the offline engine's version: a change to its rules changes it


def identity(llm: LLMConfig, prompt_set=None) -> dict:
    """Its name (the offline engine's version; the litellm model and the digest of its prompt set,
    `prompt_set` if given, else the one `llm.prompts` names) and an LLM's sampling and grounding
    settings."""
    if llm.engine == "offline":
        return {"name": OFFLINE_NAME, "engine": "offline"}
    if prompt_set is None:
        from . import prompts

        try:
            prompt_set = prompts.prompt_set(llm.prompts)
        except ValueError as err:
            raise ConfigError(str(err)) from None
    return {"name": f"litellm:{llm.model}:p{prompt_set.digest}", "engine": "litellm", "model": llm.model,
            "temperature": llm.temperature, "max_output_tokens": llm.max_output_tokens, "grounding": llm.grounding}
