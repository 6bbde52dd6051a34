"""Hostile data from a token holder, against the real proxy, worker and learner on a real Redis:
manifests that point outside their run (traversal, other buckets, runs or attempts), a pickle planted
as an adapter and adapters of the wrong shapes (refused by the worker, nothing unpickled, and no code
path hands bucket bytes to a pickle loader), forged steps and versions, oversized or control-character
fields, and state that would grow without bound (workers per run, runs per Redis). One token holder
must not be able to crash the learner, finish a run, strand its workers, break ListRuns for everyone,
or grow a run's Redis state without bound."""

from __future__ import annotations

import ast
import asyncio
import io
import os
import pickle
from pathlib import Path

import grpc
import pytest
import redis
import torch
from proxy_support import (
    BackgroundProxy,
    SyncClient,
    make_prompts,
    make_spec,
    manifest_for,
    new_run_id,
    status_of,
)

from brigade import adapters, keys
from brigade.spec import MAX_WORKERS_PER_RUN
from brigade.store.sweeps import PRUNE_SLICE
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_MANIFEST_BYTES, MAX_RUNS
from brigade_harness.devservers import start_redis

ROOT = Path(__file__).resolve().parents[2]


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


async def _worker_on_hostile_adapter(redis_url, bucket_url, model_dir, files: dict[str, bytes],
                                     damage=None) -> list[pb.DeadLetter]:
    """A run whose v1 is `files` (with a manifest whose sha256 values match them), one batch, one
    attempt allowed; a real rollout worker serves it. `damage(bucket, run)`, awaited after v1 is
    published, may spoil it further. Returns the dead letters."""
    from brigade.bucket import open_bucket
    from brigade.rpc import ProxyClient
    from brigade_proxy.server import start_server
    from brigade_rollout.config import WorkerConfig
    from brigade_rollout.worker import Worker
    from brigade_testing.tiny import demo_prompts, tiny_spec

    run = new_run_id("hostile-adapter")
    spec = tiny_spec(model_dir, run_id=run, staleness={"max_attempts": 1}, prompts_per_batch=2)
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=bucket_url, monitor_redis=False)
    try:
        async with ProxyClient.connect(server.target) as proxy_client, open_bucket(bucket_url) as bucket:
            await proxy_client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=demo_prompts(2)))
            manifest = await adapters.write_version(bucket, run, 1, 1, files, "bf16")
            await proxy_client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=manifest))
            if damage is not None:
                await damage(bucket, run)
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


# ---------------------------------------------------------------- one token holder's data in Redis


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


async def test_a_corrupt_adapter_manifest_fails_the_lease_and_is_dead_lettered(own_redis, file_bucket_url, tiny):
    async def corrupt_manifest(bucket, run: str) -> None:
        await bucket.put(keys.adapter_prefix(run, 1) + adapters.MANIFEST, b"\xff\xff\xff not a manifest")

    # the worker exits 0 with the batch failed (before: retried for ever)
    (dead,) = await _worker_on_hostile_adapter(own_redis, file_bucket_url, tiny, {adapters.CONFIG: b"{}"},
                                               damage=corrupt_manifest)
    assert "adapter v1 is unusable" in dead.reason and "does not parse" in dead.reason, dead.reason
