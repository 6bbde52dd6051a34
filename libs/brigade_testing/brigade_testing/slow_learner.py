"""A learner on a simulated device: `python -m brigade_testing.slow_learner`, the whole-system
benchmarks' learner host (`AuditedSystem.learner_host`), as `brigade_testing.slow_worker` is their
worker host.

It drives the service's own `brigade_learner.learner.Learner` as `brigade learner` does, with the
two things only benchmarks need: it serves several runs one after the other (torch and the model
load once, so startup is out of the figures), and it waits for a "go-<run>" file before each (the
learner loaded and waiting; no backlog piles up while it loads), touching "ready-learner-<run>"
before and "done-learner-<run>" after. `--learner-step-s` makes each GRPO step take at least that
long (`simulate_learner_device`), so that the learner-to-fleet speed ratio is a setting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def simulate_learner_device(trainer, step_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
    """Make `trainer.train_step` take at least `step_s` of wall time (the real step runs first, then
    the rest is slept): the learner's simulated device, as DelayedEngine is the workers'. The
    commit that follows (checkpoint, adapter, publish, ack) stays real."""
    real_step = trainer.train_step

    def train_step(*args, **kwargs):
        t0 = time.monotonic()
        out = real_step(*args, **kwargs)
        out = dict(out, real_train_s=time.monotonic() - t0)
        while (left := t0 + step_s - time.monotonic()) > 0:
            sleep(min(left, 0.05))
        return out

    trainer.train_step = train_step


async def _learner_host(a: argparse.Namespace) -> None:
    from brigade.bucket import open_bucket
    from brigade.log import configure_logging
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb
    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import Learner
    from brigade_learner.trainer import Trainer
    from brigade_testing.slow_worker import wait_for_file

    configure_logging("learner", "info")
    signals = Path(a.signals)
    main = asyncio.current_task()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main.cancel)
    for run in a.runs.split(","):
        client = ProxyClient.connect(a.proxy)
        bucket = open_bucket(a.bucket)
        try:
            await bucket.ensure()
            spec = (await client.runs.GetRun(pb.RunRef(run_id=run), timeout=30)).spec
            trainer = await asyncio.to_thread(Trainer.create, spec)
            if a.learner_step_s > 0:
                simulate_learner_device(trainer, a.learner_step_s)
            learner = Learner(LearnerConfig(proxy=a.proxy, bucket=a.bucket, run=run), spec, bucket, client, trainer)
            (signals / f"ready-learner-{run}").touch()
            await wait_for_file(signals / f"go-{run}")
            await learner.run()
            (signals / f"done-learner-{run}").touch()
        finally:
            await bucket.close()
            await client.close()


def main(argv: Sequence[str] | None = None) -> None:
    """The learner host (`python -m brigade_testing.slow_learner`)."""
    p = argparse.ArgumentParser(prog="python -m brigade_testing.slow_learner")
    p.add_argument("--proxy", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--runs", required=True, help="comma-separated run ids, served one after the other")
    p.add_argument("--signals", required=True, help="folder of ready/go/done files")
    p.add_argument("--learner-step-s", type=float, default=0.0,
                   help="simulated duration of one GRPO step on the learner's device (0 = real time)")
    with contextlib.suppress(asyncio.CancelledError):
        asyncio.run(_learner_host(p.parse_args(argv)))


if __name__ == "__main__":
    main()
