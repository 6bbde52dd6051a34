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
