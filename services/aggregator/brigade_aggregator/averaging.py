"""How the aggregator merges a round: the LoRA merge rule, the weights, the outer optimizer and the
averaging error. Pure tensor math, no IO: the service and the unit tests call these functions.

A LoRA module's weight delta is (alpha / r) B A (B: d_out x r, A: r x d_in). Averaging the factors of
K trainers separately is not averaging their deltas: (sum_k w_k B_k)(sum_k w_k A_k) differs from
sum_k w_k B_k A_k by the cross terms B_j A_k. `local_sgd.merge` picks the rule:

- frozen_a (the default): A stays the run's seeded v0 in every process (never trained, never sent)
  and only B is trained and averaged. Then sum_k w_k B_k A = (sum_k w_k B_k) A: the merged adapter's
  delta IS the weighted average of the trainers' deltas, and the outer optimizer works in a space
  where averaging is linear. The price is LoRA-FA's: each trainer learns within the fixed random
  row space of A, with half the trainable parameters.
- factors: A and B are both trained, as the central learner trains them, and averaged separately;
  `averaging_error` reports what the cross terms cost each round.

A contribution k that started from global version u_k moved its trained factors by
delta_k = theta_k - theta(u_k), theta(u) being version u as published (the bytes the trainer loaded).
Its weight is its usable samples times stale_weight^(v - u_k), normalised over the round. The outer
gradient g = -(sum_k w_k delta_k) is DiLoCo's pseudo-gradient, and the outer optimizer steps the
aggregator's float32 master copy theta with it:

    average:   theta <- theta - lr g                        (lr 1: theta + sum_k w_k delta_k, FedAvg)
    nesterov:  m <- mu m + g;  theta <- theta - lr (g + mu m)   (torch.optim.SGD(nesterov=True), DiLoCo)

Every sum runs over the contributions in the order given (the service sorts them by id), so the same
round gives the same bytes on any restart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from brigade.adapters import A_SUFFIX, B_SUFFIX


def modules(names: list[str] | set[str]) -> list[tuple[str, str]]:
    """(A name, B name) of each LoRA module."""
    pairs = []
    for a in sorted(n for n in names if n.endswith(A_SUFFIX)):
        b = a[: -len(A_SUFFIX)] + B_SUFFIX
        if b not in names:
            raise ValueError(f"LoRA tensor {a} has no {B_SUFFIX} beside it")
        pairs.append((a, b))
    return pairs


@dataclass
class Delta:
    """One contribution, as the aggregator merges it."""

    contribution: str
    base_version: int
    samples: int
    tensors: dict[str, torch.Tensor]   # trained name -> theta_k - theta(base_version), float32


def delta(trained: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a trainer's local steps did to each tensor it sent."""
    return {name: trained[name].float() - base[name].float() for name in sorted(trained)}


def weights(deltas: list[Delta], version: int, stale_weight: float) -> list[float]:
    """Usable samples times stale_weight^staleness, normalised to sum to 1."""
    raw = [d.samples * stale_weight ** (version - d.base_version) for d in deltas]
    total = sum(raw)
    if not deltas or total <= 0:
        raise ValueError("a round needs at least one contribution with usable samples")
    return [r / total for r in raw]


def average(deltas: list[Delta], w: list[float]) -> dict[str, torch.Tensor]:
    """sum_k w_k delta_k, tensor by tensor, in the order of `deltas`."""
    out: dict[str, torch.Tensor] = {}
    for d, wk in zip(deltas, w, strict=True):
        for name, t in d.tensors.items():
            out[name] = out[name] + wk * t if name in out else wk * t
    return out


@dataclass
class OuterStep:
    master: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    pseudo_grad_norm: float
    update_norm: float


def outer_step(master: dict[str, torch.Tensor], momentum: dict[str, torch.Tensor], avg: dict[str, torch.Tensor],
               optimizer: str, lr: float, mu: float) -> OuterStep:
    """One step of the outer optimizer on the pseudo-gradient -avg; tensors not in `avg` stay as they are."""
    if optimizer not in ("average", "nesterov"):
        raise ValueError(f"outer optimizer {optimizer!r} is not average or nesterov")
    new_master, new_momentum = dict(master), dict(momentum)
    grad_sq = update_sq = 0.0
    for name in sorted(avg):
        g = -avg[name]
        if optimizer == "nesterov":
            buf = mu * momentum[name] + g if name in momentum else g.clone()
            new_momentum[name] = buf
            step = g + mu * buf
        else:
            step = g
        new_master[name] = master[name] - lr * step
        grad_sq += float(g.double().pow(2).sum())
        update_sq += float((lr * step).double().pow(2).sum())
    return OuterStep(new_master, new_momentum, grad_sq ** 0.5, update_sq ** 0.5)


def _product_norm_sq(us: list[torch.Tensor], vs: list[torch.Tensor]) -> float:
    """||sum_j U_j V_j||_F^2 without forming a d_out x d_in matrix: with U = [U_1 .. U_n] side by side
    and V = [V_1; ..; V_n] stacked, it is <U^T U, V V^T>, two (n r) x (n r) Gram matrices."""
    u, v = torch.cat(us, dim=1), torch.cat(vs, dim=0)
    return float(((u.T @ u) * (v @ v.T)).sum())


def averaging_error(master: dict[str, torch.Tensor], deltas: list[Delta], w: list[float]) -> float:
    """How far the merged adapter's deltas are from the average of the trainers' deltas, relative:
    sqrt(sum_m ||B_bar A_bar - sum_k w_k B_k A_k||^2 / sum_m ||sum_k w_k B_k A_k||^2) over the LoRA
    modules m, each contribution rebased on the master (B_k = B + delta_k, likewise A_k) and plain
    averaging (B_bar = sum_k w_k B_k). 0 up to float64 rounding with frozen_a; the cross terms with
    factors. In float64, through Gram matrices: O(K^2 r^2 (d_in + d_out)) per module."""
    err_sq = ref_sq = 0.0
    for a, b in modules(set(master)):
        bs = [(master[b] + d.tensors[b] if b in d.tensors else master[b]).double() for d in deltas]
        as_ = [(master[a] + d.tensors[a] if a in d.tensors else master[a]).double() for d in deltas]
        b_bar = sum(wk * bk for wk, bk in zip(w, bs, strict=True))
        a_bar = sum(wk * ak for wk, ak in zip(w, as_, strict=True))
        weighted = [wk * bk for wk, bk in zip(w, bs, strict=True)]
        err_sq += max(0.0, _product_norm_sq([b_bar, *(-x for x in weighted)], [a_bar, *as_]))
        ref_sq += max(0.0, _product_norm_sq(weighted, as_))
    return (err_sq / ref_sq) ** 0.5 if ref_sq > 0 else 0.0
