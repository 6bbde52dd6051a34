"""Roles and per-credential quotas over real gRPC (a real proxy, a real redis-server): each role may
call only its methods, tokens rotate without a restart, one-token mode is unchanged, and one
credential's flood of worker ids or runs does not lock out another credential."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_support import make_prompts, make_spec, new_run_id

from brigade import keys
from brigade.rpc import ProxyClient
from brigade.spec import MAX_WORKERS_PER_RUN
from brigade.v1 import brigade_pb2 as pb
from brigade_proxy import credentials
from brigade_proxy.credentials import METHOD_ROLES
from brigade_proxy.limits import Limits
from brigade_proxy.server import start_server

pytestmark = pytest.mark.asyncio(loop_scope="session")

TOKENS = {name: f"{name}-token-0123456789abcdef" for name in
          ("ops", "ops2", "learner", "fleet-a", "fleet-b", "dash", "trainer")}
TOKENS_FILE = f"""\
# role[,role...] name token
operator   ops      {TOKENS['ops']}
operator   ops2     {TOKENS['ops2']}
learner    learner  {TOKENS['learner']}
worker     fleet-a  {TOKENS['fleet-a']}
worker     fleet-b  {TOKENS['fleet-b']}
reader     dash     {TOKENS['dash']}
learner,operator trainer {TOKENS['trainer']}
"""
ROLES_OF = {"ops": {"operator"}, "learner": {"learner"}, "fleet-a": {"worker"}, "dash": {"reader"},
            "trainer": {"learner", "operator"}}


async def code_of(call) -> tuple[grpc.StatusCode, str]:
    try:
        await call
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


def tokens_file(tmp_path, text: str = TOKENS_FILE):
    path = tmp_path / "tokens"
    path.write_text(text)
    return path


async def roles_server(redis_url, tmp_path, **kwargs):
    return await start_server(redis_url, tokens_file=str(tokens_file(tmp_path)), monitor_redis=False, **kwargs)


async def create(c: ProxyClient, run: str | None = None, **spec) -> str:
    run = run or new_run_id("r")
    await c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, **spec), prompts=make_prompts(16)), timeout=10)
    return run


def call_of(c: ProxyClient, method: str):
    """An empty request to `method` ("/brigade.v1.Service/Name"), as an awaitable."""
    service, name = method.rsplit("/", 1)
    stub = {"LeaseService": c.lease, "LearnerService": c.learner, "RunService": c.runs}[service.rsplit(".", 1)[1]]
    desc = pb.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]].methods_by_name[name]
    call = getattr(stub, name)(getattr(pb, desc.input_type.name)(), timeout=5)
    return call.read() if desc.server_streaming else call


async def test_each_role_calls_only_its_methods(redis_url, tmp_path):
    s = await roles_server(redis_url, tmp_path)
    try:
        for name, roles in ROLES_OF.items():
            async with ProxyClient.connect(s.target, token=TOKENS[name]) as c:
                for method, role in METHOD_ROLES.items():
                    got, details = await code_of(call_of(c, method))
                    if role == "reader" or role in roles:
                        # served: an empty request is refused for what it lacks, never for the caller
                        assert got not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), \
                            (name, method, details)
                    else:
                        assert got == grpc.StatusCode.PERMISSION_DENIED, (name, method, got, details)
                        assert method in details and f"the {role} role" in details, details
        # a worker credential cannot create a run (even a valid one); the operator can, and the worker reads it
        async with ProxyClient.connect(s.target, token=TOKENS["fleet-a"]) as worker, \
                ProxyClient.connect(s.target, token=TOKENS["ops"]) as ops:
            run = new_run_id("r")
            got, details = await code_of(create(worker, run))
            assert got == grpc.StatusCode.PERMISSION_DENIED and "CreateRun needs the operator role" in details
            assert not await s.proxy.store.runs.exists(run)
            await create(ops, run)
            assert (await worker.runs.GetRun(pb.RunRef(run_id=run), timeout=5)).spec.run_id == run
            lease = await worker.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w1"), timeout=5)
            assert lease.granted
            stream = worker.runs.WatchRun(pb.WatchRunRequest(run_id=run, from_start=True), timeout=10)
            assert (await stream.read()).type == "RunCreated"
            stream.cancel()
        for token in ("", "wrong-token-0123456789abcdef"):
            async with ProxyClient.connect(s.target, token=token) as c:
                assert (await code_of(c.runs.ListRuns(pb.ListRunsRequest())))[0] == grpc.StatusCode.UNAUTHENTICATED
                assert (await code_of(c.runs.WatchRun(pb.WatchRunRequest(run_id="x")).read()))[0] == \
                    grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(c.channel)
                assert (await health.Check(health_pb2.HealthCheckRequest())).status == \
                    health_pb2.HealthCheckResponse.SERVING
    finally:
        await s.stop(0)


async def test_tokens_rotate_without_a_restart(redis_url, tmp_path, monkeypatch):
    old, new = "old-token-0123456789abcdef", "new-token-0123456789abcdef"
    path = tokens_file(tmp_path, f"reader dash {old}\n")
    s = await start_server(redis_url, tokens_file=str(path), monitor_redis=False)

    async def status(token: str) -> grpc.StatusCode:
        async with ProxyClient.connect(s.target, token=token) as c:
            return (await code_of(c.runs.ListRuns(pb.ListRunsRequest(), timeout=5)))[0]

    try:
        assert await status(old) == grpc.StatusCode.OK
        assert await status(new) == grpc.StatusCode.UNAUTHENTICATED
        monkeypatch.setattr(credentials, "RELOAD_CHECK_S", 0.0)  # the file is checked at most once a second
        path.write_text(f"reader dash {old}\nreader dash {new}\n")  # both, while the fleet moves over
        os.utime(path, ns=(1, 1_000_000_000))
        assert await status(new) == grpc.StatusCode.OK and await status(old) == grpc.StatusCode.OK
        path.write_text(f"reader dash {new}\n")
        os.utime(path, ns=(2, 2_000_000_000))
        assert await status(old) == grpc.StatusCode.UNAUTHENTICATED
        assert await status(new) == grpc.StatusCode.OK
        path.write_text("not a tokens file\n")  # a broken edit keeps the tokens in force
        os.utime(path, ns=(3, 3_000_000_000))
        assert await status(new) == grpc.StatusCode.OK
        # SIGHUP's reload, with no change of mtime
        monkeypatch.setattr(credentials, "RELOAD_CHECK_S", 3600.0)
        path.write_text(f"reader dash {old}\n")
        os.utime(path, ns=(3, 3_000_000_000))
        assert s.proxy.tokens.reload()
        assert await status(old) == grpc.StatusCode.OK and await status(new) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await s.stop(0)


async def test_one_token_mode_keeps_every_role_and_refuses_a_tokens_file_too(redis_url, tmp_path):
    with pytest.raises(ValueError, match="not both"):
        await start_server(redis_url, token="sekrit", tokens_file=str(tokens_file(tmp_path)), monitor_redis=False)
    s = await start_server(redis_url, token="sekrit", monitor_redis=False,
                           limits=Limits(max_runs_per_credential=1, max_worker_ids_per_credential=1))
    try:
        async with ProxyClient.connect(s.target, token="sekrit") as c:
            runs = [await create(c), await create(c)]  # no per-credential quotas with one credential
            for i in range(3):
                assert (await c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=runs[0], worker_id=f"w{i}"))).granted
            for method in METHOD_ROLES:
                got, details = await code_of(call_of(c, method))
                assert got not in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED), details
    finally:
        await s.stop(0)


async def test_a_flood_of_worker_ids_from_one_credential_does_not_lock_out_another(redis_url, tmp_path):
    s = await roles_server(redis_url, tmp_path)
    try:
        async with ProxyClient.connect(s.target, token=TOKENS["ops"]) as ops, \
                ProxyClient.connect(s.target, token=TOKENS["fleet-a"]) as a, \
                ProxyClient.connect(s.target, token=TOKENS["fleet-b"]) as b:
            run = await create(ops, batches_per_step=64, staleness={"max_staleness": 100})

            async def acquire(c: ProxyClient, worker: str) -> tuple[grpc.StatusCode, str]:
                return await code_of(c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=worker),
                                                          timeout=30))

            # the flood: MAX_WORKERS_PER_RUN made-up worker ids of credential A, every one granted a lease
            for start in range(0, MAX_WORKERS_PER_RUN, 512):
                got = await asyncio.gather(*(acquire(a, f"fake-{i}") for i in range(start, start + 512)))
                assert {code for code, _ in got} == {grpc.StatusCode.OK}
            stats = keys.RunKeys(run).stats
            redis = s.proxy.store.redis
            assert int(await redis.hget(stats, "workers@fleet-a")) == MAX_WORKERS_PER_RUN
            code, details = await acquire(a, "fake-one-more")
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "credential fleet-a" in details, details
            # ... and credential B's honest worker still gets its lease
            lease = await b.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="honest"), timeout=10)
            assert lease.granted
            assert int(await redis.hget(stats, "workers@fleet-b")) == 1
            # pruning an idle worker id frees its place in its own credential's count
            await s.proxy.store.sweeps.expire_leases(run, min_idle_ms=0)
            await s.proxy.store.sweeps.prune_consumers(run, min_idle_ms=0)
            assert await redis.hget(stats, "workers@fleet-a") is None
            assert (await acquire(a, "fake-one-more"))[0] == grpc.StatusCode.OK
    finally:
        await s.stop(0)


async def test_runs_per_credential(redis_url, tmp_path):
    # names of their own: the count of runs per credential lives in Redis, which the tests share
    one, two = new_run_id("ops"), new_run_id("ops")
    path = tokens_file(tmp_path, f"operator {one} {TOKENS['ops']}\noperator {two} {TOKENS['ops2']}\n")
    s = await start_server(redis_url, tokens_file=str(path), monitor_redis=False,
                           limits=Limits(max_runs_per_credential=2))
    try:
        async with ProxyClient.connect(s.target, token=TOKENS["ops"]) as ops, \
                ProxyClient.connect(s.target, token=TOKENS["ops2"]) as ops2:
            first = await create(ops)
            await create(ops)
            got, details = await code_of(create(ops))
            assert got == grpc.StatusCode.RESOURCE_EXHAUSTED and f"credential {one} has created 2 runs" in details
            # creating an existing run again (a learner's ensure_run) is not a new run
            await ops.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(first), prompts=make_prompts(16),
                                                         exist_ok=True), timeout=10)
            await create(ops2)  # another credential is not locked out
    finally:
        await s.stop(0)
