"""`brigade janitor`: requeues expired leases, enforces the staleness cap; a singleton by Redis lock."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from brigade.options import DEFAULTS, LogLevel, MetricsPort, RedisUrl

Interval = Annotated[float, typer.Option("--interval", envvar="BRIGADE_JANITOR_INTERVAL", help="Seconds between sweeps.")]
LockTtl = Annotated[int, typer.Option("--lock-ttl-ms", envvar="BRIGADE_JANITOR_LOCK_TTL_MS",
                                      help="Lock lifetime; a standby takes over this long after the holder dies.")]
JanitorId = Annotated[str, typer.Option("--id", envvar="BRIGADE_JANITOR_ID", help="Name in the lock (default host:pid:random).")]


def janitor(
    redis_url: RedisUrl = DEFAULTS.redis_url,
    interval: Interval = 1.0,
    lock_ttl_ms: LockTtl = 5_000,
    janitor_id: JanitorId = "",
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """Requeue leases whose worker went silent, revoke stale leases, drop stale manifests.

    Run one or more: they elect a single active janitor through a Redis lock.
    """
    from brigade.log import configure_logging

    try:
        configure_logging("janitor", log_level)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-level") from None
    if lock_ttl_ms <= interval * 1000:
        raise typer.BadParameter("--lock-ttl-ms must be longer than --interval")
    from brigade.prom import serve_metrics
    from brigade_janitor.janitor import run_janitor

    serve_metrics(metrics_port)

    from brigade.errors import LegacyKeys

    try:
        asyncio.run(run_janitor(redis_url, interval=interval, lock_ttl_ms=lock_ttl_ms, janitor_id=janitor_id or None))
    except LegacyKeys as e:
        typer.echo(f"brigade janitor: {e}", err=True)
        raise typer.Exit(2) from None


def main() -> None:
    """`brigade-janitor` (and `python -m brigade_janitor`): the same command as `brigade janitor`."""
    typer.run(janitor)
