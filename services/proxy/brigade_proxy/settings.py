"""`brigade proxy`'s settings: its flags, BRIGADE_* variables and config, one field each."""

from __future__ import annotations

from dataclasses import dataclass

from brigade.settings import (
    BUCKET,
    LISTEN,
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT,
    METRICS_TOKEN,
    REDIS_URL,
    STATE_DIR,
    TLS_CERT,
    TLS_KEY,
    TOKEN,
    group,
    setting,
)
from brigade_proxy.limits import Limits


@dataclass(frozen=True)
class ProxySettings:
    listen: str = LISTEN.field()
    redis_url: str = REDIS_URL.field()
    bucket: str = BUCKET.field()
    token: str = TOKEN.field(doc="Bearer token; every caller holding it has every role (one-token mode, for a "
                             "laptop). Empty = no auth, unless --tokens-file. Not with --tokens-file.")
    tokens_file: str = setting(
        "", "File of per-role tokens, one `role[,role...] name token` a line (docs/threat-model.md, Roles and "
        "tokens); re-read on SIGHUP and when it changes. Not with --token.", env="BRIGADE_TOKENS_FILE")
    tls_cert: str = TLS_CERT.field()
    tls_key: str = TLS_KEY.field()
    log_level: str = LOG_LEVEL.field()
    grace: float = setting(5.0, "Seconds to drain in-flight calls on SIGTERM.")
    pipelined: bool = setting(True, "Run the lease scripts over brigade's pipelining Redis client "
                              "(--no-pipelined: plain redis-py, as `brigade bench proxy` compares).")
    limits: Limits = group(Limits, panel="Limits")
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field(default="", doc="Address the metrics endpoint binds; empty = the host "
                                           "of --listen (0.0.0.0 for a Prometheus on another host or container).")
    metrics_token: str = METRICS_TOKEN.field()
    processes: int = setting(
        1, "Proxy processes sharing the listen port (SO_REUSEPORT), one event loop each. One serves about "
        "1,000 lease cycles/s flat out: give one per core beyond ~500 cycles/s. Limits apply per process; "
        "with --metrics-port P, process i serves its metrics on P+i.", env="BRIGADE_PROXY_PROCESSES",
        low=1, high=64)
