"""The proxy over real gRPC (grpc.aio server in-process, real redis-server): every RPC's happy
path and its refusals, health, reflection, auth, TLS, the bucket copy of the run. The tests on the
shared `server` run twice: on one redis-server and on a three-master Redis Cluster."""

from __future__ import annotations

import subprocess

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from proxy_support import adapter_manifest, make_prompts, make_spec, manifest_for, new_run_id

from brigade import keys
from brigade.rpc import ProxyClient, open_channel
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import free_port
from brigade_proxy.server import start_server

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def server(any_redis_url):
    s = await start_server(any_redis_url, monitor_redis=False)
    yield s
    await s.stop(0)


@pytest_asyncio.fixture(loop_scope="session")
async def client(server):
    async with ProxyClient.connect(server.target) as c:
        yield c


async def create(client: ProxyClient, n_prompts: int = 10, **spec) -> str:
    run = new_run_id("p")
    resp = await client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, **spec), prompts=make_prompts(n_prompts)))
    assert resp.created and resp.run_id == run
    return run


async def acquire(client: ProxyClient, run: str, worker: str = "w1") -> pb.Lease:
    resp = await client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=worker,
                                                                  capacity_class="spot", price_per_hour=0.4,
                                                                  engine="hf"))
    assert resp.granted, resp
    return resp.lease


async def code_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


async def leases_held(client: ProxyClient, run: str) -> list[str]:
    return sorted(x.batch_id for x in (await client.runs.ListLeases(pb.RunRef(run_id=run))).leases)


# ---------------------------------------------------------------- health and reflection

async def test_health_and_reflection(server):
    async with open_channel(server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "brigade.v1.LeaseService", "brigade.v1.RunService"):
            resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        call = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        async for resp in call:
            names = {s.name for s in resp.list_services_response.service}
            break
    assert {"brigade.v1.LeaseService", "brigade.v1.LearnerService", "brigade.v1.RunService",
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names


# ---------------------------------------------------------------- the whole cycle

async def test_full_cycle(client):
    run = await create(client, n_prompts=6, prompts_per_batch=4, seed=11, staleness={"lease_seconds": 30})
    lease = await acquire(client, run)
    assert lease.run_id == run and lease.attempt == 1 and lease.lease_seconds == 30
    assert lease.batch.batch_id == f"{run}:0:0" and len(lease.batch.prompts) == 4
    assert lease.seed == keys.batch_seed(11, lease.batch.batch_id, 1)  # the spec's seed, not the run id
    assert lease.adapter_version == 0
    second = await acquire(client, run, "w2")
    assert len(second.batch.prompts) == 2  # the epoch's last batch holds the remainder
    assert {p.id for p in lease.batch.prompts} | {p.id for p in second.batch.prompts} == {f"p{i}" for i in range(6)}

    beat = await client.lease.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id=lease.lease_id, worker_id="w1"))
    assert beat.status == pb.HeartbeatResponse.OK and beat.deadline_ms >= lease.deadline_ms

    m = manifest_for(run, lease, "w1")
    done = await client.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id,
                                                                    worker_id="w1", manifest=m))
    assert not done.duplicate
    dup = await client.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id,
                                                                   worker_id="w1", manifest=m))
    assert dup.duplicate

    failed = await client.lease.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=second.lease_id, worker_id="w2",
                                                              reason=pb.FailLeaseRequest.PREEMPTED))
    assert failed.requeued and failed.next_attempt == 2

    pulled = await client.learner.PullRollouts(pb.PullRolloutsRequest(run_id=run, learner_id="L", max_manifests=8,
                                                                      wait_ms=100))
    assert [r.manifest for r in pulled.rollouts] == [m] and pulled.latest_adapter_version == 0
    acked = await client.learner.AckRollouts(pb.AckRolloutsRequest(
        run_id=run, learner_id="L", delivery_ids=[pulled.rollouts[0].delivery_id],
        consumed_batch_ids=[lease.batch.batch_id], step=1, metrics_json='{"loss": 0.25}'))
    assert acked.acked == 1
    pub = await client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=adapter_manifest(run, 1)))
    assert pub.latest_version == 1

    retry = await acquire(client, run, "w3")
    assert retry.batch.batch_id == second.batch.batch_id and retry.attempt == 2 and retry.adapter_version == 1

    state = await client.runs.GetRun(pb.RunRef(run_id=run))
    assert (state.latest_version, state.learner_step, state.batches_created, state.leased, state.consumed,
            state.duplicates, state.num_prompts) == (1, 1, 2, 1, 1, 1, 6)
    assert state.spec.run_id == run

    leases = (await client.runs.ListLeases(pb.RunRef(run_id=run))).leases
    assert [(x.lease_id, x.worker_id, x.attempt, x.adapter_version) for x in leases] == [
        (retry.lease_id, "w3", 2, 1)]
    workers = {w.worker_id: w for w in (await client.runs.ListWorkers(pb.RunRef(run_id=run))).workers}
    assert set(workers) == {"w1", "w2", "w3"}
    assert (workers["w1"].leases_granted, workers["w1"].leases_completed, workers["w1"].engine) == (1, 1, "hf")
    adapters = (await client.runs.ListAdapters(pb.RunRef(run_id=run))).adapters
    assert [(a.version, a.step) for a in adapters] == [(1, 1)]
    metrics = (await client.runs.GetMetrics(pb.GetMetricsRequest(run_id=run))).steps
    assert [(s.step, s.metrics_json) for s in metrics] == [(1, '{"loss": 0.25}')]
    assert (await client.runs.ListDeadLetters(pb.RunRef(run_id=run))).dead_letters == []
    runs = {r.spec.run_id for r in (await client.runs.ListRuns(pb.ListRunsRequest())).runs}
    assert run in runs


async def test_complete_lease_acquires_the_next_in_the_same_call(client):
    """The worker's cycle in one call: CompleteLease with `next` completes, then answers exactly as
    AcquireLease would; a retry completes as a duplicate and acquires again; a refused completion, a
    foreign `next` or one AcquireLease would refuse completes and acquires nothing."""
    run = await create(client, n_prompts=8, prompts_per_batch=2, seed=11,
                       staleness={"max_staleness": 10})  # no admission wait
    lease = await acquire(client, run)
    ask = pb.AcquireLeaseRequest(run_id=run, worker_id="w1", capacity_class="spot", engine="hf")
    req = pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="w1",
                                  manifest=manifest_for(run, lease, "w1"), next=ask)
    done = await client.lease.CompleteLease(req)
    assert not done.duplicate and done.next.granted
    nxt = done.next.lease
    assert nxt.batch.batch_id == f"{run}:0:1" and nxt.seed == keys.batch_seed(11, nxt.batch.batch_id, 1)
    assert await leases_held(client, run) == [nxt.batch.batch_id]   # the first is completed, the next is held
    again = await client.lease.CompleteLease(req)                      # a retry after a lost answer
    assert again.duplicate and again.next.granted and again.next.lease.batch.batch_id == f"{run}:0:2"
    plain = await client.lease.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id=nxt.lease_id, worker_id="w1", manifest=manifest_for(run, nxt, "w1")))
    assert not plain.duplicate and not plain.HasField("next")         # without `next`, as before

    held = await leases_held(client, run)
    third = again.next.lease
    foreign = pb.CompleteLeaseRequest(run_id=run, lease_id=third.lease_id, worker_id="w1",
                                      manifest=manifest_for(run, third, "w1"),
                                      next=pb.AcquireLeaseRequest(run_id=run, worker_id="w2"))
    got, details = await code_of(client.lease.CompleteLease(foreign))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "next" in details
    assert await leases_held(client, run) == held                      # refused before completing anything
    bad_next = pb.CompleteLeaseRequest(run_id=run, lease_id=third.lease_id, worker_id="w1",
                                       manifest=manifest_for(run, third, "w1"),
                                       next=pb.AcquireLeaseRequest(run_id=run, worker_id="w1", price_per_hour=-1))
    got, details = await code_of(client.lease.CompleteLease(bad_next))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "price_per_hour" in details
    assert await leases_held(client, run) == held                      # both checked before either is written
    unknown = pb.CompleteLeaseRequest(run_id=run, lease_id="1-0", worker_id="w1",
                                      manifest=manifest_for(run, third, "w1"), next=ask)
    got, _ = await code_of(client.lease.CompleteLease(unknown))
    assert got == grpc.StatusCode.NOT_FOUND
    assert await leases_held(client, run) == held                      # and no lease granted for it
    last = await client.lease.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id=third.lease_id, worker_id="w1", manifest=manifest_for(run, third, "w1"), next=ask))
    assert last.next.granted and last.next.lease.batch.batch_id == f"{run}:0:3"


async def test_eval_json_in_adapters(client, server):
    run = await create(client)
    await client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=adapter_manifest(run, 1)))
    await server.proxy.store.redis.hset(keys.RunKeys(run).evals, "1", '{"accuracy": 0.5}')
    (a,) = (await client.runs.ListAdapters(pb.RunRef(run_id=run))).adapters
    assert a.eval_json == '{"accuracy": 0.5}'


async def test_watch_run(client):
    run = await create(client)
    await acquire(client, run)
    stream = client.runs.WatchRun(pb.WatchRunRequest(run_id=run, from_start=True), timeout=10)
    got = []
    async for event in stream:
        got.append(event)
        if len(got) == 3:
            break
    stream.cancel()
    assert [e.type for e in got] == ["RunCreated", "WorkerSeen", "LeaseGranted"]
    assert all(e.run_id == run and e.id and e.time_ms > 0 for e in got)
    # resume after the second event: the third comes next
    stream = client.runs.WatchRun(pb.WatchRunRequest(run_id=run, after_id=got[1].id), timeout=10)
    async for event in stream:
        assert event.id == got[2].id
        break
    stream.cancel()


# ---------------------------------------------------------------- refusals

async def test_acquire_refusals(client):
    run = await create(client)
    cases = [
        (pb.AcquireLeaseRequest(run_id="", worker_id="w"), grpc.StatusCode.INVALID_ARGUMENT, "run_id is required"),
        (pb.AcquireLeaseRequest(run_id="x" * 300, worker_id="w"), grpc.StatusCode.INVALID_ARGUMENT, "limit is 256"),
        (pb.AcquireLeaseRequest(run_id="nope", worker_id="w"), grpc.StatusCode.NOT_FOUND, "no run 'nope' (known:"),
        (pb.AcquireLeaseRequest(run_id=run, worker_id=""), grpc.StatusCode.INVALID_ARGUMENT, "worker_id is required"),
        (pb.AcquireLeaseRequest(run_id=run, worker_id="w" * 257), grpc.StatusCode.INVALID_ARGUMENT, "worker_id"),
        (pb.AcquireLeaseRequest(run_id=run, worker_id="w\x00"), grpc.StatusCode.INVALID_ARGUMENT, "control"),
        (pb.AcquireLeaseRequest(run_id=run, worker_id="w", price_per_hour=float("nan")),
         grpc.StatusCode.INVALID_ARGUMENT, "price_per_hour"),
    ]
    for request, code, needle in cases:
        got, details = await code_of(client.lease.AcquireLease(request))
        assert got == code and needle in details, (request, got, details)


async def test_lease_refusals(client):
    run = await create(client, staleness={"max_attempts": 1})
    lease = await acquire(client, run)
    L = client.lease
    got, details = await code_of(L.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id="junk", worker_id="w1")))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "lease_id" in details
    lost = await L.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id=lease.lease_id, worker_id="w2"))
    assert lost.status == pb.HeartbeatResponse.LOST and "another worker" in lost.message

    good = manifest_for(run, lease, "w1")
    req = pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="w1")
    got, details = await code_of(L.CompleteLease(req))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "manifest is required" in details
    bad = pb.RolloutManifest()
    bad.CopyFrom(good)
    bad.uri = f"runs/other-run/rollouts/{lease.batch.batch_id}/attempt-1.safetensors"
    got, details = await code_of(L.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id=lease.lease_id, worker_id="w1", manifest=bad)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "uri" in details
    got, details = await code_of(L.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id=lease.lease_id, worker_id="w2", manifest=manifest_for(run, lease, "w2"))))
    assert got == grpc.StatusCode.FAILED_PRECONDITION and "another worker" in details
    got, details = await code_of(L.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id="1-0", worker_id="w1", manifest=good)))
    assert got == grpc.StatusCode.NOT_FOUND

    got, details = await code_of(L.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=lease.lease_id,
                                                                 worker_id="w1")))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "ERROR or PREEMPTED" in details
    failed = await L.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="w1",
                                                   reason=pb.FailLeaseRequest.ERROR, message="boom"))
    assert failed.deadlettered and not failed.requeued
    (dead,) = (await client.runs.ListDeadLetters(pb.RunRef(run_id=run))).dead_letters
    assert dead.batch_id == lease.batch.batch_id and "boom" in dead.reason
    got, _ = await code_of(L.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="w1",
                                                           reason=pb.FailLeaseRequest.ERROR)))
    assert got == grpc.StatusCode.NOT_FOUND


async def test_run_and_learner_refusals(client):
    run = await create(client)
    spec = make_spec(run)
    got, details = await code_of(client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, seed=3),
                                                                           prompts=make_prompts(3), exist_ok=True)))
    assert got == grpc.StatusCode.ALREADY_EXISTS and "different spec" in details
    again = await client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=make_prompts(10), exist_ok=True))
    assert not again.created
    bad = make_spec(new_run_id("p"))
    bad.grpo.loss_agg = "nonsense"
    got, details = await code_of(client.runs.CreateRun(pb.CreateRunRequest(spec=bad, prompts=make_prompts(1))))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "grpo.loss_agg" in details
    got, _ = await code_of(client.runs.CreateRun(pb.CreateRunRequest()))
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    got, details = await code_of(client.runs.GetRun(pb.RunRef(run_id="missing-run")))
    assert got == grpc.StatusCode.NOT_FOUND and "missing-run" in details
    # a typo of a run id is answered with the run meant, however many other runs this Redis holds
    got, details = await code_of(client.runs.GetRun(pb.RunRef(run_id=run[:-1])))
    assert got == grpc.StatusCode.NOT_FOUND and f"did you mean {run}" in details
    got, _ = await code_of(client.learner.PullRollouts(pb.PullRolloutsRequest(run_id=run)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    got, details = await code_of(client.learner.AckRollouts(pb.AckRolloutsRequest(
        run_id=run, consumed_batch_ids=[f"{run}:999:0"])))  # far past the cursor: no lost cut
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "never completed" in details
    got, _ = await code_of(client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    m = adapter_manifest(run, 1)
    m.uri = "runs/elsewhere/adapters/v00000001/"
    got, details = await code_of(client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=m)))
    assert got == grpc.StatusCode.INVALID_ARGUMENT and "uri" in details
    await client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=adapter_manifest(run, 1)))
    got, _ = await code_of(client.learner.PublishAdapter(pb.PublishAdapterRequest(
        run_id=run, manifest=adapter_manifest(run, 1, step=5))))
    assert got == grpc.StatusCode.ALREADY_EXISTS
    stream = client.runs.WatchRun(pb.WatchRunRequest(run_id=run, after_id="bogus"))
    got, _ = await code_of(stream.read())
    assert got == grpc.StatusCode.INVALID_ARGUMENT
    stream = client.runs.WatchRun(pb.WatchRunRequest(run_id="missing-run"))
    got, _ = await code_of(stream.read())
    assert got == grpc.StatusCode.NOT_FOUND


async def test_servicer_bug_is_internal_and_server_survives(client, server, monkeypatch):
    run = await create(client)

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.proxy.store.views, "run_state", broken)
    got, details = await code_of(client.runs.GetRun(pb.RunRef(run_id=run)))
    assert got == grpc.StatusCode.INTERNAL and "RuntimeError" in details
    monkeypatch.undo()
    assert (await client.runs.GetRun(pb.RunRef(run_id=run))).spec.run_id == run


async def test_redis_down_is_unavailable():
    s = await start_server(f"redis://127.0.0.1:{free_port()}/0", monitor_redis=False)
    try:
        async with ProxyClient.connect(s.target) as c:
            got, details = await code_of(c.runs.GetRun(pb.RunRef(run_id="x"), timeout=20))
            assert got == grpc.StatusCode.UNAVAILABLE and "Redis" in details
            got, details = await code_of(c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id="x", worker_id="w"),
                                                              timeout=20))
            assert got == grpc.StatusCode.UNAVAILABLE
    finally:
        await s.stop(0)


# ---------------------------------------------------------------- auth and TLS

async def test_bearer_token(redis_url):
    s = await start_server(redis_url, token="sekrit", monitor_redis=False)
    try:
        for token in ("", "wrong"):
            async with ProxyClient.connect(s.target, token=token) as c:
                got, details = await code_of(c.runs.ListRuns(pb.ListRunsRequest()))
                assert got == grpc.StatusCode.UNAUTHENTICATED, details
                got, _ = await code_of(c.runs.WatchRun(pb.WatchRunRequest(run_id="x")).read())
                assert got == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(c.channel)
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.SERVING
        async with ProxyClient.connect(s.target, token="sekrit") as c:
            await c.runs.ListRuns(pb.ListRunsRequest())
            run = await create(c)
            stream = c.runs.WatchRun(pb.WatchRunRequest(run_id=run, from_start=True), timeout=10)
            assert (await stream.read()).type == "RunCreated"  # the token travels on streams too
            stream.cancel()
    finally:
        await s.stop(0)


async def test_tls(redis_url, tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    s = await start_server(redis_url, tls_cert=str(cert), tls_key=str(key), monitor_redis=False)
    try:
        async with ProxyClient.connect(s.target, tls_ca=str(cert)) as c:
            await c.runs.ListRuns(pb.ListRunsRequest(), timeout=10)
        async with ProxyClient.connect(s.target) as c:  # plaintext to a TLS port
            got, _ = await code_of(c.runs.ListRuns(pb.ListRunsRequest(), timeout=5))
            assert got == grpc.StatusCode.UNAVAILABLE
    finally:
        await s.stop(0)


# ---------------------------------------------------------------- the bucket copy

async def test_create_run_writes_the_bucket(redis_url, file_bucket_url):
    from brigade.bucket import open_bucket

    s = await start_server(redis_url, bucket_url=file_bucket_url, monitor_redis=False)
    try:
        async with ProxyClient.connect(s.target) as c:
            run = await create(c, n_prompts=5)
            await acquire(c, run)
            again = await c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(5),
                                                               exist_ok=True))
            assert not again.created
        bucket = open_bucket(file_bucket_url)
        assert pb.RunSpec.FromString(await bucket.get(keys.run_spec_key(run))) == make_spec(run)
        bundle = pb.PromptBatch.FromString(await bucket.get(keys.prompts_key(run)))
        assert bundle.run_id == run and list(bundle.prompts) == make_prompts(5)
        await bucket.close()
    finally:
        await s.stop(0)
