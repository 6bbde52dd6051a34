"""GRPO math on plain tensors: advantages, the clipped surrogate, KL, importance weights, aggregation.

Nothing here knows about models, buckets or micro-batches beyond the normalisers it is handed, so
every formula can be checked by hand on a 2x3 tensor (tests/unit/test_learner_loss.py does).

Shapes: N sequences, C completion tokens; `mask` is 1.0 on generated tokens, 0.0 on padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Added to the std in the advantage denominator: a group whose rewards are all equal has std 0
# and, after centring, all-zero advantages, which must stay 0 rather than become 0/0.
ADV_EPS = 1e-4

AGGREGATIONS = ("grpo", "dapo", "dr_grpo")
SCALINGS = ("group", "batch", "none")


def _std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std (as TRL), but 0 for a single element instead of NaN: a group that lost all
    but one sample to filtering has nothing to compare against, and its advantage is 0 anyway."""
    n = x.numel()
    if n < 2:
        return x.new_zeros(())
    return ((x - x.mean()).pow(2).sum() / (n - 1)).sqrt()


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, scale: str = "group",
                     eps: float = ADV_EPS) -> torch.Tensor:
    """A_i = (r_i - mean of i's group) / (std + eps).

    scale: "group" divides by the std of i's group (GRPO), "batch" by the std of every reward in
    the batch (more robust when a group's rewards are nearly equal), "none" does not divide
    (Dr. GRPO: the std division biases toward too-easy and too-hard prompts).
    """
    if scale not in SCALINGS:
        raise ValueError(f"scale_rewards {scale!r} is not one of {SCALINGS}")
    rewards = rewards.float()
    adv = torch.empty_like(rewards)
    group_std = torch.empty_like(rewards)
    for g in torch.unique(group):
        idx = group == g
        r = rewards[idx]
        adv[idx] = r - r.mean()
        group_std[idx] = _std(r)
    if scale == "group":
        return adv / (group_std + eps)
    if scale == "batch":
        return adv / (_std(rewards) + eps)
    return adv


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - new) - (ref - new) - 1: unbiased, always >= 0,
    and exactly 0 where the two agree (so 0 before the first step, when the adapter is zero)."""
    d = ref_logp - logp
    return torch.exp(d) - d - 1.0


def truncated_is_weight(logp_prox: torch.Tensor, logp_behaviour: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_learner / pi_engine, cap), detached: corrects the sampler-vs-trainer numerics gap
    without letting one token with a tiny engine probability dominate the gradient."""
    return torch.exp(logp_prox - logp_behaviour).clamp(max=cap).detach()


@dataclass
class TokenLoss:
    loss: torch.Tensor     # [N, C] per-token loss (policy term + beta * KL), 0 on padding
    ratio: torch.Tensor    # [N, C] detached
    kl: torch.Tensor       # [N, C] detached, 0 when no reference was given
    clipped_low: torch.Tensor   # [N, C] bool: the lower clip bound is the active term
    clipped_high: torch.Tensor  # [N, C] bool


def token_loss(
    logp: torch.Tensor,          # [N, C] log-probs under the weights being trained (with grad)
    logp_old: torch.Tensor,      # [N, C] the policy the ratio is taken against
    advantages: torch.Tensor,    # [N]
    mask: torch.Tensor,          # [N, C]
    eps_low: float,
    eps_high: float,
    is_weight: torch.Tensor | None = None,  # [N, C] truncated importance weights, or None
    ref_logp: torch.Tensor | None = None,   # [N, C] reference log-probs (adapter disabled)
    beta: float = 0.0,
) -> TokenLoss:
    """PPO's pessimistic surrogate: -min(r A, clip(r, 1-eps_low, 1+eps_high) A) per token."""
    mask = mask.to(logp.dtype)
    # padding positions carry log-prob 0 on both sides; mask the difference so their ratio is 1
    ratio = torch.exp((logp - logp_old) * mask)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * adv
    loss = -torch.min(unclipped, clipped)
    if is_weight is not None:
        loss = loss * is_weight
    kl = torch.zeros_like(logp)
    if ref_logp is not None and beta > 0:
        kl = k3_kl(logp, ref_logp) * mask
        loss = loss + beta * kl
    with torch.no_grad():
        on = mask > 0
        # a bound is "active" when it is the term min() picked and it differs from the unclipped one
        low = on & (ratio < 1.0 - eps_low) & (adv < 0)
        high = on & (ratio > 1.0 + eps_high) & (adv > 0)
    return TokenLoss(loss * mask, ratio.detach(), kl.detach(), low, high)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, agg: str, *, num_sequences: int, num_tokens: int,
              max_new_tokens: int) -> torch.Tensor:
    """Reduce a (micro-)batch's per-token loss to its share of the full-batch scalar.

    The normalisers are those of the FULL step batch, so summing this over micro-batches gives
    exactly the full-batch loss (gradient accumulation without a rescale):
      grpo:    mean over sequences of each sequence's token-mean (long answers weigh less per token)
      dapo:    sum over all tokens / number of tokens (every token weighs the same)
      dr_grpo: sum over all tokens / (num_sequences * max_new_tokens), a constant: no length bias
    """
    mask = mask.to(loss.dtype)
    if agg == "grpo":
        per_seq = (loss * mask).sum(1) / mask.sum(1).clamp(min=1.0)
        return per_seq.sum() / max(num_sequences, 1)
    if agg == "dapo":
        return (loss * mask).sum() / max(num_tokens, 1)
    if agg == "dr_grpo":
        return (loss * mask).sum() / max(num_sequences * max_new_tokens, 1)
    raise ValueError(f"loss_agg {agg!r} is not one of {AGGREGATIONS}")
