"""The learner's data path against a real bucket: hostile manifests and objects are rejected with a
clear reason, nothing pickled is ever loaded, and the prefetcher never hands a batch out twice."""

from __future__ import annotations

import asyncio
import os
import pickle

import pytest
import torch
from safetensors.torch import save as st_save

from brigade import keys
from brigade.bucket import open_bucket, sha256_hex
from brigade.rollout_format import FORMAT, Rollout
from brigade.v1 import brigade_pb2 as pb
from brigade_learner import ingest
from brigade_learner.ingest import Prefetcher, Rejected, fetch

RUN = "hostile"
VOCAB = 32


def make_rollout(batch: str = f"{RUN}:0:0", attempt: int = 1, version: int = 0, n: int = 4) -> Rollout:
    g = torch.Generator().manual_seed(0)
    return Rollout(
        run_id=RUN, batch_id=batch, attempt=attempt, policy_version=version,
        prompt_ids=torch.randint(1, VOCAB, (n, 3), generator=g), prompt_mask=torch.ones(n, 3, dtype=torch.int8),
        completion_ids=torch.randint(1, VOCAB, (n, 4), generator=g), completion_mask=torch.ones(n, 4, dtype=torch.int8),
        logprobs=-torch.rand(n, 4, generator=g), rewards=torch.arange(n, dtype=torch.float32),
        reward_parts=torch.arange(n, dtype=torch.float32).unsqueeze(1), group=torch.zeros(n, dtype=torch.int32),
        reward_names=["r"],
    )


async def upload(bucket, data: bytes, batch: str = f"{RUN}:0:0", attempt: int = 1, version: int = 0,
                 key: str | None = None, sha: str | None = None, delivery: str = "1-0") -> pb.PulledRollout:
    key = key or keys.rollout_key(RUN, batch, attempt)
    await bucket.put(key, data)
    m = pb.RolloutManifest(run_id=RUN, batch_id=batch, attempt=attempt, policy_version=version, uri=key,
                           sha256=sha or sha256_hex(data), size_bytes=len(data), num_samples=4)
    return pb.PulledRollout(delivery_id=delivery, manifest=m)


async def rejected(bucket, pulled) -> Rejected:
    with pytest.raises(Rejected) as info:
        await fetch(bucket, pulled, RUN, VOCAB)
    return info.value


@pytest.fixture
async def bucket(file_bucket_url):
    async with open_bucket(file_bucket_url) as b:
        yield b


async def test_a_valid_rollout_is_accepted(bucket):
    acc = await fetch(bucket, await upload(bucket, make_rollout().to_bytes()), RUN, VOCAB)
    assert acc.rollout.num_samples == 4 and not acc.dropped


async def test_manifest_pointing_outside_the_run_prefix_is_never_read(bucket):
    good = make_rollout().to_bytes()
    for key in ("runs/other/rollouts/hostile:0:0/attempt-1.safetensors",   # another run's prefix
                f"runs/{RUN}/checkpoints/step-00000001/adapter.safetensors",  # inside the run, not a rollout
                f"runs/{RUN}/rollouts/{RUN}:0:0/attempt-2.safetensors"):     # another attempt's object
        e = await rejected(bucket, await upload(bucket, good, key=key))
        assert e.reason == ingest.FOREIGN_URI and key in e.detail
    # a manifest of another run handed to this learner
    p = await upload(bucket, good)
    p.manifest.run_id = "other"
    assert (await rejected(bucket, p)).reason == ingest.FOREIGN_URI
    p = await upload(bucket, good, batch="other:0:0")
    p.manifest.uri = keys.rollout_key(RUN, "other:0:0", 1)
    assert (await rejected(bucket, p)).reason == ingest.FOREIGN_URI


async def test_a_pickle_is_rejected_and_never_unpickled(bucket, tmp_path):
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    e = await rejected(bucket, await upload(bucket, pickle.dumps(Exploit())))
    assert e.reason == ingest.INVALID and "safetensors" in e.detail
    # torch.save output (a zip holding a pickle) is refused the same way
    import io
    buf = io.BytesIO()
    torch.save({"x": torch.zeros(1)}, buf)
    assert (await rejected(bucket, await upload(bucket, buf.getvalue()))).reason == ingest.INVALID
    assert not marker.exists()


async def test_wrong_shapes_dtypes_and_vocab_are_rejected(bucket):
    r = make_rollout()
    tensors = {name: getattr(r, name) for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                                                   "logprobs", "rewards", "reward_parts", "group")}
    meta = {"format": FORMAT, "run_id": RUN, "batch_id": r.batch_id, "attempt": "1", "policy_version": "0",
            "reward_names": '["r"]'}
    cases = {
        "shape": dict(tensors, logprobs=torch.zeros(4, 5)),
        "rows": dict(tensors, group=torch.zeros(3, dtype=torch.int32)),
        "dtype": dict(tensors, completion_ids=tensors["completion_ids"].float()),
        "vocab": dict(tensors, completion_ids=torch.full((4, 4), VOCAB)),
        "negative": dict(tensors, prompt_ids=torch.full((4, 3), -1)),
        "missing": {k: v for k, v in tensors.items() if k != "rewards"},
    }
    for name, ts in cases.items():
        e = await rejected(bucket, await upload(bucket, st_save(ts, metadata=meta)))
        assert e.reason == ingest.INVALID, name
    # safetensors that is not a brigade rollout at all
    e = await rejected(bucket, await upload(bucket, st_save({"w": torch.zeros(2)})))
    assert e.reason == ingest.INVALID and "not a brigade rollout" in e.detail


async def test_corrupt_missing_and_mismatched_objects(bucket):
    data = make_rollout().to_bytes()
    e = await rejected(bucket, await upload(bucket, data, sha="0" * 64))
    assert e.reason == ingest.CORRUPT
    p = await upload(bucket, data)
    await bucket.delete(p.manifest.uri)
    assert (await rejected(bucket, p)).reason == ingest.MISSING
    # metadata inside the object disagrees with the manifest: version, batch (a copied object)
    e = await rejected(bucket, await upload(bucket, make_rollout(version=3).to_bytes(), version=1))
    assert e.reason == ingest.MISMATCH and "version" in e.detail
    other = make_rollout(batch=f"{RUN}:0:7").to_bytes()
    assert (await rejected(bucket, await upload(bucket, other))).reason == ingest.MISMATCH


async def test_nonfinite_samples_are_dropped_and_an_all_nan_batch_is_rejected(bucket):
    r = make_rollout()
    r.rewards[1] = float("nan")
    acc = await fetch(bucket, await upload(bucket, r.to_bytes()), RUN, VOCAB)
    assert acc.dropped == {ingest.NONFINITE_REWARD: 1} and acc.rollout.num_samples == 3
    r.rewards[:] = float("nan")
    assert (await rejected(bucket, await upload(bucket, r.to_bytes()))).reason == ingest.EMPTY


class FakeProxyQueue:
    """Stands in for PullRollouts/AckRollouts: a list of deliveries, this learner's pending list
    (delivered, not acked) and a record of acks. `lose_reply` makes the next pull of new entries
    that delivers something lose its reply: the entries become pending, the retry answers empty."""

    def __init__(self, pending: list[pb.PulledRollout], fresh: list[pb.PulledRollout]):
        self.pending, self.fresh = list(pending), fresh
        self.acks: list[tuple[list[str], list[str], list[str]]] = []
        self.calls: list[tuple[int, bool]] = []
        self.lose_reply = False

    async def pull(self, n: int, include_pending: bool) -> tuple[list[pb.PulledRollout], bool]:
        self.calls.append((n, include_pending))
        if include_pending and self.pending:
            return self.pending[:n], False
        out, self.fresh = self.fresh[:n], self.fresh[n:]
        self.pending += out
        if out and self.lose_reply and not include_pending:
            self.lose_reply = False
            return [], True
        if not out:
            await asyncio.sleep(0.01)
        return out, False

    async def ack(self, delivery_ids: list[str], consumed: list[str], rejected: list[str]) -> None:
        self.acks.append((delivery_ids, consumed, rejected))
        self.pending = [p for p in self.pending if p.delivery_id not in delivery_ids]


async def test_prefetcher_replays_pending_skips_consumed_and_judges_staleness_at_take(bucket):
    items = []
    for i, version in enumerate([5, 5, 1, 6, 6, 6]):
        batch = f"{RUN}:0:{i}"
        items.append(await upload(bucket, make_rollout(batch, version=version).to_bytes(), batch=batch,
                                  version=version, delivery=f"{i + 1}-0"))
    bad = await upload(bucket, b"not safetensors", batch=f"{RUN}:0:9", delivery="10-0")
    # items 0-2 were pulled before a restart (pending), item 0 was already trained on
    queue = FakeProxyQueue(pending=items[:3], fresh=[bad, *items[3:]])
    consumed = {items[0].manifest.batch_id}
    pf = Prefetcher(queue.pull, queue.ack, bucket, RUN, VOCAB, want=2, consumed=consumed, max_staleness=2)
    pf.start()
    try:
        first = await asyncio.wait_for(pf.take(version=6), 10)
        # item 0 consumed -> acked as duplicate; item 2 (version 1 at learner 6) stale; then item 1 and 3
        assert [a.batch_id for a in first.accepted] == [f"{RUN}:0:1", f"{RUN}:0:3"]
        assert first.staleness == {1: 1, 0: 1}
        assert first.duplicates == 1
        consumed.update(a.batch_id for a in first.accepted)
        second = await asyncio.wait_for(pf.take(version=7), 10)
        assert [a.batch_id for a in second.accepted] == [f"{RUN}:0:4", f"{RUN}:0:5"]
        assert second.staleness == {1: 2}
    finally:
        await pf.stop()
    rejected_total = first.rejected + second.rejected
    assert rejected_total == {ingest.STALE: 1, ingest.INVALID: 1}
    # the pending read is repeated until a reply comes back short (2 of 2, then 3 of 4), never again
    assert queue.calls[:2] == [(2, True), (4, True)] and not any(p for _, p in queue.calls[2:])
    acked = {d for ds, _, _ in queue.acks for d in ds}
    assert {"1-0", "10-0"} <= acked  # the duplicate and the invalid one; 3-0 is the stale one
    assert (["3-0"], [], [f"{RUN}:0:2"]) in queue.acks
    # the duplicate's ack names its batch consumed: Redis records its fate even if it lost the first
    assert (["1-0"], [items[0].manifest.batch_id], []) in queue.acks


async def test_prefetcher_reads_pending_again_after_a_failed_pull(bucket):
    """A pull whose delivering read happened but whose reply was lost: the entries are pending for
    this learner and no later new-entry read returns them. The prefetcher reads its pending list
    again and trains them; what it already holds (ready, or taken and awaiting the commit's ack) is
    not taken twice."""
    items = []
    for i in range(6):
        batch = f"{RUN}:0:{i}"
        items.append(await upload(bucket, make_rollout(batch, version=0).to_bytes(), batch=batch, version=0,
                                  delivery=f"{i + 1}-0"))
    queue = FakeProxyQueue(pending=[], fresh=list(items))
    queue.lose_reply = True  # the first pull after the start-up one (which reads pending first)
    consumed: set[str] = set()
    pf = Prefetcher(queue.pull, queue.ack, bucket, RUN, VOCAB, want=2, consumed=consumed, max_staleness=2)
    pf.start()
    try:
        first = await asyncio.wait_for(pf.take(version=0), 10)
        assert [a.batch_id for a in first.accepted] == [f"{RUN}:0:0", f"{RUN}:0:1"]
        consumed.update(a.batch_id for a in first.accepted)  # trained; their ack waits for the commit
        second = await asyncio.wait_for(pf.take(version=0), 10)
        third = await asyncio.wait_for(pf.take(version=0), 10)
    finally:
        await pf.stop()
    taken = [a.batch_id for data in (first, second, third) for a in data.accepted]
    assert sorted(taken) == sorted(set(taken))  # none twice (the re-read held 0:0 and 0:1 again)
    assert len(taken) == 6  # the lost reply's entries (0:2 and 0:3) were trained
    assert second.duplicates == third.duplicates == 0 and not queue.acks  # nothing acked early
    assert any(pending for _, pending in queue.calls[2:])
