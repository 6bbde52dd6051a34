"""Lease-proxy throughput and latency: acquire + complete cycles through `brigade proxy` (separate
processes, over loopback gRPC, backed by their own redis-server), against the same cycle through a
proxy whose store runs its scripts over plain redis-py (`--no-pipelined`), and against raw redis-py
stream commands at the same concurrency, all in the same run.

    brigade bench proxy [--quick]

lease_cycles_per_s   AcquireLease + CompleteLease pairs per second through one proxy process, 64
                     concurrent clients back to back (closed loop: one event loop's capacity)
one_call_*           the worker's cycle since CompleteLease takes `next`: one call completes a
                     lease and acquires the next. one_call_cycles_per_s is its closed loop,
                     one_call_p50/p99_ms its latency at 1000 cycles/s (a worker's wait between
                     handing in a batch and holding the next lease), one_call_cpu_ms_per_cycle
                     the proxy's CPU per cycle there; one_call_over_target_share the share of
                     its calls over the 25 ms target and one_call_slow_stretch_s the longest run
                     of 100 ms windows holding such a call (a p99 set by queueing comes in stretches);
                     one_call_clients/redis_cpu_ms_per_cycle what the load clients and Redis spent
                     beside the proxy on this machine, one_call_machine_busy/steal the share of its
                     cores in use and taken by the hypervisor over the phase, and _slow_busy/_slow_steal
                     the same in the windows holding a call over 25 ms
saturated_acquire_*  AcquireLease latency in that closed loop; by Little's law it is mostly
                     queueing (64 calls in flight / throughput), not service time
acquire_p50/p99_ms, complete_*
                     the same 64 clients offering 1000 cycles/s in all (open loop, like workers
                     that generate between calls) to one process
paced_cycles_per_s   the rate that phase carried (one_call_/processes_/one_call_processes_paced_*
                     for the others): clients that fall behind their schedule catch up back to back,
                     so a machine that cannot keep up shows here, and the report judges a p99 "at
                     1000 cycles/s" only where its phase carried 95 % of that
proxy_cpu_ms_per_cycle, proxy_cores
                     that process's CPU (all its threads) per cycle and in cores at 1000 cycles/s:
                     what it needs of a machine whose other jobs set the p99; clients_/redis_cpu_ms_per_cycle,
                     phase_cores (proxy, load clients and Redis together, in cores), machine_*,
                     over_target_share and slow_stretch_s as for one_call_*: two calls a cycle cost
                     the clients twice what one does, and on 2 cores the phase takes about all of them
light_acquire_*      200 cycles/s (64 workers, one cycle each every 320 ms), one process
floor_*              the one-call phase again, the same clients and rate, against a gRPC server that
                     parses each call and answers a fixed lease (brigade_bench.floor_server: no Redis,
                     no checks, no interceptors), started right after it: floor_one_call_p99_ms is
                     the p99 this machine gives any Python gRPC server that minute, floor_cpu_ms_per_cycle
                     gRPC's own CPU per call, floor_machine_busy/steal the machine meanwhile; then the
                     two-call phase against it: floor_acquire_p99_ms, floor_cpu_ms_per_two_call_cycle
                     and floor_phase_cores (server and clients)
processes_*          1000 cycles/s and the closed loop again through `brigade proxy --processes 2`
                     (one port, SO_REUSEPORT), with the processes' CPU per cycle; one_call_processes_*
                     the worker's one-call cycle at 1000 cycles/s through them
raw_cycles_per_s     XREADGROUP, then XACK + XDEL + XADD in one pipeline, 64 concurrent tasks
redis_py_cycles_per_s  lease_cycles_per_s again (same closed loop, same scripts, a fresh run on the
                     same Redis), through a proxy started with --no-pipelined: what the
                     hand-written pipelining client (brigade.resp) buys over plain redis-py
cycle_ratio          our time per cycle / raw time per cycle (lower is better)

The clients run in `client_processes` processes (2 by default) so the client side, which costs
about as much CPU as the server, does not cap the figure on a small machine. Every 4 clients share
a connection of their own, as workers on separate machines would (gRPC would otherwise put all the
channels of a process on one connection, and so on one proxy process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path

CONCURRENCY = 64
CLIENTS_PER_CONNECTION = 4
LIGHT_RATE = 200.0
TARGET_P99_MS = 25.0  # AcquireLease (or the one-call cycle) at 1000 cycles/s
PROCESSES = 2  # `brigade proxy --processes` of the processes_* figures: one per core of this machine


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = min(len(values) - 1, max(0, round(q * (len(values) - 1))))
    return values[k]


# ---------------------------------------------------------------- our cycle, through the proxy

async def _proxy_clients(target: str, run: str, clients: int, cycles: int, tag: str, rate: float = 0.0,
                         start_at: float = 0.0, one_call: bool = False) -> dict:
    """`clients` concurrent acquire+complete loops until `cycles` are done. rate=0: back to back
    (closed loop, saturation); rate>0: each client starts a cycle every clients/rate seconds
    (open loop at `rate` cycles/s in all, the way workers behave: they generate between calls).
    `target` may list several proxies, comma-separated: the channels go round them. The clock
    starts once every connection is up and every client has done one cycle (and not before
    `start_at`, a time.time()): a worker keeps its connection for hours, and the first calls on a
    new one wait for TCP and HTTP/2 setup, which was enough to set a 10-second phase's p99 alone.
    one_call: each cycle is one CompleteLease of the lease the client holds, with `next` (the first,
    untimed cycle acquires), timed as its acquire; a lease still held at the end is left to expire."""
    import grpc

    from brigade import keys
    from brigade.rpc import channel_options
    from brigade.v1 import brigade_pb2 as pb
    from brigade.v1 import brigade_pb2_grpc as pbg

    targets = target.split(",")
    # a connection per channel: on one port, SO_REUSEPORT spreads connections (not calls) over processes
    options = [*channel_options(), ("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.aio.insecure_channel(targets[i % len(targets)], options=options)
                for i in range(max(len(targets), clients // CLIENTS_PER_CONNECTION))]
    stubs = [pbg.LeaseServiceStub(ch) for ch in channels]
    requests = [pb.AcquireLeaseRequest(run_id=run, worker_id=f"bench-{tag}-{i}", capacity_class="spot", engine="bench")
                for i in range(clients)]
    held: list[pb.Lease | None] = [None] * clients  # one_call: the lease each client completes next

    def completion(lease: pb.Lease, req: pb.AcquireLeaseRequest) -> pb.CompleteLeaseRequest:
        b = lease.batch.batch_id
        manifest = pb.RolloutManifest(
            run_id=run, batch_id=b, attempt=lease.attempt, worker_id=req.worker_id,
            policy_version=lease.adapter_version, uri=keys.rollout_key(run, b, lease.attempt),
            sha256="0" * 64, size_bytes=1, num_samples=8, num_tokens=256, reward_mean=0.5,
        )
        return pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id=req.worker_id, manifest=manifest,
                                       next=req if one_call else None)

    async def cycle(i: int) -> tuple[float, float] | float:
        """(acquire ms, complete ms), or the retry-after seconds of a refusal."""
        stub, req = stubs[i % len(stubs)], requests[i]
        t0 = time.perf_counter()
        if one_call and held[i] is not None:
            resp = (await stub.CompleteLease(completion(held[i], req))).next
        else:
            resp = await stub.AcquireLease(req)
        t1 = time.perf_counter()
        held[i] = resp.lease if resp.granted else None
        if not resp.granted:
            return resp.retry_after_ms / 1000
        if one_call:
            return (t1 - t0) * 1000, 0.0
        await stub.CompleteLease(completion(resp.lease, req))
        return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000

    # connected, and each client's first cycle done (untimed), then the clock starts
    await asyncio.wait_for(asyncio.gather(*(ch.channel_ready() for ch in channels)), 30)
    await asyncio.gather(*(cycle(i) for i in range(clients)))
    await asyncio.sleep(max(0.0, start_at - time.time()))
    remaining = cycles
    acquire_ms: list[float] = []
    complete_ms: list[float] = []
    ends: list[float] = []  # time.time() at the end of each timed cycle: where in the phase the slow ones fell
    denied = 0
    interval = clients / rate if rate > 0 else 0.0

    async def client(i: int) -> None:
        nonlocal remaining, denied
        next_at = time.perf_counter() + interval * i / clients
        while remaining > 0:
            remaining -= 1
            if interval:
                delay = next_at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                next_at += interval
            result = await cycle(i)
            if isinstance(result, float):
                denied += 1
                await asyncio.sleep(result)
                continue
            acquire_ms.append(result[0])
            complete_ms.append(result[1])
            ends.append(time.time())

    start, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu  # this process's CPU, every thread
    for ch in channels:
        await ch.close()
    return {"acquire_ms": acquire_ms, "complete_ms": complete_ms, "ends": ends, "elapsed": elapsed, "denied": denied,
            "cpu_s": cpu}


def _client_process_main() -> None:
    """Entry point of a client process: args as JSON on argv[1], results as JSON to the file argv[2]."""
    import uvloop  # as the proxy does: the load clients share this machine's cores with it

    from brigade_proxy.server import settle_heap  # imports grpc and the stubs the clients use

    target, run_id, clients, cycles, tag, start_at, rate, one_call = json.loads(sys.argv[1])
    # as the proxy does: a full collection here would pause the 32 clients of this process mid-call
    # and count as the proxy's latency
    settle_heap()
    result = uvloop.run(_proxy_clients(target, run_id, clients, cycles, tag, rate, start_at, one_call))
    Path(sys.argv[2]).write_text(json.dumps(result))  # a file: a pipe cut a big result short under uvloop


def _tag(rate: float, one_call: bool) -> str:
    """The phase's part of its clients' worker ids."""
    return ("one-" if one_call else "") + ("paced" if rate else "p")


async def _proxy_clients_in_processes(target: str, run_id: str, processes: int, clients: int,
                                      cycles: int, rate: float = 0.0, one_call: bool = False) -> list[dict]:
    start_at = time.time() + 3.0  # process start, imports and connecting take about a second
    tag = _tag(rate, one_call)
    code = "from brigade_bench.proxy import _client_process_main; _client_process_main()"
    with tempfile.TemporaryDirectory(prefix="brigade-bench-clients-") as tmp:
        outs = [Path(tmp) / f"client-{i}.json" for i in range(processes)]
        procs = []
        for i, out in enumerate(outs):
            args = json.dumps([target, run_id, clients // processes, cycles // processes, f"{tag}{i}", start_at,
                               rate / processes, one_call])
            procs.append(await asyncio.create_subprocess_exec(sys.executable, "-c", code, args, str(out)))
        for p in procs:
            if await p.wait() != 0:
                raise RuntimeError(f"a benchmark client process exited with code {p.returncode}")
        return [json.loads(out.read_text()) for out in outs]


# ---------------------------------------------------------------- the raw redis-py cycle

async def _raw_cycles(redis_url: str, clients: int, cycles: int) -> dict:
    import redis.asyncio as aioredis

    r = aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=clients))
    work, out = "rawbench:work", "rawbench:rollouts"
    await r.delete(work, out)
    await r.xgroup_create(work, "rollout", id="0", mkstream=True)
    for i in range(0, cycles, 1000):
        async with r.pipeline(transaction=False) as p:
            for j in range(i, min(cycles, i + 1000)):
                p.xadd(work, {"batch": f"raw:0:{j}", "attempt": 1, "failures": 0})
            await p.execute()
    remaining = cycles
    acquire_ms: list[float] = []
    manifest = b"x" * 200

    async def client(i: int) -> None:
        nonlocal remaining
        consumer = f"raw-{i}"
        while remaining > 0:
            remaining -= 1
            t0 = time.perf_counter()
            res = await r.xreadgroup("rollout", consumer, {work: ">"}, count=1)
            t1 = time.perf_counter()
            entry_id, fields = res[0][1][0]
            async with r.pipeline(transaction=False) as p:
                p.xack(work, "rollout", entry_id)
                p.xdel(work, entry_id)
                p.xadd(out, {"batch": fields[b"batch"], "version": 0, "m": manifest})
                await p.execute()
            acquire_ms.append((t1 - t0) * 1000)

    start = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    await r.delete(work, out)
    await r.aclose()
    return {"acquire_ms": acquire_ms, "elapsed": elapsed}


# ---------------------------------------------------------------- the benchmark

async def _create_run(target: str, run: str, prompts: int, lease_seconds: int = 600) -> None:
    from brigade.rpc import ProxyClient
    from brigade.spec_file import build_spec
    from brigade.v1 import brigade_pb2 as pb

    # no learner consumes the rollouts: a fixed lookahead as wide as the cap lets leases go on forever
    spec = build_spec({"run_id": run, "prompts_per_batch": 1, "batches_per_step": 1,
                       "staleness": {"max_staleness": 1_000_000, "lookahead": 1_000_000,
                                     "lease_seconds": lease_seconds, "max_attempts": 3}})
    async with ProxyClient.connect(target) as client:
        for _ in range(100):  # the proxy may still be starting
            try:
                await client.runs.CreateRun(pb.CreateRunRequest(
                    spec=spec, prompts=[pb.Prompt(id=str(i), text=f"{i} + {i} =") for i in range(prompts)]),
                    timeout=30, wait_for_ready=True)
                return
            except Exception:  # noqa: BLE001
                await asyncio.sleep(0.1)
        raise RuntimeError("the proxy did not accept CreateRun")


def _start_proxy(redis_url: str, port: int, pipelined: bool = True, processes: int = 1) -> subprocess.Popen:
    from brigade_harness.devservers import wait_for_port

    env = dict(os.environ, BRIGADE_LOG_FORMAT="json")
    argv = [sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url,
            "--bucket", "", "--log-level", "warning", "--pipelined" if pipelined else "--no-pipelined",
            "--processes", str(processes)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wait_for_port(port, timeout=30, proc=proc)
    return proc


async def _phase(target: str, run_id: str, processes: int, cycles: int, rate: float = 0.0,
                 one_call: bool = False) -> dict:
    if processes <= 1:
        results = [await _proxy_clients(target, run_id, CONCURRENCY, cycles, _tag(rate, one_call), rate,
                                        one_call=one_call)]
    else:
        results = await _proxy_clients_in_processes(target, run_id, processes, CONCURRENCY, cycles, rate, one_call)
    acquire = [x for r in results for x in r["acquire_ms"]]
    complete = [x for r in results for x in r["complete_ms"]]
    wall = max(r["elapsed"] for r in results)
    return {"rate": len(acquire) / wall, "acquire": acquire, "complete": complete, "cycles": len(acquire),
            "ends": [x for r in results for x in r["ends"]],
            "denied": sum(r["denied"] for r in results), "clients_cpu_s": sum(r["cpu_s"] for r in results)}


WINDOW_S = 0.1  # the windows in which slow calls and the machine's state are placed


def _slow_windows(latency_ms: list[float], ends: list[float], limit_ms: float) -> set[int]:
    """The WINDOW_S windows (numbered from the epoch) in which some call over `limit_ms` started."""
    return {int((end - ms / 1000) / WINDOW_S) for ms, end in zip(latency_ms, ends, strict=True) if ms > limit_ms}


def _longest_slow_stretch_s(latency_ms: list[float], ends: list[float], limit_ms: float) -> float:
    """The longest run of consecutive windows in which some call (placed by its start) took over
    `limit_ms`: whether a p99 comes from calls slow all along or from a stretch where they queue."""
    slow = sorted(_slow_windows(latency_ms, ends, limit_ms))
    longest = run = 0
    for i, w in enumerate(slow):
        run = run + 1 if i and w == slow[i - 1] + 1 else 1
        longest = max(longest, run)
    return round(longest * WINDOW_S, 3)


@contextlib.asynccontextmanager
async def _machine_windows() -> AsyncIterator[dict[int, tuple[float, float]]]:
    """While inside: window number -> (busy, stolen) share of the machine's cores in that WINDOW_S
    window, read from /proc/stat by a task of this event loop (empty where there is no /proc)."""
    from brigade_bench.system import machine_ticks, shares

    windows: dict[int, tuple[float, float]] = {}

    async def sample() -> None:
        at, before = time.time(), machine_ticks()
        while True:
            await asyncio.sleep(WINDOW_S)
            now, after = time.time(), machine_ticks()
            if (during := shares(before, after)) is not None:
                windows[int(at / WINDOW_S)] = during
            at, before = now, after

    task = asyncio.create_task(sample())
    try:
        yield windows
    finally:
        task.cancel()


def _machine_during(windows: dict[int, tuple[float, float]], latency_ms: list[float], ends: list[float],
                    limit_ms: float) -> dict[str, float]:
    """The machine's mean busy and stolen share over the timed part of a phase, and over its windows
    that hold a call over `limit_ms` (NaN with none): what the rest of the machine did while calls queued."""
    starts = [end - ms / 1000 for ms, end in zip(latency_ms, ends, strict=True)]
    if not starts:
        return {}
    first, last = int(min(starts) / WINDOW_S), int(max(ends) / WINDOW_S)
    timed = {w: v for w, v in windows.items() if first <= w <= last}
    slow_windows = _slow_windows(latency_ms, ends, limit_ms)
    slow = [v for w, v in timed.items() if w in slow_windows]

    def mean(rows: list[tuple[float, float]], i: int) -> float:
        return round(statistics.fmean(r[i] for r in rows), 3) if rows else float("nan")

    rows = list(timed.values())
    return {"busy": mean(rows, 0), "steal": mean(rows, 1), "slow_busy": mean(slow, 0), "slow_steal": mean(slow, 1)}


async def _phase_with_cpu(pid: int, redis_pid: int | None, *phase_args, **phase_kwargs) -> tuple[dict, dict]:
    """A `_phase`, and who else used the machine during it: the CPU seconds of the proxy (process
    `pid` and its children) and of Redis (NaN where /proc cannot tell), and the machine's busy and
    stolen share in each window (`_machine_windows`). The clients' own is in the phase's result."""
    from brigade_bench.system import process_cpu_s

    def cpu() -> tuple[float | None, float | None]:
        return process_cpu_s(pid, children=True), process_cpu_s(redis_pid)

    before = cpu()
    async with _machine_windows() as windows:
        result = await _phase(*phase_args, **phase_kwargs)
    after = cpu()
    spent = [float("nan") if a is None or b is None else b - a for a, b in zip(before, after, strict=True)]
    return result, {"proxy": spent[0], "redis": spent[1], "windows": dict(windows)}


def _cores(phase: dict, *cpu_s: float) -> float:
    """Cores that these CPU seconds, spent over a phase's timed part, kept busy."""
    return sum(cpu_s) * phase["rate"] / max(1, phase["cycles"])


def _who_else(prefix: str, phase: dict, cpu: dict) -> dict:
    """A paced phase's figures beside its latency: what the load clients and Redis spent per cycle
    next to the proxy, the cores the three used together (`phase_cores`: on this machine the load
    generator is not on other machines, as workers are), the machine's busy and stolen share
    (`_machine_during`), the share of calls over the target and the longest stretch of them."""
    n = max(1, phase["cycles"])
    return {
        f"{prefix}clients_cpu_ms_per_cycle": round(1000 * phase["clients_cpu_s"] / n, 3),
        f"{prefix}redis_cpu_ms_per_cycle": round(1000 * cpu["redis"] / n, 3),
        f"{prefix}phase_cores": round(_cores(phase, phase["clients_cpu_s"], cpu["proxy"], cpu["redis"]), 2),
        **{f"{prefix}machine_{k}": v
           for k, v in _machine_during(cpu["windows"], phase["acquire"], phase["ends"], TARGET_P99_MS).items()},
        f"{prefix}over_target_share": round(sum(x > TARGET_P99_MS for x in phase["acquire"]) / n, 4),
        f"{prefix}slow_stretch_s": _longest_slow_stretch_s(phase["acquire"], phase["ends"], TARGET_P99_MS),
    }


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _floor_phases(client_processes: int, cycles: int, rate: float,
                        warmup: int) -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """The one-call and the two-call phase at `rate` against `brigade_bench.floor_server` (gRPC
    alone, no work): each as `_phase_with_cpu` gives it."""
    from brigade_harness.devservers import free_port, wait_for_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "brigade_bench.floor_server", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    target = f"127.0.0.1:{port}"
    try:
        wait_for_port(port, timeout=30, proc=server)
        await _proxy_clients(target, "bench-proxy", CONCURRENCY, min(warmup, cycles), "warm", one_call=True)
        one = await _phase_with_cpu(server.pid, None, target, "bench-proxy", client_processes, cycles, rate,
                                    one_call=True)
        two = await _phase_with_cpu(server.pid, None, target, "bench-proxy", client_processes, cycles, rate)
        return one, two
    finally:
        _stop(server)


async def _saturated_without_pipelining(redis_url: str, processes: int, cycles: int, warmup: int) -> dict:
    """The closed-loop phase again, through a proxy whose store uses plain redis-py."""
    from brigade_harness.devservers import free_port

    port = free_port()
    proxy = _start_proxy(redis_url, port, pipelined=False)
    target = f"127.0.0.1:{port}"
    try:
        run_id = "bench-proxy-redis-py"
        await _create_run(target, run_id, cycles + warmup + 1000)
        await _proxy_clients(target, run_id, CONCURRENCY, min(warmup, cycles), "warm")
        return await _phase(target, run_id, processes, cycles)
    finally:
        _stop(proxy)


async def run(quick: bool = False, client_processes: int = 2, paced_rate: float = 1000.0,
              cycles: int | None = None, paced_seconds: float | None = None, processes: int = PROCESSES) -> dict:
    from brigade_harness.devservers import free_port, start_redis

    cycles = cycles or (4_000 if quick else 20_000)
    paced_cycles = int(paced_rate * (paced_seconds or (3 if quick else 10)))
    light_cycles = int(LIGHT_RATE * (paced_seconds or 2))
    warmup = 500
    run_id = "bench-proxy"
    with tempfile.TemporaryDirectory(prefix="brigade-bench-proxy-") as tmp:
        redis = start_redis(Path(tmp) / "redis")
        try:
            # one process: its capacity, and what 1000 and 200 cycles/s do to it
            port = free_port()
            proxy = _start_proxy(redis.url, port)
            target = f"127.0.0.1:{port}"
            try:
                # every phase's cycles, the warm-ups, and each client's untimed first cycle per phase
                await _create_run(target, run_id, 3 * cycles + 4 * paced_cycles + light_cycles + 3 * warmup + 4000)
                await _proxy_clients(target, run_id, CONCURRENCY, min(warmup, cycles), "warm")
                saturated = await _phase(target, run_id, client_processes, cycles)
                paced, paced_cpu = await _phase_with_cpu(proxy.pid, redis.proc.pid, target, run_id, client_processes,
                                                         paced_cycles, paced_rate)
                light = await _phase(target, run_id, client_processes, light_cycles, LIGHT_RATE)
                # the worker's cycle: one CompleteLease that also acquires the next lease
                one_saturated = await _phase(target, run_id, client_processes, cycles, one_call=True)
                one_paced, one_cpu = await _phase_with_cpu(proxy.pid, redis.proc.pid, target, run_id, client_processes,
                                                           paced_cycles, paced_rate, one_call=True)
            finally:
                _stop(proxy)
            # the same clients and rate against a server that does no work, right after: this minute's floor
            (floor, floor_cpu), (floor_two, floor_two_cpu) = await _floor_phases(client_processes, paced_cycles,
                                                                                 paced_rate, warmup)
            # `--processes N` on one port, the same run
            port = free_port()
            proxy = _start_proxy(redis.url, port, processes=processes)
            target = f"127.0.0.1:{port}"
            try:
                await _proxy_clients(target, run_id, CONCURRENCY, min(warmup, cycles), "warm")
                several_paced, several_cpu = await _phase_with_cpu(proxy.pid, redis.proc.pid, target, run_id,
                                                                   client_processes, paced_cycles, paced_rate)
                several = await _phase(target, run_id, client_processes, cycles)
                several_one, several_one_cpu = await _phase_with_cpu(proxy.pid, redis.proc.pid, target, run_id,
                                                                     client_processes, paced_cycles, paced_rate,
                                                                     one_call=True)
            finally:
                _stop(proxy)
            plain = await _saturated_without_pipelining(redis.url, client_processes, cycles, warmup)
            raw = await _raw_cycles(redis.url, CONCURRENCY, cycles)
            raw_rate = len(raw["acquire_ms"]) / raw["elapsed"]
        finally:
            redis.stop()
    ours = saturated["rate"]
    return {
        # closed loop through one process: 64 clients back to back, as fast as it answers
        "lease_cycles_per_s": round(ours, 1),
        "saturated_acquire_p50_ms": round(statistics.median(saturated["acquire"]), 3),
        "saturated_acquire_p99_ms": round(_percentile(saturated["acquire"], 0.99), 3),
        # open loop: the same 64 clients offering `paced_rate` cycles/s in all, to one process
        "paced_cycles_per_s": round(paced["rate"], 1),
        "acquire_p50_ms": round(statistics.median(paced["acquire"]), 3),
        "acquire_p99_ms": round(_percentile(paced["acquire"], 0.99), 3),
        "complete_p50_ms": round(statistics.median(paced["complete"]), 3),
        "complete_p99_ms": round(_percentile(paced["complete"], 0.99), 3),
        "proxy_cpu_ms_per_cycle": round(1000 * paced_cpu["proxy"] / max(1, paced["cycles"]), 3),
        "proxy_cores": round(_cores(paced, paced_cpu["proxy"]), 3),
        **_who_else("", paced, paced_cpu),
        # the same two with one call per cycle (CompleteLease with `next`), what workers do
        "one_call_cycles_per_s": round(one_saturated["rate"], 1),
        "one_call_paced_cycles_per_s": round(one_paced["rate"], 1),
        "one_call_p50_ms": round(statistics.median(one_paced["acquire"]), 3),
        "one_call_p99_ms": round(_percentile(one_paced["acquire"], 0.99), 3),
        "one_call_cpu_ms_per_cycle": round(1000 * one_cpu["proxy"] / max(1, one_paced["cycles"]), 3),
        **_who_else("one_call_", one_paced, one_cpu),
        # the same clients and rate against a gRPC server that does no work (`brigade_bench.floor_server`)
        "floor_one_call_p50_ms": round(statistics.median(floor["acquire"]), 3),
        "floor_one_call_p99_ms": round(_percentile(floor["acquire"], 0.99), 3),
        "floor_cpu_ms_per_cycle": round(1000 * floor_cpu["proxy"] / max(1, floor["cycles"]), 3),
        "floor_clients_cpu_ms_per_cycle": round(1000 * floor["clients_cpu_s"] / max(1, floor["cycles"]), 3),
        **{f"floor_machine_{k}": v for k, v in _machine_during(floor_cpu["windows"], floor["acquire"], floor["ends"],
                                                               TARGET_P99_MS).items()},
        # and the two-call phase against it: AcquireLease's p99 and the cores used with gRPC alone
        "floor_acquire_p99_ms": round(_percentile(floor_two["acquire"], 0.99), 3),
        "floor_cpu_ms_per_two_call_cycle": round(1000 * floor_two_cpu["proxy"] / max(1, floor_two["cycles"]), 3),
        "floor_phase_cores": round(_cores(floor_two, floor_two["clients_cpu_s"], floor_two_cpu["proxy"]), 2),
        # the same through `--processes N`, and its closed loop
        "processes_acquire_p50_ms": round(statistics.median(several_paced["acquire"]), 3),
        "processes_acquire_p99_ms": round(_percentile(several_paced["acquire"], 0.99), 3),
        "processes_cpu_ms_per_cycle": round(1000 * several_cpu["proxy"] / max(1, several_paced["cycles"]), 3),
        "processes_paced_cycles_per_s": round(several_paced["rate"], 1),
        "processes_cycles_per_s": round(several["rate"], 1),
        "one_call_processes_paced_cycles_per_s": round(several_one["rate"], 1),
        "one_call_processes_p50_ms": round(statistics.median(several_one["acquire"]), 3),
        "one_call_processes_p99_ms": round(_percentile(several_one["acquire"], 0.99), 3),
        "one_call_processes_cpu_ms_per_cycle": round(1000 * several_one_cpu["proxy"] / max(1, several_one["cycles"]), 3),
        # open loop at a fleet-like load: 64 workers, one cycle every 320 ms each
        "light_acquire_p50_ms": round(statistics.median(light["acquire"]), 3),
        "light_acquire_p99_ms": round(_percentile(light["acquire"], 0.99), 3),
        # the same closed loop through a proxy without the pipelining client
        "redis_py_cycles_per_s": round(plain["rate"], 1),
        "redis_py_saturated_acquire_p99_ms": round(_percentile(plain["acquire"], 0.99), 3),
        "raw_cycles_per_s": round(raw_rate, 1),
        "raw_acquire_p99_ms": round(_percentile(raw["acquire_ms"], 0.99), 3),
        "cycle_ratio": round(raw_rate / ours, 3),
        "cycles": sum(p["cycles"] for p in (saturated, paced, light, one_saturated, one_paced, several_paced, several,
                                            several_one)),  # through a proxy (the floor's are not)
        "denied": sum(p["denied"] for p in (saturated, paced, light, one_saturated, one_paced, several_paced, several,
                                            several_one, plain)),
        "concurrency": CONCURRENCY,
        "client_processes": client_processes,
        "processes": processes,
        "target_cycles_per_s": 1000,
        "target_acquire_p99_ms": TARGET_P99_MS,
    }
