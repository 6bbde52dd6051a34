"""Hostile input: random and malformed requests to every RPC, wrong and missing tokens, garbage
bytes and oversized messages. The proxy must answer each with a deliberate status (never
UNKNOWN, never INTERNAL for a request problem) and keep serving afterwards."""

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

from brigade.rpc import MAX_MESSAGE_BYTES
from brigade.v1 import brigade_pb2 as pb

TOKEN = PROXY_TOKEN
SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def run(proxy_client):
    run = new_run_id("h")
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(20)), metadata=proxy_client.metadata)
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
