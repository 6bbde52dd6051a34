"""`brigade migrate-keys`: a Redis holding runs in the key layout before hash tags (brigade:<run>:*,
the run list a plain set) is refused by the services, moved in place by the command, and the run
goes on where it was: the lease in flight heartbeats and completes, the janitor can expire leases."""

from __future__ import annotations

import asyncio

import pytest
import redis
from proxy_support import make_prompts, make_spec, manifest_for, new_run_id
from typer.testing import CliRunner

from brigade import keys
from brigade.errors import LegacyKeys
from brigade.store import Store
from brigade_cli.main import app
from brigade_harness.devservers import start_redis
from brigade_janitor.janitor import Janitor


@pytest.fixture
def own_redis(tmp_path):
    server = start_redis(tmp_path / "redis")  # its own: a legacy set would stop other tests' janitors
    yield server.url
    server.stop()


def to_legacy_layout(r: redis.Redis, run: str) -> int:
    """Rewrite a run as the code before hash tags stored it; the number of keys renamed."""
    k = keys.RunKeys(run)
    r.delete(k.lease_deadlines, k.lease_versions)  # the old layout had no lease indexes
    moved = 0
    for key in r.scan_iter(match="brigade:{" + run + "}:*"):
        r.rename(key, keys.legacy_run_prefix(run) + key.decode()[len(k.prefix):])
        moved += 1
    r.zrem(keys.RUN_INDEX, run)
    r.sadd(keys.LEGACY_RUNS_SET, run)
    return moved


def test_migrate_keys_moves_a_live_run_in_place(own_redis):
    run = new_run_id("m")

    async def before():
        store = Store(own_redis)
        try:
            await store.runs.create(make_spec(run), make_prompts(10))
            held = await store.leases.acquire(run, "w1")
            done = await store.leases.acquire(run, "w2")
            await store.leases.complete(run, done.lease.lease_id, "w2", manifest_for(run, done.lease, "w2"))
            return held.lease, await store.views.run_state(run)
        finally:
            await store.close()

    held, state = asyncio.run(before())
    r = redis.Redis.from_url(own_redis)
    moved = to_legacy_layout(r, run)
    assert moved >= 10 and not r.exists(keys.RunKeys(run).spec)

    async def refused():
        store = Store(own_redis)
        try:
            with pytest.raises(LegacyKeys, match="migrate-keys"):
                await store.runs.check_layout()
            with pytest.raises(LegacyKeys):  # the janitor refuses to sweep such a Redis
                await Janitor(store, janitor_id="j").tick()
        finally:
            await store.close()

    asyncio.run(refused())
    cli = CliRunner()
    dry = cli.invoke(app, ["migrate-keys", "--redis-url", own_redis, "--dry-run"])
    assert dry.exit_code == 0 and f"{moved} key(s) would move" in dry.output
    assert r.exists(keys.LEGACY_RUNS_SET)
    r.set(keys.JANITOR_LOCK, "old-janitor")
    busy = cli.invoke(app, ["migrate-keys", "--redis-url", own_redis])
    assert busy.exit_code == 2 and "janitor holds the lock" in busy.output and r.exists(keys.LEGACY_RUNS_SET)
    r.delete(keys.JANITOR_LOCK)
    done = cli.invoke(app, ["migrate-keys", "--redis-url", own_redis])
    assert done.exit_code == 0 and f"1 run(s), {moved} key(s) moved" in done.output, done.output
    assert not r.exists(keys.LEGACY_RUNS_SET) and not r.keys(keys.legacy_run_prefix(run) + "*")
    again = cli.invoke(app, ["migrate-keys", "--redis-url", own_redis])  # nothing left to do
    assert again.exit_code == 0 and "0 run(s), 0 key(s) moved" in again.output

    async def after():
        store = Store(own_redis)
        try:
            await store.runs.check_layout()
            assert await store.runs.ids() == [run]
            assert await store.views.run_state(run) == state
            assert (await store.leases.heartbeat(run, held.lease_id, "w1")).status == "ok"
            # the migration entered the lease in flight in the janitor's indexes
            assert (await store.sweeps.expire_leases(run, min_idle_ms=0)).expired == 1
            again = await store.leases.acquire(run, "w1")
            assert again.lease.batch.batch_id == held.batch.batch_id and again.lease.attempt == 2
            await store.leases.complete(run, again.lease.lease_id, "w1", manifest_for(run, again.lease, "w1"))
            assert (await store.views.run_state(run)).completed == 2
        finally:
            await store.close()

    asyncio.run(after())


def test_migrate_keys_refuses_a_cluster(redis_cluster_url):
    result = CliRunner().invoke(app, ["migrate-keys", "--redis-url", redis_cluster_url])
    assert result.exit_code == 2 and "redis-cli --cluster import" in result.output
