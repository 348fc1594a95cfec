"""A sliding-window limiter on requests and tokens per window, for asyncio callers.

`acquire(tokens)` waits until one more request (reserving `tokens`) fits in the last
`window_seconds`: at most `max_requests` request starts and at most `max_tokens` tokens in any
window of that length. A reservation can be corrected once the real usage is known (`settle`).
`pause(seconds)` holds every caller back, e.g. after a 429 with Retry-After, so the whole run
slows down instead of each worker hammering the server on its own schedule.

The window the limiter enforces is a little longer than the nominal one (`safety_seconds`,
default 2% of the window, at least 0.25 s and at most 1 s): a request is stamped here when it
is released, but the server stamps it on arrival, and a delay that differs from one request to
the next must not let the server count one request too many in its own window.

Waiters are served in arrival order (one asyncio.Lock), so no request starves.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass
class Reservation:
    at: float
    tokens: int


class SlidingWindowLimiter:
    def __init__(
        self,
        max_requests: int | None = None,
        max_tokens: int | None = None,
        window_seconds: float = 60.0,
        safety_seconds: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        if window_seconds <= 0:
            raise ValueError("window_seconds must be positive")
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.window = float(window_seconds)
        self.safety = min(1.0, max(0.25, 0.02 * self.window)) if safety_seconds is None else safety_seconds
        self._clock = clock
        self._sleep = sleep
        self._entries: deque[Reservation] = deque()
        self._paused_until = 0.0
        self._lock: asyncio.Lock | None = None
        self.waited_seconds = 0.0
        """Total time callers spent waiting here (for the overhead benchmark)."""

    @property
    def enabled(self) -> bool:
        return self.max_requests is not None or self.max_tokens is not None

    def pause(self, seconds: float) -> None:
        """No request starts in the next `seconds` (extends an existing pause, never shortens it)."""
        self._paused_until = max(self._paused_until, self._clock() + max(0.0, seconds))

    def settle(self, reservation: Reservation, tokens: int) -> None:
        """Replace a reservation's estimated tokens by the real count."""
        reservation.tokens = max(0, int(tokens))

    def _expire(self, now: float) -> None:
        horizon = now - self.window - self.safety
        while self._entries and self._entries[0].at <= horizon:
            self._entries.popleft()

    def _wait_needed(self, now: float, tokens: int) -> float:
        if self._paused_until > now:
            return self._paused_until - now
        span = self.window + self.safety
        if self.max_requests is not None and len(self._entries) >= self.max_requests:
            return self._entries[len(self._entries) - self.max_requests].at + span - now
        if self.max_tokens is not None and self._entries:
            used = sum(e.tokens for e in self._entries)
            if used + tokens > self.max_tokens:
                # wait until enough of the oldest reservations leave the window; a request larger
                # than the whole budget goes alone into an empty window rather than never
                for entry in self._entries:
                    used -= entry.tokens
                    if used + tokens <= self.max_tokens:
                        return entry.at + span - now
                return self._entries[-1].at + span - now
        return 0.0

    async def acquire(self, tokens: int = 0) -> Reservation:
        if self._lock is None:
            self._lock = asyncio.Lock()
        started = self._clock()
        async with self._lock:
            while True:
                now = self._clock()
                self._expire(now)
                wait = self._wait_needed(now, tokens)
                if wait <= 0:
                    entry = Reservation(now, max(0, int(tokens)))
                    self._entries.append(entry)
                    self.waited_seconds += now - started
                    return entry
                await self._sleep(wait + 0.001)
