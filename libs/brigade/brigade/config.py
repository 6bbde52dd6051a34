"""Process settings, one layer for every service.

Where Redis, the bucket and the proxy are, the token, TLS: command-line flags, which fall back to
`BRIGADE_*` environment variables (typer's `envvar=`), which fall back to the defaults below. Run
parameters (GRPO, sampling, LoRA, staleness) are not settings: they live in a run spec, declared in
`brigade.spec` and read from YAML or TOML by `brigade.spec_file`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any


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
