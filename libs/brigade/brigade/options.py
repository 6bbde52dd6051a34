"""Command-line options shared by the services. Each falls back to its BRIGADE_* variable, then to
the default in `brigade.config.Settings`, so one image serves every service."""

from __future__ import annotations

import os
import socket
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

# what a rollout worker and a local trainer share: the machines of the fleet
CapacityClass = Annotated[str, typer.Option("--capacity-class", envvar="BRIGADE_CAPACITY_CLASS",
                                            help="spot or on-demand, reported in every manifest.")]
Price = Annotated[float, typer.Option("--price-per-hour", envvar="BRIGADE_PRICE_PER_HOUR",
                                      help="What this machine costs per hour, for dollars per usable sample.")]
ExitWhenFinished = Annotated[bool, typer.Option(
    "--exit-when-finished/--poll-when-finished", envvar="BRIGADE_EXIT_WHEN_FINISHED",
    help="Exit 0 once the proxy says the run is finished (max_steps reached or every batch done): right for "
         "spot VMs and jobs that bill until they stop. Off by default: under a supervisor that restarts any exit "
         "(a Deployment, systemd Restart=always) an exit would only reload the model in a loop, while polling a "
         "finished run costs one call per 5 s.")]
Device = Annotated[str, typer.Option("--device", envvar="BRIGADE_DEVICE",
                                     help="cpu, cuda or cuda:N; overrides the run spec's device.")]
RewardRedis = Annotated[str, typer.Option(
    "--rq-redis-url", "--redis-url", envvar=["BRIGADE_RQ_REDIS_URL", "BRIGADE_REDIS_URL"],
    help="Single-node Redis for the rq queue of sandboxed reward functions (brigade:<run>:rewards); only needed "
         "when the run has sandboxed rewards. BRIGADE_RQ_REDIS_URL, else BRIGADE_REDIS_URL (not a cluster).")]
RewardWorkers = Annotated[bool, typer.Option(
    "--reward-worker/--no-reward-worker",
    help="Start a local rq worker subprocess for sandboxed rewards; with --no-reward-worker run "
         "`rq worker --url $BRIGADE_RQ_REDIS_URL brigade:<run>:rewards` yourself.")]


def default_fleet_id() -> str:
    """A worker's or local trainer's id when none is given: hostname-pid, unique on a machine and
    telling an operator where it runs."""
    return f"{socket.gethostname()}-{os.getpid()}"


def check_fleet_flags(capacity_class: str, price_per_hour: float) -> None:
    if capacity_class not in ("spot", "on-demand"):
        raise typer.BadParameter(f"{capacity_class!r}: use spot or on-demand", param_hint="--capacity-class")
    if price_per_hour < 0:
        raise typer.BadParameter("--price-per-hour must be >= 0", param_hint="--price-per-hour")


DEFAULTS = _D
