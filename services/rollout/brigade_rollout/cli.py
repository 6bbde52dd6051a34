"""`brigade rollout`: one rollout worker, its flags from `WorkerConfig`. torch, transformers and the
worker itself are imported in the command body, so `brigade --help` stays fast."""

from __future__ import annotations

import typer

from brigade.settings import command
from brigade_rollout.config import WorkerConfig


@command(WorkerConfig)
def rollout(cfg: WorkerConfig) -> None:
    """A rollout worker: leases prompt batches, generates groups with the leased adapter version,
    scores them, uploads the rollouts and hands the proxy their manifests.

    SIGTERM or SIGINT hands the batch in progress back (requeued at once) and exits 0.
    """
    import asyncio
    import signal

    from brigade.log import configure_logging

    configure_logging("rollout", cfg.log_level)
    from brigade.prom import serve_metrics

    serve_metrics(cfg.metrics_port)
    from brigade_rollout.worker import Worker

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
