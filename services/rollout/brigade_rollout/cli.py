"""`brigade rollout`: one rollout worker. torch, transformers and the worker itself are imported in
the command body, so `brigade --help` stays fast."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import DEFAULTS, BucketUrl, LogLevel, MetricsPort, ProxyAddr, Run, TlsCa, Token

WorkerId = Annotated[str, typer.Option("--worker-id", envvar="BRIGADE_WORKER_ID",
                                       help="This worker's id. [default: hostname-pid]", show_default=False)]
CapacityClass = Annotated[str, typer.Option("--capacity-class", envvar="BRIGADE_CAPACITY_CLASS",
                                            help="spot or on-demand, reported in every manifest.")]
Price = Annotated[float, typer.Option("--price-per-hour", envvar="BRIGADE_PRICE_PER_HOUR",
                                      help="What this machine costs per hour, for dollars per usable sample.")]
EngineName = Annotated[str, typer.Option("--engine", envvar="BRIGADE_ENGINE",
                                         help="hf (transformers, CPU or GPU) or vllm (CUDA; pip install brigade[vllm]).")]
MaxBatches = Annotated[int, typer.Option("--max-batches", help="Exit after this many completed batches; 0 = forever.")]
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
    if capacity_class not in ("spot", "on-demand"):
        raise typer.BadParameter(f"{capacity_class!r}: use spot or on-demand", param_hint="--capacity-class")
    if engine not in ("hf", "vllm"):
        raise typer.BadParameter(f"{engine!r}: use hf or vllm", param_hint="--engine")
    if price_per_hour < 0 or max_batches < 0:
        raise typer.BadParameter("--price-per-hour and --max-batches must be >= 0")

    import asyncio
    import signal

    from brigade.log import configure_logging

    configure_logging("rollout", log_level)
    from brigade.prom import serve_metrics

    serve_metrics(metrics_port)
    from brigade_rollout.worker import Worker, WorkerConfig, default_worker_id

    cfg = WorkerConfig(
        proxy=proxy, bucket=bucket, run=run, token=token, tls_ca=tls_ca, worker_id=worker_id or default_worker_id(),
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
