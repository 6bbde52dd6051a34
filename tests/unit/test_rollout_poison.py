"""Poison rollout objects: valid safetensors whose header, metadata or values are hostile. Each must be
an InvalidRollout from `rollout_format` and a counted rejection in the learner's ingest, never an
exception that stops the learner; shapes beyond the run spec are refused from the header alone."""

from __future__ import annotations

import json

import pytest
import torch

from brigade import keys
from brigade.bucket import open_bucket, sha256_hex
from brigade.rollout_format import InvalidRollout, Limits, Rollout, from_bytes
from brigade.v1 import brigade_pb2 as pb
from brigade_learner import ingest
from brigade_learner.ingest import Rejected, fetch
from brigade_testing.poison import with_header, with_metadata

RUN = "poison"
VOCAB = 32
LIMITS = Limits.for_spec(prompts_per_batch=1, group_size=4, max_new_tokens=6, max_positions=64)


def rollout(n: int = 4, c: int = 4, p: int = 3, **tensors: torch.Tensor) -> Rollout:
    g = torch.Generator().manual_seed(0)
    fields = dict(
        prompt_ids=torch.randint(1, VOCAB, (n, p), generator=g), prompt_mask=torch.ones(n, p, dtype=torch.int8),
        completion_ids=torch.randint(1, VOCAB, (n, c), generator=g), completion_mask=torch.ones(n, c, dtype=torch.int8),
        logprobs=-torch.rand(n, c, generator=g), rewards=torch.arange(n, dtype=torch.float32),
        reward_parts=torch.arange(n, dtype=torch.float32).unsqueeze(1), group=torch.zeros(n, dtype=torch.int32))
    fields.update(tensors)
    return Rollout(run_id=RUN, batch_id=f"{RUN}:0:0", attempt=1, policy_version=0, reward_names=["r"], **fields)


def with_meta(**meta) -> bytes:
    return with_metadata(rollout().to_bytes(), **meta)


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


POISON = {
    "reward_names is a number": with_meta(reward_names="123"),
    "reward_names is an object": with_meta(reward_names='{"a": 1}'),
    "reward_names nested 100k deep": with_meta(reward_names=deep(100_000)),
    "reward_names of numbers": with_meta(reward_names="[1]"),
    "metadata is a list": with_header(rollout().to_bytes(), lambda h: {**h, "__metadata__": ["format"]}),
    "metadata is a number": with_header(rollout().to_bytes(), lambda h: {**h, "__metadata__": 7}),
    "metadata value is a number": with_meta(attempt=1),
    "header nested 50k deep": with_header(rollout().to_bytes(), lambda h: json.dumps(h)[:-1].encode()
                                          + b', "x": ' + deep(50_000).encode() + b"}"),
    "header is a list": with_header(rollout().to_bytes(), lambda h: [h]),
    "a tensor entry is a string": with_header(rollout().to_bytes(), lambda h: {**h, "group": "x"}),
    "a shape of strings": with_header(rollout().to_bytes(),
                                      lambda h: {**h, "rewards": {**h["rewards"], "shape": ["4"]}}),
    "attempt of 5000 digits": with_meta(attempt="1" * 5000),
    "completion mask of -1": rollout(completion_mask=-torch.ones(4, 4, dtype=torch.int8)).to_bytes(),
    "completion mask of 2": rollout(completion_mask=2 * torch.ones(4, 4, dtype=torch.int8)).to_bytes(),
    "prompt mask of 3": rollout(prompt_mask=3 * torch.ones(4, 3, dtype=torch.int8)).to_bytes(),
    "positive log-probs": rollout(logprobs=torch.full((4, 4), 0.5)).to_bytes(),
}
# an episode's env_mask (brigade.episodes), in a run with an environment of at most 2 model turns
EPISODES = Limits.for_spec(prompts_per_batch=1, group_size=4, max_new_tokens=6, max_positions=64, max_turns=2)
REPLY = torch.tensor([[0, 1, 1, 0]] * 4, dtype=torch.int8)  # one reply between two model turns
ZERO_UNDER_REPLY = -torch.rand(4, 4) * (1 - REPLY)


def episode(**tensors: torch.Tensor) -> bytes:
    return rollout(**{"env_mask": REPLY, "logprobs": ZERO_UNDER_REPLY, **tensors}).to_bytes()


EPISODE_POISON = {
    "env_mask of 2": episode(env_mask=2 * REPLY),
    "env_mask on padding": episode(completion_mask=torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.int8)),
    "env_mask on the first token": episode(env_mask=torch.tensor([[1, 0, 0, 0]] * 4, dtype=torch.int8),
                                           logprobs=torch.zeros(4, 4)),
    "a log-prob under env_mask": episode(logprobs=-torch.rand(4, 4) - 0.1),
    "two replies where the run allows one": episode(env_mask=torch.tensor([[0, 1, 0, 1]] * 4, dtype=torch.int8),
                                                     logprobs=-torch.rand(4, 4) * torch.tensor([1, 0, 1, 0])),
    "env_mask of the wrong shape": episode(env_mask=REPLY[:, :3]),
    "env_mask of floats": with_header(episode(), lambda h: {**h, "env_mask": {**h["env_mask"], "dtype": "F32"}}),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_poison_is_an_invalid_rollout(name):
    with pytest.raises(InvalidRollout):
        from_bytes(POISON[name], VOCAB, LIMITS)


@pytest.mark.parametrize("name", sorted(EPISODE_POISON))
def test_episode_poison_is_an_invalid_rollout(name):
    with pytest.raises(InvalidRollout):
        from_bytes(EPISODE_POISON[name], VOCAB, EPISODES)


def test_an_episode_round_trips_and_trains_only_the_models_tokens():
    r = from_bytes(episode(), VOCAB, EPISODES)
    assert torch.equal(r.env_mask, REPLY) and r.num_tokens == 8  # 2 of 4 tokens a sample are the model's
    assert torch.equal(r.loss_mask, (1 - REPLY).to(torch.int8))
    with pytest.raises(InvalidRollout, match="the run has no environment"):
        from_bytes(episode(), VOCAB, LIMITS)
    assert from_bytes(rollout().to_bytes(), VOCAB, EPISODES).env_mask is None  # single turns are still fine
    kept, _ = ingest.drop_nonfinite(from_bytes(episode(rewards=torch.tensor([0.0, float("nan"), 1.0, 2.0])),
                                               VOCAB, EPISODES))
    assert kept.num_samples == 3 and kept.env_mask.shape == (3, 4)


def test_shapes_beyond_the_spec_are_refused_from_the_header_before_any_tensor_byte():
    # 60,000 completion tokens where the spec allows 6
    with pytest.raises(InvalidRollout, match="60000 completion tokens; the run allows at most 6"):
        from_bytes(rollout(c=60_000).to_bytes(), VOCAB, LIMITS)
    with pytest.raises(InvalidRollout, match="8 samples; the run allows at most 4"):
        from_bytes(rollout(n=8).to_bytes(), VOCAB, LIMITS)
    with pytest.raises(InvalidRollout, match="prompt tokens"):
        from_bytes(rollout(p=100).to_bytes(), VOCAB, LIMITS)

    # a header promising 10^9 tokens with no bytes behind it: refused by the bound, never loaded
    def huge(h):
        h["completion_ids"]["shape"] = [4, 10**9]
        return h
    with pytest.raises(InvalidRollout, match="1000000000 completion tokens"):
        from_bytes(with_header(rollout().to_bytes(), huge), VOCAB, LIMITS)


def test_a_rollout_within_the_spec_still_parses():
    r = from_bytes(rollout(c=6).to_bytes(), VOCAB, LIMITS)
    assert r.num_samples == 4 and r.reward_names == ["r"]
    # log-probs a rounding hair above 0 are what a log-softmax can give
    assert from_bytes(rollout(logprobs=torch.full((4, 4), 1e-6)).to_bytes(), VOCAB, LIMITS).num_samples == 4


@pytest.fixture
async def bucket(file_bucket_url):
    async with open_bucket(file_bucket_url) as b:
        yield b


async def test_every_poison_is_a_counted_rejection_in_ingest(bucket):
    for i, (name, data) in enumerate(sorted({**POISON, "long completion": rollout(c=60_000).to_bytes()}.items())):
        batch = f"{RUN}:0:{i}"
        key = keys.rollout_key(RUN, batch, 1)
        await bucket.put(key, data)
        m = pb.RolloutManifest(run_id=RUN, batch_id=batch, attempt=1, uri=key, sha256=sha256_hex(data),
                               size_bytes=len(data), num_samples=4)
        with pytest.raises(Rejected) as info:
            await fetch(bucket, pb.PulledRollout(delivery_id=f"{i + 1}-0", manifest=m), RUN, VOCAB, LIMITS)
        assert info.value.reason == ingest.INVALID, name
