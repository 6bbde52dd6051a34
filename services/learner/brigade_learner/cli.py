"""`brigade learner`: the one learner of a run, its flags from `LearnerConfig`. torch and
transformers are imported inside the command, so `brigade --help` and the other services start
without them."""

from __future__ import annotations

import typer

from brigade.settings import RUN, command
from brigade_learner.config import LearnerConfig


@command(LearnerConfig)
def learner(cfg: LearnerConfig) -> None:
    """The learner: GRPO steps on the LoRA adapter from the rollouts workers hand in.

    Resumes from the newest complete checkpoint in the bucket; with --spec, creates the run at the
    proxy first if it does not exist (the run id defaults to the spec's). Exits 0 after max_steps;
    1 when it crashed, 2 for a bad configuration, 3 when it crashed the same way 3 times in a row;
    128 + the signal's number when SIGTERM or SIGINT stopped it first.
    """
    from brigade.log import configure_logging

    log = configure_logging("learner", cfg.log_level)
    from brigade.config import ConfigError
    from brigade.service import crash_journal, exit_with, use_torch_threads

    if not cfg.run:  # no --run / BRIGADE_RUN: the spec file's run, else the default run
        cfg.run = RUN.default
        if cfg.spec_path:
            from brigade.spec_file import build_spec

            try:
                cfg.run = build_spec(path=cfg.spec_path).run_id
            except ConfigError as e:
                log.error("config_error", error=str(e))
                raise typer.Exit(2) from None
    journal = crash_journal("learner", cfg.run, cfg.state_dir)  # a crash loop stops here, before torch loads
    from brigade.prom import serve_metrics
    from brigade_learner.learner import serve

    serve_metrics(cfg.metrics_port, cfg.metrics_host, cfg.metrics_token)
    use_torch_threads(cfg.torch_threads)
    # stopped before max_steps is not a success, so a supervisor that restarts on failure (a
    # Kubernetes Job after a node drain, compose, systemd) starts it again; 0 means finished
    exit_with(lambda: serve(cfg), log, cfg.proxy, journal)


def main() -> None:
    """`brigade-learner` (and `python -m brigade_learner`): the same command as `brigade learner`."""
    typer.run(learner)
