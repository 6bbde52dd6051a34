"""The GRPO math against values worked out by hand (no model)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from brigade_learner.loss import (
    ADV_EPS,
    aggregate,
    group_advantages,
    k3_kl,
    token_loss,
    truncated_is_weight,
)
from brigade_learner.trainer import lr_factor

# Two sequences, three completion positions; the last position of row 0 is padding.
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
ADV = torch.tensor([1.0, -0.5])
# ratios row 0: [1, 1.5, (pad)], row 1: [0.5, 1, 1.1]
LOGP_OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -3.0]])
LOGP = LOGP_OLD + torch.log(torch.tensor([[1.0, 1.5, 1.0], [0.5, 1.0, 1.1]]))
LOGP = LOGP * MASK  # padding carries log-prob 0, as in the rollout format
# Per token, by hand, with eps_low 0.2 and eps_high 0.28 (clip range [0.8, 1.28]):
#   row 0 (A = 1):    min(1*1, 1*1) = 1;      min(1.5, 1.28) = 1.28          -> loss -1, -1.28
#   row 1 (A = -0.5): min(-0.25, -0.4) = -0.4; min(-0.5, -0.5); min(-0.55, -0.55) -> loss 0.4, 0.5, 0.55
HAND = torch.tensor([[-1.0, -1.28, 0.0], [0.4, 0.5, 0.55]])


def _loss(**kw):
    return token_loss(LOGP, LOGP_OLD, ADV, MASK, eps_low=0.2, eps_high=0.28, **kw)


def test_per_token_surrogate_and_clip_flags():
    tl = _loss()
    torch.testing.assert_close(tl.loss, HAND)
    # row 0 token 1: ratio 1.5 > 1.28 with A > 0; row 1 token 0: ratio 0.5 < 0.8 with A < 0
    assert tl.clipped_high.tolist() == [[False, True, False], [False, False, False]]
    assert tl.clipped_low.tolist() == [[False, False, False], [True, False, False]]
    assert tl.ratio[0, 2] == 1.0  # padding


@pytest.mark.parametrize("agg, expected", [
    # per-sequence token mean: row 0 (-1 - 1.28) / 2 = -1.14, row 1 1.45 / 3; then the mean of both
    ("grpo", (-1.14 + 1.45 / 3) / 2),
    # every token alike: (-2.28 + 1.45) / 5 tokens
    ("dapo", -0.83 / 5),
    # a constant: 2 sequences x max_new_tokens 4
    ("dr_grpo", -0.83 / 8),
])
def test_aggregation_modes_by_hand(agg, expected):
    value = aggregate(_loss().loss, MASK, agg, num_sequences=2, num_tokens=5, max_new_tokens=4)
    assert value.item() == pytest.approx(expected, abs=1e-6)


def test_unknown_aggregation_is_refused():
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(HAND, MASK, "sum", num_sequences=2, num_tokens=5, max_new_tokens=4)


def test_k3_kl_by_hand():
    new = torch.tensor([0.0, 0.0, -1.0])
    ref = torch.tensor([0.0, math.log(2.0), -1.0 + math.log(0.5)])
    # exp(d) - d - 1 with d = 0, ln 2, ln 0.5
    expected = [0.0, 2 - math.log(2) - 1, 0.5 - math.log(0.5) - 1]
    torch.testing.assert_close(k3_kl(new, ref), torch.tensor(expected))
    assert k3_kl(new, new).abs().max() == 0.0


def test_kl_term_is_added_per_token_and_aggregated_like_the_policy_term():
    ref = LOGP + torch.tensor([[math.log(2.0), 0.0, 0.0], [0.0, 0.0, 0.0]]) * MASK
    tl = _loss(ref_logp=ref, beta=0.1)
    expected = HAND.clone()
    expected[0, 0] += 0.1 * (2 - math.log(2) - 1)
    torch.testing.assert_close(tl.loss, expected)
    assert tl.kl[0, 0].item() == pytest.approx(2 - math.log(2) - 1)


def test_truncated_importance_weight():
    prox = torch.tensor([math.log(3.0), math.log(0.5), 0.0])
    behaviour = torch.zeros(3)
    w = truncated_is_weight(prox, behaviour, cap=2.0)
    torch.testing.assert_close(w, torch.tensor([2.0, 0.5, 1.0]))
    assert not w.requires_grad
    # the weight multiplies the per-token surrogate
    weights = torch.tensor([[2.0, 1.0, 1.0], [0.5, 1.0, 1.0]])
    tl = _loss(is_weight=weights)
    torch.testing.assert_close(tl.loss, HAND * weights)


def test_gradient_is_zero_where_the_clip_is_active():
    logp = LOGP.clone().requires_grad_(True)
    tl = token_loss(logp, LOGP_OLD, ADV, MASK, 0.2, 0.28)
    tl.loss.sum().backward()
    grad = logp.grad
    assert grad[0, 1] == 0.0 and grad[1, 0] == 0.0   # clipped tokens
    assert grad[0, 0] == pytest.approx(-1.0)          # d(-r A)/dlogp = -r A at r = 1, A = 1
    assert grad[0, 2] == 0.0                          # padding


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 1, 1])
    # group 0: mean 0.5, unbiased std sqrt(0.5); group 1: all equal -> 0
    s = math.sqrt(0.5)
    torch.testing.assert_close(group_advantages(rewards, group, "group"),
                               torch.tensor([0.5 / (s + ADV_EPS), -0.5 / (s + ADV_EPS), 0.0, 0.0]))
    # batch std of [1, 0, 1, 1]: mean 0.75, unbiased var 0.25 -> std 0.5
    torch.testing.assert_close(group_advantages(rewards, group, "batch"),
                               torch.tensor([0.5 / (0.5 + ADV_EPS), -0.5 / (0.5 + ADV_EPS), 0.0, 0.0]))
    torch.testing.assert_close(group_advantages(rewards, group, "none"), torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_single_sample_group_has_zero_advantage_not_nan():
    adv = group_advantages(torch.tensor([3.0, 1.0, 2.0]), torch.tensor([0, 1, 1]), "group")
    assert adv[0] == 0.0 and torch.isfinite(adv).all()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from(["grpo", "dapo", "dr_grpo"]), st.integers(0, 2**31 - 1))
def test_micro_batch_shares_add_up_to_the_full_batch(n, c, agg, seed):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(n, c, generator=g)
    mask = (torch.rand(n, c, generator=g) > 0.3).float()
    norms = dict(num_sequences=n, num_tokens=int(mask.sum()), max_new_tokens=c)
    full = aggregate(loss, mask, agg, **norms)
    parts = sum(aggregate(loss[i:i + 1], mask[i:i + 1], agg, **norms) for i in range(n))
    assert parts.item() == pytest.approx(full.item(), abs=1e-5)


def test_lr_schedules():
    kw = dict(warmup_steps=2, max_steps=6)
    assert [lr_factor(s, schedule="constant", **kw) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]
    # linear: after warmup, 1 - (s - 2) / 4
    assert [lr_factor(s, schedule="linear", **kw) for s in range(2, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    cos = [lr_factor(s, schedule="cosine", **kw) for s in (2, 4, 6)]
    assert cos == pytest.approx([1.0, 0.5, 0.0])
    # no horizon (max_steps 0): constant after warmup
    assert lr_factor(100, schedule="cosine", warmup_steps=0, max_steps=0) == 1.0
