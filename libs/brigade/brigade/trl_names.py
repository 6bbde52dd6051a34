"""TRL's GRPOConfig names in a brigade run spec: a TRL user's settings, spelled as TRL spells them,
mean the same here (a spec file and `brigade.GRPOConfig` both go through `from_trl_names`).

Every TRL name falls in one of four tables:

- RENAMED: brigade has the setting under another name (`num_generations` is `sampling.group_size`).
- BATCH: TRL counts completions per device and accumulation step; brigade counts prompts per
  leased batch. `per_device_train_batch_size x gradient_accumulation_steps / num_generations`
  prompts make one learner step (one process: brigade's learner is one).
- NO_EFFECT: settings of TRL's machinery that brigade does by itself or differently (logging,
  saving, data loading; every `vllm_*`): accepted and ignored, each with why.
- REFUSED: settings brigade has no equivalent of; accepted only at TRL's default value, otherwise
  refused with why, so a port never trains differently in silence.

A name in none of them, and in no spec section, is the spec's usual "no field named ..." error.
"""

from __future__ import annotations

from typing import Any

from brigade.config import ConfigError
from brigade.spec import BY_PATH

RENAMED = {
    "run_name": "run_id",
    "num_generations": "sampling.group_size",
    "max_completion_length": "sampling.max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "learning_rate": "grpo.learning_rate",
    "lr_scheduler_type": "grpo.lr_schedule",
    "warmup_steps": "grpo.warmup_steps",
    "weight_decay": "grpo.weight_decay",
    "max_grad_norm": "grpo.max_grad_norm",
    "epsilon": "grpo.eps_low",
    "epsilon_high": "grpo.eps_high",
    "loss_type": "grpo.loss_agg",
    "scale_rewards": "grpo.scale_rewards",
    "beta": "grpo.beta",
    "num_train_epochs": "epochs",
    "save_steps": "checkpoint_every",
    "eval_steps": "eval_every",
    "model_revision": "revision",
    "tools": "environment.tools",
}
# TRL spells some values differently
VALUES = {
    "scale_rewards": {True: "group", False: "none"},
    "lr_scheduler_type": {"constant_with_warmup": "constant"},  # brigade's constant schedule warms up too
}
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")
# set through other names: the spec's own, or the trainer's arguments
SPECIAL = {
    "reward_weights": "one weight per reward function, into rewards[i].weight",
    "bf16": "dtype: bfloat16", "fp16": "dtype: float16", "use_cpu": "device: cpu",
    "model_init_kwargs": "revision, trust_remote_code and dtype, into the spec's fields of those names",
    "environment_factory": "environment.factory (a class's import path) or environment.factories (a mapping)",
    "max_tool_calling_iterations": "environment.max_turns, one more (a model turn follows each tool round)",
}
# model_init_kwargs keys -> spec fields (any other key is refused: every service loads the model its way)
MODEL_INIT = {"revision": "revision", "trust_remote_code": "trust_remote_code", "dtype": "dtype",
              "torch_dtype": "dtype"}
NO_EFFECT = {
    "output_dir": "GRPOTrainer's run folder (brigade up's --out); not part of the spec",
    "logging_steps": "the learner logs every step", "logging_strategy": "the learner logs every step",
    "logging_first_step": "the learner logs every step", "logging_dir": "trackers write under the run's folder",
    "save_strategy": "the learner checkpoints every checkpoint_every steps and publishes every version",
    "save_total_limit": "the learner keeps its newest checkpoints (--keep-checkpoints)",
    "eval_strategy": "the evaluator scores every eval_every-th version (eval_steps)",
    "per_device_eval_batch_size": "the evaluator batches by itself", "disable_tqdm": "up prints one line a step",
    "dataloader_num_workers": "prompts are cut into batches by the proxy", "dataloader_pin_memory": "no data loader",
    "remove_unused_columns": "every dataset column reaches the reward functions",
    "shuffle_dataset": "the prompt order is shuffled by the run's seed",
    "log_level": "services log at --log-level", "overwrite_output_dir": "a run folder is never reused",
    "log_completions": "the rollouts' decoded text is in the bucket beside each batch",
    "num_completions_to_print": "the rollouts' decoded text is in the bucket beside each batch",
    "hub_token": "huggingface_hub reads HF_TOKEN", "hub_private_repo": "brigade export --private",
    "hub_strategy": "the final adapter is pushed once, at the end", "do_train": "GRPOTrainer.train() trains",
    "do_eval": "the evaluator runs when eval_every > 0",
}
# TRL name -> (TRL's default, why brigade has no equivalent). Accepted at the default only.
REFUSED: dict[str, tuple[Any, str]] = {
    "use_vllm": (False, "the rollout workers choose their engine (brigade rollout --engine vllm), not the spec"),
    "num_iterations": (1, "brigade's learner takes one optimizer step per batch; staleness, not reuse, is "
                          "what its off-policy correction (tis_cap) covers"),
    "importance_sampling_level": ("token", "brigade's ratios are per token"),
    "mask_truncated_completions": (False, "truncated completions are trained on"),
    "delta": (None, "no two-sided clipping bound; grpo.tis_cap truncates importance weights"),
    "gradient_checkpointing": (False, "the learner does not checkpoint activations"),
    "sync_ref_model": (False, "the reference is the base model (the adapter switched off)"),
    "top_entropy_quantile": (1.0, "every completion token is trained on"),
    "entropy_coef": (0.0, "no entropy bonus"),
    "repetition_penalty": (1.0, "sampling has temperature, top_p and top_k only"),
    "min_p": (None, "sampling has temperature, top_p and top_k only"),
    "generation_kwargs": (None, "sampling has temperature, top_p and top_k only"),
    "steps_per_generation": (None, "workers generate ahead as admission allows (staleness.lookahead)"),
    "generation_batch_size": (None, "workers generate one leased batch at a time"),
    "max_prompt_length": (None, "prompts are not truncated"),
    "multi_objective_aggregation": ("sum_then_normalize", "rewards are summed with their weights, then normalized"),
    "use_liger_kernel": (False, "no Liger kernels"),
    "torch_compile": (False, "the learner does not compile"),
    "optim": ("adamw_torch", "the learner's optimizer is AdamW"),
    "adam_beta1": (0.9, "AdamW with torch's betas"), "adam_beta2": (0.999, "AdamW with torch's betas"),
    "adam_epsilon": (1e-8, "AdamW with torch's epsilon"),
    "warmup_ratio": (0.0, "give warmup_steps"),
}

TRL_NAMES = (*RENAMED, *BATCH, *SPECIAL, *NO_EFFECT, *REFUSED)
# TRL's vllm_* settings tune its in-process vLLM: a brigade rollout worker's engine has its own flags
VLLM = "vllm_"


def from_trl_names(data: dict[str, Any]) -> dict[str, Any]:
    """`data` (a spec mapping, top level) with TRL's names turned into brigade's; ConfigError
    listing every name refused, or given both ways with two different values."""
    out = {k: v for k, v in data.items()}
    problems: list[str] = []
    for name in [k for k in data if (k in TRL_NAMES and k not in BATCH) or k.startswith(VLLM)]:
        value = out.pop(name)
        if name in NO_EFFECT or name.startswith(VLLM):
            continue
        if name in REFUSED:
            default, why = REFUSED[name]
            if not (value == default or (default is None and value in (None, [], {}, ""))):
                problems.append(f"{name}: TRL's {name}={value!r} has no brigade equivalent ({why})")
            continue
        if name in SPECIAL:
            _special(name, value, out, problems)
            continue
        value = VALUES.get(name, {}).get(value, value) if isinstance(value, bool | str) else value
        _set(out, RENAMED[name], value, name, problems)
    _batch(data, out, problems)
    if problems:
        raise ConfigError("\n".join(problems))
    return out


def _set(out: dict, path: str, value: Any, trl_name: str, problems: list[str]) -> None:
    """Put `value` at the dotted `path`, unless the spec already says something else there."""
    *sections, leaf = path.split(".")
    holder = out
    for section in sections:  # a section that is not a mapping is the spec parser's error to report
        holder = holder.setdefault(section, {})
        if not isinstance(holder, dict):
            return
    if leaf in holder and holder[leaf] != value:
        problems.append(f"{trl_name}: TRL's name for {path}, which is also given as {holder[leaf]!r}: give one")
        return
    holder[leaf] = value


def _special(name: str, value: Any, out: dict, problems: list[str]) -> None:
    if name == "reward_weights":
        if value is None:
            return
        rewards = out.get("rewards")
        try:
            out["rewards"] = weighted_rewards(rewards if isinstance(rewards, list) else [], value)
        except ConfigError as e:
            problems.append(str(e))
    elif name in ("bf16", "fp16") and value:
        _set(out, "dtype", "bfloat16" if name == "bf16" else "float16", name, problems)
    elif name == "use_cpu" and value:
        _set(out, "device", "cpu", name, problems)
    elif name == "environment_factory" and value:
        _set(out, "environment.factories" if isinstance(value, dict) else "environment.factory", value, name, problems)
    elif name == "max_tool_calling_iterations" and value is not None:
        _set(out, "environment.max_turns", int(value) + 1, name, problems)
    elif name == "model_init_kwargs" and value:
        for key, v in dict(value).items():
            if key not in MODEL_INIT:
                problems.append(f"model_init_kwargs.{key}: brigade's services load the model themselves; only "
                                f"{', '.join(MODEL_INIT)} carry over")
            else:
                _set(out, MODEL_INIT[key], str(v).removeprefix("torch.") if "dtype" in key else v, name, problems)


def weighted_rewards(rewards: list, weights: Any) -> list:
    """`rewards` (spec entries) with TRL's reward_weights, one per function: a spec file's `rewards`
    list, or GRPOTrainer's reward_funcs."""
    if len(weights) != len(rewards):
        raise ConfigError(f"reward_weights: {len(weights)} weights for {len(rewards)} reward functions")
    return [dict(r, weight=float(w)) if isinstance(r, dict) else r for r, w in zip(rewards, weights, strict=True)]


def _batch(data: dict, out: dict, problems: list[str]) -> None:
    """TRL's batch arithmetic: completions per device and accumulation step -> prompts per step."""
    per_device, accumulation = data.get(BATCH[0]), data.get(BATCH[1], 1)
    for name in BATCH:
        out.pop(name, None)
    if per_device is None:
        if data.get(BATCH[1], 1) != 1:
            problems.append(f"{BATCH[1]}: needs {BATCH[0]} (TRL counts completions per device and step)")
        return
    group = out.get("sampling", {}).get("group_size", BY_PATH["sampling.group_size"].default)
    completions = int(per_device) * int(accumulation)
    if completions % group:
        problems.append(f"{BATCH[0]} x {BATCH[1]} = {completions} completions is not a multiple of "
                        f"num_generations ({group}), as TRL requires too")
        return
    prompts = completions // group
    if "prompts_per_batch" in out:  # brigade's batch size given too: the step is several batches
        per_batch = out["prompts_per_batch"]
        if prompts % per_batch:
            problems.append(f"{BATCH[0]}: {prompts} prompts a step is not a multiple of prompts_per_batch ({per_batch})")
            return
        _set(out, "batches_per_step", prompts // per_batch, BATCH[0], problems)
    else:  # one batch a step, unless brigade's batches_per_step splits the step
        batches = out.setdefault("batches_per_step", 1)
        if prompts % batches:
            problems.append(f"{BATCH[0]}: {prompts} prompts a step do not split into batches_per_step ({batches})")
            return
        _set(out, "prompts_per_batch", prompts // batches, BATCH[0], problems)
