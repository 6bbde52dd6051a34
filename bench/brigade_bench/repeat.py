"""Repeated runs of one benchmark, for every benchmark alike: `brigade bench NAME --repeat N` and
`brigade bench all --repeat N` run `brigade_bench.<name>.run(...)` N times in a row and summarise.

A figure from one run on a shared machine says little: other jobs' load moves every wall-clock
figure. So each run is recorded with the load average (1, 5, 15 min) just before and just after
it, and each figure is summarised as its median over the runs and its worst run: the largest
value of a figure where lower is better (times, our-over-baseline ratios, idle shares), the
smallest where higher is better (rates, speedups). Which way is better is read off the figure's
name (`better`), so a new benchmark gets the summary without code of its own; a figure whose name
says neither gets its median only. The report judges its targets on the worst run.

The flat summary (what `--json` prints) keeps each figure's key for its median, so a reader of one
run's JSON reads the same keys, and adds `<key>_worst` (with several runs), `repeat`, and
`load_before` / `load_after` (each run's 1-minute load average, comma-separated, in run order) and
`cpu_probe_ms` / `net_probe_ms` (before each run, the time of a fixed piece of work on one core and
of 2,000 loopback TCP round trips: how fast the machine is that minute) and `steal_pct` (during
each run, the share of the machine's core time its hypervisor gave to other machines: load from
neighbours that no load average here shows).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from brigade_bench.system import machine_ticks, shares

# figure names, by the end of the name (or the whole name), whose larger value is better; the
# rest of the numeric names that end like LOWER are better small. Booleans are better true.
HIGHER = ("_per_s", "_mb_s", "speedup", "_vs_theory", "_capacity")
LOWER = ("_ratio", "_ratio_cpu", "_ms", "_s", "_idle", "_idle_from_go", "_loss", "_rejection_rate",
         "_overrun_frac", "denied", "_leases")


# what each run records beside its result, besides the load average (the summary's keys for them)
PROBES = ("cpu_probe_ms", "net_probe_ms", "steal_pct")


def better(key: str) -> str | None:
    """'higher', 'lower' or None (unknown) for a figure's name."""
    name = key.lower()
    if name.endswith(HIGHER) or name.startswith("speedup"):
        return "higher"
    if name.endswith(LOWER):
        return "lower"
    return None


def loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def probes() -> dict[str, float]:
    """The machine's speed before a run, by PROBES: a piece of CPU work and a batch of loopback round trips."""
    return {"cpu_probe_ms": cpu_probe_ms(), "net_probe_ms": net_probe_ms()}


def cpu_probe_ms(rounds: int = 3) -> float:
    """Milliseconds of a fixed piece of work on one core (a Python loop and the sha256 of 16 MiB), the
    best of `rounds`: how fast this machine is right now. The same code measured 0.87 and then 1.16 ms
    of proxy CPU per lease cycle an hour apart on one shared VM; the probe puts that beside each run."""
    import hashlib

    data = bytes(16 << 20)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        sum(i * i for i in range(200_000))
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - t0)
    return round(best * 1000, 1)


def net_probe_ms(trips: int = 2000) -> float:
    """Milliseconds of `trips` one-byte round trips over loopback TCP to a child process: the
    syscalls and context switches a lease cycle is made of. On this VM they slowed by a quarter for
    an hour (raw Redis cycles 3,100 -> 2,300/s) while cpu_probe_ms did not move."""
    import socket
    import subprocess

    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(30)  # a child that never connects fails the probe, not the benchmark's wait
        port = server.getsockname()[1]
        echo = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\n"
                f"s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
                f"for _ in range({trips}):\n    s.sendall(s.recv(1))\n")
        child = subprocess.Popen([sys.executable, "-c", echo])
        conn, _ = server.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            t0 = time.perf_counter()
            for _ in range(trips):
                conn.sendall(b"x")
                conn.recv(1)
            elapsed = time.perf_counter() - t0
        child.wait(10)
    return round(elapsed * 1000, 1)


def load_text(load: tuple[float, float, float] | None) -> str:
    return " ".join(f"{x:.2f}" for x in load) if load else "?"


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and v == v  # NaN is no figure


def worst(key: str, values: list) -> object:
    """The worst of one figure's values over the runs; None where better() does not say."""
    if values and all(isinstance(v, bool) for v in values):
        return min(values)  # a flag (finished, within noise): false is the worse
    nums = [v for v in values if _number(v)]
    way = better(key)
    if not nums or way is None:
        return None
    return min(nums) if way == "higher" else max(nums)


def median(values: list) -> object:
    """Numbers: their median; flags: what most runs said; text (a path, a server name): the last run's."""
    if values and all(isinstance(v, bool) for v in values):
        return sum(values) * 2 > len(values)
    if values and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        nums = [v for v in values if v == v]
        if not nums:
            return float("nan")
        if len(set(nums)) == 1:
            return nums[0]  # a setting, or a count every run agreed on: as the runs gave it
        m = statistics.median(nums)
        return float(f"{m:.6g}") if isinstance(m, float) else m  # the mean of a middle pair: no 16 digits
    return values[-1] if values else None


def summarize(runs: list[dict]) -> dict:
    """One flat dict from the runs' results: each key's median (see the module doc), `<key>_worst`
    where there is a worst (with several runs), `repeat`, each run's 1-minute load average before and
    after, and `runs_failed` when a run raised (its `error` is the last failed run's)."""
    results = [r["result"] for r in runs]
    keys: list[str] = []
    for r in results:
        keys += [k for k in r if k not in keys]
    out: dict = {}
    for k in keys:
        values = [r[k] for r in results if k in r]
        out[k] = median(values)
        if len(runs) > 1:
            w = worst(k, values)
            if w is not None:
                out[f"{k}_worst"] = w
    failed = sum("error" in r for r in results)
    if failed:
        out["runs_failed"] = failed
    out["repeat"] = len(runs)
    for when in ("load_before", "load_after"):
        out[when] = ",".join(f"{r[when][0]:.2f}" if r.get(when) else "?" for r in runs)
    for probe in PROBES:
        out[probe] = ",".join(f"{r[probe]:g}" if r.get(probe) is not None else "?" for r in runs)
    return out


def bench_module(name: str):
    """The module of benchmark `name` (`sync-latency` -> brigade_bench.sync_latency)."""
    return importlib.import_module(f"brigade_bench.{name.replace('-', '_')}")


def default_repeat(name: str, quick: bool) -> int:
    """Runs of `name` when --repeat is not given: 3 with --quick, else 5, or fewer where the
    benchmark's module says its full run is long (`FULL_REPEAT`)."""
    if quick:
        return 3
    return getattr(bench_module(name), "FULL_REPEAT", 5)


def run_once(name: str, quick: bool, out_dir: Path | None = None) -> dict:
    """`brigade_bench.<name>.run(quick[, out_dir])`, sync or async."""
    module = bench_module(name)
    kwargs: dict = {"quick": quick}
    if out_dir is not None and "out_dir" in inspect.signature(module.run).parameters:
        kwargs["out_dir"] = out_dir
    result = module.run(**kwargs)
    if inspect.iscoroutine(result):
        result = asyncio.run(result)
    return result


def run_repeated(name: str, quick: bool, repeat: int, out_dir: Path | None = None,
                 once: Callable[[str, bool, Path | None], dict] = run_once) -> list[dict]:
    """`repeat` runs of one benchmark, one after the other: for each, its result (or {"error": ...},
    with the traceback on stderr: one failed run does not hide the others), seconds, and the load
    average before and after. With several runs, each run's JSON goes to stderr as it finishes."""
    runs = []
    for i in range(1, repeat + 1):
        before, speed = loadavg(), probes()
        t0, ticks0 = time.monotonic(), machine_ticks()
        if repeat > 1:
            print(f"== {name} run {i}/{repeat} (load {load_text(before)}, probes cpu {speed['cpu_probe_ms']:g} ms, "
                  f"net {speed['net_probe_ms']:g} ms)", file=sys.stderr, flush=True)
        try:
            result = once(name, quick, out_dir)
        except Exception as e:  # noqa: BLE001 - recorded as the run's result, its traceback on stderr
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"[:2000]}
        during = shares(ticks0, machine_ticks())
        runs.append({"result": result, "seconds": round(time.monotonic() - t0, 1), "load_before": before,
                     "load_after": loadavg(), **speed, "steal_pct": None if during is None else round(100 * during[1], 1)})
        if repeat > 1:
            print(json.dumps(result), file=sys.stderr, flush=True)
    return runs
