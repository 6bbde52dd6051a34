"""Command-line options shared by the services. Each falls back to its BRIGADE_* variable, then to
the default in `brigade.config.Settings`, so one image serves every service."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.config import Settings

_D = Settings()

RedisUrl = Annotated[str, typer.Option(
    "--redis-url", envvar="BRIGADE_REDIS_URL",
    help="Redis URL (the message queue); redis+cluster://host:port for Redis Cluster.")]
RqRedisUrl = Annotated[str, typer.Option(
    "--rq-redis-url", envvar="BRIGADE_RQ_REDIS_URL",
    help="Single-node Redis for rq's job queues (evaluations, sandboxed rewards); empty = --redis-url, "
         "which must then not be a cluster (rq cannot use one).")]
BucketUrl = Annotated[str, typer.Option("--bucket", envvar="BRIGADE_BUCKET", help="s3://bucket/prefix or file:///path.")]
ProxyAddr = Annotated[str, typer.Option("--proxy", envvar="BRIGADE_PROXY", help="Proxy address host:port (https:// for TLS).")]
Listen = Annotated[str, typer.Option("--listen", envvar="BRIGADE_LISTEN", help="Address the server listens on.")]
Token = Annotated[str, typer.Option("--token", envvar="BRIGADE_TOKEN", help="Bearer token; empty = no auth.", show_default=False)]
TlsCa = Annotated[str, typer.Option("--tls-ca", envvar="BRIGADE_TLS_CA", help="CA file to verify the proxy's TLS certificate.")]
Run = Annotated[str, typer.Option("--run", envvar="BRIGADE_RUN", help="Run id.")]
LogLevel = Annotated[str, typer.Option("--log-level", envvar="BRIGADE_LOG_LEVEL", help="debug, info, warning or error.")]
MetricsPort = Annotated[int, typer.Option(
    "--metrics-port", envvar="BRIGADE_METRICS_PORT", min=0,
    help="Serve Prometheus metrics at http://0.0.0.0:PORT/metrics; 0 = off.")]
TrackerDir = Annotated[str, typer.Option(
    "--tracker-dir", envvar="BRIGADE_TRACKER_DIR",
    help="Folder for the experiment trackers' local files (W&B offline runs, TensorBoard events).")]
SpecPath = Annotated[str, typer.Option("--spec", envvar="BRIGADE_SPEC", help="Run spec file (YAML or TOML).")]

DEFAULTS = _D
