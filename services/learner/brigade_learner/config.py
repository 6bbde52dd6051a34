"""The learner's and a local trainer's configs: their settings, one field each, from which the
flags and BRIGADE_* variables of `brigade learner` and `brigade trainer` come
(`brigade.settings.command`). Light to import: the CLIs build their commands from these before torch
is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from brigade.settings import (
    BUCKET,
    CAPACITY_CLASS,
    DEVICE,
    EXIT_WHEN_FINISHED,
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT,
    METRICS_TOKEN,
    PRICE_PER_HOUR,
    PROXY,
    REWARD_REDIS,
    REWARD_WORKERS,
    RUN,
    SPEC,
    STATE_DIR,
    TLS_CA,
    TOKEN,
    TORCH_THREADS,
    TRACKER_DIR,
    fleet_id,
    setting,
)
from brigade.trackers import parse_report_to


def _spec_if_negative(max_steps: int) -> int | None:
    return None if max_steps < 0 else max_steps


@dataclass
class LearnerConfig:
    proxy: str = PROXY.field()
    token: str = TOKEN.field()
    tls_ca: str = TLS_CA.field()
    bucket: str = BUCKET.field()
    # "": the spec file's run_id, else `demo` (the learner command resolves it)
    run: str = RUN.field(default="")
    spec_path: str = SPEC.field()
    learner_id: str = setting("learner", "Consumer name at the proxy; keep it stable across restarts so "
                              "pending rollouts come back.", env="BRIGADE_LEARNER_ID")
    price_per_hour: float = PRICE_PER_HOUR.field(doc="This machine's $/hour, for dollars per usable sample.",
                                                 low=None)
    max_steps: int | None = setting(-1, "Stop after this many steps; -1 = the run spec's max_steps.",
                                    env="BRIGADE_MAX_STEPS", parse=_spec_if_negative)  # None: the run spec's
    keep_checkpoints: int = setting(3, "Complete checkpoints kept in the bucket (the newest, never fewer "
                                    "than 2: the one before a damaged newest one); older ones are deleted. 0 = keep "
                                    "all.", env="BRIGADE_KEEP_CHECKPOINTS", low=0)
    # experiment trackers; None: the run spec's report_to
    report_to: list[str] | None = setting(
        "", "Experiment trackers, comma-separated (wandb, tensorboard, trackio), or none; overrides the run "
        "spec's report_to. [default: the run spec's]", env="BRIGADE_REPORT_TO", show_default=False,
        parse=parse_report_to)
    tracker_dir: str = TRACKER_DIR.field()
    torch_threads: int = TORCH_THREADS.field()
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()
    pull_wait_ms: int = 2000  # not a flag


@dataclass
class TrainerConfig:
    proxy: str = PROXY.field()
    token: str = TOKEN.field()
    tls_ca: str = TLS_CA.field()
    bucket: str = BUCKET.field()
    run: str = RUN.field()
    trainer_id: str = setting("", "This trainer's id (its leases' worker id). [default: hostname-pid]",
                              env="BRIGADE_TRAINER_ID", show_default=False, parse=fleet_id)
    capacity_class: str = CAPACITY_CLASS.field()
    price_per_hour: float = PRICE_PER_HOUR.field()
    device: str = DEVICE.field()  # overrides spec.device
    exit_when_finished: bool = EXIT_WHEN_FINISHED.field()
    redis_url: str = REWARD_REDIS.field()  # rq queue for sandboxed rewards
    reward_workers: bool = REWARD_WORKERS.field()
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()
