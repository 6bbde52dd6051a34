"""The proxy's /metrics, scraped over HTTP and parsed with prometheus-client's parser: RPC counts and
latency by method and status code, lease outcomes read off the responses, and the run-state
gauges from the store's views."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from proxy_support import make_prompts, make_spec, new_run_id

from brigade.rpc import ProxyClient
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import free_port


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


async def test_proxy_metrics_count_rpcs_leases_and_run_state(redis_url):
    from brigade_proxy.metrics import start_metrics
    from brigade_proxy.server import start_server

    server = await start_server(redis_url, "127.0.0.1:0")
    port = free_port()
    refresher = start_metrics(port, server.proxy.store)
    run = new_run_id("prom")
    before = await asyncio.to_thread(scrape, port)
    try:
        async with ProxyClient.connect(f"127.0.0.1:{server.port}") as c:
            await c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run, max_steps=1), prompts=make_prompts(4)))
            acquire = pb.AcquireLeaseRequest(run_id=run, worker_id="w1", capacity_class="spot", engine="hf")
            answers = [await c.lease.AcquireLease(acquire) for _ in range(8)]  # admission shuts at some point
            granted = sum(a.granted for a in answers)
            refusals = [a.reason for a in answers if not a.granted]
            assert granted and refusals, answers
            with pytest.raises(grpc.aio.AioRpcError):
                await c.runs.GetRun(pb.RunRef(run_id="no-such-run"))
        for _ in range(50):  # the run-state snapshot is renewed every few seconds
            samples = await asyncio.to_thread(scrape, port)
            if value(samples, "brigade_run_batches_leased", run=run) == granted:
                break
            await asyncio.sleep(0.2)
    finally:
        refresher.cancel()
        await server.stop(0)

    def delta(name, **labels):
        return value(samples, name, **labels) - value(before, name, **labels)

    assert delta("brigade_proxy_rpcs_total", method="CreateRun", code="OK") == 1
    assert delta("brigade_proxy_rpcs_total", method="AcquireLease", code="OK") == 8
    assert delta("brigade_proxy_rpcs_total", method="GetRun", code="NOT_FOUND") == 1
    assert delta("brigade_proxy_rpc_duration_seconds_count", method="AcquireLease", code="OK") == 8
    assert value(samples, "brigade_proxy_rpc_duration_seconds_bucket", method="CreateRun", code="OK", le="+Inf") >= 1
    assert value(samples, "brigade_proxy_leases_granted_total", run=run) == granted
    for reason in set(refusals):
        assert value(samples, "brigade_proxy_admission_refusals_total", run=run, reason=reason) == refusals.count(reason)
    assert value(samples, "brigade_run_batches_leased", run=run) == granted
    assert value(samples, "brigade_run_batches_created_total", run=run) >= 1
    assert ("brigade_run_leases_expired_total", frozenset({("run", run)})) in samples


# ---------------------------------------------------------------- bounded labels, bound host, token

def series(samples, prefix: str = "brigade_proxy_rpc") -> set:
    return {key for key in samples if key[0].startswith(prefix)}


async def test_unauthenticated_calls_add_no_series(redis_url):
    """500 random method paths (and known methods) without the token: refused, and no new series."""
    import uuid

    from brigade_proxy.metrics import start_metrics
    from brigade_proxy.server import start_server

    server = await start_server(redis_url, "127.0.0.1:0", token="metrics-test-token")
    port = free_port()
    refresher = start_metrics(port, server.proxy.store)
    try:
        before = series(await asyncio.to_thread(scrape, port))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            async def call(path: str) -> grpc.StatusCode:
                try:
                    await ch.unary_unary(path, request_serializer=None, response_deserializer=None)(b"", timeout=10)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    return e.code()

            paths = [f"/{uuid.uuid4().hex}/{uuid.uuid4().hex}" for _ in range(500)]
            paths += ["/brigade.v1.LeaseService/AcquireLease", "/brigade.v1.RunService/CreateRun"]
            codes = []
            for start in range(0, len(paths), 50):
                codes += await asyncio.gather(*(call(p) for p in paths[start:start + 50]))
        assert set(codes) == {grpc.StatusCode.UNAUTHENTICATED}
        samples = await asyncio.to_thread(scrape, port)
        assert series(samples) <= before, sorted(series(samples) - before)[:5]
        assert value(samples, "brigade_proxy_rpcs_total", method="unauthenticated", code="UNAUTHENTICATED") >= 502
    finally:
        refresher.cancel()
        await server.stop(0)


async def test_method_label_is_a_registered_method_or_other():
    """Labels come from the methods the server registers; any other path a handler answers is `other`."""
    from brigade_proxy.metrics import OTHER, RPCS, RpcMetrics

    metrics = RpcMetrics()
    assert metrics.methods["/brigade.v1.LeaseService/AcquireLease"] == "AcquireLease"
    assert metrics.methods["/grpc.health.v1.Health/Check"] == "Check"
    assert "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo" in metrics.methods

    async def echo(request, context):
        return request

    async def continuation(details):
        return grpc.unary_unary_rpc_method_handler(echo)

    class Details:
        method = "/some.Service/NotOurs"

    class Context:
        def code(self):
            return None

    before = value_of(RPCS, OTHER, "OK")
    handler = await metrics.intercept_service(continuation, Details())
    assert await handler.unary_unary(b"x", Context()) == b"x"
    assert value_of(RPCS, OTHER, "OK") == before + 1
    assert ("NotOurs", "OK") not in {tuple(s.labels.values()) for m in RPCS.collect() for s in m.samples}


def value_of(counter, *labels: str) -> float:
    return next((s.value for m in counter.collect() for s in m.samples
                 if s.name.endswith("_total") and tuple(s.labels.values()) == labels), 0.0)


async def test_run_labels_are_capped(redis_url, monkeypatch):
    """Past MAX_RUN_LABELS runs, lease counters say `_other` and the run-state series leave runs out."""
    from brigade_proxy import metrics
    from brigade_proxy.server import start_server

    monkeypatch.setattr(metrics, "MAX_RUN_LABELS", 2)
    server = await start_server(redis_url, "127.0.0.1:0")
    port = free_port()
    refresher = metrics.start_metrics(port, server.proxy.store)
    runs = [new_run_id("cap") for _ in range(4)]
    before = await asyncio.to_thread(scrape, port)
    try:
        async with ProxyClient.connect(f"127.0.0.1:{server.port}") as c:
            for run in runs:
                await c.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(4)))
                answer = await c.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w1"))
                assert answer.granted
        for _ in range(50):  # the run-state snapshot is renewed every few seconds
            samples = await asyncio.to_thread(scrape, port)
            if value(samples, "brigade_proxy_runs_unlabelled") >= 2:
                break
            await asyncio.sleep(0.2)
    finally:
        refresher.cancel()
        await server.stop(0)
    granted = {dict(labels)["run"] for (name, labels), v in samples.items()
               if name == "brigade_proxy_leases_granted_total" and v > value(before, name, **dict(labels))}
    assert granted == {runs[0], runs[1], "_other"}, granted
    assert value(samples, "brigade_proxy_leases_granted_total", run="_other") - \
        value(before, "brigade_proxy_leases_granted_total", run="_other") == 2
    shown = {dict(labels)["run"] for name, labels in samples if name == "brigade_run_batches_queued"}
    assert len(shown) <= 2 and value(samples, "brigade_proxy_runs_unlabelled") >= 2


def test_metrics_endpoint_binds_the_listen_host_and_requires_its_token(redis_url, tmp_path):
    """`brigade proxy --listen 127.0.0.2:P --metrics-port M --metrics-token T`: /metrics on 127.0.0.2 only,
    401 without the token, served with it."""
    import os
    import socket
    import subprocess
    import sys
    import time
    import urllib.error

    port, metrics_port = free_port(), free_port()
    env = dict(os.environ, BRIGADE_METRICS_TOKEN="scrape-token")
    env.pop("BRIGADE_METRICS_HOST", None)
    proc = subprocess.Popen([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.2:{port}", "--redis-url",
                             redis_url, "--bucket", "", "--metrics-port", str(metrics_port), "--state-dir",
                             str(tmp_path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.2", metrics_port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                assert time.monotonic() < deadline, "the metrics endpoint never opened"
                time.sleep(0.1)
        with pytest.raises(OSError):  # not every interface: nothing on 127.0.0.1
            socket.create_connection(("127.0.0.1", metrics_port), timeout=1).close()
        url = f"http://127.0.0.2:{metrics_port}/metrics"
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == 401
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer wrong"}), timeout=5)
        ok = urllib.request.urlopen(urllib.request.Request(url, headers={"Authorization": "Bearer scrape-token"}),
                                    timeout=5)
        assert ok.status == 200 and b"brigade_proxy_rpcs_total" in ok.read()
    finally:
        proc.terminate()
        proc.wait(10)
