"""`brigade bench scale`: how the control plane's costs grow with what a large deployment has more
of: workers, proxy replicas, leases in flight, prompts per run and batches through a run.

    brigade bench scale [--quick] [--json]

Each part runs on a redis-server of its own; requests go through real `brigade proxy` processes over
loopback gRPC, the janitor and batch parts drive `brigade.store` (its Lua scripts) directly.

workers   10, 100 and 1,000 simulated rollout workers: each leases a batch, holds it while it
          "generates", heartbeating every lease_seconds / 3 as the real worker does, and completes
          it. Together they offer OFFERED_RATE cycles/s whatever their number (each cycle lasts
          workers / rate seconds), so the figures show what more workers cost, not more load:
          AcquireLease and CompleteLease p50 / p99, cycles and heartbeats per second.
replicas  the lease cycle closed loop (64 clients back to back in 2 client processes) through 1, 2
          and 4 proxy processes on one Redis: cycles/s, and the CPU cores Redis, the proxies and
          the clients used (what limits it on this machine).
janitor   one janitor pass over a run (`Sweeps.sweep`) with 100 to 100,000 leases in flight and
          nothing due: Redis CPU per pass (INFO cpu, main thread) and wall time; then one pass that
          takes back 1 % of them, and one after a version is published.
prompts   CreateRun with 1,000 to 1,000,000 prompts (100,000 in quick mode) through one proxy; the
          run's first AcquireLease on a second proxy that never saw it (it reads the prompts once)
          less a warm one; the Redis bytes of the run.
batches   a synthetic driver (no model: 64 workers and a learner that acks and publishes a version
          per ack) through 10,000, 100,000 and 1,000,000 batches (1,000 to 100,000 in quick mode),
          compacting finished epochs every COMPACT_EVERY batches, as the janitor does every minute
          (at 5,000 batches a minute): the Redis bytes of the run after each.

Each curve is fitted as y = a * x^k on log-log axes; `<curve>_exponent` is k (1 = linear, 0 = flat).
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import tempfile
import time
from pathlib import Path

from brigade_bench.proxy import (
    _create_run,
    _percentile,
    _proxy_clients,
    _proxy_clients_in_processes,
    _start_proxy,
    _stop,
)

OFFERED_RATE = 100.0  # lease cycles per second the simulated fleet offers in all, whatever its size
LEASE_SECONDS = 15    # so workers heartbeat every 5 s (lease_seconds / 3, as brigade_rollout does)
COMPACT_EVERY = 5_000  # batches between the batch driver's compactions (the janitor compacts every minute)
FULL = dict(workers=(10, 100, 1000), measure_s=30.0, replicas=(1, 2, 4), replica_cycles=10_000,
            leases=(100, 1_000, 10_000, 100_000), prompts=(1_000, 10_000, 100_000, 1_000_000),
            batches=(10_000, 100_000, 1_000_000))
QUICK = dict(workers=(10, 100, 1000), measure_s=8.0, replicas=(1, 2, 4), replica_cycles=3_000,
             leases=(100, 1_000, 10_000, 100_000), prompts=(1_000, 10_000, 100_000),
             batches=(1_000, 10_000, 100_000))
# curve name -> (x label, y label, x key pattern, y key pattern)
CURVES = {
    "acquire_p99_vs_workers": ("workers", "AcquireLease p99 (ms)", "acquire_p99_ms_at_{}_workers"),
    "complete_p99_vs_workers": ("workers", "CompleteLease p99 (ms)", "complete_p99_ms_at_{}_workers"),
    "cycles_vs_replicas": ("proxy replicas", "lease cycles/s", "cycles_per_s_at_{}_replicas"),
    "janitor_sweep_vs_leases": ("leases in flight", "Redis ms per janitor pass", "janitor_sweep_redis_ms_at_{}_leases"),
    "create_run_vs_prompts": ("prompts", "CreateRun (s)", "create_run_s_at_{}_prompts"),
    "first_touch_vs_prompts": ("prompts", "first AcquireLease - warm (s)", "first_touch_s_at_{}_prompts"),
    "run_bytes_vs_prompts": ("prompts", "Redis bytes of the run", "run_bytes_at_{}_prompts"),
    "run_bytes_vs_batches": ("batches through the run", "Redis bytes of the run", "run_bytes_at_{}_batches"),
}
CURVE_X = {"acquire_p99_vs_workers": "workers", "complete_p99_vs_workers": "workers", "cycles_vs_replicas": "replicas",
           "janitor_sweep_vs_leases": "leases", "create_run_vs_prompts": "prompts",
           "first_touch_vs_prompts": "prompts", "run_bytes_vs_prompts": "prompts", "run_bytes_vs_batches": "batches"}


def fit_exponent(xs: list[float], ys: list[float]) -> float:
    """k of the least-squares fit log y = log a + k log x (points with y <= 0 are left out)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len(pts) < 2:
        return float("nan")
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (/proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _spec(run: str, **over):
    from brigade.spec_file import build_spec

    staleness = {"max_staleness": 1_000_000, "lease_seconds": 600} | over.pop("staleness", {})
    return build_spec({"run_id": run, "prompts_per_batch": 1, "batches_per_step": 1, "staleness": staleness} | over)


def _prompts(n: int):
    from brigade.v1 import brigade_pb2 as pb

    return [pb.Prompt(id=str(i), text=f"{i}+1=") for i in range(n)]


async def _redis_cpu_ms(r) -> float:
    info = await r.info("cpu")
    return 1000 * (float(info["used_cpu_user_main_thread"]) + float(info["used_cpu_sys_main_thread"]))


# ---------------------------------------------------------------- workers


async def _fleet(target: str, run: str, workers: int, measure_s: float) -> dict:
    """`workers` simulated workers offering OFFERED_RATE cycles/s in all; latencies of the cycles
    that start after one warm-up cycle each."""
    from brigade import keys
    from brigade.rpc import open_channel
    from brigade.v1 import brigade_pb2 as pb
    from brigade.v1 import brigade_pb2_grpc as pbg

    period, beat_every = workers / OFFERED_RATE, LEASE_SECONDS / 3
    channels = [open_channel(target) for _ in range(max(1, min(16, workers // 16)))]
    stubs = [pbg.LeaseServiceStub(ch) for ch in channels]
    acquire_ms: list[float] = []
    complete_ms: list[float] = []
    counts = {"beats": 0, "denied": 0}
    now = time.perf_counter
    t0 = now()
    warm_until = t0 + period + 1.0
    stop_at = warm_until + measure_s

    async def worker(i: int) -> None:
        stub, wid = stubs[i % len(stubs)], f"sim-{workers}-{i}"
        req = pb.AcquireLeaseRequest(run_id=run, worker_id=wid, capacity_class="spot", engine="sim")
        at = t0 + period * i / workers  # staggered starts, as a fleet's workers come up
        while at < stop_at:
            await asyncio.sleep(max(0.0, at - now()))
            start = now()
            resp = await stub.AcquireLease(req)
            got = now()
            done_at = at + period
            if not resp.granted:
                counts["denied"] += 1
                at = done_at
                continue
            lease = resp.lease
            beat_at = got + beat_every
            while beat_at < done_at:  # "generating": heartbeats at the worker's rate
                await asyncio.sleep(max(0.0, beat_at - now()))
                await stub.Heartbeat(pb.HeartbeatRequest(run_id=run, lease_id=lease.lease_id, worker_id=wid))
                counts["beats"] += start >= warm_until
                beat_at += beat_every
            await asyncio.sleep(max(0.0, done_at - now()))
            b = lease.batch.batch_id
            manifest = pb.RolloutManifest(run_id=run, batch_id=b, attempt=lease.attempt, worker_id=wid,
                                          policy_version=lease.adapter_version,
                                          uri=keys.rollout_key(run, b, lease.attempt), sha256="0" * 64,
                                          num_samples=8, num_tokens=256)
            sent = now()
            await stub.CompleteLease(pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id=wid,
                                                             manifest=manifest))
            if start >= warm_until:
                acquire_ms.append((got - start) * 1000)
                complete_ms.append((now() - sent) * 1000)
            at = done_at

    await asyncio.gather(*(worker(i) for i in range(workers)))
    for ch in channels:
        await ch.close()
    return {"acquire_ms": acquire_ms, "complete_ms": complete_ms, **counts}


async def _workers_part(redis_url: str, sizes: tuple, measure_s: float) -> dict:
    from brigade_harness.devservers import free_port

    port = free_port()
    proxy = _start_proxy(redis_url, port)
    target, out = f"127.0.0.1:{port}", {}
    try:
        for n in sizes:
            run = f"scale-workers-{n}"
            await _create_run(target, run, 20_000, lease_seconds=LEASE_SECONDS)
            r = await _fleet(target, run, n, measure_s)
            out |= {f"acquire_p50_ms_at_{n}_workers": round(statistics.median(r["acquire_ms"]), 3),
                    f"acquire_p99_ms_at_{n}_workers": round(_percentile(r["acquire_ms"], 0.99), 3),
                    f"complete_p50_ms_at_{n}_workers": round(statistics.median(r["complete_ms"]), 3),
                    f"complete_p99_ms_at_{n}_workers": round(_percentile(r["complete_ms"], 0.99), 3),
                    f"cycles_per_s_at_{n}_workers": round(len(r["acquire_ms"]) / measure_s, 1),
                    f"heartbeats_per_s_at_{n}_workers": round(r["beats"] / measure_s, 1),
                    f"denied_at_{n}_workers": r["denied"]}
    finally:
        _stop(proxy)
    return out


# ---------------------------------------------------------------- proxy replicas


async def _replicas_part(redis, counts: tuple, cycles: int) -> dict:
    from brigade_harness.devservers import free_port

    out = {}
    for k in counts:
        ports = [free_port() for _ in range(k)]
        procs = [_start_proxy(redis.url, p) for p in ports]
        targets = ",".join(f"127.0.0.1:{p}" for p in ports)
        try:
            run = f"scale-replicas-{k}"
            await _create_run(f"127.0.0.1:{ports[0]}", run, cycles + 3_000)
            await _proxy_clients(targets, run, 64, 500, "warm")  # every replica has the run cached
            cpu = [cpu_seconds(redis.proc.pid), sum(cpu_seconds(p.pid) for p in procs), os.times()]
            results = await _proxy_clients_in_processes(targets, run, 2, 64, cycles)
            wall = max(r["elapsed"] for r in results)
            after = os.times()
            clients = (after.children_user + after.children_system) - (cpu[2].children_user + cpu[2].children_system)
            out |= {f"cycles_per_s_at_{k}_replicas": round(sum(len(r["acquire_ms"]) for r in results) / wall, 1),
                    f"redis_cores_at_{k}_replicas": round((cpu_seconds(redis.proc.pid) - cpu[0]) / wall, 2),
                    f"proxy_cores_at_{k}_replicas": round((sum(cpu_seconds(p.pid) for p in procs) - cpu[1]) / wall, 2),
                    f"client_cores_at_{k}_replicas": round(clients / wall, 2)}
        finally:
            for p in procs:
                _stop(p)
    out["proxy_scaling_4_over_1"] = round(out[f"cycles_per_s_at_{counts[-1]}_replicas"]
                                          / out[f"cycles_per_s_at_{counts[0]}_replicas"], 3)
    return out


# ---------------------------------------------------------------- janitor


async def _sweep_cost(store, run: str, repeats: int) -> tuple[float, float]:
    """(Redis CPU ms, wall ms) of one janitor pass, averaged over `repeats`, less INFO's own cost."""
    a = await _redis_cpu_ms(store.redis)
    base = await _redis_cpu_ms(store.redis) - a  # one INFO call
    before, t = await _redis_cpu_ms(store.redis), time.perf_counter()
    for _ in range(repeats):
        await store.sweeps.sweep(run)
    wall = (time.perf_counter() - t) * 1000 / repeats
    return max(0.0, (await _redis_cpu_ms(store.redis) - before - base) / repeats), wall


async def _janitor_part(redis_url: str, sizes: tuple) -> dict:
    from brigade import keys
    from brigade.store import Store

    store, run, out = Store(redis_url), "scale-janitor", {}
    k = keys.RunKeys(run)
    try:  # capacity for every lease: batches_per_step x (max_staleness + 1) >= the largest size
        await store.runs.create(_spec(run, batches_per_step=max(sizes), staleness={"max_staleness": 2}),
                                _prompts(max(sizes)))
        await store.redis.set(k.adapter_latest, 3)  # leases at version 3: revocation looks, finds none stale
        gate, have = asyncio.Semaphore(256), 0
        memory = (await store.redis.info("memory"))["used_memory"]

        async def grant(i: int) -> None:
            async with gate:
                assert (await store.leases.acquire(run, f"w{i % 4000}")).granted

        for n in sizes:
            await asyncio.gather(*(grant(i) for i in range(have, n)))
            have = n
            await store.sweeps.sweep(run)  # the first pass of a process also reads the waiting manifests
            redis_ms, wall_ms = await _sweep_cost(store, run, 20)
            out |= {f"janitor_sweep_redis_ms_at_{n}_leases": round(redis_ms, 4),
                    f"janitor_sweep_wall_ms_at_{n}_leases": round(wall_ms, 3)}
        held = (await store.redis.info("memory"))["used_memory"] - memory
        out["redis_bytes_per_lease_in_flight"] = round(held / have, 1)  # hash, stream and PEL entry, 2 index entries
        due = await store.redis.zrange(k.lease_deadlines, 0, max(1, have // 100) - 1)
        await store.redis.zadd(k.lease_deadlines, dict.fromkeys(due, 0))
        before = await _redis_cpu_ms(store.redis)
        swept = await store.sweeps.sweep(run)
        out |= {"janitor_expire_1pct_redis_ms": round(await _redis_cpu_ms(store.redis) - before, 3),
                "janitor_expire_1pct_leases": swept.expired}
        await store.redis.set(k.adapter_latest, 4)  # a new version: the pass reads the waiting manifests too
        before = await _redis_cpu_ms(store.redis)
        await store.sweeps.sweep(run)
        out["janitor_pass_after_publish_redis_ms"] = round(await _redis_cpu_ms(store.redis) - before, 3)
    finally:
        await store.close()
    return out


# ---------------------------------------------------------------- prompts


async def _run_bytes(r, run: str) -> int:
    """Bytes Redis holds for a run's keys (MEMORY USAGE of each, every element counted)."""
    from brigade import keys

    total = 0
    async for key in r.scan_iter(match=keys.RunKeys(run).prefix + "*", count=1000):
        total += await r.memory_usage(key, samples=0) or 0
    return total


async def _prompts_part(redis_url: str, sizes: tuple) -> dict:
    import redis.asyncio as aioredis

    from brigade.rpc import open_channel
    from brigade.v1 import brigade_pb2 as pb
    from brigade.v1 import brigade_pb2_grpc as pbg
    from brigade_harness.devservers import free_port

    ports = [free_port(), free_port()]
    procs = [_start_proxy(redis_url, p) for p in ports]  # one creates the runs, the other touches them first
    r, out = aioredis.from_url(redis_url), {}
    try:
        async with open_channel(f"127.0.0.1:{ports[0]}") as creator, open_channel(f"127.0.0.1:{ports[1]}") as toucher:
            create = creator.unary_unary("/brigade.v1.RunService/CreateRun", request_serializer=None,
                                         response_deserializer=pb.CreateRunResponse.FromString)
            lease = pbg.LeaseServiceStub(toucher)
            for n in sizes:
                run = f"scale-prompts-{n}"
                body = pb.CreateRunRequest(spec=_spec(run, prompts_per_batch=8), prompts=_prompts(n)).SerializeToString()
                t = time.perf_counter()
                await create(body, timeout=600)
                created = time.perf_counter() - t
                times = []
                for worker in ("first", "warm"):
                    t = time.perf_counter()
                    assert (await lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=worker),
                                                     timeout=600)).granted
                    times.append(time.perf_counter() - t)
                out |= {f"create_run_s_at_{n}_prompts": round(created, 4),
                        f"first_touch_s_at_{n}_prompts": round(max(1e-5, times[0] - times[1]), 4),
                        f"run_bytes_at_{n}_prompts": await _run_bytes(r, run),
                        f"request_bytes_at_{n}_prompts": len(body)}
    finally:
        await r.aclose()
        for p in procs:
            _stop(p)
    return out


# ---------------------------------------------------------------- batches


async def _batches_part(redis_url: str, checkpoints: tuple) -> dict:
    """Drive batches through one run as fast as the store takes them: 64 workers acquire and complete,
    a learner pulls, acks (with a step's metrics) and publishes a version per ack; at each checkpoint
    the janitor's compaction runs, then the run's bytes are read."""
    from brigade import keys
    from brigade.store import Store
    from brigade.v1 import brigade_pb2 as pb

    store, run = Store(redis_url), "scale-batches"
    await store.runs.create(_spec(run, prompts_per_batch=8, staleness={"max_staleness": 63}), _prompts(1_000))
    out = {"redis_bytes_per_run": await _run_bytes(store.redis, run)}
    state = {"granted": 0, "consumed": 0, "version": 0, "target": 0, "compacted_at": 0}
    metrics = '{"loss": 0.1234, "reward_mean": 0.5, "kl": 0.01, "staleness_mean": 1.5, "tokens_per_s": 1234.5}'
    # the driver's loops stop on this flag, not on cancel alone: redis-py may drop a cancel on Python 3.11
    # (brigade.redis_clients.raise_if_cancelled)
    done = asyncio.Event()

    async def worker(i: int) -> None:
        wid = f"w{i}"
        while not done.is_set():
            if state["granted"] >= state["target"]:
                await asyncio.sleep(0.01)
                continue
            got = await store.leases.acquire(run, wid)
            if not got.granted:
                await asyncio.sleep(0.002)
                continue
            state["granted"] += 1
            lease, b = got.lease, got.lease.batch.batch_id
            await store.leases.complete(run, lease.lease_id, wid, pb.RolloutManifest(
                run_id=run, batch_id=b, attempt=lease.attempt, worker_id=wid, policy_version=lease.adapter_version,
                uri=keys.rollout_key(run, b, lease.attempt), sha256="0" * 64, num_samples=64, num_tokens=2048))

    async def learner() -> None:
        while not done.is_set():
            pulled = await store.learner.pull(run, "learner", 1000)
            if not pulled.rollouts:
                await asyncio.sleep(0.005)
                continue
            state["consumed"] += len(pulled.rollouts)
            await store.learner.ack(run, "learner", [d for d, _ in pulled.rollouts],
                                    [m.batch_id for _, m in pulled.rollouts], [], step=state["consumed"],
                                    metrics_json=metrics)
            if state["consumed"] - state["compacted_at"] >= COMPACT_EVERY:  # the janitor's minute, here
                state["compacted_at"] = state["consumed"]
                await store.sweeps.compact_epochs(run)
            state["version"] += 1
            v = state["version"]
            await store.learner.publish(run, pb.AdapterManifest(run_id=run, version=v, step=state["consumed"],
                                                                uri=keys.adapter_prefix(run, v), payload="bf16"))

    tasks = [asyncio.create_task(worker(i)) for i in range(64)] + [asyncio.create_task(learner())]
    try:
        t = time.perf_counter()
        for n in checkpoints:
            state["target"] = n
            while state["consumed"] < n:
                if stopped := next((t for t in tasks if t.done()), None):
                    stopped.result()  # a driver task that ended early raises what ended it
                    raise RuntimeError("a batch driver task ended early")
                await asyncio.sleep(0.05)
            await store.sweeps.compact_epochs(run)  # what the janitor does every minute
            out[f"run_bytes_at_{n}_batches"] = await _run_bytes(store.redis, run)
        out["driver_batches_per_s"] = round(checkpoints[-1] / (time.perf_counter() - t), 1)
    finally:
        done.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await store.close()
    a, b = checkpoints[-2], checkpoints[-1]
    out["redis_bytes_per_finished_batch"] = round((out[f"run_bytes_at_{b}_batches"]
                                                  - out[f"run_bytes_at_{a}_batches"]) / (b - a), 2)
    return out


# ---------------------------------------------------------------- the benchmark


def _plot(out_dir: Path, result: dict, sizes: dict) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    for ax, (name, (xlabel, ylabel, key)) in zip(axes.flat, CURVES.items(), strict=True):
        xs = [x for x in sizes[CURVE_X[name]] if key.format(x) in result]
        ys = [result[key.format(x)] for x in xs]
        k = result.get(f"{name}_exponent", float("nan"))
        ax.loglog(xs, ys, "o-", ms=4)
        if xs and not math.isnan(k):
            a = math.exp(statistics.fmean(math.log(max(y, 1e-12)) - k * math.log(x) for x, y in zip(xs, ys, strict=True)))
            ax.loglog(xs, [a * x ** k for x in xs], "--", color="gray", lw=1)
        ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{name}: k = {k:.2f}")
        ax.title.set_fontsize(9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(out_dir) / "scale.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


async def run(quick: bool = False, out_dir: str | Path | None = None, cfg: dict | None = None) -> dict:
    from brigade_bench.fleet import out_dir_default
    from brigade_bench.system import progress
    from brigade_harness.devservers import start_redis

    cfg = cfg or (QUICK if quick else FULL)
    sizes = {"workers": cfg["workers"], "replicas": cfg["replicas"], "leases": cfg["leases"],
             "prompts": cfg["prompts"], "batches": cfg["batches"]}
    result: dict = {"quick": quick, "offered_rate": OFFERED_RATE, "lease_seconds": LEASE_SECONDS,
                    "load_before": loadavg()}
    seconds = {}
    with tempfile.TemporaryDirectory(prefix="brigade-bench-scale-") as tmp:
        for part, go in (("workers", lambda url, r: _workers_part(url, cfg["workers"], cfg["measure_s"])),
                         ("replicas", lambda url, r: _replicas_part(r, cfg["replicas"], cfg["replica_cycles"])),
                         ("janitor", lambda url, r: _janitor_part(url, cfg["leases"])),
                         ("prompts", lambda url, r: _prompts_part(url, cfg["prompts"])),
                         ("batches", lambda url, r: _batches_part(url, cfg["batches"]))):
            redis = start_redis(Path(tmp) / part)  # a Redis per part: one part's keys never weigh on another
            progress("scale", f"{part}: {sizes.get({'janitor': 'leases'}.get(part, part))} (load average {loadavg()})")
            t = time.monotonic()
            try:
                result |= await go(redis.url, redis)
            finally:
                redis.stop()
            seconds[part] = round(time.monotonic() - t, 1)
            result[f"load_after_{part}"] = loadavg()
    for name, (_xl, _yl, key) in CURVES.items():
        xs = [x for x in sizes[CURVE_X[name]] if key.format(x) in result]
        result[f"{name}_exponent"] = round(fit_exponent(xs, [result[key.format(x)] for x in xs]), 3)
    result |= {f"seconds_{k}": v for k, v in seconds.items()}
    result["plot_scale"] = _plot(Path(out_dir) if out_dir is not None else out_dir_default(), result, sizes)
    return result
