"""`brigade janitor`: requeues expired leases, enforces the staleness cap; a singleton by Redis lock."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import typer

from brigade.settings import (
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT,
    METRICS_TOKEN,
    REDIS_URL,
    STATE_DIR,
    command,
    setting,
)


@dataclass(frozen=True)
class JanitorSettings:
    redis_url: str = REDIS_URL.field()
    interval: float = setting(1.0, "Seconds between sweeps.", env="BRIGADE_JANITOR_INTERVAL")
    lock_ttl_ms: int = setting(5_000, "Lock lifetime; a standby takes over this long after the holder dies.",
                               env="BRIGADE_JANITOR_LOCK_TTL_MS")
    janitor_id: str = setting("", "Name in the lock (default host:pid:random).", flag="--id",
                              env="BRIGADE_JANITOR_ID")
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()


@command(JanitorSettings)
def janitor(s: JanitorSettings) -> None:
    """Requeue leases whose worker went silent, revoke stale leases, drop stale manifests.

    Run one or more: they elect a single active janitor through a Redis lock. It has no bucket: it
    writes no object, so it has no create-only writes to check. Exits 0 on SIGTERM or SIGINT; 1 when
    it crashed (Redis away is an outage: never a crash loop), 2 on a Redis it must not serve, 3 when
    it crashed the same way 3 times in a row.
    """
    from brigade.log import configure_logging

    try:
        configure_logging("janitor", s.log_level)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-level") from None
    if s.lock_ttl_ms <= s.interval * 1000:
        raise typer.BadParameter("--lock-ttl-ms must be longer than --interval")
    from brigade.service import crash_journal

    journal = crash_journal("janitor", "", s.state_dir, s.janitor_id)  # a standby beside it: a journal each
    from brigade.prom import serve_metrics
    from brigade_janitor.janitor import run_janitor

    serve_metrics(s.metrics_port, s.metrics_host, s.metrics_token)

    from brigade.errors import LegacyKeys

    def main() -> int:
        try:
            asyncio.run(run_janitor(s.redis_url, interval=s.interval, lock_ttl_ms=s.lock_ttl_ms,
                                    janitor_id=s.janitor_id or None))
        except LegacyKeys as e:
            typer.echo(f"brigade janitor: {e}", err=True)
            return 2
        return 0

    code = journal.run(main)
    if code:
        raise typer.Exit(code)


def main() -> None:
    """`brigade-janitor` (and `python -m brigade_janitor`): the same command as `brigade janitor`."""
    typer.run(janitor)
