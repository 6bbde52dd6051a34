"""`brigade learner`: the one learner of a run. torch and transformers are imported inside the
command, so `brigade --help` and the other services start without them."""

from __future__ import annotations

from typing import Annotated

import typer

from brigade.options import (
    DEFAULTS,
    BucketUrl,
    LogLevel,
    MetricsPort,
    ProxyAddr,
    Run,
    SpecPath,
    TlsCa,
    Token,
    TrackerDir,
)

LearnerId = Annotated[str, typer.Option(
    "--learner-id", envvar="BRIGADE_LEARNER_ID",
    help="Consumer name at the proxy; keep it stable across restarts so pending rollouts come back.")]
PricePerHour = Annotated[float, typer.Option(
    "--price-per-hour", envvar="BRIGADE_PRICE_PER_HOUR", help="This machine's $/hour, for dollars per usable sample.")]
KeepCheckpoints = Annotated[int, typer.Option(
    "--keep-checkpoints", envvar="BRIGADE_KEEP_CHECKPOINTS", min=0,
    help="Complete checkpoints kept in the bucket (the newest); older ones are deleted. 0 = keep all.")]
MaxSteps = Annotated[int, typer.Option(
    "--max-steps", envvar="BRIGADE_MAX_STEPS", help="Stop after this many steps; -1 = the run spec's max_steps.")]
ReportTo = Annotated[str, typer.Option(
    "--report-to", envvar="BRIGADE_REPORT_TO",
    help="Experiment trackers, comma-separated (wandb, tensorboard, trackio), or none; overrides the run spec's "
         "report_to. [default: the run spec's]", show_default=False)]


def learner(
    proxy: ProxyAddr = DEFAULTS.proxy,
    token: Token = "",
    tls_ca: TlsCa = "",
    bucket: BucketUrl = DEFAULTS.bucket,
    run: Run = "",
    spec: SpecPath = "",
    learner_id: LearnerId = "learner",
    price_per_hour: PricePerHour = 0.0,
    max_steps: MaxSteps = -1,
    keep_checkpoints: KeepCheckpoints = 3,
    report_to: ReportTo = "",
    tracker_dir: TrackerDir = "trackers",
    metrics_port: MetricsPort = 0,
    log_level: LogLevel = DEFAULTS.log_level,
) -> None:
    """The learner: GRPO steps on the LoRA adapter from the rollouts workers hand in.

    Resumes from the newest complete checkpoint in the bucket; with --spec, creates the run at the
    proxy first if it does not exist (the run id defaults to the spec's). Exits 0 after max_steps;
    128 + the signal's number when SIGTERM or SIGINT stopped it first.
    """
    from brigade.log import configure_logging

    log = configure_logging("learner", log_level)
    from brigade.trackers import parse_report_to

    try:
        trackers = parse_report_to(report_to)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--report-to") from None
    from brigade.config import ConfigError
    from brigade.service import exit_with
    from brigade_learner.learner import LearnerConfig, serve

    if not run:  # no --run / BRIGADE_RUN: the spec file's run, else the default run
        run = DEFAULTS.run
        if spec:
            from brigade.spec_file import build_spec

            try:
                run = build_spec(path=spec).run_id
            except ConfigError as e:
                log.error("config_error", error=str(e))
                raise typer.Exit(2) from None
    cfg = LearnerConfig(proxy=proxy, token=token, tls_ca=tls_ca, bucket=bucket, run=run, spec_path=spec,
                        learner_id=learner_id, price_per_hour=price_per_hour,
                        max_steps=None if max_steps < 0 else max_steps, keep_checkpoints=keep_checkpoints,
                        report_to=trackers, tracker_dir=tracker_dir)
    from brigade.prom import serve_metrics

    serve_metrics(metrics_port)
    # stopped before max_steps is not a success, so a supervisor that restarts on failure (a
    # Kubernetes Job after a node drain, compose, systemd) starts it again; 0 means finished
    exit_with(lambda: serve(cfg), log, proxy)


def main() -> None:
    """`brigade-learner` (and `python -m brigade_learner`): the same command as `brigade learner`."""
    typer.run(learner)
