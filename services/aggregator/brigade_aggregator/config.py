"""The aggregator's config: its settings, one field each, from which `brigade aggregator`'s flags
and BRIGADE_* variables come (`brigade.settings.command`). Light to import: the CLI builds its
command from it before torch is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from brigade.settings import (
    BUCKET,
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT,
    METRICS_TOKEN,
    PROXY,
    RUN,
    STATE_DIR,
    TLS_CA,
    TOKEN,
    setting,
)


@dataclass
class AggregatorConfig:
    proxy: str = PROXY.field()
    token: str = TOKEN.field()
    tls_ca: str = TLS_CA.field()
    bucket: str = BUCKET.field()
    run: str = RUN.field()
    aggregator_id: str = setting("aggregator", "Consumer name at the proxy; keep it stable across restarts "
                                 "so pending contributions come back.", env="BRIGADE_AGGREGATOR_ID")
    keep_rounds: int = setting(3, "Round records kept in the bucket (the newest); older ones are deleted. "
                               "0 = keep all.", env="BRIGADE_KEEP_ROUNDS", low=0)
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()
    pull_wait_ms: int = 1000  # not a flag
