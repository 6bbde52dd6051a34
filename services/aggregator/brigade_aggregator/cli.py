"""`brigade aggregator`: the aggregator of a topology local_sgd run (one per run). torch is imported
inside the command, so `brigade --help` stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import DEFAULTS, BucketUrl, LogLevel, MetricsPort, ProxyAddr, Run, TlsCa, Token

AggregatorId = Annotated[str, typer.Option(
    "--aggregator-id", envvar="BRIGADE_AGGREGATOR_ID",
    help="Consumer name at the proxy; keep it stable across restarts so pending contributions come back.")]
KeepRounds = Annotated[int, typer.Option(
    "--keep-rounds", envvar="BRIGADE_KEEP_ROUNDS", min=0,
    help="Round records kept in the bucket (the newest); older ones are deleted. 0 = keep all.")]


def aggregator(
    proxy: ProxyAddr = DEFAULTS.proxy,
    token: Token = "",
    tls_ca: TlsCa = "",
    bucket: BucketUrl = DEFAULTS.bucket,
    run: Run = DEFAULTS.run,
    aggregator_id: AggregatorId = "aggregator",
    keep_rounds: KeepRounds = 3,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """The aggregator (topology local_sgd): merges the local trainers' contributions of each round into
    the next global adapter version and publishes it.

    Resumes from its newest round record in the bucket. Exits 0 after max_steps rounds; 128 + the
    signal's number when SIGTERM or SIGINT stopped it first.
    """
    from brigade.log import configure_logging
    from brigade.prom import serve_metrics
    from brigade.service import exit_with

    log = configure_logging("aggregator", log_level)
    serve_metrics(metrics_port)
    from brigade_aggregator.aggregator import AggregatorConfig, serve

    cfg = AggregatorConfig(proxy=proxy, bucket=bucket, run=run, token=token, tls_ca=tls_ca,
                           aggregator_id=aggregator_id, keep_rounds=keep_rounds)
    exit_with(lambda: serve(cfg), log, proxy)


def main() -> None:
    """`brigade-aggregator` (and `python -m brigade_aggregator`): the same command as `brigade aggregator`."""
    typer.run(aggregator)
