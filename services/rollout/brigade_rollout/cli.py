"""`brigade rollout`: one rollout worker, its flags from `WorkerConfig`. torch, transformers and the
worker itself are imported in the command body, so `brigade --help` stays fast."""

from __future__ import annotations

import typer

from brigade.settings import NO_RUN, command
from brigade_rollout.config import WorkerConfig


@command(WorkerConfig)
def rollout(cfg: WorkerConfig) -> None:
    """A rollout worker: leases prompt batches, generates groups with the leased adapter version,
    scores them, uploads the rollouts and hands the proxy their manifests.

    SIGTERM or SIGINT hands the batch in progress back (requeued at once) and exits 0; a worker that
    cannot work here (a bad configuration, a store that ignores create-only writes) exits 2, one that
    crashed 1, and 3 when it crashed the same way 3 times in a row.
    """
    import asyncio
    import signal

    from brigade.log import configure_logging
    from brigade.service import crash_journal, use_torch_threads
    from brigade.settings import fleet_id

    if not cfg.run:
        typer.echo(f"brigade rollout: {NO_RUN}", err=True)
        raise typer.Exit(2)
    configure_logging("rollout", cfg.log_level)
    # one journal per worker an operator named (systemd's %H-%i); hostname-pid, the default, is new each start
    journal = crash_journal("rollout", cfg.run, cfg.state_dir, "" if cfg.worker_id == fleet_id() else cfg.worker_id)
    from brigade.prom import serve_metrics

    serve_metrics(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
    use_torch_threads(cfg.torch_threads)
    from brigade_rollout.worker import Worker

    async def main() -> int:
        worker = Worker(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, worker.stop)
        return await worker.run()

    code = journal.run(lambda: asyncio.run(main()))
    if code:
        raise typer.Exit(code)


def main() -> None:
    """`brigade-rollout` (and `python -m brigade_rollout`): the same command as `brigade rollout`."""
    typer.run(rollout)
