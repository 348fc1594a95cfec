"""litellm, imported once per process on first use (seconds of import, never at module import),
with its price table local (never fetched at run time) and its own retries and chatter off: the
transport retries and counts each wait itself."""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Any

_LITELLM: Any = None
_IMPORT_LOCK = threading.Lock()


def load_litellm():
    """litellm, imported on first use with its price table local and its chatter off."""
    global _LITELLM
    if _LITELLM is None:
        with _IMPORT_LOCK:
            if _LITELLM is None:
                os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
                os.environ.setdefault("LITELLM_LOG", "CRITICAL")
                # its pydantic models warn about ReadOnly TypedDict items, at import and first use
                warnings.filterwarnings("ignore", message=r"Items? '.*' on TypedDict class", category=UserWarning)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    import litellm

                litellm.telemetry = False
                litellm.suppress_debug_info = True
                litellm.disable_hf_tokenizer_download = True  # token counts must never hit the network
                # the transport retries, and counts each wait; litellm's embedding path reads an explicit
                # max_retries=0 as "unset" and would retry 429s unseen with this default
                litellm.DEFAULT_MAX_RETRIES = 0
                for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm", "httpx", "openai"):
                    logging.getLogger(name).setLevel(logging.CRITICAL)
                _LITELLM = litellm
    return _LITELLM
