"""The proxy's connection-level limits, against a real proxy: keepalive policy (clients' pings are
accepted, a flood is not), reflection v1, request sizes by method, refusals before a body is read,
WatchRun stream limits that cannot starve PullRollouts, a large CreateRun off the event loop, and
run touches that never read the prompts."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_support import PROXY_TOKEN, BackgroundProxy, make_prompts, make_spec, new_run_id

from brigade.rpc import KEEPALIVE_MS, channel_options, is_transient, server_options
from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade_proxy import reflection
from brigade_proxy.calls import Slots, SlotsFull
from brigade_proxy.limits import MIB, Limits

LIMITS = Limits(max_streams=4, max_streams_per_client=2, max_prompts=400_000)
AUTH = (("authorization", f"Bearer {PROXY_TOKEN}"),)


@pytest.fixture(scope="module")
def proxy(redis_url):
    # clients ping every second in this module; the server takes pings down to every 500 ms
    p = BackgroundProxy(redis_url, token=PROXY_TOKEN, limits=LIMITS, min_ping_interval_ms=500)
    yield p
    p.close()


@pytest.fixture(scope="module")
def run(proxy):
    run = new_run_id("lim")
    with grpc.insecure_channel(proxy.target) as ch:
        pbg.RunServiceStub(ch).CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(8)),
                                         metadata=AUTH, timeout=30)
    return run


def channel(target: str, keepalive_ms: int = 1000) -> grpc.Channel:
    options = [o for o in channel_options(keepalive_ms) if o[0] != "grpc.max_send_message_length"]
    return grpc.insecure_channel(target, options=[*options, ("grpc.max_send_message_length", 64 * MIB)])


def watch_for(ch: grpc.Channel, run: str, seconds: float) -> grpc.StatusCode:
    """How a WatchRun on a quiet run ends within `seconds`: DEADLINE_EXCEEDED = it stayed open."""
    stream = pbg.RunServiceStub(ch).WatchRun(pb.WatchRunRequest(run_id=run), metadata=AUTH, timeout=seconds)
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        return e.code()
    return grpc.StatusCode.OK


def test_policy_accepts_the_clients_pings():
    client = dict(channel_options())
    server = dict(server_options())
    assert server["grpc.keepalive_permit_without_calls"] == 1
    assert server["grpc.http2.min_ping_interval_without_data_ms"] < client["grpc.keepalive_time_ms"] == KEEPALIVE_MS


def test_keepalive_pings_keep_a_quiet_stream_and_a_stricter_server_sends_goaway(proxy, run, redis_url):
    """The production ratio scaled down: 1 s pings against the 500 ms minimum keep a quiet stream for
    7 s (grpc-core's default policy sent GOAWAY too_many_pings after about 5 s); the same pings
    against a server that wants 3 s between them get GOAWAY, so the policy is what decides."""
    strict = BackgroundProxy(redis_url, token=PROXY_TOKEN, min_ping_interval_ms=3000)
    results = {}

    def watch(name: str, target: str) -> None:
        with channel(target, 1000) as ch:
            results[name] = watch_for(ch, run, 7.0)

    threads = [threading.Thread(target=watch, args=a) for a in (("accepted", proxy.target), ("strict", strict.target))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    finally:
        strict.close()
    assert results == {"accepted": grpc.StatusCode.DEADLINE_EXCEEDED, "strict": grpc.StatusCode.UNAVAILABLE}


def test_reflection_v1_lists_services(proxy):
    request_cls, response_cls = reflection.v1_messages()
    with grpc.insecure_channel(proxy.target) as ch:
        call = ch.stream_stream(reflection.V1_METHOD, request_serializer=request_cls.SerializeToString,
                                response_deserializer=response_cls.FromString)
        (reply,) = list(call(iter([request_cls(list_services="")]), timeout=10))
        names = {s.name for s in reply.list_services_response.service}
        (described,) = list(call(iter([request_cls(file_containing_symbol=reflection.V1_SERVICE)]), timeout=10))
    assert {"brigade.v1.LeaseService", "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection"} <= names
    assert described.file_descriptor_response.file_descriptor_proto


def test_request_sizes_by_method(proxy):
    with channel(proxy.target) as ch:
        lease, runs = pbg.LeaseServiceStub(ch), pbg.RunServiceStub(ch)
        # 5 MiB is over every method's limit but CreateRun's: refused before it is parsed
        with pytest.raises(grpc.RpcError) as e:
            lease.AcquireLease(pb.AcquireLeaseRequest(run_id="r", worker_id="w" * (5 * MIB)), metadata=AUTH, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 4194304" in e.value.details()
        assert not is_transient(e.value)
        with pytest.raises(grpc.RpcError) as e:  # CreateRun takes it (and then finds no spec)
            runs.CreateRun(pb.CreateRunRequest(prompts=[pb.Prompt(text="x" * (5 * MIB))]), metadata=AUTH, timeout=10)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_no_token_is_refused_before_the_body_is_read(proxy):
    """A 40 MiB body is over gRPC's receive limit: had the proxy read it, the answer would be
    RESOURCE_EXHAUSTED; the token is checked first, so it never is."""
    big_run = pb.CreateRunRequest(prompts=[pb.Prompt(text="x" * (40 * MIB))])
    big_lease = pb.AcquireLeaseRequest(run_id="r", worker_id="w" * (40 * MIB))
    with channel(proxy.target) as ch:
        for call, request in ((pbg.RunServiceStub(ch).CreateRun, big_run),
                              (pbg.LeaseServiceStub(ch).AcquireLease, big_lease)):
            with pytest.raises(grpc.RpcError) as e:
                call(request, timeout=20)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_watchers_are_capped_and_cannot_starve_pulls(proxy, run):
    opened = threading.Barrier(3)
    ends = []

    def watch() -> None:
        with channel(proxy.target) as ch:
            stream = pbg.RunServiceStub(ch).WatchRun(pb.WatchRunRequest(run_id=run), metadata=AUTH, timeout=3)
            opened.wait(10)
            try:
                list(stream)
            except grpc.RpcError as e:
                ends.append(e.code())

    threads = [threading.Thread(target=watch) for _ in range(2)]
    for t in threads:
        t.start()
    opened.wait(10)
    time.sleep(0.5)  # both streams reach the proxy
    with channel(proxy.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pbg.RunServiceStub(ch).WatchRun(pb.WatchRunRequest(run_id=run), metadata=AUTH, timeout=5))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "per client" in e.value.details()
        assert is_transient(e.value)
        pulled = pbg.LearnerServiceStub(ch).PullRollouts(
            pb.PullRolloutsRequest(run_id=run, learner_id="l", max_manifests=1, wait_ms=300), metadata=AUTH, timeout=10)
        assert list(pulled.rollouts) == []
    for t in threads:
        t.join(15)
    assert ends == [grpc.StatusCode.DEADLINE_EXCEEDED] * 2
    streams = proxy.server.proxy.streams
    for _ in range(50):  # closed streams give their slots back once the proxy sees them cancelled
        if streams.used == 0:
            break
        time.sleep(0.1)
    assert streams.used == 0 and streams.by_client == {}


def test_slots_total_and_per_client():
    slots = Slots("things", total=2, per_client=1)
    with slots.hold("a"):
        with pytest.raises(SlotsFull, match="per client"):
            with slots.hold("a"):
                pass
        with slots.hold("b"):
            with pytest.raises(SlotsFull, match="its limit"):
                with slots.hold("c"):
                    pass
    assert slots.used == 0 and slots.by_client == {}


def test_large_create_run_leaves_the_loop_free_and_touches_skip_prompts(proxy):
    run = new_run_id("big")
    request = pb.CreateRunRequest(spec=make_spec(run), prompts=[pb.Prompt(id=str(i)) for i in range(300_000)])
    done = threading.Event()
    worst = 0.0

    def create() -> None:
        with channel(proxy.target) as ch:
            pbg.RunServiceStub(ch).CreateRun(request, metadata=AUTH, timeout=120)
        done.set()

    t = threading.Thread(target=create)
    t.start()
    with channel(proxy.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        health.Check(health_pb2.HealthCheckRequest(), timeout=10)
        while not done.is_set():
            started = time.monotonic()
            health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.02)
        t.join(5)
        too_many = pb.CreateRunRequest(spec=make_spec(new_run_id("big")), prompts=[pb.Prompt()] * 400_001)
        with pytest.raises(grpc.RpcError) as e:
            pbg.RunServiceStub(ch).CreateRun(too_many, metadata=AUTH, timeout=60)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most 400000" in e.value.details()
    assert worst < 1.0, f"the event loop stalled {worst:.2f} s during CreateRun"

    proxy.restart()  # empty caches: touching the run must not read its 300k prompts
    with channel(proxy.target) as ch:
        listed = pbg.RunServiceStub(ch).ListRuns(pb.ListRunsRequest(), metadata=AUTH, timeout=10)
    assert [r.num_prompts for r in listed.runs if r.spec.run_id == run] == [300_000]
    assert proxy.store.runs._cache[run].prompt_bytes is None


def test_every_limit_is_in_the_configuration_doc():
    from dataclasses import fields
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs/configuration.md").read_text()
    for f in fields(Limits):
        assert f"`BRIGADE_{f.name.upper()}` | `--{f.name.replace('_', '-')}`" in doc, f.name


def test_prompt_bundle_is_the_deterministic_serialization():
    from brigade.store.runs import prompt_bundle

    prompts = [*make_prompts(300), pb.Prompt(), pb.Prompt(text="é" * 200, columns={"b": "2", "a": "1"})]
    expected = pb.PromptBatch(run_id="r", prompts=prompts).SerializeToString(deterministic=True)
    assert prompt_bundle("r", [p.SerializeToString(deterministic=True) for p in prompts]) == expected
