"""One settings layer for every service.

Process settings (where Redis, the bucket and the proxy are; the token; TLS) come from command-line
flags, which fall back to `BRIGADE_*` environment variables (typer's `envvar=`), which fall back to
the defaults below. Run parameters (GRPO, sampling, LoRA, staleness) live in a run spec file, YAML
or TOML, parsed into the `RunSpec` protobuf that travels with the run, and validated here with
messages that name the field and the allowed values.
"""

from __future__ import annotations

import copy
import os
import re
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml
from google.protobuf import json_format

from brigade.v1 import brigade_pb2 as pb

RUN_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")


class ConfigError(ValueError):
    """A bad setting or run spec; the message says which field and why."""


@dataclass
class Settings:
    """Where the shared pieces are. Each field has a flag and an env var `BRIGADE_<FIELD>`."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    bucket: str = "file://./brigade-runs/bucket"
    proxy: str = "127.0.0.1:50051"
    listen: str = "127.0.0.1:50051"
    token: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    tls_ca: str = ""
    run: str = "demo"
    log_level: str = "info"

    @classmethod
    def from_env(cls, **overrides: Any) -> Settings:
        """Defaults, then BRIGADE_* variables, then explicit overrides (flags) that are not None."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            env = os.environ.get(f"BRIGADE_{f.name.upper()}")
            if env is not None:
                values[f.name] = env
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# The defaults of a run; a spec file overrides any subset. Kept as a dict so the file format and
# the defaults read the same.
DEFAULT_SPEC: dict[str, Any] = {
    "run_id": "demo",
    "model": "demo",
    "dtype": "float32",
    "device": "auto",
    "dataset": "demo",
    "eval_dataset": "demo:heldout",
    "prompts_per_batch": 8,
    "batches_per_step": 1,
    "max_steps": 0,
    "publish_every": 1,
    "checkpoint_every": 1,
    "seed": 0,
    "adapter_payload": "bf16",
    "eval_every": 5,
    "sync": False,
    "epochs": 0,
    "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["all-linear"]},
    "sampling": {"group_size": 8, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 32},
    "grpo": {
        "learning_rate": 1e-4,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "beta": 0.0,
        "loss_agg": "dapo",
        "scale_rewards": "group",
        "max_grad_norm": 1.0,
        "micro_batch_tokens": 4096,
        "tis_cap": 0.0,
        "recompute_logprobs": False,
        "lr_schedule": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
    },
    "staleness": {"max_staleness": 4, "lease_seconds": 60, "max_attempts": 3},
    "rewards": [{"function": "demo_sum", "weight": 1.0, "sandboxed": False, "timeout_s": 10.0}],
}

CHOICES = {
    "dtype": {"float32", "bfloat16", "float16"},
    "device": {"cpu", "cuda", "auto"},
    "adapter_payload": {"bf16", "int8"},
    "grpo.loss_agg": {"grpo", "dapo", "dr_grpo"},
    "grpo.scale_rewards": {"group", "batch", "none"},
    "grpo.lr_schedule": {"constant", "linear", "cosine"},
}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def read_spec_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"cannot read run spec {path}: {e.strerror}") from e
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"run spec {path} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"run spec {path} must be a mapping of fields, got {type(data).__name__}")
    return data


def build_spec(overrides: dict[str, Any] | None = None, path: str | Path | None = None) -> pb.RunSpec:
    """Defaults, then the file at `path`, then `overrides`; parsed and validated."""
    data = DEFAULT_SPEC
    if path is not None:
        data = _merge(data, read_spec_file(path))
    if overrides:
        data = _merge(data, overrides)
    # a list replaces the default list whole, so fill each reward's missing fields here
    reward_defaults = DEFAULT_SPEC["rewards"][0] | {"function": ""}
    data = dict(data, rewards=[_merge(reward_defaults, r) if isinstance(r, dict) else r for r in data.get("rewards", [])])
    try:
        spec = json_format.ParseDict(data, pb.RunSpec())
    except json_format.ParseError as e:
        raise ConfigError(f"run spec: {e}") from e
    validate_spec(spec)
    return spec


def spec_to_dict(spec: pb.RunSpec) -> dict[str, Any]:
    return json_format.MessageToDict(spec, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _short(value: str, limit: int = 64) -> str:
    """A value quoted for an error message, cut short: hostile input must not bloat the message
    (gRPC refuses status details larger than its metadata limit)."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def validate_spec(spec: pb.RunSpec) -> None:
    problems: list[str] = []

    def need(ok: bool, field: str, msg: str) -> None:
        if not ok:
            problems.append(f"{field}: {msg}")

    need(bool(RUN_ID_RE.match(spec.run_id)), "run_id",
         f"{_short(spec.run_id)} must be 1-63 chars of a-z 0-9 . _ - starting with a letter or digit")
    need(bool(spec.model), "model", "is required (a Hugging Face id, a local folder, a bucket URI, or 'demo')")
    for name, allowed in CHOICES.items():
        section, _, attr = name.rpartition(".")
        value = getattr(getattr(spec, section) if section else spec, attr)
        need(value in allowed, name, f"{_short(value)} is not one of {sorted(allowed)}")
    need(spec.prompts_per_batch >= 1, "prompts_per_batch", "must be >= 1")
    need(spec.batches_per_step >= 1, "batches_per_step", "must be >= 1")
    need(spec.publish_every >= 1, "publish_every", "must be >= 1")
    need(spec.checkpoint_every >= 1, "checkpoint_every", "must be >= 1")
    need(spec.lora.rank >= 1, "lora.rank", "must be >= 1")
    need(spec.lora.alpha > 0, "lora.alpha", "must be > 0")
    need(0 <= spec.lora.dropout < 1, "lora.dropout", "must be in [0, 1)")
    need(len(spec.lora.target_modules) > 0, "lora.target_modules", "must name at least one module or 'all-linear'")
    s = spec.sampling
    need(s.group_size >= 2, "sampling.group_size", "must be >= 2 (GRPO compares completions within a group)")
    need(s.temperature > 0, "sampling.temperature", "must be > 0")
    need(0 < s.top_p <= 1, "sampling.top_p", "must be in (0, 1]")
    need(s.max_new_tokens >= 1, "sampling.max_new_tokens", "must be >= 1")
    g = spec.grpo
    need(g.learning_rate > 0, "grpo.learning_rate", "must be > 0")
    need(0 <= g.eps_low < 1, "grpo.eps_low", "must be in [0, 1)")
    need(g.eps_high >= 0, "grpo.eps_high", "must be >= 0")
    need(g.beta >= 0, "grpo.beta", "must be >= 0")
    need(g.max_grad_norm >= 0, "grpo.max_grad_norm", "must be >= 0 (0 = no clipping)")
    need(g.micro_batch_tokens >= 1, "grpo.micro_batch_tokens", "must be >= 1")
    need(g.tis_cap >= 0, "grpo.tis_cap", "must be >= 0 (0 = off)")
    st = spec.staleness
    need(st.lease_seconds >= 1, "staleness.lease_seconds", "must be >= 1")
    need(st.max_attempts >= 1, "staleness.max_attempts", "must be >= 1")
    need(len(spec.rewards) > 0, "rewards", "at least one reward function is required")
    for i, r in enumerate(spec.rewards):
        need(bool(r.function), f"rewards[{i}].function", "is required")
        need(r.timeout_s > 0, f"rewards[{i}].timeout_s", "must be > 0")
    for name in ("learning_rate", "eps_low", "eps_high", "beta", "max_grad_norm", "tis_cap"):
        value = getattr(g, name)
        need(value == value and abs(value) != float("inf"), f"grpo.{name}", "must be a finite number")
    if problems:
        raise ConfigError("invalid run spec:\n  " + "\n  ".join(problems))
