"""`brigade rollout`: one rollout worker. torch, transformers and the worker itself are imported in
the command body, so `brigade --help` stays fast."""

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

WorkerId = Annotated[str, typer.Option("--worker-id", envvar="BRIGADE_WORKER_ID",
                                       help="This worker's id. [default: hostname-pid]", show_default=False)]
EngineName = Annotated[str, typer.Option("--engine", envvar="BRIGADE_ENGINE",
                                         help="hf (transformers, CPU or GPU) or vllm (CUDA; pip install brigade[vllm]).")]
MaxBatches = Annotated[int, typer.Option("--max-batches", help="Exit after this many completed batches; 0 = forever.")]


def rollout(
    proxy: ProxyAddr = DEFAULTS.proxy,
    token: Token = "",
    tls_ca: TlsCa = "",
    bucket: BucketUrl = DEFAULTS.bucket,
    run: Run = DEFAULTS.run,
    worker_id: WorkerId = "",
    capacity_class: CapacityClass = "spot",
    price_per_hour: Price = 0.0,
    engine: EngineName = "hf",
    max_batches: MaxBatches = 0,
    exit_when_finished: ExitWhenFinished = False,
    device: Device = "",
    redis_url: RewardRedis = "",
    reward_worker: RewardWorkers = True,
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """A rollout worker: leases prompt batches, generates groups with the leased adapter version,
    scores them, uploads the rollouts and hands the proxy their manifests.

    SIGTERM or SIGINT hands the batch in progress back (requeued at once) and exits 0.
    """
    check_fleet_flags(capacity_class, price_per_hour)
    if engine not in ("hf", "vllm"):
        raise typer.BadParameter(f"{engine!r}: use hf or vllm", param_hint="--engine")
    if max_batches < 0:
        raise typer.BadParameter("--max-batches must be >= 0")

    import asyncio
    import signal

    from brigade.log import configure_logging

    configure_logging("rollout", log_level)
    from brigade.prom import serve_metrics

    serve_metrics(metrics_port)
    from brigade_rollout.worker import Worker, WorkerConfig

    cfg = WorkerConfig(
        proxy=proxy, bucket=bucket, run=run, token=token, tls_ca=tls_ca, worker_id=worker_id or default_fleet_id(),
        capacity_class=capacity_class, price_per_hour=price_per_hour, engine=engine, max_batches=max_batches,
        exit_when_finished=exit_when_finished, device=device, redis_url=redis_url,
        reward_workers=reward_worker,
    )

    async def main() -> int:
        worker = Worker(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()

    code = asyncio.run(main())
    if code:
        raise typer.Exit(code)


def main() -> None:
    """`brigade-rollout` (and `python -m brigade_rollout`): the same command as `brigade rollout`."""
    typer.run(rollout)
