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

With a bucket, the proxy first checks that its store refuses a second create-only write (run.pb and
the prompts are written once): once, in the parent with --processes N. Each process keeps a crash
journal of its own (brigade.crash_loop; process i of N: `proxy-all-<i>`), so a crash loop of one is
seen at its next start.
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

# the probe's objects go under a name no run can have (brigade.spec.RUN_ID_RE): the proxy serves every run
PROBE_RUN = "_proxy"


def probe_bucket(s: ProxySettings) -> int:
    """The create-only check of the proxy's bucket: 0, or 2 with one line when the store ignores
    If-None-Match. A store still unreachable after the probe's retries raises (a crash: an outage)."""
    import asyncio

    import structlog

    from brigade.bucket import open_bucket, probe_at_start
    from brigade.config import ConfigError

    async def probe() -> None:
        async with open_bucket(s.bucket) as bucket:
            await probe_at_start(bucket, PROBE_RUN)

    if not s.bucket:
        return 0
    try:
        asyncio.run(probe())
    except ConfigError as e:
        structlog.get_logger("brigade.proxy").error("config_error", error=str(e))
        return 2
    return 0


def serve_one(s: ProxySettings, reuse_port: bool = False, instance: str = "", probe: bool = True) -> int:
    """One proxy process until SIGTERM or SIGINT; its exit code (1 for a crash, 2 for a Redis or a
    bucket it must not serve, 3 for a crash loop). `instance` names its crash journal
    among the processes of one proxy; `probe`: check the bucket first (the parent did, with several)."""
    from brigade.crash_loop import CrashJournal, state_dir

    journal = CrashJournal(state_dir(s.state_dir), "proxy", "", instance)
    if (looping := journal.loop()) is not None:  # before grpc and Redis: a refused restart is cheap
        return journal.refuse(looping)
    return journal.run(lambda: _serve(s, reuse_port, probe))


def _serve(s: ProxySettings, reuse_port: bool, probe: bool) -> int:
    import uvloop

    from brigade.errors import LegacyKeys
    from brigade_proxy.server import serve

    if probe and (code := probe_bucket(s)):
        return code
    # anything but LegacyKeys escaping (the address taken, a bad bucket URL, unreadable TLS files) is a
    # crash (serve_one): one line saying what and where, and no endless restarts when it stays so
    try:
        # uvloop: the same calls cost the proxy about 6 % less CPU and 30 % less p50 latency than on
        # asyncio's own loop (`brigade bench proxy`), most of it in the loop's socket and timer handling
        uvloop.run(serve(s.listen, s.redis_url, bucket_url=s.bucket, token=s.token, tokens_file=s.tokens_file,
                         tls_cert=s.tls_cert, tls_key=s.tls_key, grace=s.grace, pipelined=s.pipelined, limits=s.limits,
                         metrics_port=s.metrics_port, metrics_host=s.metrics_host,
                         metrics_token=s.metrics_token, reuse_port=reuse_port))
    except LegacyKeys as e:  # a Redis of the key layout before hash tags: `brigade migrate-keys` first
        print(f"brigade proxy: {e}", file=sys.stderr)
        return 2
    return 0


def _child(s: ProxySettings, index: int) -> None:
    from brigade.log import configure_logging

    configure_logging("proxy", s.log_level)
    sys.exit(serve_one(s, reuse_port=True, instance=str(index), probe=False))


def serve_processes(s: ProxySettings) -> int:
    """Run `s.processes` proxies sharing `s.listen` until SIGTERM or SIGINT; the exit code.
    With --metrics-port P, process i serves its own metrics on P + i."""
    import structlog

    from brigade.crash_loop import CrashJournal, state_dir

    log = structlog.get_logger("brigade.proxy")
    # the parent's own journal holds what can fail in it: the bucket's probe
    journal = CrashJournal(state_dir(s.state_dir), "proxy")
    if (looping := journal.loop()) is not None:
        return journal.refuse(looping)
    if code := journal.run(lambda: probe_bucket(s)):
        return code
    ctx = multiprocessing.get_context("spawn")
    children = [
        ctx.Process(target=_child, name=f"brigade-proxy-{i}", daemon=False,
                    args=(replace(s, metrics_port=s.metrics_port + i if s.metrics_port else 0), i))
        for i in range(s.processes)
    ]
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True
        for child in children:
            if child.pid is not None and child.exitcode is None:
                os.kill(child.pid, signal.SIGTERM)

    def forward_hup(*_: Any) -> None:  # re-read the tokens file: each process holds its own table
        for child in children:
            if child.pid is not None and child.exitcode is None:
                os.kill(child.pid, signal.SIGHUP)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGHUP, forward_hup)
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
