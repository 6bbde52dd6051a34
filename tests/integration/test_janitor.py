"""The janitor: expiry and requeue, dead letters, revocation, stale-manifest removal, and the
singleton lock (a standby takes over when the holder stops renewing or is killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import pytest_asyncio
import redis
from proxy_support import adapter_manifest, make_prompts, make_spec, new_run_id

from brigade import keys
from brigade.store import Store
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import start_redis
from brigade_janitor.janitor import LOCK_KEY, Janitor

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private redis-server: the janitor lock is one global key, so these tests must not share it
    with a janitor some other test left running."""
    server = start_redis(tmp_path_factory.mktemp("janitor-redis"))
    yield server.url
    server.stop()


@pytest_asyncio.fixture
async def q(redis_url):
    store = Store(redis_url)
    await store.redis.delete(LOCK_KEY)
    yield store
    await store.redis.delete(LOCK_KEY)
    await store.close()


async def new_run(q: Store, **spec) -> str:
    run = new_run_id("j")
    await q.runs.create(make_spec(run, **spec), make_prompts(20))
    return run


def manifest(run: str, g, worker: str) -> pb.RolloutManifest:
    lease = g.lease
    return pb.RolloutManifest(run_id=run, batch_id=lease.batch.batch_id, attempt=lease.attempt, worker_id=worker,
                              policy_version=lease.adapter_version,
                              uri=keys.rollout_key(run, lease.batch.batch_id, lease.attempt),
                              sha256="0" * 64, num_samples=2)


async def go_silent(q: Store, run: str, g, worker: str) -> None:
    """As if the worker died long ago: no heartbeat for ages, its deadline long past."""
    await q.redis.xclaim(keys.RunKeys(run).work, keys.WORK_GROUP, worker, 0, [g.lease.lease_id], idle=10**9,
                         justid=True)
    await q.redis.zadd(keys.RunKeys(run).lease_deadlines, {g.lease.lease_id: 0})


async def test_expired_lease_requeued_then_deadlettered(q):
    run = await new_run(q, staleness={"max_attempts": 2})
    janitor = Janitor(q, runs=[run], janitor_id="j1", interval=0.1, lock_ttl_ms=1000)
    g = await q.leases.acquire(run, "w1")
    await go_silent(q, run, g, "w1")
    assert await janitor.tick()
    assert janitor.totals.expired == 1
    events = [e for e in await q.views.read_events(run) if e.type == "LeaseExpired"]
    assert [(e.attrs["batch"], e.attrs["worker"], e.attrs["attempt"]) for e in events] == [
        (g.lease.batch.batch_id, "w1", "1")]
    g2 = await q.leases.acquire(run, "w2")
    assert (g2.lease.batch.batch_id, g2.lease.attempt) == (g.lease.batch.batch_id, 2)
    beat = await q.leases.heartbeat(run, g.lease.lease_id, "w1")
    assert beat.status == "lost" and "expired" in beat.message
    await go_silent(q, run, g2, "w2")
    await janitor.tick()
    assert janitor.totals.deadlettered == 1
    (dead,) = await q.views.dead_letters(run)
    assert (dead.batch_id, dead.reason, dead.last_worker, dead.attempts) == (
        g.lease.batch.batch_id, "lease expired", "w2", 2)
    assert (await q.leases.acquire(run, "w3")).lease.batch.batch_id != g.lease.batch.batch_id  # never handed out again


async def test_expiry_in_real_time_and_heartbeats_keep_leases(q):
    run = await new_run(q, staleness={"lease_seconds": 1, "max_attempts": 5})
    janitor = Janitor(q, runs=[run], janitor_id="j-rt", interval=0.1, lock_ttl_ms=1000)
    stop = asyncio.Event()
    task = asyncio.create_task(janitor.run(stop))
    try:
        kept = await q.leases.acquire(run, "alive")
        dropped = await q.leases.acquire(run, "dead")
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            assert (await q.leases.heartbeat(run, kept.lease.lease_id, "alive")).status == "ok"
            if (await q.views.run_state(run)).expired:
                break
            await asyncio.sleep(0.2)
        state = await q.views.run_state(run)
        assert state.expired == 1 and state.queued == 1 and state.leased == 1
        again = await q.leases.acquire(run, "other")
        assert (again.lease.batch.batch_id, again.lease.attempt) == (dropped.lease.batch.batch_id, 2)
        assert (await q.leases.heartbeat(run, kept.lease.lease_id, "alive")).status == "ok"
    finally:
        stop.set()
        await task
    assert await q.sweeps.lock_holder(LOCK_KEY) == ""  # released on the way out


async def test_revocation_and_stale_removal(q):
    run = await new_run(q, staleness={"max_staleness": 1, "max_attempts": 3})
    janitor = Janitor(q, runs=[run], janitor_id="j2", interval=0.1, lock_ttl_ms=1000)
    inflight = await q.leases.acquire(run, "w1")
    waiting = await q.leases.acquire(run, "w2")
    await q.leases.complete(run, waiting.lease.lease_id, "w2", manifest(run, waiting, "w2"))
    await q.learner.publish(run, adapter_manifest(run, 1))
    await janitor.tick()
    assert janitor.totals.revoked == janitor.totals.stale_removed == 0  # staleness 1 is allowed
    await q.learner.publish(run, adapter_manifest(run, 2))
    await janitor.tick()
    assert (janitor.totals.revoked, janitor.totals.stale_removed) == (1, 1)
    assert (await q.leases.heartbeat(run, inflight.lease.lease_id, "w1")).status == "revoked"
    state = await q.views.run_state(run)
    assert (state.revoked, state.stale_removed, state.completed, state.queued) == (1, 1, 0, 1)
    types = [e.type for e in await q.views.read_events(run)]
    assert "LeaseRevoked" in types and "RolloutRejected" in types
    assert (await q.redis.hget(keys.RunKeys(run).rejected, waiting.lease.batch.batch_id)) == b"stale (janitor)"
    retry = await q.leases.acquire(run, "w3")
    assert (retry.lease.batch.batch_id, retry.lease.attempt, retry.lease.adapter_version) == (
        inflight.lease.batch.batch_id, 2, 2)


async def test_lock_failover_in_process(q):
    a = Janitor(q, janitor_id="A", interval=0.1, lock_ttl_ms=400, runs=[])
    b = Janitor(q, janitor_id="B", interval=0.1, lock_ttl_ms=400, runs=[])
    assert await a.tick() and not await b.tick()
    assert await q.sweeps.lock_holder(LOCK_KEY) == "A"
    assert await a.tick()  # renewing keeps it
    # A dies without releasing: B takes over once the lock lapses
    start = time.monotonic()
    while not await b.tick():
        await asyncio.sleep(0.05)
        assert time.monotonic() - start < 3
    assert 0.2 < time.monotonic() - start < 1.5
    assert await q.sweeps.lock_holder(LOCK_KEY) == "B"
    assert not await a.tick() and not a.holding  # A comes back: it notices and waits
    await b.release()
    assert await a.tick()


def _start_janitor(redis_url: str, name: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "brigade_janitor", "--redis-url", redis_url, "--interval", "0.2",
         "--lock-ttl-ms", "1000", "--id", name, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=dict(os.environ, BRIGADE_LOG_FORMAT="json"))


def _wait_for(predicate, timeout: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s")


async def test_lock_failover_between_processes(q, redis_url):
    r = redis.Redis.from_url(redis_url)
    run = await new_run(q, staleness={"max_attempts": 5})
    a = _start_janitor(redis_url, "proc-A")
    b = None
    try:
        _wait_for(lambda: r.get(LOCK_KEY) == b"proc-A", 10)
        b = _start_janitor(redis_url, "proc-B")
        time.sleep(1.0)  # B is up and waiting
        assert r.get(LOCK_KEY) == b"proc-A"
        a.send_signal(signal.SIGKILL)
        a.wait(5)
        took = _wait_for(lambda: r.get(LOCK_KEY) == b"proc-B", 5)
        assert took < 3
        # and B does the job: a silent lease gets requeued
        g = await q.leases.acquire(run, "w1")
        await go_silent(q, run, g, "w1")
        await asyncio.to_thread(_wait_for, lambda: r.hget(keys.RunKeys(run).stats, "expired") == b"1", 5)
        b.send_signal(signal.SIGTERM)  # graceful: releases the lock
        assert b.wait(10) == 0
        assert r.get(LOCK_KEY) is None
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        r.close()
