"""brigade's Redis clients against real redis-servers and the installed redis-py: long polls that
outlast redis-py 8's 5 s default socket timeout, the pipelining client and the redis-py pools over
TLS with a CA, a full Redis (maxmemory, noeviction): a transient RESOURCE_EXHAUSTED that says
so, and no half-written lease state; and a Redis still loading its data after a restart: UNAVAILABLE."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import shutil
import subprocess
import threading
import time

import grpc
import pytest
import redis
import structlog
from proxy_support import BackgroundProxy, make_prompts, make_spec, new_run_id

from brigade import keys
from brigade.redis_clients import sync_client
from brigade.resp import OutOfMemory, PipelinedRedis
from brigade.rpc import is_transient
from brigade.store import Store
from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade_harness.devservers import free_port, start_redis, wait_for_port

IDLE_S = 12.5  # past redis-py 8's 5 s socket timeout, twice over


def test_long_polls_outlast_the_socket_timeout(redis_url):
    """An idle WatchRun, an idle PullRollouts and the evaluator's event tail, side by side for 12.5 s."""
    from brigade_evaluator.cli import watch

    proxy = BackgroundProxy(redis_url)
    run = new_run_id("idle")
    errors: dict[str, object] = {}
    try:
        with grpc.insecure_channel(proxy.target) as ch:
            pbg.RunServiceStub(ch).CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(4)),
                                             timeout=30)

        def watch_run() -> None:
            with grpc.insecure_channel(proxy.target) as ch:
                try:
                    list(pbg.RunServiceStub(ch).WatchRun(pb.WatchRunRequest(run_id=run), timeout=IDLE_S))
                except grpc.RpcError as e:
                    errors["watch"] = e.code()

        def pull() -> None:
            with grpc.insecure_channel(proxy.target) as ch:
                reply = pbg.LearnerServiceStub(ch).PullRollouts(
                    pb.PullRolloutsRequest(run_id=run, learner_id="l", max_manifests=1, wait_ms=int(IDLE_S * 1000)),
                    timeout=IDLE_S + 10)
                errors["pull"] = list(reply.rollouts)

        def evaluator() -> None:
            async def tail() -> None:
                task = asyncio.ensure_future(watch(redis_url, "file:///nonexistent", run, structlog.get_logger()))
                done, _ = await asyncio.wait([task], timeout=IDLE_S)
                errors["evaluator"] = task.exception() if done else "still watching"
                task.cancel()

            asyncio.run(tail())

        threads = [threading.Thread(target=f) for f in (watch_run, pull, evaluator)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(IDLE_S + 15)
    finally:
        proxy.close()
    assert errors == {"watch": grpc.StatusCode.DEADLINE_EXCEEDED, "pull": [], "evaluator": "still watching"}


# ---------------------------------------------------------------- TLS

def _certificates(folder) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 signed by it, as PEM files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    files = {}
    ca_key, server_key, other_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    pems = {
        "ca": cert("brigade test CA", ca_key, "brigade test CA", ca_key, True).public_bytes(serialization.Encoding.PEM),
        "other_ca": cert("another CA", other_key, "another CA", other_key, True).public_bytes(serialization.Encoding.PEM),
        "cert": cert("127.0.0.1", server_key, "brigade test CA", ca_key, False).public_bytes(serialization.Encoding.PEM),
        "key": server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption()),
    }
    for name, pem in pems.items():
        files[name] = str(folder / f"{name}.pem")
        (folder / f"{name}.pem").write_bytes(pem)
    return files


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    exe = shutil.which("redis-server")
    folder = tmp_path_factory.mktemp("tls")
    files = _certificates(folder)
    port = free_port()
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                             "--tls-cert-file", files["cert"], "--tls-key-file", files["key"],
                             "--tls-ca-cert-file", files["ca"], "--tls-auth-clients", "no", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=proc)
    except Exception:
        proc.kill()
        pytest.skip("this redis-server was built without TLS")
    yield f"rediss://127.0.0.1:{port}/0", files
    proc.terminate()
    proc.wait(10)


async def test_pipelining_and_pools_over_tls(tls_redis):
    base, files = tls_redis
    url = f"{base}?ssl_ca_certs={files['ca']}"
    fast = PipelinedRedis(url)
    try:
        replies = await asyncio.gather(*(fast.execute("INCR", "tls-counter") for _ in range(50)))
        assert sorted(replies) == list(range(replies[0], replies[0] + 50))
    finally:
        await fast.close()
    with pytest.raises(redis.exceptions.ConnectionError):  # a certificate from a CA it was not given
        await PipelinedRedis(f"{base}?ssl_ca_certs={files['other_ca']}").execute("PING")

    store = Store(url)  # the lease scripts over the pipelining client, the rest over redis-py's pools
    try:
        assert store.fast is not None
        run = new_run_id("tls")
        assert await store.runs.create(make_spec(run), make_prompts(4))
        granted = await store.leases.acquire(run, "w1")
        assert granted.granted and len(granted.lease.batch.prompts) == 2
        assert await store.blocking.xread({keys.RunKeys(run).events: "0-0"}, count=1, block=100)
    finally:
        await store.close()
    assert sync_client(url).ping()


# ---------------------------------------------------------------- a full Redis

@pytest.fixture
def small_redis(tmp_path):
    server = start_redis(tmp_path / "redis")
    yield server
    server.stop()


def _state(admin: redis.Redis, run: str) -> dict:
    k = keys.RunKeys(run)
    return {"keys": sorted(admin.keys("*")), "cursor": admin.get(k.cursor), "work": admin.xlen(k.work),
            "pending": admin.xpending(k.work, keys.WORK_GROUP)["pending"], "events": admin.xlen(k.events)}


@pytest.mark.parametrize("pipelined", [True, False])
async def test_a_full_redis_refuses_whole_lease_operations(small_redis, pipelined):
    admin = redis.Redis.from_url(small_redis.url)
    store = Store(small_redis.url, pipelined=pipelined)
    run = new_run_id("oom")
    try:
        assert await store.runs.create(make_spec(run), make_prompts(8))
        first = await store.leases.acquire(run, "w1")
        before = _state(admin, run)
        admin.config_set("maxmemory", 1)  # any write that may grow memory is refused (noeviction)
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await store.leases.acquire(run, "w2")
            assert _state(admin, run) == before  # the script was refused whole: no cursor, no lease, no event
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await store.runs.create(make_spec(new_run_id("oom")), make_prompts(3000))
            assert _state(admin, run) == before  # nor a staged prompt list
            # what frees memory still runs: the worker's failure report puts the batch back
            assert (await store.leases.fail(run, first.lease.lease_id, "w1", pb.FailLeaseRequest.PREEMPTED)).requeued
        finally:
            admin.config_set("maxmemory", 0)
        assert (await store.leases.acquire(run, "w2")).granted
    finally:
        await store.close()


@contextlib.contextmanager
def run_behind_a_proxy(server, name: str):
    """A proxy (in a thread) on `server` with a fresh 4-prompt run: (a channel to it, the run id)."""
    proxy = BackgroundProxy(server.url)
    run = new_run_id(name)
    try:
        with grpc.insecure_channel(proxy.target) as ch:
            pbg.RunServiceStub(ch).CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(4)),
                                             timeout=30)
            yield ch, run
    finally:
        proxy.close()


def test_a_full_redis_is_a_transient_resource_exhausted(small_redis):
    admin = redis.Redis.from_url(small_redis.url)
    with run_behind_a_proxy(small_redis, "oom") as (ch, run):
        admin.config_set("maxmemory", 1)
        try:
            with pytest.raises(grpc.RpcError) as e:
                pbg.LeaseServiceStub(ch).AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w"), timeout=10)
        finally:
            admin.config_set("maxmemory", 0)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "Redis is full" in e.value.details()
        assert is_transient(e.value)  # the learner and the workers wait and call again
        assert pbg.LeaseServiceStub(ch).AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w"),
                                                     timeout=10).granted


def test_oom_replies_are_redis_py_out_of_memory_errors():
    from brigade.resp import Loading, Replies

    replies = Replies()
    replies.feed(b"-OOM command not allowed when used memory > 'maxmemory'.\r\n-LOADING Redis is loading\r\n")
    oom, loading = replies.next(), replies.next()
    assert isinstance(oom, OutOfMemory) and isinstance(oom, redis.exceptions.OutOfMemoryError)
    assert isinstance(loading, Loading) and isinstance(loading, redis.exceptions.BusyLoadingError)


def test_a_loading_redis_is_unavailable_not_an_internal_error(small_redis):
    """A restarted Redis answers LOADING until its data is back in memory (a big dataset: seconds). The
    proxy says UNAVAILABLE (the learner and the workers call again), never INTERNAL (which they give up
    on), and grants as soon as the data is loaded. Loading is slowed for real: Redis's own
    key-load-delay, and events served during the load every 1 KiB instead of every 2 MB."""
    admin = redis.Redis.from_url(small_redis.url)
    with run_behind_a_proxy(small_redis, "loading") as (ch, run):
        admin.mset({f"filler:{i}": "x" * 64 for i in range(100)})
        admin.save()  # the RDB the restart loads: ~120 keys at 20 ms each
        admin.close()
        small_redis.argv += ["--key-load-delay", "20000", "--loading-process-events-interval-bytes", "1024"]
        small_redis.restart()
        leases, answers = pbg.LeaseServiceStub(ch), []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                assert leases.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w"), timeout=10).granted
                break
            except grpc.RpcError as e:
                answers.append((e.code(), e.details()))
                time.sleep(0.05)
        else:
            pytest.fail(f"no lease within 60 s of the restart: {answers[-3:]}")
    assert {code for code, _ in answers} == {grpc.StatusCode.UNAVAILABLE}, answers
    assert any("loading its data" in details for _, details in answers), answers
