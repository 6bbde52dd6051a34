"""The learner's model, optimizer and schedule, and one GRPO step on a list of rollouts.

`Trainer.train_step` reads top to bottom as the algorithm: advantages per group, (optionally) the
proximal log-probs of the version that generated each rollout, then micro-batches of forward, loss
and backward with gradient accumulation (rows whose advantage is 0 skipped when no KL term gives them
a gradient), then one clipped AdamW step on the LoRA parameters only.
It is synchronous and does no IO: the service runs it in a thread while the next step's data
downloads, and the benchmark calls exactly the same function.
"""

from __future__ import annotations

import json
import math
import re
import time
import warnings
from dataclasses import dataclass

import torch
from peft import PeftModel

from brigade import adapters
from brigade.model import attach_lora, completion_logprobs, load_base, pick_device
from brigade.rollout_format import Limits, Rollout
from brigade.spec import episodic
from brigade.v1 import brigade_pb2 as pb
from brigade_learner.loss import aggregate, group_advantages, token_loss, truncated_is_weight

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def lr_factor(step: int, *, schedule: str, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the base learning rate for optimizer step `step` (0-based).

    Linear warmup that reaches the full rate at step warmup_steps - 1 (no wasted step at lr 0),
    then constant, or linear / cosine decay to 0 at max_steps. With max_steps = 0 (run until
    stopped) there is no horizon to decay over, so the rate stays constant after warmup.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant" or max_steps <= 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule {schedule!r} is not one of constant, linear, cosine")


@dataclass(frozen=True)
class MicroBatch:
    """Rows of one rollout trained together, and the columns they need."""
    rollout: int           # index into the step's rollouts
    rows: torch.Tensor     # the rollout's rows (sample indices) in this micro-batch
    prompt_from: int       # prompt columns before this are left padding in every one of the rows
    completion_to: int     # completion columns from this on are right padding in every one of them


def micro_batches(rollouts: list[Rollout], token_budget: int,
                  advantages: list[torch.Tensor] | None = None) -> list[MicroBatch]:
    """The step's rows in micro-batches of at most `token_budget` padded tokens (at least one row).

    With `advantages` (only when beta is 0), a row whose advantage is exactly 0 is left out: its loss
    and its gradient are exactly 0 (a group whose rewards all agree), so the forward and backward on
    it would buy nothing; the normalisers stay the full batch's, so the step is the same. A
    micro-batch never mixes rollouts (each has its own padding); rows go in order of length, so the
    short ones share a micro-batch, and each keeps only the columns its rows fill.
    """
    chunks = []
    for i, r in enumerate(rollouts):
        rows = torch.arange(r.num_samples)
        if advantages is not None:
            rows = rows[advantages[i] != 0]
        prompt_len, completion_len = r.prompt_mask.sum(1), _filled(r.completion_mask)
        order = rows[torch.argsort(prompt_len[rows] + completion_len[rows], stable=True)].tolist()
        start = 0
        while start < len(order):
            end, p_max, c_max = start, 0, 1  # grow while the padded micro-batch stays within the budget
            while end < len(order):
                p, c = max(p_max, int(prompt_len[order[end]])), max(c_max, int(completion_len[order[end]]))
                if end > start and (end + 1 - start) * (p + c) > token_budget:
                    break
                end, p_max, c_max = end + 1, p, c
            chunks.append(MicroBatch(i, torch.tensor(order[start:end]), r.prompt_ids.shape[1] - p_max, c_max))
            start = end
    return chunks


def _filled(completion_mask: torch.Tensor) -> torch.Tensor:
    """Per row, one past its last completion token (right padding: its length)."""
    positions = torch.arange(1, completion_mask.shape[1] + 1)
    return (positions * (completion_mask > 0)).max(1).values


def batch_advantages(rollouts: list[Rollout], scale: str) -> list[torch.Tensor]:
    """Group-relative advantages over the step's samples; a group never spans two rollouts."""
    rewards, groups, offset = [], [], 0
    for r in rollouts:
        _, inverse = torch.unique(r.group.long(), return_inverse=True)
        groups.append(inverse + offset)
        offset += int(inverse.max()) + 1
        rewards.append(r.rewards.float())
    adv = group_advantages(torch.cat(rewards), torch.cat(groups), scale)
    return list(adv.split([r.num_samples for r in rollouts]))


@dataclass
class Trainer:
    spec: pb.RunSpec
    model: PeftModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    device: torch.device
    max_steps: int
    v0: dict[str, torch.Tensor]  # the seeded initial adapter: version 0, never published

    @classmethod
    def create(cls, spec: pb.RunSpec, max_steps: int | None = None, device: torch.device | None = None) -> Trainer:
        device = device or pick_device(spec.device)
        base, _ = load_base(spec, device)
        model = attach_lora(base, spec)
        if spec.topology == "local_sgd" and spec.local_sgd.merge == "frozen_a":
            # a local trainer keeps A at the seeded v0, so averaging B averages the deltas exactly
            # (brigade_aggregator.averaging); the optimizer below then holds B only
            for name, p in model.named_parameters():
                if "lora_A" in name:
                    p.requires_grad_(False)
        # peft keeps adapter weights in float32 even on a bf16 base: the learner's own copy stays
        # full precision; only the published payload is rounded.
        params = [p for _, p in model.named_parameters() if p.requires_grad]
        g = spec.grpo
        optimizer = torch.optim.AdamW(params, lr=g.learning_rate, betas=ADAM_BETAS, eps=ADAM_EPS,
                                      weight_decay=g.weight_decay)
        max_steps = spec.max_steps if max_steps is None else max_steps
        schedule = dict(schedule=g.lr_schedule, warmup_steps=g.warmup_steps, max_steps=max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, **schedule))
        v0 = {k: v.clone() for k, v in adapters.adapter_state(model).items()}
        return cls(spec, model, optimizer, scheduler, device, max_steps, v0)

    # ------------------------------------------------------------ the step

    def train_step(self, rollouts: list[Rollout],
                   proximal: dict[int, dict[str, torch.Tensor]] | None = None) -> dict[str, float]:
        """One optimizer step on `rollouts`. `proximal` maps each policy version among them to its
        adapter tensors (as published), needed only with grpo.recompute_logprobs."""
        g, temperature = self.spec.grpo, self.spec.sampling.temperature
        t0 = time.perf_counter()

        # 1. advantages, and the full batch's normalisers (so micro-batch losses add up exactly)
        advantages = batch_advantages(rollouts, g.scale_rewards)
        num_sequences = sum(r.num_samples for r in rollouts)
        num_tokens = sum(r.num_tokens for r in rollouts)  # the model's own: an episode's replies do not train
        norms = dict(num_sequences=num_sequences, num_tokens=num_tokens,
                     max_new_tokens=max(self.spec.sampling.max_new_tokens, 1))
        # with a KL term every row has a gradient; without one, a zero-advantage row has none
        chunks = micro_batches(rollouts, g.micro_batch_tokens, None if g.beta > 0 else advantages)

        # 2. decoupled PPO: the behaviour policy re-scored under the learner's own numerics
        prox = self.proximal_logprobs(rollouts, chunks, proximal or {}) if g.recompute_logprobs else None

        # 3. forward, loss, backward per micro-batch; gradients accumulate
        stats = _Stats()
        total_loss = 0.0
        for mb in chunks:
            batch = self._tensors(rollouts[mb.rollout], mb)
            behaviour, mask = batch.pop("logprobs"), batch.pop("loss_mask")
            adv = advantages[mb.rollout][mb.rows].to(self.device)
            ref = None
            if g.beta > 0:
                # the reference is the same network with the adapter switched off: no second copy
                with torch.no_grad(), self.model.disable_adapter():
                    self.model.eval()
                    ref = completion_logprobs(self.model, **batch, temperature=temperature)
            self.model.train()
            logp, entropy = completion_logprobs(self.model, **batch, temperature=temperature, with_entropy=True)
            if prox is not None:            # ratio vs the proximal policy, weight corrects the engine
                logp_old = prox[mb.rollout][mb.rows, : mb.completion_to].to(self.device)
                weight = truncated_is_weight(logp_old, behaviour, g.tis_cap) if g.tis_cap > 0 else None
            elif g.tis_cap > 0:             # truncated IS against the engine, from the current weights
                logp_old = logp.detach()
                weight = truncated_is_weight(logp_old, behaviour, g.tis_cap)
            else:                           # plain off-policy PPO against the engine's log-probs
                logp_old, weight = behaviour, None
            tl = token_loss(logp, logp_old, adv, mask, g.eps_low, g.eps_high, weight, ref, g.beta)
            loss = aggregate(tl.loss, mask, g.loss_agg, **norms)
            loss.backward()
            total_loss += loss.item()
            stats.add(tl, mask, weight, g.tis_cap, entropy)
        self.model.eval()
        if not chunks:  # every advantage was 0: a zero gradient, so Adam's moments move as they would
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    p.grad = torch.zeros_like(p)

        # 4. one clipped AdamW step; a non-finite gradient skips the update instead of poisoning it
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        max_norm = g.max_grad_norm if g.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        lr = self.scheduler.get_last_lr()[0]
        skipped = not (math.isfinite(grad_norm) and math.isfinite(total_loss))
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with warnings.catch_warnings():  # torch warns when a step is skipped; that is the point here
            warnings.filterwarnings("ignore", message=re.escape("Detected call of `lr_scheduler.step()`"))
            self.scheduler.step()  # the schedule follows the step count even when an update is skipped

        train_s = time.perf_counter() - t0
        all_tokens = num_tokens + int(sum(r.prompt_mask.sum() for r in rollouts))
        adv = torch.cat(advantages)
        return {**completion_stats(rollouts, self.spec.sampling.max_new_tokens), "tokens": all_tokens,
            "loss": total_loss, "grad_norm": grad_norm, "lr": lr, "skipped_nonfinite": int(skipped),
            **stats.summary(num_tokens), **reward_stats(rollouts),
            "adv_mean": adv.mean().item(), "adv_std": adv.std(correction=0).item(),
            "adv_min": adv.min().item(), "adv_max": adv.max().item(),
            "sequences": num_sequences, "completion_tokens": num_tokens, "micro_batches": len(chunks),
            "train_s": train_s, "tokens_per_s": all_tokens / max(train_s, 1e-9),
        }

    def _tensors(self, r: Rollout, mb: MicroBatch) -> dict[str, torch.Tensor]:
        d, rows, p, c = self.device, mb.rows, mb.prompt_from, mb.completion_to
        return dict(
            prompt_ids=r.prompt_ids[rows, p:].to(d), prompt_mask=r.prompt_mask[rows, p:].to(d, torch.long),
            completion_ids=r.completion_ids[rows, :c].to(d),
            completion_mask=r.completion_mask[rows, :c].to(d, torch.long),
            logprobs=r.logprobs[rows, :c].to(d), loss_mask=r.loss_mask[rows, :c].to(d, torch.long),
        )

    @torch.no_grad()
    def proximal_logprobs(self, rollouts: list[Rollout], chunks: list[MicroBatch],
                          versions: dict[int, dict[str, torch.Tensor]]) -> list[torch.Tensor]:
        """Log-probs of each rollout under the adapter version that generated it, computed by this
        learner. The adapters are small, so the version's tensors are swapped into the LoRA weights
        (in place: the optimizer keeps its parameter objects) and the current ones put back."""
        current = {k: v.clone() for k, v in adapters.adapter_state(self.model).items()}
        out = [torch.zeros_like(r.logprobs) for r in rollouts]
        self.model.eval()
        try:
            for version in sorted({r.policy_version for r in rollouts}):
                state = self.v0 if version == 0 else versions.get(version)
                if state is None:
                    raise KeyError(f"adapter version {version} is needed to recompute log-probs but was not loaded")
                adapters.apply(self.model, state)
                for mb in chunks:
                    if rollouts[mb.rollout].policy_version == version:
                        batch = self._tensors(rollouts[mb.rollout], mb)
                        batch.pop("logprobs")
                        batch.pop("loss_mask")
                        out[mb.rollout][mb.rows, : mb.completion_to] = completion_logprobs(
                            self.model, **batch, temperature=self.spec.sampling.temperature).cpu()
        finally:
            adapters.apply(self.model, current)
        return out

    # ------------------------------------------------------------ what gets published

    def adapter_config_json(self) -> bytes:
        """PEFT's adapter_config.json, naming the base by the run spec's model (not this machine's
        cache path), so the same weights give the same bytes on any machine and after a restart."""
        config = json.loads(adapters.adapter_config_json(self.model))
        config["base_model_name_or_path"] = self.spec.model
        return json.dumps(config, indent=2, sort_keys=True).encode()

    def adapter_files(self, payload: str, config_json: bytes | None = None) -> tuple[dict[str, bytes], float]:
        """The files of an adapter version made from the current weights, and the quantization error."""
        state = {k: v.cpu() for k, v in adapters.adapter_state(self.model).items()}
        return adapters.encode(state, config_json or self.adapter_config_json(), payload)

    @property
    def vocab_size(self) -> int:
        return self.model.get_input_embeddings().num_embeddings

    @property
    def rollout_limits(self) -> Limits:
        """The largest rollout this run's spec can produce, and this model can take."""
        s = self.spec
        return Limits.for_spec(s.prompts_per_batch, s.sampling.group_size, s.sampling.max_new_tokens,
                               getattr(getattr(self.model, "config", None), "max_position_embeddings", None),
                               max_turns=s.environment.max_turns if episodic(s) else 1)


class _Stats:
    """Token-level sums over micro-batches, reduced once at the end. Clip fractions and KL are over
    every completion token (a zero-advantage row is never clipped, and is trained when a KL term
    makes its gradient nonzero), as TRL reports them; entropy, ratios and weights over the tokens
    trained, which `trained_frac` says."""

    def __init__(self) -> None:
        self.kl = self.low = self.high = self.ratio_sum = self.weight_sum = self.capped = self.entropy = 0.0
        self.trained = 0
        self.ratio_min, self.ratio_max = math.inf, -math.inf
        self.weighted = False

    @torch.no_grad()
    def add(self, tl, mask: torch.Tensor, weight: torch.Tensor | None, cap: float = 0.0,
            entropy: torch.Tensor | None = None) -> None:
        on = mask > 0
        self.trained += int(on.sum())
        self.kl += float(tl.kl[on].sum())
        if entropy is not None:
            self.entropy += float(entropy[on].sum())
        self.low += float(tl.clipped_low.sum())
        self.high += float(tl.clipped_high.sum())
        if on.any():
            ratios = tl.ratio[on]
            self.ratio_sum += float(ratios.sum())
            self.ratio_min = min(self.ratio_min, float(ratios.min()))
            self.ratio_max = max(self.ratio_max, float(ratios.max()))
        if weight is not None:
            self.weighted = True
            self.weight_sum += float(weight[on].sum())
            self.capped += float((weight[on] >= cap).sum())

    def summary(self, num_tokens: int) -> dict[str, float]:
        n, t = max(num_tokens, 1), max(self.trained, 1)
        out = {
            "kl": self.kl / n, "clip_low_frac": self.low / n, "clip_high_frac": self.high / n,
            "entropy": self.entropy / t, "ratio_mean": self.ratio_sum / t if self.trained else 1.0,
            "ratio_min": self.ratio_min if self.trained else 1.0, "ratio_max": self.ratio_max if self.trained else 1.0,
            "trained_frac": self.trained / n,
        }
        if self.weighted:
            out["is_weight_mean"] = self.weight_sum / t if self.trained else 1.0
            out["is_weight_capped_frac"] = self.capped / t  # tokens whose weight tis_cap truncated
        return out


def completion_stats(rollouts: list[Rollout], max_new_tokens: int) -> dict[str, float]:
    """Completion lengths, and the share cut off at max_new_tokens (TRL's completions/clipped_ratio)."""
    lengths = torch.cat([r.completion_mask.sum(1).float() for r in rollouts])
    return {"completion_length_mean": lengths.mean().item(), "completion_length_min": lengths.min().item(),
            "completion_length_max": lengths.max().item(),
            "completion_clipped_frac": (lengths >= max_new_tokens).float().mean().item()}


def reward_stats(rollouts: list[Rollout]) -> dict[str, float]:
    """Mean and std of the total reward (over the batch, and within groups as TRL's reward_std)
    and of each reward function's part; the share of groups whose rewards are all equal (no
    signal: TRL's frac_reward_zero_std)."""
    rewards = torch.cat([r.rewards.float() for r in rollouts])
    group_stds = [r.rewards.float()[r.group == g].std(correction=0) for r in rollouts for g in r.group.unique()]
    stds = torch.stack(group_stds) if group_stds else torch.zeros(1)
    out = {"reward_mean": rewards.mean().item(), "reward_std": rewards.std(correction=0).item(),
           "reward_group_std": stds.mean().item(), "frac_reward_zero_std": (stds < 1e-8).float().mean().item()}
    parts: dict[str, list[torch.Tensor]] = {}
    for r in rollouts:
        for k, name in enumerate(r.reward_names[: r.reward_parts.shape[1]]):
            parts.setdefault(name, []).append(r.reward_parts[:, k].float())
    for name, cols in parts.items():
        col = torch.cat(cols)
        scored = torch.isfinite(col)
        out[f"reward/{name}/none_frac"] = 1.0 - scored.float().mean().item()  # the function returned None
        col = col[scored]
        if col.numel():
            out[f"reward/{name}/mean"] = col.mean().item()
            out[f"reward/{name}/std"] = col.std(correction=0).item()
    logged: dict[str, list[float]] = {}  # what reward functions logged, averaged over the step as TRL does
    for r in rollouts:
        for name, (total, count) in r.reward_metrics.items():
            acc = logged.setdefault(name, [0.0, 0.0])
            acc[0], acc[1] = acc[0] + total, acc[1] + count
    out.update({name: total / count for name, (total, count) in logged.items()})
    return out
