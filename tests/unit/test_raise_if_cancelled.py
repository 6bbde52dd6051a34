"""A loop of Redis calls ends when its task is cancelled, even when a call swallowed the cancel (as
redis-py's asyncio.wait_for does on Python 3.11 when the cancel arrives as a write completes)."""

from __future__ import annotations

import asyncio

import pytest

from brigade.redis_clients import raise_if_cancelled


async def swallowing_call() -> str:
    """A call that drops a cancel arriving as it completes, as asyncio.wait_for can on 3.11."""
    try:
        await asyncio.sleep(0.02)
    except asyncio.CancelledError:
        pass
    return "reply"


async def test_a_swallowed_cancel_still_ends_the_loop():
    turns = []

    async def loop(check: bool) -> None:
        while len(turns) < 20:
            turns.append(await swallowing_call())
            if check:
                raise_if_cancelled()

    task = asyncio.create_task(loop(check=True))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(turns) == 1  # the turn in flight completed; no other began

    turns.clear()
    task = asyncio.create_task(loop(check=False))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.wait_for(task, 10)  # without the check the cancel is lost and the loop runs on
    assert len(turns) == 20
