"""The aggregator's merge (topology local_sgd): frozen_a is exact, factors' error is what the cross
terms make, weights follow usable samples and staleness, Nesterov is torch's, and the error computed
through Gram matrices equals the explicit products."""

from __future__ import annotations

import pytest
import torch

from brigade.adapters import trained_names
from brigade_aggregator.averaging import Delta, average, averaging_error, modules, outer_step, weights

D_IN, D_OUT, R = 12, 10, 4


def adapter(seed: int, n_modules: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for m in range(n_modules):
        out[f"model.layers.{m}.q_proj.lora_A.weight"] = torch.randn(R, D_IN, generator=g)
        out[f"model.layers.{m}.q_proj.lora_B.weight"] = torch.randn(D_OUT, R, generator=g)
    return out


def contributions(master, merge: str, k: int, scale: float = 0.3) -> list[Delta]:
    names = trained_names(set(master), merge)
    out = []
    for i in range(k):
        g = torch.Generator().manual_seed(100 + i)
        out.append(Delta(f"c{i}", base_version=5, samples=8 * (i + 1),
                         tensors={n: scale * torch.randn(master[n].shape, generator=g) for n in names}))
    return out


def explicit_error(master, deltas, w) -> float:
    """The definition, with every d_out x d_in product formed."""
    err = ref = 0.0
    for a, b in modules(set(master)):
        bs = [(master[b] + d.tensors.get(b, 0)).double() for d in deltas]
        as_ = [(master[a] + d.tensors.get(a, 0)).double() for d in deltas]
        target = sum(wk * bk @ ak for wk, bk, ak in zip(w, bs, as_, strict=True))
        merged = sum(wk * bk for wk, bk in zip(w, bs, strict=True)) @ sum(wk * ak for wk, ak in zip(w, as_, strict=True))
        err += float((merged - target).pow(2).sum())
        ref += float(target.pow(2).sum())
    return (err / ref) ** 0.5


def test_frozen_a_merges_exactly_the_average_of_the_trainers_deltas():
    master = adapter(0)
    deltas = contributions(master, "frozen_a", 3)
    assert all(set(d.tensors) == {n for n in master if "lora_B" in n} for d in deltas)
    w = weights(deltas, version=5, stale_weight=0.5)
    step = outer_step(master, {}, average(deltas, w), "average", lr=1.0, mu=0.0)
    for a, b in modules(set(master)):
        target = sum(wk * (master[b] + d.tensors[b]).double() @ master[a].double() for wk, d in zip(w, deltas, strict=True))
        got = step.master[b].double() @ step.master[a].double()
        assert torch.equal(step.master[a], master[a])  # A never moves
        assert float((got - target).norm() / target.norm()) < 1e-6
    assert averaging_error(master, deltas, w) < 1e-7


def test_factors_error_is_the_cross_terms_and_the_gram_form_equals_the_products():
    master = adapter(1)
    deltas = contributions(master, "factors", 3)
    w = weights(deltas, version=5, stale_weight=0.5)
    got, want = averaging_error(master, deltas, w), explicit_error(master, deltas, w)
    assert want > 0.01 and abs(got - want) < 1e-9 * max(1.0, want)
    # one contribution: nothing to cross
    assert averaging_error(master, deltas[:1], [1.0]) < 1e-7
    # the same deltas on B alone (A frozen): exact again
    only_b = [Delta(d.contribution, d.base_version, d.samples, {n: t for n, t in d.tensors.items() if "lora_B" in n})
              for d in deltas]
    assert averaging_error(master, only_b, w) < 1e-7


def test_weights_follow_usable_samples_and_staleness():
    def d(samples, base):
        return Delta("c", base, samples, {})

    assert weights([d(10, 7), d(30, 7)], 7, 0.5) == pytest.approx([0.25, 0.75])
    assert weights([d(10, 7), d(10, 6), d(10, 5)], 7, 0.5) == pytest.approx([4 / 7, 2 / 7, 1 / 7])
    assert weights([d(10, 6), d(10, 5)], 7, 1.0) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError):
        weights([d(0, 7)], 7, 0.5)


def test_plain_averaging_adds_the_weighted_mean_delta():
    master = adapter(2)
    deltas = contributions(master, "factors", 2)
    w = [0.25, 0.75]
    step = outer_step(master, {}, average(deltas, w), "average", lr=1.0, mu=0.0)
    for name in master:
        want = master[name] + 0.25 * deltas[0].tensors[name] + 0.75 * deltas[1].tensors[name]
        assert torch.allclose(step.master[name], want, atol=1e-6)
    assert step.momentum == {}


def test_nesterov_is_torch_sgd_with_nesterov_momentum_on_the_pseudo_gradient():
    master = adapter(3, n_modules=1)
    names = trained_names(set(master), "frozen_a")
    params = {n: torch.nn.Parameter(master[n].clone()) for n in names}
    sgd = torch.optim.SGD(params.values(), lr=0.7, momentum=0.9, nesterov=True)
    state, momentum = dict(master), {}
    for r in range(3):
        deltas = contributions(state, "frozen_a", 2, scale=0.1 * (r + 1))
        avg = average(deltas, [0.5, 0.5])
        step = outer_step(state, momentum, avg, "nesterov", lr=0.7, mu=0.9)
        state, momentum = step.master, step.momentum
        for n in names:
            params[n].grad = -avg[n]
        sgd.step()
        for n in names:
            assert torch.allclose(state[n], params[n].detach(), atol=1e-6), (r, n)
    assert step.pseudo_grad_norm > 0 and step.update_norm > 0
