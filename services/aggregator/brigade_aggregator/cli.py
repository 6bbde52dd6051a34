"""`brigade aggregator`: the aggregator of a topology local_sgd run (one per run), its flags from
`AggregatorConfig`. torch is imported inside the command, so `brigade --help` stays fast."""

from __future__ import annotations

import typer

from brigade.settings import command
from brigade_aggregator.config import AggregatorConfig


@command(AggregatorConfig)
def aggregator(cfg: AggregatorConfig) -> None:
    """The aggregator (topology local_sgd): merges the local trainers' contributions of each round into
    the next global adapter version and publishes it.

    Resumes from its newest round record in the bucket. Exits 0 after max_steps rounds; 1 when it
    crashed, 2 for a bad configuration, 3 when it crashed the same way 3 times in a row; 128 + the
    signal's number when SIGTERM or SIGINT stopped it first.
    """
    from brigade.log import configure_logging
    from brigade.prom import serve_metrics
    from brigade.service import crash_journal, exit_with

    log = configure_logging("aggregator", cfg.log_level)
    journal = crash_journal("aggregator", cfg.run, cfg.state_dir)  # a crash loop stops here, before torch loads
    serve_metrics(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
    from brigade_aggregator.aggregator import serve

    exit_with(lambda: serve(cfg), log, cfg.proxy, journal)


def main() -> None:
    """`brigade-aggregator` (and `python -m brigade_aggregator`): the same command as `brigade aggregator`."""
    typer.run(aggregator)
