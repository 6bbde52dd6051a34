"""The rollout object: what a worker uploads and the learner trains on.

One safetensors file per (batch, attempt), N = prompts x group_size samples:

  prompt_ids       int64   [N, P]  left-padded
  prompt_mask      int8    [N, P]
  completion_ids   int64   [N, C]  right-padded
  completion_mask  int8    [N, C]  1 on generated tokens (eos included)
  logprobs         float32 [N, C]  behaviour log-probs of the sampled tokens (0 on padding)
  rewards          float32 [N]     weighted total; NaN where a reward function gave None
  reward_parts     float32 [N, K]  one column per reward function
  group            int32   [N]     index of the prompt within the batch

Metadata (strings) carries run, batch, attempt, policy version, reward names and reward metrics
(what reward functions logged: name -> [sum, count], averaged over a step by the learner). Decoded text goes
to a JSON sidecar for people; the learner never needs it. safetensors cannot hold code, so a hostile
object can at worst be rejected, never executed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT = "brigade-rollout-1"
SPEC = {  # name -> (dtype, rank)
    "prompt_ids": (torch.int64, 2),
    "prompt_mask": (torch.int8, 2),
    "completion_ids": (torch.int64, 2),
    "completion_mask": (torch.int8, 2),
    "logprobs": (torch.float32, 2),
    "rewards": (torch.float32, 1),
    "reward_parts": (torch.float32, 2),
    "group": (torch.int32, 1),
}


class InvalidRollout(ValueError):
    """A rollout object that is not what its manifest promises."""


@dataclass
class Rollout:
    run_id: str
    batch_id: str
    attempt: int
    policy_version: int
    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    logprobs: torch.Tensor
    rewards: torch.Tensor
    reward_parts: torch.Tensor
    group: torch.Tensor
    reward_names: list[str] = field(default_factory=list)
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)  # name -> [sum, count] (log_metric...)

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def to_bytes(self) -> bytes:
        # clone: safetensors refuses tensors that share memory (e.g. rewards and a view of reward_parts)
        tensors = {name: getattr(self, name).to(dtype).contiguous().clone() for name, (dtype, _) in SPEC.items()}
        metadata = {
            "format": FORMAT,
            "run_id": self.run_id,
            "batch_id": self.batch_id,
            "attempt": str(self.attempt),
            "policy_version": str(self.policy_version),
            "reward_names": json.dumps(self.reward_names),
            "reward_metrics": json.dumps(self.reward_metrics),
        }
        return st_save(tensors, metadata=metadata)


def _metadata(data: bytes) -> dict[str, str]:
    # safetensors header: 8-byte little-endian length, then JSON with "__metadata__"
    if len(data) < 8:
        raise InvalidRollout("rollout object is too short to be safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > 1 << 20:
        raise InvalidRollout("rollout object has a corrupt safetensors header")
    try:
        header = json.loads(data[8 : 8 + n])
        return dict(header.get("__metadata__") or {})
    except (ValueError, AttributeError) as e:
        raise InvalidRollout(f"rollout object header is not JSON: {e}") from e


def from_bytes(data: bytes, vocab_size: int | None = None) -> Rollout:
    """Parse and check a rollout object: dtypes, shapes that agree, token ids inside the vocabulary."""
    meta = _metadata(data)
    if meta.get("format") != FORMAT:
        raise InvalidRollout(f"not a brigade rollout (format {meta.get('format')!r}, expected {FORMAT!r})")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, OSError) as e:
        raise InvalidRollout(f"rollout object is not valid safetensors: {e}") from e
    for name, (dtype, rank) in SPEC.items():
        t = tensors.get(name)
        if t is None:
            raise InvalidRollout(f"rollout object lacks tensor {name!r}")
        if t.dtype != dtype or t.dim() != rank:
            raise InvalidRollout(f"tensor {name!r} is {t.dtype} rank {t.dim()}, expected {dtype} rank {rank}")
    n = tensors["rewards"].shape[0]
    p = tensors["prompt_ids"].shape[1]
    c = tensors["completion_ids"].shape[1]
    shapes = {
        "prompt_ids": (n, p), "prompt_mask": (n, p), "completion_ids": (n, c), "completion_mask": (n, c),
        "logprobs": (n, c), "group": (n,),
    }
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise InvalidRollout(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {shape}")
    if tensors["reward_parts"].shape[0] != n:
        raise InvalidRollout("tensor 'reward_parts' does not have one row per sample")
    if n == 0 or c == 0:
        raise InvalidRollout("rollout object holds no samples or no completion tokens")
    ids = torch.cat([tensors["prompt_ids"].flatten(), tensors["completion_ids"].flatten()])
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise InvalidRollout(f"token ids outside the vocabulary [0, {vocab_size})")
    try:
        attempt, version = int(meta["attempt"]), int(meta["policy_version"])
        names = json.loads(meta.get("reward_names", "[]"))
        metrics = json.loads(meta.get("reward_metrics", "{}"))
    except (KeyError, ValueError) as e:
        raise InvalidRollout(f"rollout metadata is incomplete: {e}") from e
    if not _sums_and_counts(metrics):
        raise InvalidRollout("rollout metadata 'reward_metrics' is not a mapping of names to [sum, count]")
    return Rollout(
        run_id=meta.get("run_id", ""), batch_id=meta.get("batch_id", ""), attempt=attempt, policy_version=version,
        reward_names=list(names), reward_metrics=metrics, **{name: tensors[name] for name in SPEC},
    )


def _sums_and_counts(metrics) -> bool:
    return isinstance(metrics, dict) and len(metrics) <= 1000 and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2
        and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v) and v[1] > 0
        for k, v in metrics.items())
