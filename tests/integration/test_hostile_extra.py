"""Hostile input, the gaps test_proxy_hostile.py, test_proxy.py and test_learner_ingest.py leave:

- random bytes and mutated (truncated, bit-flipped, spliced) valid requests to EVERY RPC of every
  service, streaming included, and a corpus of malformed protobuf wire data: always a deliberate
  status, and the proxy keeps serving (a real lease cycle still works afterwards);
- an oversized message to an RPC of each service and to the streaming one, with and without the
  token: RESOURCE_EXHAUSTED (or UNAUTHENTICATED), never a crash;
- tokens that almost match: UNAUTHENTICATED;
- rollout manifests and adapter manifests that point outside the run (path traversal, another
  bucket, another run, another attempt): INVALID_ARGUMENT, and the lease is still the worker's;
- a pickle planted as adapter_model.safetensors (with a manifest whose sha256 matches it), and an
  adapter with wrong shapes: the rollout worker refuses them with a clear error (the batch is
  dead-lettered with that reason) and nothing is unpickled;
- the code base never hands bucket bytes to a pickle loader: a scan for every such call.
"""

from __future__ import annotations

import ast
import asyncio
import io
import os
import pickle
from pathlib import Path

import grpc
import pytest
import torch
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

from brigade import adapters, keys
from brigade.rpc import MAX_MESSAGE_BYTES
from brigade.v1 import brigade_pb2 as pb

TOKEN = PROXY_TOKEN
ROOT = Path(__file__).resolve().parents[2]

METHODS = [(service.full_name, method) for service in pb.DESCRIPTOR.services_by_name.values()
           for method in service.methods]


@pytest.fixture(scope="module")
def run(proxy_client):
    run = new_run_id("hx")
    proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(40)), metadata=proxy_client.metadata)
    return run


def raw_call(channel: grpc.Channel, service: str, method):
    """The method on the wire: bytes in, bytes out, no client-side parsing."""
    path = f"/{service}/{method.name}"
    if method.server_streaming:
        return channel.unary_stream(path, request_serializer=None, response_deserializer=None)
    return channel.unary_unary(path, request_serializer=None, response_deserializer=None)


def assert_serving(proxy_client: SyncClient, run: str) -> None:
    health = health_pb2_grpc.HealthStub(proxy_client.channel)
    assert health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
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
    assert_serving(proxy_client, run)


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
    assert_serving(proxy_client, run)


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
    assert_serving(proxy_client, run)


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


def test_manifests_pointing_outside_the_run_are_refused(proxy_client):
    """What test_proxy.py does not try already: traversal, other buckets, other attempts, a text
    sidecar elsewhere, a manifest of another run. The lease stays the worker's throughout."""
    md = proxy_client.metadata
    # runs of its own: the module's shared run may be at its admission limit after the fuzzers
    run, other = new_run_id("mallory"), new_run_id("victim")
    for r in (run, other):
        proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=make_spec(r), prompts=make_prompts(4)), metadata=md)
    grant = proxy_client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="mallory"), metadata=md)
    assert grant.granted, grant
    lease = grant.lease
    b, a = lease.batch.batch_id, lease.attempt
    good = manifest_for(run, lease, "mallory")
    bad_uris = [
        f"runs/{run}/rollouts/{b}/../../../{other}/rollouts/{other}:0:0/attempt-1.safetensors",
        f"runs/{run}/rollouts/{b}/./attempt-{a}.safetensors",
        f"s3://elsewhere/runs/{run}/rollouts/{b}/attempt-{a}.safetensors",
        f"/runs/{run}/rollouts/{b}/attempt-{a}.safetensors",
        f"runs/{run}/rollouts/{b}/attempt-{a + 1}.safetensors",
        f"runs/{run}/adapters/v00000001/adapter_model.safetensors",
        f"runs/{run}/checkpoints/step-00000001/adapter.safetensors",
        keys.rollout_key(other, b, a),
    ]
    variants = [dict(uri=u) for u in bad_uris] + [
        dict(text_uri=f"runs/{other}/rollouts/{b}/attempt-{a}.json"),
        dict(text_uri=f"runs/{run}/rollouts/{b}/../x.json"),
        dict(run_id=other),
        dict(batch_id=f"{other}:0:0", uri=keys.rollout_key(run, f"{other}:0:0", a)),
    ]
    for change in variants:
        m = pb.RolloutManifest()
        m.CopyFrom(good)
        for k, v in change.items():
            setattr(m, k, v)
        req = pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="mallory", manifest=m)
        assert status_of(proxy_client.lease.CompleteLease, req, metadata=md) == grpc.StatusCode.INVALID_ARGUMENT, change
    # the same lease for the victim run: the run does not know this lease
    m = manifest_for(other, lease, "mallory")
    req = pb.CompleteLeaseRequest(run_id=other, lease_id=lease.lease_id, worker_id="mallory", manifest=m)
    assert status_of(proxy_client.lease.CompleteLease, req, metadata=md) in {grpc.StatusCode.INVALID_ARGUMENT,
                                                                      grpc.StatusCode.NOT_FOUND}
    # the lease was never disturbed: heartbeat OK, the honest completion lands once
    beat = proxy_client.lease.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id=lease.lease_id, worker_id="mallory"),
                                  metadata=md)
    assert beat.status == pb.HeartbeatResponse.OK
    done = proxy_client.lease.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id,
                                                              worker_id="mallory", manifest=good), metadata=md)
    assert not done.duplicate

    for uri in (f"runs/{run}/adapters/v00000001/../../../{other}/adapters/v00000001/",
                f"runs/{run}/adapters/v00000001/./",
                f"runs/{run}/adapters/v00000002/",
                f"runs/{other}/adapters/v00000001/",
                f"file:///etc/runs/{run}/adapters/v0000001/"):
        m = pb.AdapterManifest(run_id=run, version=1, step=1, uri=uri, payload="bf16")
        code = status_of(proxy_client.learner.PublishAdapter, pb.PublishAdapterRequest(run_id=run, manifest=m), metadata=md)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, uri
    m = pb.AdapterManifest(run_id=other, version=1, step=1, uri=keys.adapter_prefix(other, 1), payload="bf16")
    assert status_of(proxy_client.learner.PublishAdapter, pb.PublishAdapterRequest(run_id=run, manifest=m),
                     metadata=md) == grpc.StatusCode.INVALID_ARGUMENT


# ---------------------------------------------------------------- hostile adapter files, at the worker


class Exploit:
    """Unpickling this touches a marker file: proof that something unpickled it."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from brigade_testing.tiny import tiny_model

    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


async def _worker_on_hostile_adapter(redis_url, bucket_url, model_dir, files: dict[str, bytes]) -> list[pb.DeadLetter]:
    """A run whose v1 is `files` (with a manifest whose sha256 values match them), one batch, one
    attempt allowed; a real rollout worker serves it. Returns the dead letters."""
    from brigade.bucket import open_bucket
    from brigade.rpc import ProxyClient
    from brigade_proxy.server import start_server
    from brigade_rollout.worker import Worker, WorkerConfig
    from brigade_testing.tiny import demo_prompts, tiny_spec

    run = new_run_id("hostile-adapter")
    spec = tiny_spec(model_dir, run_id=run, staleness={"max_attempts": 1}, prompts_per_batch=2)
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=bucket_url, monitor_redis=False)
    try:
        async with ProxyClient.connect(server.target) as proxy_client, open_bucket(bucket_url) as bucket:
            await proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=demo_prompts(2)))
            manifest = await adapters.write_version(bucket, run, 1, 1, files, "bf16")
            await proxy_client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=manifest))
            worker = Worker(WorkerConfig(proxy=server.target, bucket=bucket_url, run=run, exit_when_finished=True))
            assert await asyncio.wait_for(worker.run(), 120) == 0
            assert worker.stats["completed"] == 0 and worker.stats["failed"] == 1
            return list((await proxy_client.runs.ListDeadLetters(pb.RunRef(run_id=run))).dead_letters)
    finally:
        await server.stop(0)


async def test_a_pickle_planted_as_an_adapter_is_refused_and_never_unpickled(redis_url, file_bucket_url, tiny,
                                                                             tmp_path):
    marker = tmp_path / "pwned"
    files = {adapters.WEIGHTS: pickle.dumps(Exploit(marker)), adapters.CONFIG: b'{"r": 4}'}
    # the file and its manifest agree, so the sha256 check passes: only the format check stands
    (dead,) = await _worker_on_hostile_adapter(redis_url, file_bucket_url, tiny, files)
    assert "adapter v1 is unusable" in dead.reason and "not a valid safetensors file" in dead.reason, dead.reason
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)  # torch's own format: a zip holding a pickle
    (dead,) = await _worker_on_hostile_adapter(redis_url, file_bucket_url, tiny,
                                               {adapters.WEIGHTS: buf.getvalue(), adapters.CONFIG: b"{}"})
    assert "not a valid safetensors file" in dead.reason, dead.reason
    assert not marker.exists(), "the planted pickle was unpickled"


async def test_an_adapter_with_wrong_shapes_or_values_is_refused_by_the_worker(redis_url, file_bucket_url, tiny):
    from safetensors.torch import save as st_save

    from brigade.model import attach_lora, load_base
    from brigade_testing.tiny import tiny_spec

    model, _ = load_base(tiny_spec(tiny))
    real = adapters.adapter_state(attach_lora(model, tiny_spec(tiny)))
    name = sorted(real)[0]
    wrong_shape = {k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) if k == name else v for k, v in real.items()}
    non_finite = {k: torch.full_like(v, float("nan")) if k == name else v for k, v in real.items()}
    unknown = dict(real, **{"base_model.model.evil.lora_A.weight": torch.zeros(2, 2)})
    for state, needle in ((wrong_shape, "has shape"), (non_finite, "NaN or infinite"), (unknown, "unknown")):
        files = {adapters.WEIGHTS: st_save({k: v.contiguous() for k, v in state.items()}), adapters.CONFIG: b"{}"}
        (dead,) = await _worker_on_hostile_adapter(redis_url, file_bucket_url, tiny, files)
        assert "InvalidAdapter" in dead.reason and needle in dead.reason, dead.reason


# ---------------------------------------------------------------- no pickle loaders anywhere


# call targets that deserialize with pickle (or can run code while loading)
BANNED_CALLS = {
    "torch.load", "torch.jit.load", "torch.serialization.load", "pickle.load", "pickle.loads", "pickle.Unpickler",
    "cPickle.load", "cPickle.loads", "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads",
    "joblib.load", "marshal.load", "marshal.loads", "shelve.open", "yaml.load", "yaml.unsafe_load", "yaml.full_load",
    "pandas.read_pickle", "pd.read_pickle", "np.load", "numpy.load", "eval", "exec",
}
BANNED_IMPORTS = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return ""


def scan_for_pickle(paths: list[Path]) -> list[str]:
    findings = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name] = a.name
                    if a.name.split(".")[0] in BANNED_IMPORTS:
                        findings.append(f"{path}:{node.lineno}: import {a.name}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                    if node.module.split(".")[0] in BANNED_IMPORTS or f"{node.module}.{a.name}" in BANNED_CALLS:
                        findings.append(f"{path}:{node.lineno}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Call):
                name = _dotted(node.func)
                head, _, rest = name.partition(".")
                full = f"{aliases.get(head, head)}.{rest}" if rest else aliases.get(head, head)
                if full in BANNED_CALLS or name in BANNED_CALLS:
                    if full.endswith(("np.load", "numpy.load")) and not any(
                            k.arg == "allow_pickle" and getattr(k.value, "value", False) for k in node.keywords):
                        continue  # numpy refuses pickles unless allow_pickle=True
                    findings.append(f"{path}:{node.lineno}: {name}(...)")
                if any(k.arg == "weights_only" and getattr(k.value, "value", True) is False for k in node.keywords):
                    findings.append(f"{path}:{node.lineno}: weights_only=False")
    return findings


def test_nothing_in_the_code_base_unpickles():
    code = [p for top in ("libs", "services", "bench") for p in sorted((ROOT / top).rglob("*.py"))]
    code = [p for p in code if "/v1/" not in str(p)]
    assert len(code) > 30
    findings = scan_for_pickle(code)
    assert not findings, "pickle-capable loaders in the code base:\n" + "\n".join(findings)


def test_the_scan_finds_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nimport numpy as np\nfrom pickle import loads\nimport pickle as p\n"
                   "torch.load('x')\np.loads(b'')\nnp.load('x', allow_pickle=True)\nnp.load('y')\n"
                   "torch.load('z', weights_only=False)\nimport yaml\nyaml.load('a')\nyaml.safe_load('a')\n")
    found = "\n".join(scan_for_pickle([bad]))
    for needle in (":3: from pickle import loads", ":4: import pickle", ":5: torch.load", ":6: p.loads", ":7: np.load",
                   ":9: weights_only=False", ":11: yaml.load"):
        assert needle in found, (needle, found)
    assert ":8:" not in found and ":12:" not in found
