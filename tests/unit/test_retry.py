"""brigade.retry: bounded full-jitter waits, a give-up after N tries, no retry for an answer."""

from __future__ import annotations

import asyncio
import random

import pytest

from brigade.retry import Backoff, retry

FAST = Backoff(base_s=0.001, cap_s=0.004)


class Flaky:
    """Fails `failures` times with `error`, then returns "ok"."""

    def __init__(self, failures: int, error: Exception):
        self.failures, self.error, self.calls = failures, error, 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


def test_delays_are_full_jitter_below_the_exponential_and_the_cap():
    random.seed(1)
    b = Backoff(base_s=0.2, cap_s=15.0)
    for attempt in range(40):
        bound = min(15.0, 0.2 * 2**attempt)
        delays = [b.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= bound for d in delays)
        assert max(delays) > 0.8 * bound and min(delays) < 0.2 * bound  # spread over the whole range


async def test_retries_until_it_succeeds_and_reports_each_wait():
    fn, seen = Flaky(5, ConnectionError("down")), []
    got = await retry(fn, retryable=lambda e: isinstance(e, ConnectionError), backoff=FAST,
                      on_retry=lambda attempt, delay, e: seen.append((attempt, delay, e)))
    assert got == "ok" and fn.calls == 6
    assert [a for a, _, _ in seen] == [1, 2, 3, 4, 5]
    assert all(0 <= d <= FAST.cap_s and isinstance(e, ConnectionError) for _, d, e in seen)


async def test_gives_up_after_the_last_attempt_with_the_last_error():
    fn = Flaky(10, ConnectionError("still down"))
    with pytest.raises(ConnectionError, match="still down"):
        await retry(fn, retryable=lambda e: True, backoff=FAST, attempts=4)
    assert fn.calls == 4


async def test_an_error_the_predicate_rejects_is_raised_at_once():
    fn, seen = Flaky(1, ValueError("an answer, not an outage")), []
    with pytest.raises(ValueError):
        await retry(fn, retryable=lambda e: isinstance(e, ConnectionError), backoff=FAST,
                    on_retry=lambda *a: seen.append(a))
    assert fn.calls == 1 and seen == []


async def test_each_try_is_bounded_by_the_timeout():
    calls = []

    async def hangs_once() -> str:
        calls.append(1)
        if len(calls) == 1:
            await asyncio.sleep(10)
        return "ok"

    got = await asyncio.wait_for(
        retry(hangs_once, retryable=lambda e: isinstance(e, TimeoutError), backoff=FAST, timeout_s=0.05), 5)
    assert got == "ok" and len(calls) == 2
