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
  env_mask         int8    [N, C]  episodes only (brigade.episodes): 1 on the environment's tokens inside a
                                   completion (tool results, user turns): attended as context, never trained;
                                   their log-probs are 0. Absent: every completion token is the model's.

Metadata (strings) carries run, batch, attempt, policy version, reward names and reward metrics
(what reward functions logged: name -> [sum, count], averaged over a step by the learner). Decoded text goes
to a JSON sidecar for people; the learner never needs it. safetensors cannot hold code, so a hostile
object can at worst be rejected, never executed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

if TYPE_CHECKING:  # annotations only
    from brigade.engine.base import Sample
    from brigade.v1 import brigade_pb2 as pb

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
OPTIONAL = {"env_mask": (torch.int8, 2)}  # name -> (dtype, rank), checked when present


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
    env_mask: torch.Tensor | None = None  # episodes: 1 on the environment's tokens

    @property
    def num_samples(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_tokens(self) -> int:
        """The model's own completion tokens: the ones that train."""
        return int(self.loss_mask.sum())

    @property
    def loss_mask(self) -> torch.Tensor:
        """completion_mask without the environment's tokens."""
        if self.env_mask is None:
            return self.completion_mask
        return self.completion_mask * (1 - self.env_mask.to(self.completion_mask.dtype))

    def to_bytes(self) -> bytes:
        # clone: safetensors refuses tensors that share memory (e.g. rewards and a view of reward_parts)
        tensors = {name: getattr(self, name).to(dtype).contiguous().clone() for name, (dtype, _) in SPEC.items()}
        if self.env_mask is not None:
            tensors["env_mask"] = self.env_mask.to(torch.int8).contiguous().clone()
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


def build_rollout(lease: pb.Lease, samples: list[Sample], totals: list[float | None],
                  parts: list[list[float | None]], names: list[str], pad_id: int,
                  reward_metrics: dict[str, list[float]] | None = None) -> Rollout:
    """The rollout of one leased batch from the engine's samples and their scores (a worker's upload,
    a local trainer's training data)."""
    n, p = len(samples), max(len(s.prompt_ids) for s in samples)
    c = max(1, max(len(s.completion_ids) for s in samples))
    prompt_ids = torch.full((n, p), pad_id, dtype=torch.int64)
    prompt_mask = torch.zeros((n, p), dtype=torch.int8)
    completion_ids = torch.full((n, c), pad_id, dtype=torch.int64)
    completion_mask = torch.zeros((n, c), dtype=torch.int8)
    logprobs = torch.zeros((n, c), dtype=torch.float32)
    for i, s in enumerate(samples):
        lp, lc = len(s.prompt_ids), len(s.completion_ids)
        prompt_ids[i, p - lp :] = torch.tensor(s.prompt_ids)      # left-padded
        prompt_mask[i, p - lp :] = 1
        completion_ids[i, :lc] = torch.tensor(s.completion_ids)  # right-padded
        completion_mask[i, :lc] = 1
        logprobs[i, :lc] = torch.tensor(s.logprobs)
    env_mask = None
    episodes = [getattr(s, "env_mask", None) for s in samples]  # Sample's, or None for a single turn
    if any(m is not None for m in episodes):
        env_mask = torch.zeros((n, c), dtype=torch.int8)
        for i, m in enumerate(episodes):
            if m:
                env_mask[i, : len(m)] = torch.tensor(m, dtype=torch.int8)
    nan = float("nan")
    return Rollout(
        run_id=lease.run_id, batch_id=lease.batch.batch_id, attempt=lease.attempt,
        policy_version=lease.adapter_version, prompt_ids=prompt_ids, prompt_mask=prompt_mask,
        completion_ids=completion_ids, completion_mask=completion_mask, logprobs=logprobs,
        rewards=torch.tensor([nan if r is None else r for r in totals], dtype=torch.float32),
        reward_parts=torch.tensor([[nan if v is None else v for v in col] for col in parts],
                                  dtype=torch.float32).T.reshape(n, len(parts)),
        group=torch.tensor([s.group for s in samples], dtype=torch.int32), reward_names=names,
        reward_metrics=reward_metrics or {}, env_mask=env_mask,
    )


@dataclass(frozen=True)
class Limits:
    """What the run spec allows one rollout to hold, checked against the safetensors header before
    any tensor byte is read: a sequence longer than the spec allows never reaches a training step."""

    max_samples: int              # prompts_per_batch x group_size
    max_completion_tokens: int    # sampling.max_new_tokens
    max_prompt_tokens: int        # what the model can take besides the completion
    max_reward_parts: int = 64
    max_turns: int = 1            # model turns of an episode (environment.max_turns); 1: no env_mask allowed

    @classmethod
    def for_spec(cls, prompts_per_batch: int, group_size: int, max_new_tokens: int,
                 max_positions: int | None = None, max_turns: int = 1) -> Limits:
        room = (max_positions or MAX_PROMPT_TOKENS + max_new_tokens) - max_new_tokens
        return cls(max(1, prompts_per_batch) * max(1, group_size), max(1, max_new_tokens),
                   max(1, min(room, MAX_PROMPT_TOKENS)), max_turns=max(1, max_turns))


MAX_HEADER_BYTES = 1 << 20    # the safetensors JSON header (tensor table and metadata)
MAX_PROMPT_TOKENS = 32_768    # a prompt's tokens when the model does not say its context length
MAX_REWARD_NAME_CHARS = 256
LOGPROB_SLACK = 1e-3          # a log-prob is <= 0; rounding in log-softmax may give a hair above
_DTYPES = {"I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "F32": torch.float32}


def _header(data: bytes) -> dict:
    # safetensors header: 8-byte little-endian length, then a JSON object with "__metadata__"
    if len(data) < 8:
        raise InvalidRollout("rollout object is too short to be safetensors")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > MAX_HEADER_BYTES:
        raise InvalidRollout("rollout object has a corrupt safetensors header")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as e:  # RecursionError: JSON nested deeper than Python recurses
        raise InvalidRollout(f"rollout object header is not JSON: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise InvalidRollout("rollout object header is not a JSON object")
    return header


def _metadata(header: dict) -> dict[str, str]:
    meta = header.get("__metadata__") or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise InvalidRollout("rollout metadata must be a JSON object of strings")
    return meta


def _check_table(header: dict, limits: Limits | None) -> None:
    """Every tensor's dtype and shape from the header, bounded by the spec, before loading."""
    for name, (dtype, rank) in SPEC.items():
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise InvalidRollout(f"rollout object lacks tensor {name!r}")
        shape = entry.get("shape")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise InvalidRollout(f"tensor {name!r} has no valid shape")
        got = _DTYPES.get(entry.get("dtype"))
        if got != dtype or len(shape) != rank:
            raise InvalidRollout(f"tensor {name!r} is {str(entry.get('dtype'))[:16]} rank {len(shape)}, "
                                 f"expected {dtype} rank {rank}")
    for name, (dtype, rank) in OPTIONAL.items():
        entry = header.get(name)
        if entry is None:
            continue
        if not isinstance(entry, dict) or _DTYPES.get(entry.get("dtype")) != dtype or not isinstance(
                entry.get("shape"), list) or len(entry["shape"]) != rank:
            raise InvalidRollout(f"tensor {name!r} is not {dtype} rank {rank}")
        if limits is not None and name == "env_mask" and limits.max_turns <= 1:
            raise InvalidRollout("rollout holds an episode's env_mask, but the run has no environment")
    if limits is None:
        return
    n, p = header["prompt_ids"]["shape"]
    c, k = header["completion_ids"]["shape"][1], header["reward_parts"]["shape"][1]
    for what, value, limit in (("samples", n, limits.max_samples), ("completion tokens", c, limits.max_completion_tokens),
                               ("prompt tokens", p, limits.max_prompt_tokens), ("reward columns", k,
                                                                                limits.max_reward_parts)):
        if value > limit:
            raise InvalidRollout(f"rollout holds {value} {what}; the run allows at most {limit}")


def _reward_names(meta: dict[str, str], columns: int) -> list[str]:
    try:
        names = json.loads(meta.get("reward_names", "[]"))
    except (ValueError, RecursionError):
        raise InvalidRollout("reward_names is not JSON") from None
    if not isinstance(names, list) or not all(isinstance(x, str) and len(x) <= MAX_REWARD_NAME_CHARS for x in names):
        raise InvalidRollout("reward_names must be a JSON list of short strings")
    if names and len(names) != columns:
        raise InvalidRollout(f"{columns} reward columns but {len(names)} reward names")
    return names


def _check_values(tensors: dict[str, torch.Tensor], vocab_size: int | None) -> None:
    ids = torch.cat([tensors["prompt_ids"].flatten(), tensors["completion_ids"].flatten()])
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise InvalidRollout(f"token ids outside the vocabulary [0, {vocab_size})")
    for name in ("prompt_mask", "completion_mask"):
        if ((tensors[name] != 0) & (tensors[name] != 1)).any():
            raise InvalidRollout(f"tensor {name!r} holds values other than 0 and 1")
    logp = tensors["logprobs"]
    if (torch.isfinite(logp) & (logp > LOGPROB_SLACK)).any():
        raise InvalidRollout("positive log-probs: a log-probability is never above 0")


def _check_episodes(tensors: dict[str, torch.Tensor], max_turns: int | None) -> None:
    """An episode's env_mask: 0/1, only on completion tokens, never the first one (the model speaks
    first), log-prob 0 under it, and at most max_turns - 1 replies (runs of 1) per completion."""
    env, mask = tensors["env_mask"], tensors["completion_mask"]
    if ((env != 0) & (env != 1)).any():
        raise InvalidRollout("tensor 'env_mask' holds values other than 0 and 1")
    if ((env == 1) & (mask == 0)).any():
        raise InvalidRollout("env_mask marks a token outside the completion")
    if (env[:, :1] == 1).any():
        raise InvalidRollout("an episode's completion starts with the environment's tokens, not the model's")
    if (tensors["logprobs"][env == 1] != 0).any():
        raise InvalidRollout("an environment token carries a log-prob: only the model's tokens were sampled")
    if max_turns is not None:
        starts = (env[:, 1:] == 1) & (env[:, :-1] == 0)  # where a reply begins
        replies = int(starts.sum(1).max()) if env.shape[1] > 1 else 0
        if replies > max_turns - 1:
            raise InvalidRollout(f"an episode holds {replies} environment replies; the run allows at most "
                                 f"{max_turns - 1} (environment.max_turns {max_turns})")


def from_bytes(data: bytes, vocab_size: int | None = None, limits: Limits | None = None) -> Rollout:
    """Parse and check a rollout object: the header's dtypes and shapes (within `limits`, before the
    tensor bytes are read), shapes that agree, masks of 0/1, log-probs <= 0, token ids inside the
    vocabulary, metadata of the right types. Anything else is InvalidRollout."""
    header = _header(data)
    meta = _metadata(header)
    if meta.get("format") != FORMAT:
        raise InvalidRollout(f"not a brigade rollout (format {str(meta.get('format'))[:64]!r}, expected {FORMAT!r})")
    _check_table(header, limits)
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError, OSError) as e:
        raise InvalidRollout(f"rollout object is not valid safetensors: {e}") from e
    for name, (dtype, rank) in SPEC.items():
        t = tensors[name]
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
    _check_values(tensors, vocab_size)
    env_mask = tensors.get("env_mask")
    if env_mask is not None:
        if tuple(env_mask.shape) != (n, c):
            raise InvalidRollout(f"tensor 'env_mask' has shape {tuple(env_mask.shape)}, expected {(n, c)}")
        _check_episodes(tensors, limits.max_turns if limits is not None else None)
    try:
        attempt, version = int(meta["attempt"]), int(meta["policy_version"])
    except (KeyError, ValueError) as e:
        raise InvalidRollout(f"rollout metadata is incomplete: {str(e)[:200]}") from None
    names = _reward_names(meta, tensors["reward_parts"].shape[1])
    try:
        metrics = json.loads(meta.get("reward_metrics", "{}"))
    except (ValueError, RecursionError):
        raise InvalidRollout("reward_metrics is not JSON") from None
    if not _sums_and_counts(metrics):
        raise InvalidRollout("rollout metadata 'reward_metrics' is not a mapping of names to [sum, count]")
    return Rollout(
        run_id=meta.get("run_id", ""), batch_id=meta.get("batch_id", ""), attempt=attempt, policy_version=version,
        reward_names=names, reward_metrics=metrics, env_mask=env_mask, **{name: tensors[name] for name in SPEC},
    )


def _sums_and_counts(metrics) -> bool:
    return isinstance(metrics, dict) and len(metrics) <= 1000 and all(
        isinstance(k, str) and isinstance(v, list) and len(v) == 2
        and all(isinstance(x, (int, float)) and math.isfinite(x) for x in v) and v[1] > 0
        for k, v in metrics.items())
