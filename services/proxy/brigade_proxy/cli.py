"""`brigade proxy`: the lease proxy. Heavy imports (grpc server, Redis) happen inside the command,
so `brigade --help` stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import DEFAULTS, BucketUrl, Listen, LogLevel, MetricsPort, RedisUrl, Token
from brigade_proxy.limits import Limits

TlsCert = Annotated[str, typer.Option("--tls-cert", envvar="BRIGADE_TLS_CERT", help="Server certificate (PEM); TLS when set.")]
TlsKey = Annotated[str, typer.Option("--tls-key", envvar="BRIGADE_TLS_KEY", help="Server private key (PEM).")]
Grace = Annotated[float, typer.Option("--grace", help="Seconds to drain in-flight calls on SIGTERM.")]
Pipelined = Annotated[bool, typer.Option("--pipelined/--no-pipelined",
                                         help="Run the lease scripts over brigade's pipelining Redis client "
                                              "(--no-pipelined: plain redis-py, as `brigade bench proxy` compares).")]

Processes = Annotated[int, typer.Option(
    "--processes", envvar="BRIGADE_PROXY_PROCESSES", min=1, max=64,
    help="Proxy processes sharing the listen port (SO_REUSEPORT), one event loop each. One serves about "
         "1,000 lease cycles/s flat out: give one per core beyond ~500 cycles/s. Limits apply per process; "
         "with --metrics-port P, process i serves its metrics on P+i.")]


def _limit(name: str) -> typer.models.OptionInfo:
    flag = name.replace("_", "-")
    return typer.Option(f"--{flag}", envvar=f"BRIGADE_{name.upper()}", help=Limits.doc(name) + ".",
                        rich_help_panel="Limits")


_L = Limits()
MaxMessageBytes = Annotated[int, _limit("max_message_bytes")]
MaxRequestBytes = Annotated[int, _limit("max_request_bytes")]
MaxPrompts = Annotated[int, _limit("max_prompts")]
MaxCreateRuns = Annotated[int, _limit("max_create_runs")]
MaxStreams = Annotated[int, _limit("max_streams")]
MaxStreamsPerClient = Annotated[int, _limit("max_streams_per_client")]
MaxPulls = Annotated[int, _limit("max_pulls")]
MaxPullsPerClient = Annotated[int, _limit("max_pulls_per_client")]
MaxRpcs = Annotated[int, _limit("max_rpcs")]


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
    max_message_bytes: MaxMessageBytes = _L.max_message_bytes,
    max_request_bytes: MaxRequestBytes = _L.max_request_bytes,
    max_prompts: MaxPrompts = _L.max_prompts,
    max_create_runs: MaxCreateRuns = _L.max_create_runs,
    max_streams: MaxStreams = _L.max_streams,
    max_streams_per_client: MaxStreamsPerClient = _L.max_streams_per_client,
    max_pulls: MaxPulls = _L.max_pulls,
    max_pulls_per_client: MaxPullsPerClient = _L.max_pulls_per_client,
    max_rpcs: MaxRpcs = _L.max_rpcs,
    metrics_port: MetricsPort = 0,
    processes: Processes = 1,
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
    try:
        limits = Limits(max_message_bytes=max_message_bytes, max_request_bytes=max_request_bytes,
                        max_prompts=max_prompts, max_create_runs=max_create_runs, max_streams=max_streams,
                        max_streams_per_client=max_streams_per_client, max_pulls=max_pulls,
                        max_pulls_per_client=max_pulls_per_client, max_rpcs=max_rpcs)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    serve_kwargs = dict(listen=listen, redis_url=redis_url, bucket_url=bucket, token=token, tls_cert=tls_cert,
                        tls_key=tls_key, grace=grace, pipelined=pipelined, limits=limits, metrics_port=metrics_port)
    if processes == 1:
        raise typer.Exit(serve_one(serve_kwargs))
    if listen.rsplit(":", 1)[-1] in ("0", ""):
        raise typer.BadParameter("several processes share one port: give it (--listen HOST:PORT, not port 0)",
                                 param_hint="--processes")
    from brigade_proxy.processes import serve_processes

    raise typer.Exit(serve_processes(processes, log_level, **serve_kwargs))


def serve_one(serve_kwargs: dict, reuse_port: bool = False) -> int:
    """One proxy process until SIGTERM or SIGINT; its exit code (1 for an error it printed, 2 for
    a Redis it must not serve)."""
    import uvloop

    from brigade.errors import LegacyKeys
    from brigade_proxy.server import serve

    try:
        # uvloop: the same calls cost the proxy about 6 % less CPU and 30 % less p50 latency than on
        # asyncio's own loop (`brigade bench proxy`), most of it in the loop's socket and timer handling
        uvloop.run(serve(**serve_kwargs, reuse_port=reuse_port))
    except LegacyKeys as e:  # a Redis of the key layout before hash tags: `brigade migrate-keys` first
        typer.echo(f"brigade proxy: {e}", err=True)
        return 2
    except (RuntimeError, ValueError, OSError) as e:  # the address is taken, a bad bucket URL, unreadable TLS files
        typer.echo(f"brigade proxy: {e}", err=True)
        return 1
    return 0


def main() -> None:
    """`brigade-proxy` (and `python -m brigade_proxy`): the same command as `brigade proxy`."""
    typer.run(proxy)
