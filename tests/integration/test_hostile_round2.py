"""Hostile input, round two (issue 14's data-level findings), against the real proxy on a real Redis:
one token holder must not be able to crash the learner, finish a run, strand its workers, break
ListRuns for everyone, or grow a run's Redis state without bound."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis
from proxy_support import BackgroundProxy, SyncClient, make_prompts, make_spec, manifest_for, new_run_id

from brigade import adapters, keys
from brigade.spec import MAX_WORKERS_PER_RUN
from brigade.store.sweeps import PRUNE_SLICE
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_MANIFEST_BYTES, MAX_RUNS
from brigade_harness.devservers import start_redis

BAD = grpc.StatusCode.INVALID_ARGUMENT


def code(call, *args, **kwargs) -> grpc.StatusCode:
    try:
        call(*args, timeout=10, **kwargs)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory):
    """A Redis of this module's own: the run cap test fills its run set."""
    server = start_redis(tmp_path_factory.mktemp("round2-redis"))
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def proxy(own_redis):
    p = BackgroundProxy(own_redis)
    yield p
    p.close()


@pytest.fixture(scope="module")
def client(proxy):
    c = SyncClient(proxy.target)
    yield c
    c.close()


@pytest.fixture
def r(own_redis):
    client = redis.Redis.from_url(own_redis)
    yield client
    client.close()


def new_run(client, **spec) -> str:
    run = new_run_id("r2")
    client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, **spec), prompts=make_prompts(40)), timeout=10)
    return run


def lease(client, run, worker="w") -> pb.Lease:
    resp = client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=worker), timeout=10)
    assert resp.granted, resp
    return resp.lease


def complete(client, run, worker="w") -> str:
    got = lease(client, run, worker)
    client.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=got.lease_id, worker_id=worker,
                                                       manifest=manifest_for(run, got, worker)), timeout=10)
    return got.batch.batch_id


def test_a_forged_step_cannot_finish_a_run(client):
    run = new_run(client, max_steps=3)
    for step in (2**64 - 1, 2**53, 3, 2):  # beyond one commit (checkpoint_every 1) past step 0
        assert code(client.learner.AckRollouts, pb.AckRolloutsRequest(run_id=run, step=step, learner_id="L")) == BAD
    assert lease(client, run).batch.batch_id  # still running
    # one consumed batch (batches_per_step 1), stored step 0: step 1 is the most the learner can have reached
    batch = complete(client, run)
    pulled = client.learner.PullRollouts(pb.PullRolloutsRequest(run_id=run, max_manifests=5, learner_id="L"))
    ids = [p.delivery_id for p in pulled.rollouts]
    assert code(client.learner.AckRollouts, pb.AckRolloutsRequest(
        run_id=run, delivery_ids=ids, consumed_batch_ids=[batch], step=2, learner_id="L")) == BAD
    client.learner.AckRollouts(pb.AckRolloutsRequest(run_id=run, delivery_ids=ids, consumed_batch_ids=[batch], step=1,
                                                     learner_id="L"), timeout=10)
    state = client.runs.GetRun(pb.RunRef(run_id=run), timeout=10)
    assert state.learner_step == 1 and not state.finished


def test_an_adapter_version_far_ahead_or_beyond_lua_numbers_is_refused(client):
    run = new_run(client)
    for version in (2**63, 2**63 + 5, 2**53, 3):
        m = pb.AdapterManifest(run_id=run, version=version, step=1, uri=keys.adapter_prefix(run, version))
        assert code(client.learner.PublishAdapter, pb.PublishAdapterRequest(run_id=run, manifest=m)) == BAD
    m = pb.AdapterManifest(run_id=run, version=1, step=1, uri=keys.adapter_prefix(run, 1))
    assert client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=m)).latest_version == 1
    # the run still serves leases, heartbeats and listings
    got = lease(client, run)
    assert got.adapter_version == 1
    beat = client.lease.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id=got.lease_id, worker_id="w"))
    assert beat.status == pb.HeartbeatResponse.OK
    assert len(client.runs.ListLeases(pb.RunRef(run_id=run)).leases) == 1


def test_oversized_and_control_character_fields_are_refused_at_the_wire(client):
    run = new_run(client)
    # over the method's request size (4 MiB): refused before it is parsed; under it, by the field's bound
    assert code(client.lease.AcquireLease, pb.AcquireLeaseRequest(run_id=run, worker_id="w",
                                                                  capacity_class="x" * (17 << 20))) == \
        grpc.StatusCode.RESOURCE_EXHAUSTED
    big = "x" * 100_000
    assert code(client.lease.AcquireLease, pb.AcquireLeaseRequest(run_id=run, worker_id="w",
                                                                  capacity_class=big)) == BAD
    got = lease(client, run, "w")
    for manifest in (manifest_for(run, got, "w", capacity_class=big), manifest_for(run, got, "w", engine="e" * 100),
                     manifest_for(run, got, "w", adapter_payload="\x1b[31mred")):
        assert code(client.lease.CompleteLease, pb.CompleteLeaseRequest(
            run_id=run, lease_id=got.lease_id, worker_id="w", manifest=manifest)) == BAD
    for learner in ("learner\x1b[2J", "l\n", "l" * 300):
        assert code(client.learner.PullRollouts, pb.PullRolloutsRequest(run_id=run, learner_id=learner)) == BAD
        assert code(client.learner.AckRollouts, pb.AckRolloutsRequest(run_id=run, learner_id=learner)) == BAD
    assert code(client.lease.AcquireLease, pb.AcquireLeaseRequest(run_id=run, worker_id="w\x1b]0;x\x07")) == BAD
    assert code(client.learner.AckRollouts, pb.AckRolloutsRequest(run_id=run, learner_id="L",
                                                                  metrics_json="{}" + " " * 100_000)) == BAD
    # the lease is still the worker's, and completes
    client.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=got.lease_id, worker_id="w",
                                                       manifest=manifest_for(run, got, "w")), timeout=10)


def test_a_run_id_with_a_newline_is_refused_and_one_already_in_redis_is_skipped(client, r):
    spec = make_spec("placeholder")
    spec.run_id = "a\n"
    assert code(client.runs.CreateRun, pb.CreateRunRequest(spec=spec, prompts=make_prompts(2))) == BAD
    run = new_run(client)
    r.zadd(keys.RUN_INDEX, {"b\n": 0})  # stored by a proxy from before ids were matched whole
    try:
        listed = [s.spec.run_id for s in client.runs.ListRuns(pb.ListRunsRequest(page_size=1000), timeout=10).runs]
        assert run in listed and "b\n" not in listed
        paged, token = [], ""  # one run a page: the page holding only "b\n" is empty, yet the next one follows
        while True:
            page = client.runs.ListRuns(pb.ListRunsRequest(page_size=1, page_token=token), timeout=10)
            paged += [s.spec.run_id for s in page.runs]
            if not (token := page.next_page_token):
                break
        assert paged == listed
        assert code(client.runs.ListRuns, pb.ListRunsRequest(page_token="not hex")) == BAD
    finally:
        r.zrem(keys.RUN_INDEX, "b\n")


def test_an_oversized_manifest_already_on_the_stream_never_reaches_a_pull_reply(client, r):
    run = new_run(client)
    batch = complete(client, run)
    # one written before manifests had a bound (17 MiB of capacity_class), then a normal one
    r.xadd(keys.RunKeys(run).rollouts, {"m": b"\x0a" + b"x" * (MAX_MANIFEST_BYTES + 1)})
    pulled = client.learner.PullRollouts(pb.PullRolloutsRequest(run_id=run, max_manifests=10, learner_id="L"))
    assert [p.manifest.batch_id for p in pulled.rollouts] == [batch]
    assert r.xlen(keys.RunKeys(run).rollouts) == 1  # taken off the stream: no longer outstanding work


def test_workers_per_run_are_capped_and_idle_ones_pruned_in_slices(client, proxy, r):
    run = new_run(client, staleness={"max_staleness": 1000})
    stats = keys.RunKeys(run).stats
    n = PRUNE_SLICE * 2 + 5   # more than one slice
    for i in range(n):
        lease(client, run, f"w{i}")
    assert int(r.hget(stats, "workers")) == n
    r.hset(stats, "workers", MAX_WORKERS_PER_RUN)  # as if the cap were reached
    with pytest.raises(grpc.RpcError) as info:
        client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="newcomer"), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "worker ids" in info.value.details()
    assert lease(client, run, "w0")  # a known worker is still served
    r.hset(stats, "workers", n)
    # the leases expire and go back: every worker now holds nothing; all but w0 are idle
    proxy.call(proxy.store.sweeps.expire_leases(run, min_idle_ms=0))
    lease(client, run, "w0")
    removed = proxy.call(proxy.store.sweeps.prune_consumers(run, min_idle_ms=0))
    assert removed >= n - 1
    workers = [w.worker_id for w in client.runs.ListWorkers(pb.RunRef(run_id=run)).workers]
    assert workers == ["w0"] and int(r.hget(stats, "workers")) == 1
    assert lease(client, run, "newcomer")


def test_the_number_of_runs_is_capped(client, r):
    kept = new_run(client)
    have = r.zcard(keys.RUN_INDEX)
    fillers = [f"filler-{i}" for i in range(MAX_RUNS - have)]
    if fillers:
        r.zadd(keys.RUN_INDEX, dict.fromkeys(fillers, 0))
    try:
        spec = make_spec(new_run_id("r2"))
        with pytest.raises(grpc.RpcError) as info:
            client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=make_prompts(2)), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not r.exists(keys.RunKeys(spec.run_id).spec)
        # listing still works, page by page (the fillers have no spec: skipped, yet each page is bounded)
        found, token, pages = [], "", 0
        while pages == 0 or token:
            page = client.runs.ListRuns(pb.ListRunsRequest(page_token=token), timeout=30)
            found += page.runs
            token, pages = page.next_page_token, pages + 1
        assert kept in [s.spec.run_id for s in found] and pages <= MAX_RUNS // 100 + 1
    finally:
        if fillers:
            r.zrem(keys.RUN_INDEX, *fillers)


async def test_a_corrupt_adapter_manifest_fails_the_lease_and_is_dead_lettered(own_redis, file_bucket_url,
                                                                              tmp_path):
    from brigade.bucket import open_bucket
    from brigade.rpc import ProxyClient
    from brigade_proxy.server import start_server
    from brigade_rollout.worker import Worker, WorkerConfig
    from brigade_testing.tiny import demo_prompts, tiny_model, tiny_spec

    model_dir = tiny_model(tmp_path / "model")
    run = new_run_id("corrupt-manifest")
    spec = tiny_spec(model_dir, run_id=run, staleness={"max_attempts": 1}, prompts_per_batch=2)
    server = await start_server(own_redis, "127.0.0.1:0", bucket_url=file_bucket_url, monitor_redis=False)
    try:
        async with ProxyClient.connect(server.target) as c, open_bucket(file_bucket_url) as bucket:
            await c.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=demo_prompts(2)))
            manifest = await adapters.write_version(bucket, run, 1, 1, {adapters.CONFIG: b"{}"}, "bf16")
            await c.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=manifest))
            await bucket.put(keys.adapter_prefix(run, 1) + adapters.MANIFEST, b"\xff\xff\xff not a manifest")
            worker = Worker(WorkerConfig(proxy=server.target, bucket=file_bucket_url, run=run, exit_when_finished=True))
            assert await asyncio.wait_for(worker.run(), 120) == 0  # before: retried for ever
            assert worker.stats["failed"] == 1
            (dead,) = (await c.runs.ListDeadLetters(pb.RunRef(run_id=run))).dead_letters
            assert "adapter v1 is unusable" in dead.reason and "does not parse" in dead.reason, dead.reason
    finally:
        await server.stop(0)
