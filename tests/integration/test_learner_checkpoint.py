"""Checkpoints: an exact round trip through a real bucket, completeness by manifest, no pickle."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load

from brigade import adapters, keys
from brigade.bucket import BucketError, open_bucket
from brigade.retry import Backoff
from brigade_learner import checkpoint
from brigade_learner.checkpoint import LearnerState, PendingAck
from brigade_learner.trainer import Trainer
from brigade_testing.tiny import make_rollout, tiny_model, tiny_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = torch.tensor([[0, 1, 6, 13, 7, 12], [1, 8, 13, 9, 12, 4]])




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", heads=4, tied=True, eos_boost=1.0)


def trained(spec, steps: int = 2) -> Trainer:
    t = Trainer.create(spec)
    for i in range(steps):
        r = make_rollout(t.model, PROMPTS, (PROMPTS != 0).long(), run=spec.run_id, batch_id=f"{spec.run_id}:0:{i}",
                         attempt=1, version=i, group_size=4, max_new_tokens=6, seed=i)
        t.train_step([r])
    return t


def snapshot(t: Trainer) -> dict:
    opt = t.optimizer.state_dict()
    return {
        "params": {n: p.detach().clone() for n, p in t.model.named_parameters()},
        "opt_state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                      for i, s in opt["state"].items()},
        "groups": opt["param_groups"],
        "sched": {k: v for k, v in t.scheduler.state_dict().items() if k != "lr_lambdas"},
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for i in a["opt_state"]:
        assert a["opt_state"][i].keys() == b["opt_state"][i].keys()
        for k, v in a["opt_state"][i].items():
            w = b["opt_state"][i][k]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (i, k)
    assert a["groups"] == b["groups"]
    assert a["sched"] == b["sched"]


@pytest.mark.parametrize("backend", ["file", "s3"])
async def test_round_trip_is_exact(model_dir, request, backend):
    url = request.getfixturevalue("file_bucket_url" if backend == "file" else "s3_bucket_url")
    spec = tiny_spec(model_dir, grpo={"lr_schedule": "cosine", "warmup_steps": 1, "weight_decay": 0.01},
                     max_steps=10)
    t = trained(spec)
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(6)
    state = LearnerState(step=2, version=2, published=True, consumed={"tiny:0:0", "tiny:0:1"},
                         ack=PendingAck(delivery_ids=["1-0"], consumed=["tiny:0:1"]),
                         metrics=[{"step": 2, "loss": 0.5}])
    files = checkpoint.encode(t, state)
    before = snapshot(t)
    rng_next = (torch.rand(3), random.random(), np.random.rand())

    async with open_bucket(url) as bucket:
        await checkpoint.save(bucket, spec.run_id, 2, files)
        found = await checkpoint.latest(bucket, spec.run_id)
    assert found is not None and found[0] == 2

    fresh = Trainer.create(spec)
    torch.manual_seed(999)
    random.seed(999)
    np.random.seed(999)
    restored = checkpoint.decode(fresh, found[1])
    assert_same(before, snapshot(fresh))
    assert (restored.step, restored.version, restored.published) == (2, 2, True)
    assert restored.consumed == state.consumed and restored.ack == state.ack and restored.metrics == state.metrics
    # the RNG streams continue exactly where the checkpoint was taken
    assert torch.equal(torch.rand(3), rng_next[0])
    assert random.random() == rng_next[1] and np.random.rand() == rng_next[2]
    # and training continues identically from both
    r = make_rollout(t.model, PROMPTS, (PROMPTS != 0).long(), run="tiny", batch_id="tiny:0:9", attempt=1,
                     version=2, group_size=4, max_new_tokens=6, seed=9)
    t.train_step([r])
    fresh.train_step([r])
    assert_same(snapshot(t), snapshot(fresh))


async def test_incomplete_and_damaged_checkpoints_are_ignored(model_dir, file_bucket_url):
    spec = tiny_spec(model_dir)
    t = trained(spec, steps=1)
    acked = PendingAck(["1-0"], ["tiny:0:0"], [])
    async with open_bucket(file_bucket_url) as bucket:
        await checkpoint.save(bucket, "tiny", 1, checkpoint.encode(t, LearnerState(step=1, version=1, ack=acked)))
        # step 2: files but no manifest (a crash before the last write)
        files = checkpoint.encode(t, LearnerState(step=2, version=2))
        for name in list(files)[:3]:
            await bucket.put(keys.checkpoint_prefix("tiny", 2) + name, files[name])
        # step 3: complete, then a file corrupted behind the manifest's back
        await checkpoint.save(bucket, "tiny", 3, checkpoint.encode(t, LearnerState(step=3, version=3)))
        await bucket.put(keys.checkpoint_prefix("tiny", 3) + checkpoint.ADAPTER, b"garbage")
        assert await checkpoint.steps(bucket, "tiny") == [1, 2, 3]
        step, files = await checkpoint.latest(bucket, "tiny")
        assert step == 1
        # the ack a commit sent, read back alone: only from a complete checkpoint whose state.json is intact
        assert await checkpoint.read_ack(bucket, "tiny", 1) == acked
        assert await checkpoint.read_ack(bucket, "tiny", 2) is None and await checkpoint.read_ack(bucket, "tiny", 9) is None
        await bucket.put(keys.checkpoint_prefix("tiny", 3) + checkpoint.STATE, b'{"ack": {}}')
        assert await checkpoint.read_ack(bucket, "tiny", 3) is None
        # saving step 2 for real replaces the partial files, and then it is the newest complete one
        await checkpoint.save(bucket, "tiny", 2, checkpoint.encode(t, LearnerState(step=2, version=2)))
        assert (await checkpoint.latest(bucket, "tiny"))[0] == 2
        # a complete checkpoint is never overwritten with different content
        with pytest.raises(checkpoint.CheckpointError, match="never overwritten"):
            await checkpoint.save(bucket, "tiny", 2, checkpoint.encode(t, LearnerState(step=2, version=5)))


DAMAGES = {
    "state": lambda data: data[: len(data) // 2],
    "optimizer": lambda data: data[: len(data) // 2],
    "adapter": lambda data: data[: len(data) // 2],
    "rng": lambda data: b"\0" * len(data),
    "config": lambda data: data + b" ",
    "manifest": lambda data: data[: len(data) // 2],
}
DAMAGED_FILE = {"state": checkpoint.STATE, "optimizer": checkpoint.OPTIMIZER, "adapter": checkpoint.ADAPTER,
                "rng": checkpoint.RNG, "config": checkpoint.CONFIG, "manifest": checkpoint.MANIFEST}


@pytest.mark.parametrize("damaged", sorted(DAMAGES))
async def test_a_damaged_checkpoint_is_saved_again_beside_itself(model_dir, file_bucket_url, damaged, monkeypatch):
    """latest(), save() and read() agree on what is complete: a damaged newest checkpoint is skipped
    by latest(), and the retrained step is saved as attempt 1 beside it, which read() then returns."""
    monkeypatch.setattr(checkpoint, "READ_BACKOFF", Backoff(base_s=0.0, cap_s=0.0))  # damage is for good here
    t = trained(tiny_spec(model_dir), steps=1)
    async with open_bucket(file_bucket_url) as bucket:
        run = f"damaged-{damaged}"
        for step in (1, 2):
            await checkpoint.save(bucket, run, step, checkpoint.encode(t, LearnerState(step=step, version=step)))
        key = keys.checkpoint_prefix(run, 2) + DAMAGED_FILE[damaged]
        cut = DAMAGES[damaged](await bucket.get(key))
        await bucket.put(key, cut)
        assert (await checkpoint.latest(bucket, run))[0] == 1
        assert await checkpoint.read(bucket, run, 2) is None

        retrained = checkpoint.encode(t, LearnerState(step=2, version=3, consumed={"tiny:0:7"}))
        await checkpoint.save(bucket, run, 2, retrained)
        assert await checkpoint.attempts(bucket, run, 2) == [0, 1]
        attempt, files = await checkpoint.read(bucket, run, 2)
        assert attempt == 1 and files == retrained
        assert (await checkpoint.latest(bucket, run))[0] == 2
        # the damaged folder is left as it was, and saving the retrained step again is a no-op
        assert await bucket.get(key) == cut
        await checkpoint.save(bucket, run, 2, retrained)
        assert await checkpoint.attempts(bucket, run, 2) == [0, 1]
        assert await checkpoint.read_ack(bucket, run, 2) == PendingAck()  # the newest attempt's
        # a prune counts the step once, whatever its attempts, and removes them together
        await checkpoint.save(bucket, run, 3, checkpoint.encode(t, LearnerState(step=3, version=4)))
        await checkpoint.save(bucket, run, 4, checkpoint.encode(t, LearnerState(step=4, version=5)))
        assert await checkpoint.prune(bucket, run, 2) == [1, 2]
        assert await checkpoint.steps(bucket, run) == [3, 4]


class _DeleteFailsOnce:
    """A real bucket whose Nth delete fails, as an outage in the middle of a prune would."""

    def __init__(self, bucket, fail_at: int):
        self.bucket, self.fail_at, self.deletes = bucket, fail_at, 0

    def __getattr__(self, name):
        return getattr(self.bucket, name)

    async def delete(self, key: str) -> None:
        self.deletes += 1
        if self.deletes == self.fail_at:
            raise BucketError("injected: the bucket went away mid-prune", key=key)
        await self.bucket.delete(key)


@pytest.mark.parametrize("backend", ["file_bucket_url", "s3_bucket_url"])
async def test_prune_keeps_the_newest_complete_checkpoints_and_survives_being_cut_short(request, backend):
    names = (checkpoint.ADAPTER, checkpoint.OPTIMIZER, checkpoint.RNG, checkpoint.CONFIG, checkpoint.STATE)
    files = {name: f"{name} bytes".encode() for name in names}  # prune reads names, never contents
    async with open_bucket(request.getfixturevalue(backend)) as real:
        for step in (1, 3, 4, 5, 6):
            await checkpoint.save(real, "keep", step, {**files, checkpoint.STATE: f"step {step}".encode()})
        await real.put(keys.checkpoint_prefix("keep", 2) + checkpoint.STATE, b"a save that crashed")
        await real.put(keys.checkpoint_prefix("keep", 7) + checkpoint.STATE, b"a save in progress")
        assert await checkpoint.prune(real, "keep", 0) == []          # 0 keeps everything
        assert await checkpoint.steps(real, "keep") == [1, 2, 3, 4, 5, 6, 7]

        # the bucket fails on the 2nd delete: step 1's manifest is gone, its other files are not
        cut = _DeleteFailsOnce(real, fail_at=2)
        with pytest.raises(BucketError):
            await checkpoint.prune(cut, "keep", 2)
        assert not await real.exists(keys.checkpoint_prefix("keep", 1) + checkpoint.MANIFEST)
        assert await checkpoint.load_files(real, "keep", 1) is None   # never resumed from
        assert (await checkpoint.latest(real, "keep"))[0] == 6

        # the next prune finishes the job: older folders gone, complete or not; 7 (newer) untouched
        assert await checkpoint.prune(cut, "keep", 2) == [1, 2, 3, 4]
        assert await checkpoint.steps(real, "keep") == [5, 6, 7]
        assert await real.list(keys.checkpoint_prefix("keep", 7)) == [keys.checkpoint_prefix("keep", 7) + checkpoint.STATE]
        for step in (5, 6):
            loaded = await checkpoint.load_files(real, "keep", step)
            assert loaded is not None and loaded[checkpoint.STATE] == f"step {step}".encode()
        assert await checkpoint.prune(real, "keep", 2) == []          # nothing more to do


def test_checkpoint_files_are_safetensors_and_json_only(model_dir):
    t = trained(tiny_spec(model_dir), steps=1)
    files = checkpoint.encode(t, LearnerState(step=1, version=1, consumed={"tiny:0:0"}))
    for name, data in files.items():
        assert not data.startswith(b"\x80"), f"{name} looks pickled"
        if name.endswith(".safetensors"):
            st_load(data)
        else:
            json.loads(data)
    opt = st_load(files[checkpoint.OPTIMIZER])
    # AdamW state for every adapter parameter, by name
    lora = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert {f"{n}:exp_avg" for n in lora} <= set(opt)
    assert set(st_load(files[checkpoint.ADAPTER])) == set(adapters.adapter_state(t.model))


def test_a_checkpoint_of_another_model_is_refused(model_dir, tmp_path):
    t = trained(tiny_spec(model_dir), steps=1)
    files = checkpoint.encode(t, LearnerState(step=1, version=1))
    other = Trainer.create(tiny_spec(model_dir, lora={"rank": 2}))
    with pytest.raises(checkpoint.CheckpointError, match="does not fit"):
        checkpoint.decode(other, files)
    wrong_run = Trainer.create(tiny_spec(model_dir, run_id="other"))
    with pytest.raises(checkpoint.CheckpointError, match="run"):
        checkpoint.decode(wrong_run, files)
