"""The declared bounds: every string, bytes, list and map field of every request has one, the wire
check applies them (ids matched whole, no control characters, integers Lua holds exactly), a
maximal manifest fits the pull reply budget, and what operators see is escaped."""

from __future__ import annotations

import os

import pytest
from google.protobuf.descriptor import FieldDescriptor

from brigade import wire
from brigade.bucket import ObjectNotFound, open_bucket
from brigade.errors import InvalidArgument
from brigade.spec import RUN_ID_RE
from brigade.store.learner import MAX_PULL, PULL_REPLY_BYTES
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_MANIFEST_BYTES, MAX_SAFE_INT, WIRE_BOUNDS, check_wire, wire_problem
from brigade_cli.ctl import format_event, format_status, shown, table
from brigade_cli.up import numeric_metrics, progress_line

REQUESTS = [getattr(pb, m.input_type.name) for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods]


def reachable(descriptor, seen=None):
    """Every message type a request can carry (not into lists whose entries are left unchecked)."""
    seen = {} if seen is None else seen
    if descriptor.full_name in seen:
        return seen
    seen[descriptor.full_name] = descriptor
    for f in descriptor.fields:
        bound = WIRE_BOUNDS.get(f"{descriptor.name}.{f.name}")
        if f.message_type and not (bound and bound.entries_unchecked):
            reachable(f.message_type, seen)
    return seen


def test_every_string_bytes_list_and_map_field_of_every_request_has_one_bound():
    missing, used = [], set()
    for request in REQUESTS:
        for d in reachable(request.DESCRIPTOR).values():
            if d.GetOptions().map_entry:
                continue
            for f in d.fields:
                name = f"{d.name}.{f.name}"
                if f.is_repeated or f.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
                    (used if name in WIRE_BOUNDS else missing.append(name) or set()).add(name)
                    if f.is_repeated and not f.message_type and f.type == FieldDescriptor.TYPE_STRING:
                        assert name + "[]" in WIRE_BOUNDS, name
                        used.add(name + "[]")
                elif name in WIRE_BOUNDS:
                    used.add(name)
            wire._plan(d)  # builds without a KeyError
    assert not missing, f"fields without a declared bound: {missing}"
    assert not set(WIRE_BOUNDS) - used, f"bounds of no request field: {set(WIRE_BOUNDS) - used}"


@pytest.mark.parametrize("request_, needle", [
    (pb.AcquireLeaseRequest(run_id="r", worker_id="w", capacity_class="x" * (17 << 20)), "capacity_class"),
    (pb.CompleteLeaseRequest(run_id="r", manifest=pb.RolloutManifest(engine="e" * 65)), "RolloutManifest.engine"),
    (pb.CompleteLeaseRequest(run_id="r", manifest=pb.RolloutManifest(adapter_payload="p" * 10_000)),
     "adapter_payload"),
    (pb.FailLeaseRequest(run_id="r", message="m" * 70_000), "message"),
    (pb.PullRolloutsRequest(run_id="r", learner_id="learner\x1b[2J"), "control characters"),
    (pb.AckRolloutsRequest(run_id="r", learner_id="l\n"), "control characters"),
    (pb.AckRolloutsRequest(run_id="r", step=2**64 - 1), "AckRolloutsRequest.step"),
    (pb.AckRolloutsRequest(run_id="r", delivery_ids=["1-0\x07"]), "delivery_ids[]"),
    (pb.AckRolloutsRequest(run_id="r", metrics_json="{}" + " " * 20_000), "metrics_json"),
    (pb.PublishAdapterRequest(run_id="r", manifest=pb.AdapterManifest(version=2**63)), "AdapterManifest.version"),
    (pb.PublishAdapterRequest(run_id="r", manifest=pb.AdapterManifest(version=2**53)), "AdapterManifest.version"),
    (pb.PublishAdapterRequest(run_id="r", manifest=pb.AdapterManifest(files=[pb.AdapterFile()] * 65)), "files"),
    (pb.CreateRunRequest(prompts=[pb.Prompt()] * (wire.MAX_PROMPTS + 1)), "prompts"),
    (pb.CreateRunRequest(spec=pb.RunSpec(run_id="r", lora=pb.LoraSpec(target_modules=["q\x00"]))), "target_modules"),
    (pb.WatchRunRequest(run_id="r" * 300), "WatchRunRequest.run_id"),
])
def test_the_wire_check_refuses_each_field_beyond_its_bound(request_, needle):
    with pytest.raises(InvalidArgument, match=needle.replace("[", r"\[").replace("]", r"\]")):
        check_wire(request_)


def test_requests_within_the_bounds_pass():
    ok = [pb.AcquireLeaseRequest(run_id="r", worker_id="w", capacity_class="spot", engine="hf"),
          pb.AckRolloutsRequest(run_id="r", step=MAX_SAFE_INT, delivery_ids=["1-0"], metrics_json='{"a": 1}'),
          pb.CreateRunRequest(spec=pb.RunSpec(run_id="r", seed=2**64 - 1), prompts=[pb.Prompt(text="\n" * 100_000)]),
          pb.FailLeaseRequest(run_id="r", message="a traceback\n\tline 2")]
    assert all(wire_problem(r) is None for r in ok)


def test_a_maximal_manifest_fits_the_pull_reply_budget():
    def longest(bound_name: str) -> str:
        return "x" * WIRE_BOUNDS[f"RolloutManifest.{bound_name}"].limit

    strings = [f.name for f in pb.RolloutManifest.DESCRIPTOR.fields if f.type == FieldDescriptor.TYPE_STRING]
    m = pb.RolloutManifest(**{name: longest(name) for name in strings}, attempt=2**32 - 1,
                           policy_version=MAX_SAFE_INT, size_bytes=MAX_SAFE_INT, num_samples=2**32 - 1,
                           num_tokens=2**32 - 1, reward_mean=1.0, compute_seconds=1.0, price_per_hour=1.0,
                           created_ms=-MAX_SAFE_INT)
    assert wire_problem(m) is None
    assert m.ByteSize() <= MAX_MANIFEST_BYTES
    pulled = pb.PulledRollout(delivery_id="9" * 20 + "-" + "9" * 20, manifest=m)
    assert MAX_PULL * pulled.ByteSize() <= PULL_REPLY_BYTES


def test_ids_are_matched_whole():
    assert RUN_ID_RE.fullmatch("run-1") and not RUN_ID_RE.fullmatch("a\n")
    with pytest.raises(InvalidArgument):
        wire.check_stream_id("lease_id", "1-0\n")
    m = pb.RolloutManifest(run_id="r", batch_id="r:0:0", attempt=1, uri="runs/r/rollouts/r:0:0/attempt-1.safetensors",
                           sha256="a" * 64 + "\n", num_samples=1)
    with pytest.raises(InvalidArgument, match="sha256"):
        wire.check_rollout_manifest("r", m)


def test_everything_ctl_prints_is_escaped():
    evil = "mallory\x1b[2J\x1b]0;owned\x07\r"
    assert shown(evil) == "mallory\\x1b[2J\\x1b]0;owned\\x07\\r" and shown("plain") == "plain"
    for out in (table(["WORKER", "REASON"], [(evil, f"error: {evil}")]),
                format_event(pb.Event(type=evil, time_ms=1, attrs={"worker": evil, evil: "x"})),
                format_status(pb.RunState(spec=pb.RunSpec(run_id="r", model=evil)))):
        assert "\x1b" not in out and "\x07" not in out and "\r" not in out and "mallory" in out


def test_up_progress_takes_metrics_of_any_shape():
    assert numeric_metrics('{"step": 3, "reward_mean": 0.5, "kl": "x", "n": [1], "ok": true}') == \
        {"step": 3, "reward_mean": 0.5}
    for junk in ("[]", "7", '"s"', "not json", "[" * 100_000, '{"kl": NaN}', ""):
        assert numeric_metrics(junk) == {}
    assert "step    3/5" in progress_line(numeric_metrics('{"step": 3, "reward_mean": "high"}'), 5, 1, 1.0, None)


async def test_the_local_bucket_does_not_follow_a_symlink_out_of_its_folder(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    root = tmp_path / "bucket"
    (root / "runs").mkdir(parents=True)
    os.symlink(outside, root / "runs" / "link")
    async with open_bucket(root.as_uri()) as bucket:
        with pytest.raises(ObjectNotFound, match="outside the bucket"):
            await bucket.get("runs/link/secret")
        with pytest.raises(ObjectNotFound, match="outside the bucket"):
            await bucket.put("runs/link/planted", b"x")
        assert not (outside / "planted").exists()
        await bucket.put("runs/inside", b"ok")  # an ordinary key still works
        assert await bucket.get("runs/inside") == b"ok"


def test_a_maximal_contribution_manifest_fits_the_pull_reply_budget():
    from brigade.store.learner import MAX_PULL_CONTRIBUTIONS
    from brigade.wire import MAX_CONTRIBUTION_BYTES

    def longest(name: str) -> str:
        return "x" * WIRE_BOUNDS[f"ContributionManifest.{name}"].limit

    d = pb.ContributionManifest.DESCRIPTOR
    strings = [f.name for f in d.fields if f.type == FieldDescriptor.TYPE_STRING and not f.is_repeated]
    ids = [longest("batch_ids[]")] * WIRE_BOUNDS["ContributionManifest.batch_ids"].limit
    m = pb.ContributionManifest(**{name: longest(name) for name in strings}, batch_ids=ids, empty_batch_ids=ids,
                                base_version=MAX_SAFE_INT, local_steps=2**32 - 1, size_bytes=MAX_SAFE_INT,
                                num_samples=2**32 - 1, reward_mean=1.0, compute_seconds=1.0, price_per_hour=1.0,
                                created_ms=-MAX_SAFE_INT)
    assert wire_problem(m) is None
    assert m.ByteSize() <= MAX_CONTRIBUTION_BYTES
    pulled = pb.PulledContribution(delivery_id="9" * 20 + "-" + "9" * 20, manifest=m)
    assert MAX_PULL_CONTRIBUTIONS * pulled.ByteSize() <= PULL_REPLY_BYTES
