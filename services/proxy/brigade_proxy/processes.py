"""`brigade proxy --processes N`: N proxies on one port, one Python event loop each.

One event loop spends about 0.9 ms of CPU per lease cycle of two calls (AcquireLease +
CompleteLease) and 0.65-0.85 ms per cycle of one (CompleteLease with `next`, what workers send),
most of it in grpc's own Cython and its poller thread, so near 1,000 cycles/s it is 80-90 % busy and
its tail latency is queueing. The proxy keeps no state between calls (it is all in Redis), so more
processes are just more proxies: each listens with SO_REUSEPORT and the kernel spreads incoming
connections over them. The parent imports no grpc (a grpc process cannot be forked safely): it
spawns the children, forwards SIGTERM and SIGINT to them, and if one dies, stops the others and
exits with its code so that whatever supervises the proxy restarts it whole.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from multiprocessing.connection import wait
from typing import Any


def _child(log_level: str, serve_kwargs: dict[str, Any]) -> None:
    import sys

    from brigade.log import configure_logging
    from brigade_proxy.cli import serve_one

    configure_logging("proxy", log_level)
    sys.exit(serve_one(serve_kwargs, reuse_port=True))


def serve_processes(processes: int, log_level: str, **serve_kwargs: Any) -> int:
    """Run `processes` proxies sharing `serve_kwargs["listen"]` until SIGTERM or SIGINT; the exit code.
    With --metrics-port P, process i serves its own metrics on P + i."""
    import structlog

    log = structlog.get_logger("brigade.proxy")
    metrics_port = serve_kwargs.pop("metrics_port", 0)
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(target=_child, name=f"brigade-proxy-{i}", daemon=False,
                    args=(log_level, {**serve_kwargs, "metrics_port": metrics_port + i if metrics_port else 0}))
        for i in range(processes)
    ]
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.pid is not None and child.exitcode is None:
                os.kill(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for child in children:
        child.start()
    log.info("proxy processes started", processes=processes, listen=serve_kwargs.get("listen"),
             pids=[c.pid for c in children])
    code = 0
    running = list(children)
    while running:
        wait([c.sentinel for c in running], timeout=1.0)
        for child in [c for c in running if c.exitcode is not None]:
            running.remove(child)
            if not stopping:
                log.error("a proxy process exited; stopping the others", pid=child.pid, exit_code=child.exitcode)
                stop()
                code = child.exitcode if child.exitcode and child.exitcode > 0 else 1
            elif child.exitcode and not code:
                code = child.exitcode if child.exitcode > 0 else 1  # killed by a signal: -N
    return code
