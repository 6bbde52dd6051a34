"""Hostile requests: random and malformed requests to every RPC (typed fields with random values;
random, mutated, truncated, bit-flipped and spliced bytes; a corpus of malformed protobuf wire
data), wrong, missing and almost-matching tokens, and oversized messages to each service. The proxy
must answer each with a deliberate status (never UNKNOWN, never INTERNAL for a request problem) and
keep serving afterwards: health, ListRuns and a lease cycle still work."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from proxy_support import (
    PROXY_TOKEN,
    REFUSALS,
    WAITING,
    SyncClient,
    make_prompts,
    make_spec,
    manifest_for,
    new_run_id,
    status_of,
)

from brigade import keys
from brigade.rpc import MAX_MESSAGE_BYTES
from brigade.v1 import brigade_pb2 as pb

TOKEN = PROXY_TOKEN
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
METHODS = [(service.full_name, method) for service in pb.DESCRIPTOR.services_by_name.values()
           for method in service.methods]


@pytest.fixture(scope="module")
def run(proxy_client):
    run = new_run_id("h")
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(40)), metadata=proxy_client.metadata)
    return run


texts = st.one_of(
    st.text(max_size=20),
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=300),
    st.sampled_from(["", " ", "0-0", "1-1", "99999999999999999999-1", "../../etc", "a:b:c", "\x00", "*", "$",
                     "x" * 257, "y" * 100_000]),
)
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=64)


def assert_serving(proxy_client: SyncClient) -> None:
    health = health_pb2_grpc.HealthStub(proxy_client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    proxy_client.runs.ListRuns(pb.ListRunsRequest(), metadata=proxy_client.metadata, timeout=5)


def pick_run(real: str):
    return st.one_of(st.just(real), texts)


def rollout_manifests(run: str):
    return st.builds(
        pb.RolloutManifest, run_id=pick_run(run), batch_id=texts, attempt=u32, worker_id=texts, policy_version=u64,
        uri=texts, sha256=st.one_of(texts, st.just("a" * 64)), size_bytes=u64, num_samples=u32, num_tokens=u32,
        reward_mean=st.floats(width=32), compute_seconds=floats, price_per_hour=floats, text_uri=texts,
    )


@given(data=st.data())
@SETTINGS
def test_random_lease_requests(proxy_client, run, data):
    md = proxy_client.metadata
    req = pb.AcquireLeaseRequest(run_id=data.draw(pick_run(run)), worker_id=data.draw(texts),
                                 capacity_class=data.draw(texts), price_per_hour=data.draw(floats),
                                 engine=data.draw(texts))
    assert status_of(proxy_client.lease.AcquireLease, req, metadata=md, timeout=10) in REFUSALS
    hb = pb.HeartbeatRequest(run_id=data.draw(pick_run(run)), lease_id=data.draw(texts), worker_id=data.draw(texts))
    assert status_of(proxy_client.lease.Heartbeat, hb, metadata=md, timeout=10) in REFUSALS
    done = pb.CompleteLeaseRequest(run_id=data.draw(pick_run(run)), lease_id=data.draw(texts),
                                   worker_id=data.draw(texts))
    if data.draw(st.booleans()):
        done.manifest.CopyFrom(data.draw(rollout_manifests(run)))
    assert status_of(proxy_client.lease.CompleteLease, done, metadata=md, timeout=10) in REFUSALS
    fail = pb.FailLeaseRequest(run_id=data.draw(pick_run(run)), lease_id=data.draw(texts), worker_id=data.draw(texts),
                               reason=data.draw(st.integers(0, 5)), message=data.draw(texts))
    assert status_of(proxy_client.lease.FailLease, fail, metadata=md, timeout=10) in REFUSALS


@given(data=st.data())
@SETTINGS
def test_random_learner_requests(proxy_client, run, data):
    md = proxy_client.metadata
    pull = pb.PullRolloutsRequest(run_id=data.draw(pick_run(run)), max_manifests=data.draw(u32),
                                  wait_ms=data.draw(st.sampled_from([0, 1, 5])),
                                  include_pending=data.draw(st.booleans()), learner_id=data.draw(texts))
    assert status_of(proxy_client.learner.PullRollouts, pull, metadata=md, timeout=10) in REFUSALS
    ids = st.lists(texts, max_size=5)
    ack = pb.AckRolloutsRequest(run_id=data.draw(pick_run(run)), delivery_ids=data.draw(ids),
                                consumed_batch_ids=data.draw(ids), rejected_batch_ids=data.draw(ids),
                                step=data.draw(u64), learner_id=data.draw(texts), metrics_json=data.draw(texts))
    assert status_of(proxy_client.learner.AckRollouts, ack, metadata=md, timeout=10) in REFUSALS
    adapter = pb.AdapterManifest(run_id=data.draw(pick_run(run)), version=data.draw(u64), step=data.draw(u64),
                                 uri=data.draw(texts), payload=data.draw(texts))
    pub = pb.PublishAdapterRequest(run_id=data.draw(pick_run(run)))
    if data.draw(st.booleans()):
        pub.manifest.CopyFrom(adapter)
    assert status_of(proxy_client.learner.PublishAdapter, pub, metadata=md, timeout=10) in REFUSALS


@given(data=st.data())
@SETTINGS
def test_random_run_requests(proxy_client, run, data):
    md = proxy_client.metadata
    r = pb.RunRef(run_id=data.draw(pick_run(run)))
    for call in (proxy_client.runs.GetRun, proxy_client.runs.ListLeases, proxy_client.runs.ListWorkers, proxy_client.runs.ListAdapters,
                 proxy_client.runs.ListDeadLetters):
        assert status_of(call, r, metadata=md, timeout=10) in REFUSALS
    m = pb.GetMetricsRequest(run_id=data.draw(pick_run(run)), last=data.draw(u32))
    assert status_of(proxy_client.runs.GetMetrics, m, metadata=md, timeout=10) in REFUSALS
    spec = make_spec(new_run_id("h"))
    spec.run_id = data.draw(st.one_of(st.just(spec.run_id), texts))
    spec.prompts_per_batch = data.draw(u32)
    spec.staleness.max_staleness = data.draw(u32)
    spec.grpo.learning_rate = data.draw(st.floats(width=32))
    create = pb.CreateRunRequest(spec=spec, prompts=data.draw(st.lists(st.builds(pb.Prompt, id=texts, text=texts),
                                                                       max_size=3)),
                                 exist_ok=data.draw(st.booleans()))
    assert status_of(proxy_client.runs.CreateRun, create, metadata=md, timeout=10) in REFUSALS
    watch = pb.WatchRunRequest(run_id=data.draw(pick_run(run)), after_id=data.draw(texts),
                               from_start=data.draw(st.booleans()))
    assert status_of(proxy_client.runs.WatchRun, watch, metadata=md, timeout=0.3) in REFUSALS | WAITING
    assert_serving(proxy_client)


def test_long_poll_is_capped_by_the_deadline(proxy_client, run):
    pull = pb.PullRolloutsRequest(run_id=run, learner_id="idle", max_manifests=1, wait_ms=2**32 - 1)
    resp = proxy_client.learner.PullRollouts(pull, metadata=proxy_client.metadata, timeout=1.0)  # answers before the deadline
    assert isinstance(resp, pb.PullRolloutsResponse)


@given(payload=st.binary(max_size=200))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_garbage_bytes(proxy_client, payload):
    for method in ("/brigade.v1.LeaseService/AcquireLease", "/brigade.v1.LearnerService/AckRollouts",
                   "/brigade.v1.RunService/CreateRun"):
        call = proxy_client.channel.unary_unary(method, request_serializer=None, response_deserializer=None)
        code = status_of(call, payload, metadata=proxy_client.metadata, timeout=10)
        assert code in REFUSALS, code
    assert_serving(proxy_client)


def test_missing_and_wrong_tokens(token_proxy, run):
    for token in ("", "not-the-token"):
        c = SyncClient(token_proxy.target, token)
        try:
            calls = [
                (c.lease.AcquireLease, pb.AcquireLeaseRequest(run_id=run, worker_id="w")),
                (c.lease.Heartbeat, pb.HeartbeatRequest(run_id=run, lease_id="1-1", worker_id="w")),
                (c.lease.CompleteLease, pb.CompleteLeaseRequest(run_id=run)),
                (c.lease.FailLease, pb.FailLeaseRequest(run_id=run)),
                (c.learner.PullRollouts, pb.PullRolloutsRequest(run_id=run, learner_id="L")),
                (c.learner.AckRollouts, pb.AckRolloutsRequest(run_id=run)),
                (c.learner.PublishAdapter, pb.PublishAdapterRequest(run_id=run)),
                (c.runs.CreateRun, pb.CreateRunRequest()),
                (c.runs.GetRun, pb.RunRef(run_id=run)),
                (c.runs.ListRuns, pb.ListRunsRequest()),
                (c.runs.ListLeases, pb.RunRef(run_id=run)),
                (c.runs.ListWorkers, pb.RunRef(run_id=run)),
                (c.runs.ListAdapters, pb.RunRef(run_id=run)),
                (c.runs.GetMetrics, pb.GetMetricsRequest(run_id=run)),
                (c.runs.ListDeadLetters, pb.RunRef(run_id=run)),
            ]
            for call, request in calls:
                assert status_of(call, request, metadata=c.metadata, timeout=5) == grpc.StatusCode.UNAUTHENTICATED
            assert status_of(c.runs.WatchRun, pb.WatchRunRequest(run_id=run), metadata=c.metadata, timeout=5) == \
                grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(c.channel)  # health stays open
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
        finally:
            c.close()


def test_oversized_message(token_proxy, proxy_client):
    # a run of its own: the module's shared run may be at its admission limit after the random tests
    run = new_run_id("big")
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(4)),
                                metadata=proxy_client.metadata)
    big_channel = grpc.insecure_channel(token_proxy.target, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)])
    try:
        create = big_channel.unary_unary("/brigade.v1.RunService/CreateRun",
                                         request_serializer=pb.CreateRunRequest.SerializeToString,
                                         response_deserializer=pb.CreateRunResponse.FromString)
        huge = pb.CreateRunRequest(spec=make_spec(new_run_id("h")), prompts=[pb.Prompt(id="x", text="z" * (MAX_MESSAGE_BYTES + 1024))])
        assert status_of(create, huge, metadata=proxy_client.metadata, timeout=30) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        big_channel.close()
    assert_serving(proxy_client)
    lease = proxy_client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="after"), metadata=proxy_client.metadata)
    assert lease.granted
    done = proxy_client.lease.CompleteLease(pb.CompleteLeaseRequest(
        run_id=run, lease_id=lease.lease.lease_id, worker_id="after",
        manifest=manifest_for(run, lease.lease, "after")), metadata=proxy_client.metadata)
    assert not done.duplicate


# ---------------------------------------------------------------- raw bytes on the wire


def raw_call(channel: grpc.Channel, service: str, method):
    """The method on the wire: bytes in, bytes out, no client-side parsing."""
    path = f"/{service}/{method.name}"
    if method.server_streaming:
        return channel.unary_stream(path, request_serializer=None, response_deserializer=None)
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def assert_leasing(proxy_client: SyncClient, run: str) -> None:
    """Serving, and a worker still gets an answer to AcquireLease."""
    assert_serving(proxy_client)
    md = proxy_client.metadata
    lease = proxy_client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="honest"), metadata=md, timeout=5)
    if lease.granted:  # admission may be full of the fuzzers' leases; then at least the refusal is an answer
        proxy_client.lease.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=lease.lease.lease_id, worker_id="honest",
                                                   reason=pb.FailLeaseRequest.PREEMPTED), metadata=md, timeout=5)


def valid_request(run: str, method) -> bytes:
    """A plausible request of the method's type, for mutation."""
    cls = getattr(pb, method.input_type.name)
    fields = {
        "AcquireLeaseRequest": dict(run_id=run, worker_id="fuzz", capacity_class="spot", price_per_hour=0.5),
        "HeartbeatRequest": dict(run_id=run, lease_id="1-0", worker_id="fuzz"),
        "CompleteLeaseRequest": dict(run_id=run, lease_id="1-0", worker_id="fuzz", manifest=pb.RolloutManifest(
            run_id=run, batch_id=f"{run}:0:0", attempt=1, uri=keys.rollout_key(run, f"{run}:0:0", 1),
            sha256="ab" * 32, num_samples=4)),
        "FailLeaseRequest": dict(run_id=run, lease_id="1-0", worker_id="fuzz", reason=pb.FailLeaseRequest.ERROR),
        "SubmitContributionRequest": dict(run_id=run, trainer_id="fuzz", lease_ids=["1-0"],
                                          manifest=pb.ContributionManifest(
                                              run_id=run, contribution_id="ab" * 16, trainer_id="fuzz",
                                              base_version=0, local_steps=1, batch_ids=[f"{run}:0:0"],
                                              uri=keys.contribution_key(run, 0, "ab" * 16), sha256="ab" * 32,
                                              num_samples=4)),
        "PullRolloutsRequest": dict(run_id=run, learner_id="fuzz", max_manifests=2, wait_ms=0),
        "PullContributionsRequest": dict(run_id=run, aggregator_id="fuzz", max_contributions=2, wait_ms=0),
        "AckRolloutsRequest": dict(run_id=run, delivery_ids=["1-0"], consumed_batch_ids=[f"{run}:0:0"], step=1),
        "PublishAdapterRequest": dict(run_id=run, manifest=pb.AdapterManifest(
            run_id=run, version=1, uri=keys.adapter_prefix(run, 1))),
        "CreateRunRequest": dict(spec=make_spec(new_run_id("fz")), prompts=make_prompts(2)),
        "RunRef": dict(run_id=run),
        "ListRunsRequest": {},
        "WatchRunRequest": dict(run_id=run, from_start=True),
        "GetMetricsRequest": dict(run_id=run, last=3),
    }[method.input_type.name]
    return cls(**fields).SerializeToString()


@st.composite
def mutated(draw, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "splice"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)):]
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            i = draw(st.integers(0, len(data)))
            data[i:] = draw(st.binary(max_size=64))
    return bytes(data)


@given(data=st.data())
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
def test_random_and_mutated_bytes_to_every_rpc(proxy_client, run, data):
    """Every method of LeaseService, LearnerService and RunService (WatchRun included), plus
    health: random bytes, and valid requests with bytes flipped, cut, inserted or spliced."""
    md = proxy_client.metadata
    for service, method in METHODS:
        call = raw_call(proxy_client.channel, service, method)
        payload = data.draw(st.one_of(st.binary(max_size=300), mutated(valid_request(run, method))),
                            label=method.name)
        code = status_of(call, payload, metadata=md, timeout=2)
        allowed = REFUSALS | (WAITING if method.name in ("WatchRun", "PullRollouts") else set())
        assert code in allowed, (method.name, payload, code)
    check = proxy_client.channel.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None,
                                       response_deserializer=None)
    status_of(check, data.draw(st.binary(max_size=64)), timeout=2)  # grpc's own service: any answer, no crash
    assert_leasing(proxy_client, run)


# protobuf wire data that is broken in each way a parser can be fooled
MALFORMED = {
    "truncated varint": b"\x08\xff\xff\xff",
    "length beyond the end": b"\x0a\x7fabc",
    "2 GiB length prefix": b"\x0a\xff\xff\xff\xff\x07abc",
    "varint longer than 10 bytes": b"\x08" + b"\xff" * 11 + b"\x01",
    "field number 0": b"\x00\x01",
    "reserved wire type 6": b"\x0e\x01",
    "reserved wire type 7": b"\x0f\x01",
    "unterminated group": b"\x0b" * 10,
    "deeply nested groups": b"\x0b" * 5000 + b"\x0c" * 5000,
    "end group without start": b"\x0c",
    "invalid utf-8 in a string": b"\x0a\x04\xff\xfe\xfd\xfc",
    "wrong wire type for a string": b"\x0d\x01\x02\x03\x04",
    "unknown fields only": b"\xf8\xff\x03\x01\xfa\xff\x03\x03abc",
    "huge repeated field count": b"\x12\x00" * 20_000,
    "a nested message that is garbage": b"\x22\x05\xff\xff\xff\xff\xff",
    "empty": b"",
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_wire_data_to_every_rpc(proxy_client, run, case):
    md = proxy_client.metadata
    for service, method in METHODS:
        code = status_of(raw_call(proxy_client.channel, service, method), MALFORMED[case], metadata=md, timeout=2)
        allowed = REFUSALS | (WAITING if method.name in ("WatchRun", "PullRollouts") else set())
        assert code in allowed, (method.name, case, code)
    assert_leasing(proxy_client, run)


def test_oversized_messages_to_each_service(token_proxy, proxy_client, run):
    """Just over the 32 MiB limit (an unknown length-delimited field, so the bytes are valid
    protobuf): refused before any handler runs, with the token and without."""
    big = grpc.insecure_channel(token_proxy.target, options=[("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES),
                                                    ("grpc.max_receive_message_length", 2 * MAX_MESSAGE_BYTES)])
    size = MAX_MESSAGE_BYTES + 1024
    payload = b"\xfa\xff\x03" + _varint(size) + b"\x00" * size   # field 65535, wire type 2
    try:
        for name in ("LeaseService.CompleteLease", "LearnerService.AckRollouts", "RunService.WatchRun",
                     "LeaseService.Heartbeat"):
            service, method = name.split(".")
            descriptor = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
            call = raw_call(big, f"brigade.v1.{service}", descriptor)
            assert status_of(call, payload, metadata=proxy_client.metadata, timeout=60) == \
                grpc.StatusCode.RESOURCE_EXHAUSTED, name
            assert status_of(call, payload, timeout=60) in {grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                            grpc.StatusCode.UNAUTHENTICATED}, name
    finally:
        big.close()
    assert_leasing(proxy_client, run)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_tokens_that_almost_match_are_refused(token_proxy, run):
    channel = grpc.insecure_channel(token_proxy.target)
    get_run = channel.unary_unary("/brigade.v1.RunService/GetRun", request_serializer=pb.RunRef.SerializeToString,
                                  response_deserializer=pb.RunState.FromString)
    near_misses = [f"bearer {TOKEN}", f"Bearer  {TOKEN}", f"Bearer {TOKEN} ", f" Bearer {TOKEN}", TOKEN,
                   f"Bearer {TOKEN[:-1]}", f"Bearer {TOKEN}x", f"Bearer {TOKEN.upper()}", f"Basic {TOKEN}",
                   "Bearer ", "Bearer", f"Bearer {TOKEN}\x00"]
    try:
        for value in near_misses:
            if "\x00" in value:
                continue  # not a legal metadata value: grpc refuses to send it at all
            code = status_of(get_run, pb.RunRef(run_id=run), metadata=(("authorization", value),), timeout=5)
            assert code == grpc.StatusCode.UNAUTHENTICATED, repr(value)
        for key in ("x-authorization", "authorisation", "token"):
            code = status_of(get_run, pb.RunRef(run_id=run), metadata=((key, f"Bearer {TOKEN}"),), timeout=5)
            assert code == grpc.StatusCode.UNAUTHENTICATED, key
        assert status_of(get_run, pb.RunRef(run_id=run), metadata=(("authorization", f"Bearer {TOKEN}"),),
                         timeout=5) == grpc.StatusCode.OK
    finally:
        channel.close()
