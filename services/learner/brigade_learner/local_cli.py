"""`brigade trainer`: one local trainer of a topology local_sgd run (brigade_learner.local). torch and
transformers are imported inside the command, so `brigade --help` stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import DEFAULTS, BucketUrl, LogLevel, MetricsPort, ProxyAddr, Run, TlsCa, Token

TrainerId = Annotated[str, typer.Option("--trainer-id", envvar="BRIGADE_TRAINER_ID",
                                        help="This trainer's id (its leases' worker id). [default: hostname-pid]",
                                        show_default=False)]
CapacityClass = Annotated[str, typer.Option("--capacity-class", envvar="BRIGADE_CAPACITY_CLASS",
                                            help="spot or on-demand, reported in every contribution.")]
Price = Annotated[float, typer.Option("--price-per-hour", envvar="BRIGADE_PRICE_PER_HOUR",
                                      help="What this machine costs per hour.")]
Device = Annotated[str, typer.Option("--device", envvar="BRIGADE_DEVICE",
                                     help="cpu, cuda or cuda:N; overrides the run spec's device.")]
ExitWhenFinished = Annotated[bool, typer.Option(
    "--exit-when-finished/--poll-when-finished", envvar="BRIGADE_EXIT_WHEN_FINISHED",
    help="Exit 0 once the run is finished (spot VMs and jobs); off by default, as for rollout workers.")]
RewardRedis = Annotated[str, typer.Option(
    "--redis-url", envvar="BRIGADE_REDIS_URL",
    help="Redis for the rq queue of sandboxed reward functions; only needed when the run has sandboxed rewards.")]


def trainer(
    proxy: ProxyAddr = DEFAULTS.proxy,
    token: Token = "",
    tls_ca: TlsCa = "",
    bucket: BucketUrl = DEFAULTS.bucket,
    run: Run = DEFAULTS.run,
    trainer_id: TrainerId = "",
    capacity_class: CapacityClass = "spot",
    price_per_hour: Price = 0.0,
    device: Device = "",
    exit_when_finished: ExitWhenFinished = False,
    redis_url: RewardRedis = "",
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """A local trainer (topology local_sgd): leases batches, generates them with the adapter it trains,
    takes local_sgd.local_steps GRPO steps, then uploads its LoRA factors for the aggregator.

    SIGTERM or SIGINT hands the round's leases back (requeued at once) and exits 0.
    """
    if capacity_class not in ("spot", "on-demand"):
        raise typer.BadParameter(f"{capacity_class!r}: use spot or on-demand", param_hint="--capacity-class")
    if price_per_hour < 0:
        raise typer.BadParameter("--price-per-hour must be >= 0")
    import asyncio

    import grpc

    from brigade.config import ConfigError
    from brigade.log import configure_logging
    from brigade.prom import serve_metrics
    from brigade.rpc import describe_rpc_error

    log = configure_logging("trainer", log_level)
    serve_metrics(metrics_port)
    from brigade_learner.local import TrainerConfig, default_trainer_id, serve

    cfg = TrainerConfig(proxy=proxy, bucket=bucket, run=run, token=token, tls_ca=tls_ca,
                        trainer_id=trainer_id or default_trainer_id(), capacity_class=capacity_class,
                        price_per_hour=price_per_hour, device=device, redis_url=redis_url,
                        exit_when_finished=exit_when_finished)
    try:
        asyncio.run(serve(cfg))
    except grpc.aio.AioRpcError as e:
        log.error("proxy_error", error=describe_rpc_error(e, proxy))
        raise typer.Exit(1) from None
    except ConfigError as e:
        log.error("config_error", error=str(e))
        raise typer.Exit(2) from None


def main() -> None:
    """`brigade-trainer`: the same command as `brigade trainer`."""
    typer.run(trainer)
