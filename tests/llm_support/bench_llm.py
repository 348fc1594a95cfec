"""Benchmark of the litellm engine against the fault-injecting server (`make bench`).

1. Rate limit: ~150 requests through the engine with requests_per_minute=60 over a 60 s window,
   while the server answers every 15th request with 429 (Retry-After). Reports the largest
   number of requests the server saw in any 60 s sliding window (must be <= 60), the achieved
   rate, and how many items failed (must be 0: 429s slow a run, they do not fail it).
   `--quick` scales the window, the limit, the request count and Retry-After by 1/10 (6 s,
   6 requests, 15 requests): the same ratio of requests to window, so the same shape of run,
   in a tenth of the time. The limiter's safety margin is a larger share of a short window
   (0.25 s of 6 s versus 1 s of 60 s), so the quick run's rate is a little lower.
2. Overhead: the engine's own time (prompt building, token counting, limiter, parsing, cache
   reads and writes) as a share of wall time, (a) when every item is a cache hit, and (b) when
   the server answers at once (time inside litellm.acompletion, i.e. litellm plus HTTP, is
   measured by wrapping it and subtracted; concurrency 1 so the times add up).

    PYTHONPATH=. python tests/llm_support/bench_llm.py [--quick]

Prints Markdown tables on stdout; exits non-zero when a limit was exceeded or an item failed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))

from fault_server import FaultServer, max_in_window  # noqa: E402

from noderag_cli.config import LLMConfig  # noqa: E402
from noderag_cli.engines import llm  # noqa: E402
from noderag_cli.engines.base import AttributeInput, ChunkInput  # noqa: E402
from noderag_cli.workspace import Cache  # noqa: E402


def _config(server: FaultServer, **settings) -> LLMConfig:
    values = {"engine": "litellm", "model": "openai/bench-model", "api_base": server.url, "timeout_seconds": 30.0,
              "retries": 3, "concurrency": 8, "max_output_tokens": 256}
    values.update(settings)
    return LLMConfig(**values)


def bench_rate_limit(quick: bool) -> tuple[list[str], bool]:
    scale = 0.1 if quick else 1.0
    window = 60.0 * scale
    limit = round(60 * scale)
    count = round(150 * scale)
    retry_after = max(1, round(2 * scale))
    with FaultServer() as server, tempfile.TemporaryDirectory() as tmp:
        items = [AttributeInput(f"Entity{i}", (f"Entity{i} took part in event {i}.",)) for i in range(count)]
        for i in range(0, count, 15):
            server.script([f"429:{retry_after}"], marker=f"Entity{i} ")
        cache = Cache(Path(tmp) / "cache.sqlite")
        engine = llm.LiteLLMEngine(_config(server, requests_per_minute=limit), cache, window_seconds=window)
        started = time.monotonic()
        results = engine.attributes(items)
        elapsed = time.monotonic() - started
        cache.close()
        records = server.completions()
    times = [r.at for r in records]
    peak = max_in_window(times, window)
    throttled = sum(1 for r in records if r.status == 429)
    failed = sum(1 for r in results if isinstance(r, llm.Failure))
    # the fastest a limiter may go: `limit` requests at once, the next `limit` one window later...
    lower_bound = ((len(records) - 1) // limit) * window
    ok = peak <= limit and failed == 0
    lines = [
        f"### Rate limit ({'quick: window, limit, requests and Retry-After scaled by 1/10' if quick else 'full'})",
        "",
        "| setting / measure | value |",
        "|---|---|",
        f"| window / limit | {window:g} s / {limit} requests |",
        f"| items / requests seen by the server | {count} / {len(records)} |",
        f"| 429s served (Retry-After {retry_after} s) | {throttled} |",
        f"| max requests in any {window:g} s sliding window | **{peak}** (limit {limit}) |",
        f"| first to last request | {times[-1] - times[0]:.1f} s (no limiter can go below {lower_bound:g} s) |",
        f"| wall time (includes importing litellm) | {elapsed:.1f} s |",
        f"| items failed | **{failed}** |",
        f"| verdict | {'OK' if ok else 'LIMIT EXCEEDED OR ITEMS FAILED'} |",
        "",
    ]
    return lines, ok


def bench_overhead(n: int) -> list[str]:
    lt = llm._litellm()
    inside = {"seconds": 0.0}
    counting = {"seconds": 0.0}
    real_acompletion = lt.acompletion
    real_count = llm.count_tokens

    async def timed_acompletion(*args, **kwargs):
        start = time.perf_counter()
        try:
            return await real_acompletion(*args, **kwargs)
        finally:
            inside["seconds"] += time.perf_counter() - start

    def timed_count(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real_count(*args, **kwargs)
        finally:
            counting["seconds"] += time.perf_counter() - start

    chunks = [ChunkInput(f"c{i}", f"Item {i}: Alice Example met Bob Sample in Town{i} on day {i}. " * 8, f"Doc {i}")
              for i in range(n)]
    rows = []
    lt.acompletion = timed_acompletion
    llm.count_tokens = timed_count
    try:
        with FaultServer() as server, tempfile.TemporaryDirectory() as tmp:
            cache = Cache(Path(tmp) / "cache.sqlite")
            engine = llm.LiteLLMEngine(_config(server, concurrency=1), cache)
            engine.decompose(chunks[:2])  # warm up: imports, client, tokenizer
            inside["seconds"] = counting["seconds"] = 0.0
            started = time.perf_counter()
            engine.decompose(chunks[2:])
            wall = time.perf_counter() - started
            items = n - 2
            own = wall - inside["seconds"]
            rows.append(("server answers at once, concurrency 1", items, wall, own, counting["seconds"]))

            engine8 = llm.LiteLLMEngine(_config(server, concurrency=8), Cache(Path(tmp) / "other.sqlite"))
            engine8.decompose(chunks[:2])
            started = time.perf_counter()
            engine8.decompose(chunks[2:])
            wall8 = time.perf_counter() - started

            hits = llm.LiteLLMEngine(_config(server), cache)
            before = len(server.records)
            started = time.perf_counter()
            hits.decompose(chunks[2:])
            wall_hits = time.perf_counter() - started
            assert len(server.records) == before, "cache-hit run reached the server"
            rows.append(("every item a cache hit", items, wall_hits, wall_hits, 0.0))
            cache.close()
    finally:
        lt.acompletion = real_acompletion
        llm.count_tokens = real_count
    lines = [
        "### Engine overhead",
        "",
        "| case | items | wall | per item | engine's own share | of which token counting |",
        "|---|---|---|---|---|---|",
    ]
    for case, items, wall, own, count_s in rows:
        lines.append(f"| {case} | {items} | {wall:.2f} s | {1000 * wall / items:.2f} ms | "
                     f"{100 * own / wall:.0f}% ({1000 * own / items:.2f} ms/item) | {1000 * count_s / items:.2f} ms/item |")
    lines += [
        f"| server answers at once, concurrency 8 | {items} | {wall8:.2f} s | {1000 * wall8 / items:.2f} ms | "
        f"(not separable under concurrency) | |",
        "",
        "The rest of the wall time with a live server is litellm plus HTTP (timed around `litellm.acompletion`);",
        "the engine's share also holds litellm's logging tasks that run on the same event loop after each call.",
        "",
    ]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description="Benchmark of the litellm engine against the fault server")
    parser.add_argument("--quick", action="store_true", help="scale the rate-limit run by 1/10 (about 15 s)")
    parser.add_argument("--items", type=int, default=300, help="items for the overhead measurement")
    args = parser.parse_args()
    lines, ok = bench_rate_limit(args.quick)
    lines += bench_overhead(args.items)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
