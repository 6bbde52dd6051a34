"""Running the proxy: one process (`serve_one`), or with `--processes N`, N proxies on one port,
one Python event loop each.

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
import sys
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

from brigade_proxy.settings import ProxySettings


def serve_one(s: ProxySettings, reuse_port: bool = False) -> int:
    """One proxy process until SIGTERM or SIGINT; its exit code (1 for an error it printed, 2 for
    a Redis it must not serve)."""
    import uvloop

    from brigade.errors import LegacyKeys
    from brigade_proxy.server import serve

    try:
        # uvloop: the same calls cost the proxy about 6 % less CPU and 30 % less p50 latency than on
        # asyncio's own loop (`brigade bench proxy`), most of it in the loop's socket and timer handling
        uvloop.run(serve(s.listen, s.redis_url, bucket_url=s.bucket, token=s.token, tls_cert=s.tls_cert,
                         tls_key=s.tls_key, grace=s.grace, pipelined=s.pipelined, limits=s.limits,
                         metrics_port=s.metrics_port, reuse_port=reuse_port))
    except LegacyKeys as e:  # a Redis of the key layout before hash tags: `brigade migrate-keys` first
        print(f"brigade proxy: {e}", file=sys.stderr)
        return 2
    except (RuntimeError, ValueError, OSError) as e:  # the address is taken, a bad bucket URL, unreadable TLS files
        print(f"brigade proxy: {e}", file=sys.stderr)
        return 1
    return 0


def _child(s: ProxySettings) -> None:
    from brigade.log import configure_logging

    configure_logging("proxy", s.log_level)
    sys.exit(serve_one(s, reuse_port=True))


def serve_processes(s: ProxySettings) -> int:
    """Run `s.processes` proxies sharing `s.listen` until SIGTERM or SIGINT; the exit code.
    With --metrics-port P, process i serves its own metrics on P + i."""
    import structlog

    log = structlog.get_logger("brigade.proxy")
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(target=_child, name=f"brigade-proxy-{i}", daemon=False,
                    args=(replace(s, metrics_port=s.metrics_port + i if s.metrics_port else 0),))
        for i in range(s.processes)
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
    log.info("proxy processes started", processes=s.processes, listen=s.listen,
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
