"""Tokens and prices: how many tokens a request holds, and what tokens cost by litellm's local
price table (never fetched at run time). The engine's accounting and the dry-run estimate read them."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ..config import Price
from . import prompts
from .litellm_import import load_litellm

_UNPRICED: set[str] = set()
"""Models litellm's local price table has no price for (the table does not change during a run)."""


def price_of(model: str, input_tokens: int, output_tokens: int, price: Price | None = None) -> float | None:
    """USD for the tokens: at `price` (the config's, per million tokens) when given, else from
    litellm's local price table; None when neither prices the model.

    The lookup costs about 0.1 ms, so a model found without a price is remembered as such and
    the prices of recent (model, tokens) triples are reused.
    """
    if price is not None:
        return (input_tokens * price.input + output_tokens * price.output) / 1e6
    if model in _UNPRICED:
        return None
    cost = _price(model, int(input_tokens), int(output_tokens))
    if cost is None:
        _UNPRICED.add(model)
    return cost


@functools.lru_cache(maxsize=4096)
def _price(model: str, input_tokens: int, output_tokens: int) -> float | None:
    try:
        prompt_cost, completion_cost = load_litellm().cost_per_token(
            model=model, prompt_tokens=input_tokens, completion_tokens=output_tokens
        )
    except Exception:
        return None
    return float(prompt_cost) + float(completion_cost)


def count_tokens(model: str, messages: list[dict]) -> int:
    """Prompt tokens of a request as litellm counts them (tiktoken where the model's tokenizer is unknown).

    litellm's count is additive: a fixed part (which depends only on whether a system message is
    present) plus one term per message. The system prompt is the same for every item of a task,
    so its term is counted once per model and reused; the other messages are counted each time.
    """
    if not _system_first(messages):
        return _count_all(model, messages)
    # count([system, *rest]) = count([system]) + count(rest) - count([]): the fixed part without a
    # system message is in count(rest) and in count([]); the one with it is in count([system])
    return _count_system(model, messages[0]["content"]) + _count_all(model, messages[1:]) - _count_empty(model)


def _system_first(messages: list[dict]) -> bool:
    """A plain system message, then at least one message, none of them a system message."""
    system = messages[0] if messages else None
    return not (system is None or len(messages) == 1 or system.keys() != {"role", "content"}
                or system["role"] != "system" or not isinstance(system["content"], str)
                or any(m.get("role") == "system" for m in messages[1:]))


_MESSAGE_SLACK = 16


def prompt_token_bound(model: str, messages: list[dict]) -> int:
    """At least `count_tokens(model, messages)`, tokenising nothing but the (cached) system prompt.

    In litellm's count a message is a few fixed tokens (3 or 4) plus the tokens of its role and
    content. No token covers less than one byte, so a message's bytes plus 16 bound its term
    (16 also covers tokenizers that add begin and end tokens to each text). Anything else, such
    as a message with a name or non-text content, is counted exactly.
    """
    if not _system_first(messages) or any(
        m.keys() != {"role", "content"} or not isinstance(m["role"], str) or not isinstance(m["content"], str)
        for m in messages[1:]
    ):
        return count_tokens(model, messages)
    return _count_system(model, messages[0]["content"]) + sum(
        _MESSAGE_SLACK + len(m["role"].encode()) + len(m["content"].encode()) for m in messages[1:]
    )


def _count_all(model: str, messages: list[dict]) -> int:
    lt = load_litellm()
    try:
        return int(lt.token_counter(model=model, messages=messages))
    except Exception:
        return int(lt.token_counter(model="gpt-4o-mini", messages=messages))


@functools.lru_cache(maxsize=256)
def _count_system(model: str, content: str) -> int:
    return _count_all(model, [{"role": "system", "content": content}])


@functools.lru_cache(maxsize=64)
def _count_empty(model: str) -> int:
    return _count_all(model, [])


def prompt_tokens_for(task: str, inputs: Sequence[Any], model: str = "gpt-4o-mini",
                      prompt_set: prompts.PromptSet = prompts.BUILT_IN) -> list[int]:
    """Prompt tokens of each task input, with exactly the prompts the engine sends.

    Inputs per task: `decompose` ChunkInput, `attributes` AttributeInput, `community_elements`
    CommunityInput, `query_entities` a question string, `answer` a (question, context) pair.
    Corrective retries are not included (they happen only for bad replies).
    """
    if task not in prompts.SPECS:
        raise ValueError(f"unknown task {task!r}; tasks are {', '.join(prompts.TASKS)}")
    return [count_tokens(model, prompt_set.messages(task, item)) for item in inputs]


def estimate_cost(model: str, calls_by_task: dict[str, tuple[int, int, int]], price: Price | None = None) -> dict:
    """Cost of a planned run from litellm's local price table.

    `calls_by_task` maps a task to (calls, input tokens, output tokens). Returns
    {"model", "price_known", "tasks": {task: {"calls", "input_tokens", "output_tokens",
    "cost_usd"}}, "total": {... same ...}, "note"}; when the model has no price every cost_usd
    is None and note is "unknown price".
    """
    known = price_of(model, 1000, 1000, price) is not None
    tasks: dict[str, dict] = {}
    total = {"calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0 if known else None}
    for task, (calls, input_tokens, output_tokens) in calls_by_task.items():
        cost = price_of(model, input_tokens, output_tokens, price) if known else None
        tasks[task] = {"calls": int(calls), "input_tokens": int(input_tokens),
                       "output_tokens": int(output_tokens), "cost_usd": cost}
        total["calls"] += int(calls)
        total["input_tokens"] += int(input_tokens)
        total["output_tokens"] += int(output_tokens)
        if known and cost is not None:
            total["cost_usd"] += cost
    return {"model": model, "price_known": known, "tasks": tasks, "total": total,
            "note": "" if known else "unknown price"}
