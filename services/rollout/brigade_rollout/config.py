"""A rollout worker's config: its settings, one field each, from which `brigade rollout`'s flags
and BRIGADE_* variables come (`brigade.settings.command`). Light to import: the CLI builds its
command from it before torch is loaded."""

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
    RUN_REQUIRED,
    STATE_DIR,
    TLS_CA,
    TOKEN,
    TORCH_THREADS,
    fleet_id,
    setting,
)


@dataclass
class WorkerConfig:
    proxy: str = PROXY.field()
    token: str = TOKEN.field()
    tls_ca: str = TLS_CA.field()
    bucket: str = BUCKET.field()
    run: str = RUN.field(**RUN_REQUIRED)
    worker_id: str = setting("", "This worker's id. [default: hostname-pid]", env="BRIGADE_WORKER_ID",
                             show_default=False, parse=fleet_id)
    capacity_class: str = CAPACITY_CLASS.field()
    price_per_hour: float = PRICE_PER_HOUR.field()
    engine: str = setting("hf", "hf (transformers, CPU or GPU) or vllm (CUDA; pip install brigade[vllm]).",
                          env="BRIGADE_ENGINE", choices=("hf", "vllm"))
    max_batches: int = setting(0, "Exit after this many completed batches; 0 = forever.", low=0)
    exit_when_finished: bool = EXIT_WHEN_FINISHED.field()
    device: str = DEVICE.field()  # overrides spec.device
    torch_threads: int = TORCH_THREADS.field()
    redis_url: str = REWARD_REDIS.field()  # rq queue for sandboxed rewards
    reward_workers: bool = REWARD_WORKERS.field()  # start a local rq worker for them
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()
