"""The learner's step metrics under TRL's names, where users read them: the experiment trackers and
`metrics.jsonl`. TRL's GRPOTrainer logs `reward`, `reward_std`, `rewards/<fn>/mean`, `kl`,
`entropy`, `clip_ratio/*`, `completions/*`, `num_tokens`, `grad_norm`, `learning_rate`; a
dashboard built for it reads a brigade run the same way. brigade's own figures (staleness,
rejection rate, learner idle, dollars per usable sample, ...) keep their names. Inside brigade
(Redis, the bucket's metrics objects, `brigade ctl metrics`, the plots) the learner's names stay:
docs/observability.md has the table, and what changed for runs logged before.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# learner name -> TRL's
RENAMED = {
    "reward_mean": "reward",
    "reward_group_std": "reward_std",         # TRL's: the mean of the per-group stds
    "reward_std": "reward_std_batch",         # brigade's: the std over the whole batch
    "lr": "learning_rate",
    "clip_low_frac": "clip_ratio/low_mean",
    "clip_high_frac": "clip_ratio/high_mean",
    "completion_length_mean": "completions/mean_length",
    "completion_length_min": "completions/min_length",
    "completion_length_max": "completions/max_length",
    "completion_clipped_frac": "completions/clipped_ratio",
    "tokens_total": "num_tokens",
}
REWARD_PREFIX = "reward/"  # the learner's reward/<spec function>/<stat>


def trl_metrics(m: Mapping[str, Any]) -> dict[str, Any]:
    """One step's metrics with TRL's names; the rest as they are."""
    out: dict[str, Any] = {}
    for key, value in m.items():
        if key.startswith(REWARD_PREFIX) and key.count("/") >= 2:
            function, stat = key[len(REWARD_PREFIX):].rsplit("/", 1)
            out[f"rewards/{reward_name(function)}/{stat}"] = value
        else:
            out[RENAMED.get(key, key)] = value
    low, high = out.get("clip_ratio/low_mean"), out.get("clip_ratio/high_mean")
    if isinstance(low, int | float) and isinstance(high, int | float):
        out["clip_ratio/region_mean"] = low + high
    return out


def reward_name(function: str) -> str:
    """What TRL calls a reward function in its metrics: the function's own name (`module:correct`
    -> `correct`), or a reward model's last path part."""
    return function.rsplit(":", 1)[-1].rstrip("/").rsplit("/", 1)[-1]
