"""A rollout worker on a simulated slow device: `python -m brigade_testing.slow_worker`.

It drives the service's own `brigade_rollout.worker.Worker` as `brigade rollout` does, with the
real engine wrapped in `SlowEngine`, and two things only benchmarks need: it serves several runs one
after the other (torch and the model load once, so startup is out of the figures), and with
`--signals` it waits for a "go-<run>" file before each, so every worker starts together.
SIGTERM or SIGINT hands the batch in progress back and exits 0, as `brigade rollout` does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from brigade.settings import BUCKET, PROXY, TOKEN
from brigade_testing.slow_engine import DelayModel, SlowEngine


async def fetch_spec(proxy: str, token: str, run: str, timeout: float = 60):
    """The run's spec, to build the engine before the Worker starts (the proxy may be restarting)."""
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    deadline = time.monotonic() + timeout
    async with ProxyClient.connect(proxy, token) as client:
        while True:
            try:
                return (await client.runs.GetRun(pb.RunRef(run_id=run), timeout=10)).spec
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)


async def wait_for_file(path: Path, stopping: asyncio.Event | None = None) -> None:
    while not path.exists() and not (stopping is not None and stopping.is_set()):
        await asyncio.sleep(0.01)


async def serve(a: argparse.Namespace) -> int:
    from brigade.engine import make_engine
    from brigade.log import configure_logging
    from brigade_rollout.config import WorkerConfig
    from brigade_rollout.worker import Worker

    configure_logging("rollout", a.log_level)
    token = TOKEN.from_env()
    runs = a.runs.split(",")
    current: list[Worker] = []
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        for w in current:
            w.stop()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    spec = await fetch_spec(a.proxy, token, runs[0])
    engine = await asyncio.to_thread(make_engine, "hf", spec, device=a.device or None)
    delay = DelayModel(**json.loads(a.delay)) if a.delay else None
    for run in runs:
        if stopping.is_set():
            break
        engine.load_adapter(0, None)  # version numbers restart with each run: start from the fresh LoRA
        if a.signals:
            (Path(a.signals) / f"ready-{a.worker_id}-{run}").touch()
            await wait_for_file(Path(a.signals) / f"go-{run}", stopping)
        cfg = WorkerConfig(proxy=a.proxy, bucket=a.bucket, run=run, token=token, worker_id=a.worker_id,
                           capacity_class=a.capacity_class, price_per_hour=a.price_per_hour, exit_when_finished=True)
        slow = SlowEngine(engine, a.speed_factor, delay, Path(a.engine_log) if a.engine_log else None, run)
        current[:] = [worker := Worker(cfg, engine=slow)]
        if code := await worker.run():
            return code
    return 0


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m brigade_testing.slow_worker")
    p.add_argument("--proxy", default=PROXY.from_env())
    p.add_argument("--bucket", default=BUCKET.from_env())
    p.add_argument("--runs", required=True, help="comma-separated run ids, served one after the other")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--speed-factor", type=float, default=1.0,
                   help="the device is this many times slower (than real, or than --delay's per-token time)")
    p.add_argument("--delay", default="", help="DelayModel fields as JSON: batch time from the delay model")
    p.add_argument("--engine-log", default="", help="one JSON line per batch here")
    p.add_argument("--signals", default="", help="folder of ready/go files: wait for go-<run> before each run")
    p.add_argument("--capacity-class", default="spot")
    p.add_argument("--price-per-hour", type=float, default=0.0)
    p.add_argument("--device", default="")
    p.add_argument("--log-level", default="info")
    sys.exit(asyncio.run(serve(p.parse_args(argv))))


if __name__ == "__main__":
    main()
