"""`brigade proxy`: the lease proxy. Heavy imports (grpc server, Redis) happen inside the command,
so `brigade --help` stays fast."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from brigade.options import DEFAULTS, BucketUrl, Listen, LogLevel, MetricsPort, RedisUrl, Token

TlsCert = Annotated[str, typer.Option("--tls-cert", envvar="BRIGADE_TLS_CERT", help="Server certificate (PEM); TLS when set.")]
TlsKey = Annotated[str, typer.Option("--tls-key", envvar="BRIGADE_TLS_KEY", help="Server private key (PEM).")]
Grace = Annotated[float, typer.Option("--grace", help="Seconds to drain in-flight calls on SIGTERM.")]
Pipelined = Annotated[bool, typer.Option("--pipelined/--no-pipelined",
                                         help="Run the lease scripts over brigade's pipelining Redis client "
                                              "(--no-pipelined: plain redis-py, as `brigade bench proxy` compares).")]


def proxy(
    listen: Listen = DEFAULTS.listen,
    redis_url: RedisUrl = DEFAULTS.redis_url,
    bucket: BucketUrl = DEFAULTS.bucket,
    token: Token = "",
    tls_cert: TlsCert = "",
    tls_key: TlsKey = "",
    log_level: LogLevel = DEFAULTS.log_level,
    grace: Grace = 5.0,
    pipelined: Pipelined = True,
    metrics_port: MetricsPort = 0,
) -> None:
    """The lease proxy: hands out prompt batches, takes rollout manifests, feeds the learner.

    Stateless (everything is in Redis); run as many replicas as you like behind one address.
    `--bucket ''` keeps run specs in Redis only.
    """
    from brigade.log import configure_logging

    try:
        configure_logging("proxy", log_level)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--log-level") from None
    if bool(tls_cert) != bool(tls_key):
        raise typer.BadParameter("TLS needs both --tls-cert and --tls-key (BRIGADE_TLS_CERT / BRIGADE_TLS_KEY)")
    from brigade_proxy.server import serve

    try:
        asyncio.run(serve(listen, redis_url, bucket_url=bucket, token=token, tls_cert=tls_cert, tls_key=tls_key,
                          grace=grace, pipelined=pipelined, metrics_port=metrics_port))
    except (RuntimeError, ValueError, OSError) as e:  # the address is taken, a bad bucket URL, unreadable TLS files
        typer.echo(f"brigade proxy: {e}", err=True)
        raise typer.Exit(1) from None


def main() -> None:
    """`brigade-proxy` (and `python -m brigade_proxy`): the same command as `brigade proxy`."""
    typer.run(proxy)
