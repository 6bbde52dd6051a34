"""`brigade trainer`: one local trainer of a topology local_sgd run (brigade_learner.local). torch and
transformers are imported inside the command, so `brigade --help` stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import (
    DEFAULTS,
    BucketUrl,
    CapacityClass,
    Device,
    ExitWhenFinished,
    LogLevel,
    MetricsPort,
    Price,
    ProxyAddr,
    RewardRedis,
    RewardWorkers,
    Run,
    TlsCa,
    Token,
    check_fleet_flags,
    default_fleet_id,
)

TrainerId = Annotated[str, typer.Option("--trainer-id", envvar="BRIGADE_TRAINER_ID",
                                        help="This trainer's id (its leases' worker id). [default: hostname-pid]",
                                        show_default=False)]


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
    reward_worker: RewardWorkers = True,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """A local trainer (topology local_sgd): leases batches, generates them with the adapter it trains,
    takes local_sgd.local_steps GRPO steps, then uploads its LoRA factors for the aggregator.

    SIGTERM or SIGINT hands the round's leases back (requeued at once) and exits 0.
    """
    check_fleet_flags(capacity_class, price_per_hour)
    from brigade.log import configure_logging
    from brigade.prom import serve_metrics
    from brigade.service import exit_with

    log = configure_logging("trainer", log_level)
    serve_metrics(metrics_port)
    from brigade_learner.local import TrainerConfig, serve

    cfg = TrainerConfig(proxy=proxy, bucket=bucket, run=run, token=token, tls_ca=tls_ca,
                        trainer_id=trainer_id or default_fleet_id(), capacity_class=capacity_class,
                        price_per_hour=price_per_hour, device=device, redis_url=redis_url,
                        reward_workers=reward_worker, exit_when_finished=exit_when_finished)
    exit_with(lambda: serve(cfg), log, proxy, signal_is_failure=False)


def main() -> None:
    """`brigade-trainer`: the same command as `brigade trainer`."""
    typer.run(trainer)
