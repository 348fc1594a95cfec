"""A sliding-window limiter on requests and tokens per window, for asyncio callers.

`acquire(tokens)` waits until one more request (reserving `tokens`) fits: at most
`max_requests` request arrivals and at most `max_tokens` tokens in any window of
`window_seconds`, as the server will count them. `settle(reservation, tokens)` records the real
token count and that the request is done. `pause(seconds)` holds every caller back, e.g. after
a 429 with Retry-After, so the whole run slows down instead of each worker retrying on its own.

Where a request falls in the server's window is its arrival there, which the limiter cannot
see: somewhere between `acquire` returning and the reply (the first request of a process can
spend a few hundred milliseconds in client setup before it leaves). So each request is placed
at the latest time it can have arrived: the reply time once settled, but never more than
`send_allowance` seconds after acquire (default 1 s; a request still in flight counts as sent
at acquire + allowance). A request arriving later than that after acquire would be the only
way to exceed the limit. `jitter_seconds` (default 20 ms) covers clock reading and scheduling.

Waiters are served in arrival order (one asyncio.Lock), so no request starves.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class Reservation:
    acquired: float
    latest_arrival: float
    tokens: int
    done: bool = False


class SlidingWindowLimiter:
    def __init__(
        self,
        max_requests: int | None = None,
        max_tokens: int | None = None,
        window_seconds: float = 60.0,
        send_allowance: float = 1.0,
        jitter_seconds: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.window = float(window_seconds)
        self.send_allowance = float(send_allowance)
        self.jitter = float(jitter_seconds)
        self._clock = clock
        self._sleep = sleep
        self._entries: list[Reservation] = []
        self._paused_until = 0.0
        self._lock: asyncio.Lock | None = None
        self.waited_seconds = 0.0
        """Total time callers spent waiting here."""

    @property
    def enabled(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None

    def pause(self, seconds: float) -> None:
        """No request starts in the next `seconds` (extends an existing pause, never shortens it)."""
        self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))

    def settle(self, reservation: Reservation, tokens: int) -> None:
        """The request is done: its real token count, and its arrival bounded by now."""
        reservation.tokens = max(0, int(tokens))
        if not reservation.done:
            reservation.done = True
            reservation.latest_arrival = min(reservation.latest_arrival, max(reservation.acquired, self._clock()))

    def _expires(self, entry: Reservation) -> float:
        return entry.latest_arrival + self.window + self.jitter

    def _wait_needed(self, now: float, tokens: int) -> float:
        if self._paused_until > now:
            return self._paused_until - now
        self._entries = [e for e in self._entries if self._expires(e) > now]
        entries = self._entries
        if self.max_requests is not None and len(entries) >= self.max_requests:
            # the (n - max + 1) earliest-expiring requests must leave the window first
            leaving = len(entries) - self.max_requests + 1
            return heapq.nsmallest(leaving, (self._expires(e) for e in entries))[-1] - now
        if self.max_tokens is not None and entries:
            used = sum(e.tokens for e in entries)
            if used + tokens > self.max_tokens:
                # wait until enough reservations leave; a request larger than the whole budget
                # goes alone into an empty window rather than never
                for entry in sorted(entries, key=self._expires):
                    used -= entry.tokens
                    if used + tokens <= self.max_tokens:
                        return self._expires(entry) - now
                return max(self._expires(e) for e in entries) - now
        return 0.0

    async def acquire(self, tokens: int = 0) -> Reservation:
        if self._lock is None:
            self._lock = asyncio.Lock()
        started = self._clock()
        async with self._lock:
            while True:
                now = self._clock()
                wait = self._wait_needed(now, tokens)
                if wait <= 0:
                    entry = Reservation(now, now + self.send_allowance, max(0, int(tokens)))
                    if self.enabled:
                        self._entries.append(entry)
                    self.waited_seconds += now - started
                    return entry
                await self._sleep(wait + 0.001)
