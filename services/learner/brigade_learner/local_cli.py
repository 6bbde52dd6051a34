"""`brigade trainer`: one local trainer of a topology local_sgd run (brigade_learner.local), its flags
from `TrainerConfig`. torch and transformers are imported inside the command, so `brigade --help`
stays fast."""

from __future__ import annotations

import typer

from brigade.settings import command
from brigade_learner.config import TrainerConfig


@command(TrainerConfig)
def trainer(cfg: TrainerConfig) -> None:
    """A local trainer (topology local_sgd): leases batches, generates them with the adapter it trains,
    takes local_sgd.local_steps GRPO steps, then uploads its LoRA factors for the aggregator.

    SIGTERM or SIGINT hands the round's leases back (requeued at once) and exits 0.
    """
    from brigade.log import configure_logging
    from brigade.prom import serve_metrics
    from brigade.service import crash_journal, exit_with
    from brigade.settings import fleet_id

    log = configure_logging("trainer", cfg.log_level)
    # one journal per trainer an operator named; hostname-pid (the default) would be a new one each start
    journal = crash_journal("trainer", cfg.run, cfg.state_dir, "" if cfg.trainer_id == fleet_id() else cfg.trainer_id)
    serve_metrics(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
    from brigade_learner.local import serve

    exit_with(lambda: serve(cfg), log, cfg.proxy, journal, signal_is_failure=False)


def main() -> None:
    """`brigade-trainer`: the same command as `brigade trainer`."""
    typer.run(trainer)
