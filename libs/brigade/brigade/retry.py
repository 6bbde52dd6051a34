"""Calling again after a failure that may heal: one helper for every service, each with its own policy.

    await retry(fn, retryable=is_outage, backoff=Backoff(base_s=0.2, cap_s=15.0), timeout_s=15,
                on_retry=lambda attempt, delay, error: log.warning(...))

Waits are full-jitter exponential (uniform in [0, min(cap, base * 2^n)]): processes that failed
together, say every worker of a fleet when the proxy restarts, spread out instead of returning in
lockstep. `attempts=None` tries for as long as the caller lives.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
# on_retry(attempt, delay_s, error): the attempt that just failed (1 = the first), before the wait
RetryHook = Callable[[int, float, BaseException], None]


@dataclass(frozen=True)
class Backoff:
    base_s: float
    cap_s: float

    def delay(self, attempt: int) -> float:
        """The wait after failed try `attempt` (0 = the first)."""
        return random.uniform(0, min(self.cap_s, self.base_s * 2 ** min(attempt, 30)))


async def retry(fn: Callable[[], Awaitable[T]], *, retryable: Callable[[BaseException], bool], backoff: Backoff,
                attempts: int | None = None, timeout_s: float | None = None, on_retry: RetryHook | None = None) -> T:
    """`fn()` until it returns; an error `retryable` rejects, or the last of `attempts`, is raised as is.
    `timeout_s` bounds each try (a TimeoutError, which `retryable` judges like any other error)."""
    attempt = 0
    while True:
        try:
            return await (fn() if timeout_s is None else asyncio.wait_for(fn(), timeout_s))
        except Exception as e:
            attempt += 1
            if not retryable(e) or (attempts is not None and attempt >= attempts):
                raise
            delay = backoff.delay(attempt - 1)
            if on_retry is not None:
                on_retry(attempt, delay, e)
            await asyncio.sleep(delay)
