"""Faults between the services and their state: an S3 path that errs, stalls, drops connections,
truncates and corrupts bodies; a Redis restarted (from its append-only file) in the middle of a run.

- Through `faulty_s3` in front of moto, each fault kind is retried until the bucket operation
  succeeds with the right bytes; a torn body is read again, and one that stays torn, or a corrupted
  body, is raised as an error: never returned as data. The readers that matter tell the two apart: a torn read is retried, a sha256 mismatch is a
  CorruptObject, which the learner's ingest turns into a rejection with reason `corrupt`.
- A whole run (processes, as in test_chaos) with faults on every service's S3 traffic, rollout
  objects corrupted in flight, and Redis restarted mid-run: no service exits, the run completes,
  corrupted rollouts are rejected (counted, with their reason) and never trained on, every lease
  and queue entry survives the restart, and every batch is accounted for.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid

import pytest
from chaos_support import chaos_spec, show_report

from brigade import keys
from brigade.bucket import BucketError, CorruptObject, sha256_hex
from brigade.bucket.s3 import READ_ATTEMPTS, S3Bucket
from brigade.v1 import brigade_pb2 as pb
from brigade_testing.audited_system import AuditedSystem
from brigade_testing.faulty_s3 import Faults, start_in_thread

pytestmark = pytest.mark.timeout(420)


@pytest.fixture
def faulty(s3_endpoint):
    proxy = start_in_thread(s3_endpoint, Faults(stall_s=0.3, seed=1))
    yield proxy
    proxy.stop()


async def _through(faulty, fn):
    bucket = S3Bucket(f"s3://faults-{uuid.uuid4().hex[:10]}/p", endpoint_url=faulty.url)
    try:
        await bucket.ensure()
        return await fn(bucket)
    finally:
        await bucket.close()


@pytest.mark.parametrize("kind", ["error", "lost_answer", "stall", "drop"])
def test_transient_faults_are_retried_until_the_operation_succeeds(faulty, kind):
    data = os.urandom(200_000)

    async def go(bucket):
        results = {}
        for op in ("put_new", "put", "get", "list", "exists"):
            faulty.faults.force = [kind] * 2        # two in a row: botocore's retries must outlast them
            if op == "put_new":
                # a lost answer means the first try landed: the retry's 412 is recognised as our own write
                results[op] = await bucket.put_new("a/new.bin", data) == sha256_hex(data)
            elif op == "put":
                results[op] = await bucket.put("a/over.bin", data) == sha256_hex(data)
            elif op == "get":
                results[op] = await bucket.get("a/new.bin", sha256=sha256_hex(data)) == data
            elif op == "list":
                results[op] = await bucket.list("a/") == ["a/new.bin", "a/over.bin"]
            else:
                results[op] = await bucket.exists("a/new.bin")
            assert faulty.faults.force == [], f"{op}: the faults were not all used"
        return results

    results = asyncio.run(_through(faulty, go))
    assert all(results.values()), results
    assert faulty.stats[kind] == 10


@pytest.mark.parametrize("size", [300, 300_000, 3_000_000])  # small bodies are read inside get_object, big
# ones after it; from 1 MiB on they are hashed by a thread as they arrive
@pytest.mark.parametrize("read", ["get", "get_buffer"])  # get_buffer copies a big body into one buffer
def test_a_truncated_body_is_read_again_and_a_lasting_one_is_an_error(faulty, size, read):
    """The headers promise N bytes, the connection dies after N/2: the bucket reads the object again.
    When every read is torn: a BucketError (never short data, never a CorruptObject, so nobody rejects
    a good object for it), and the worker's retry reads it once the connection heals."""
    from brigade_rollout.retries import bucket_retryable, with_retries

    data = os.urandom(size)

    async def go(bucket):
        get = getattr(bucket, read)
        sha = await bucket.put_new("r/x.bin", data)
        faulty.faults.only_methods = ("GET",)
        faulty.faults.force = ["truncate"] * (READ_ATTEMPTS - 1)
        assert await get("r/x.bin", sha256=sha) == data
        assert faulty.faults.force == []
        faulty.faults.force = ["truncate"] * READ_ATTEMPTS
        with pytest.raises(BucketError) as info:
            await get("r/x.bin", sha256=sha)
        assert not isinstance(info.value, CorruptObject)
        assert "truncat" in str(info.value).lower() or "payload" in str(info.value).lower(), info.value
        faulty.faults.force = ["truncate"] * (READ_ATTEMPTS + 1)
        got = await with_retries("get", lambda: get("r/x.bin", sha256=sha), bucket_retryable, 30)
        assert got == data and faulty.faults.force == []

    asyncio.run(_through(faulty, go))
    assert faulty.stats["truncate"] == 3 * READ_ATTEMPTS  # (R-1) + R + (R+1)


def test_corrupted_rollout_bytes_are_caught_by_sha256_and_rejected(faulty):
    """A flipped byte in flight keeps the length: only the sha256 catches it. The learner's ingest
    rejects the rollout as `corrupt` (a terminal answer), while a torn read of the same object is a
    BucketError the prefetcher retries."""
    import torch

    from brigade.rollout_format import Rollout
    from brigade_learner import ingest

    run = "faults"
    n = 4
    rollout = Rollout(run_id=run, batch_id=f"{run}:0:0", attempt=1, policy_version=0,
                      prompt_ids=torch.ones(n, 3, dtype=torch.int64), prompt_mask=torch.ones(n, 3, dtype=torch.int8),
                      completion_ids=torch.ones(n, 2, dtype=torch.int64),
                      completion_mask=torch.ones(n, 2, dtype=torch.int8), logprobs=-torch.ones(n, 2),
                      rewards=torch.arange(n, dtype=torch.float32), reward_parts=torch.zeros(n, 1),
                      group=torch.zeros(n, dtype=torch.int32), reward_names=["r"])
    data = rollout.to_bytes()
    key = keys.rollout_key(run, rollout.batch_id, 1)
    manifest = pb.RolloutManifest(run_id=run, batch_id=rollout.batch_id, attempt=1, policy_version=0, uri=key,
                                  sha256=sha256_hex(data), size_bytes=len(data), num_samples=n)
    pulled = pb.PulledRollout(delivery_id="1-0", manifest=manifest)

    async def go(bucket):
        await bucket.put_new(key, data)
        assert (await ingest.fetch(bucket, pulled, run, 32)).rollout.num_samples == n
        faulty.faults.corrupt_rate = 1.0
        with pytest.raises(CorruptObject):
            await bucket.get(key, sha256=manifest.sha256)
        with pytest.raises(ingest.Rejected) as info:
            await ingest.fetch(bucket, pulled, run, 32)
        assert info.value.reason == ingest.CORRUPT and "sha256" in info.value.detail
        faulty.faults.corrupt_rate = 0.0
        faulty.faults.force = ["truncate"] * READ_ATTEMPTS
        with pytest.raises(BucketError) as torn:
            await ingest.fetch(bucket, pulled, run, 32)
        assert not isinstance(torn.value, CorruptObject)
        assert (await ingest.fetch(bucket, pulled, run, 32)).rollout.num_samples == n

    asyncio.run(_through(faulty, go))
    assert faulty.stats["corrupt"] == 2 and len(faulty.corrupted) == 2


# A torn (transient BucketError) or corrupted read of a checkpoint file is read again: it neither kills
# the learner at resume nor makes it fall back to an older checkpoint whose next save would collide.
def test_learner_resume_survives_a_torn_or_corrupted_checkpoint_read(faulty, tmp_path, one_torch_thread):
    from brigade_learner import checkpoint
    from brigade_learner.checkpoint import LearnerState
    from brigade_learner.trainer import Trainer
    from brigade_testing.tiny import tiny_model, tiny_spec

    spec = tiny_spec(tiny_model(tmp_path / "model"), run_id="resume")
    trainer = Trainer.create(spec)

    async def go(bucket):
        for step in (1, 2):
            await checkpoint.save(bucket, "resume", step, checkpoint.encode(trainer, LearnerState(step=step)))
        faulty.faults.only_methods = ("GET",)
        faulty.faults.only_match = "/checkpoints/step-00000002/"
        faulty.faults.force = ["truncate"]
        found = await checkpoint.latest(bucket, "resume")
        assert found is not None and found[0] == 2
        faulty.faults.corrupt_match, faulty.faults.corrupt_suffix = "/checkpoints/step-00000002/", ".safetensors"
        faulty.faults.corrupt_rate, faulty.faults.max_corrupt = 1.0, 1
        found = await checkpoint.latest(bucket, "resume")
        assert found is not None and found[0] == 2, "fell back to an older checkpoint after one corrupted read"

    asyncio.run(_through(faulty, go))


# ---------------------------------------------------------------- a whole run


def redis_snapshot(system: AuditedSystem) -> dict:
    """Everything that defines the run's coordination state, read while every service is frozen."""
    k = keys.RunKeys(system.run)
    with system.r() as r:
        pending = r.xpending_range(k.work, keys.WORK_GROUP, "-", "+", 10_000)
        leases = {row["message_id"].decode(): r.hgetall(k.lease(row["message_id"].decode())) for row in pending}
        return {
            "cursor": r.get(k.cursor), "latest": r.get(k.adapter_latest), "step": r.get(k.learner_step),
            "work": r.xrange(k.work), "rollouts": r.xrange(k.rollouts),
            "leases": {i: (row["consumer"], leases[i]) for i, row in
                       ((row["message_id"].decode(), row) for row in pending)},
            "learner_pending": [row["message_id"] for row in
                                r.xpending_range(k.rollouts, keys.LEARNER_GROUP, "-", "+", 10_000)],
            "consumed": r.smembers(k.consumed), "completed": r.smembers(k.completed), "rejected": r.hgetall(k.rejected),
            "adapters": r.hgetall(k.adapters), "deadletter": r.xrange(k.deadletter), "stats": r.hgetall(k.stats),
            "spec": r.get(k.spec), "prompts": r.llen(k.prompts),
        }


def test_run_survives_s3_faults_corruption_and_a_redis_restart(tmp_path, one_torch_thread, capsys):
    t0 = time.monotonic()
    max_steps = 10
    # no transient faults on rollout uploads: a lost answer there makes the worker read its object
    # back, and a corruption of THAT read (a worker refusing its own batch) is not what is measured here
    faults = Faults(rate=0.06, stall_s=1.0, corrupt_rate=0.5, max_corrupt=2, seed=int.from_bytes(os.urandom(4), "big"),
                    skip=lambda method, path: method == "PUT" and "/rollouts/" in path)
    spec = chaos_spec(f"faults-{uuid.uuid4().hex[:8]}", max_steps, staleness={"lease_seconds": 8})
    speeds = {i: ["--speed-factor", "100"] for i in range(2)}
    with AuditedSystem(tmp_path, spec, workers=2, faults=faults, worker_args=speeds) as system:
        system.start()
        system.wait_until(lambda: system.learner_step() >= 4, 240, "step 4")
        system.wait_until(lambda: bool(system.lease_holders()), 60, "a lease in flight")

        # Redis restarted (SIGTERM: it flushes the append-only file) while every service is frozen, so
        # the state before and after can be compared exactly; then they carry on with dead connections
        everyone = list(system.services)
        system.freeze(everyone)
        before = redis_snapshot(system)
        system.redis.restart()
        after = redis_snapshot(system)
        system.note("redis_restart", "redis")
        system.thaw(everyone)
        assert before == after, "Redis lost state across a restart with its append-only file"
        leases_at_restart = {i: c.decode() for i, (c, _) in before["leases"].items()}
        assert leases_at_restart

        system.finish(timeout=300)
        report = system.audit()
        with system.r() as r:
            events = [f for _, f in r.xrange(keys.RunKeys(system.run).events)]
        completed_by = {f[b"lease"].decode(): f[b"worker"].decode() for f in events if f.get(b"type") == b"RolloutCompleted"}
        revoked = {f[b"lease"].decode() for f in events if f.get(b"type") == b"LeaseRevoked"}
        stats, corrupted, detail = dict(system.faulty.stats), list(system.faulty.corrupted), system.detail
        restarts = {n: s.starts for n, s in system.services.items()}
    problems = report.pop("problems")
    report.update(s3_faults=stats, corrupted=len(corrupted),
                  leases_at_restart=len(leases_at_restart),
                  completed_after_restart_by_holder=sum(completed_by.get(i) == w for i, w in leases_at_restart.items()),
                  revoked_after_restart=sum(i in revoked for i in leases_at_restart),
                  wall_s=round(time.monotonic() - t0, 1))
    show_report(capsys, "FAULTS " + json.dumps(report))
    assert not problems, "\n".join(problems)
    assert all(n == 1 for n in restarts.values()), f"a service had to be restarted: {restarts}"
    assert report["steps"] == max_steps and report["vanished"] == 0 and report["duplicates"] == 0
    # the faults happened
    assert sum(stats.get(k, 0) for k in ("error", "lost_answer", "stall", "drop", "truncate")) >= 5, stats
    # every corrupted rollout was rejected as corrupt, never trained on
    assert corrupted, "no rollout object was corrupted in flight"
    corrupt_batches = {p.split("/rollouts/")[1].split("/")[0] for p in corrupted}
    for b in corrupt_batches:
        assert b not in detail["consumed"], f"{b} was corrupted in flight and trained on"
        assert detail["rejected"].get(b) == "learner" and detail["learner_reasons"].get(b) == "corrupt", b
    # every lease granted before the restart outlived it: its holder completed it afterwards, or the janitor
    # revoked it as stale (the learner ran max_staleness versions past it first). A lease the restart lost
    # would do neither: the proxy would refuse its completion and the janitor would never see it expire.
    for lease, holder in leases_at_restart.items():
        assert completed_by.get(lease) == holder or lease in revoked, (lease, holder, completed_by, revoked)
