"""What the whole-system benchmarks (fleet, preemption) share: the arithmetic that turns a run's
learner metrics and event stream into figures, and reading a run back from its system.

The system is `brigade_testing.audited_system.AuditedSystem.for_hosts`, on the harness `brigade up`
starts too (`brigade_harness.system.LocalSystem`): a redis-server, a local-folder bucket, `brigade
proxy`, `brigade janitor`, one learner and N rollout workers, each its own process. The learner and
the workers run through two small hosts (`python -m brigade_testing.slow_learner`, `python -m
brigade_testing.slow_worker`) that drive the services' own classes (`brigade_learner.learner.Learner`,
`brigade_rollout.worker.Worker`) exactly as their CLIs do, with three differences that only a
benchmark needs:

- a host serves several runs one after the other (the async and the sync run), so torch and the
  model are imported and loaded once, not once per run, and startup cost is out of the figures;
- it waits for a "go" file before each run, so every worker and the learner start together and
  the clock starts at go (the learner is loaded and waiting; no backlog piles up while it loads);
- the worker's engine is wrapped in `brigade_testing.slow_engine.SlowEngine`, and the learner's
  `train_step` in `brigade_testing.slow_learner.simulate_learner_device`: the simulated device speeds.

Simulated device speed. On a 2-core machine shared by a learner, four workers, Redis and the proxy,
real generation time measures CPU contention, not the schedule. So each batch's generation takes
    per_token_s x speed_factor x decode_tokens(batch)
of wall time (`DelayModel`): the real engine generates (the real tokens, log-probs and rewards the
learner trains on), then the worker sleeps until that much time has passed since generation started.
A batched decoder waits for the longest completion of its batch, so `decode_tokens` is the batch's
longest completion, drawn from a lognormal (long tail, capped) seeded by the batch's prompts: the
same batch takes the same number of tokens in the async and the sync run, and on a retry. If the
real generation overruns the simulated time the batch simply takes longer; the engine log counts
that. The learner's device is simulated the same way (a GRPO step takes at least `learner_step_s`;
the real step runs inside it), so that the learner-to-fleet speed ratio is a setting, as it is when
one sizes a real fleet to a real learner, and not an accident of this machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from brigade_testing.audited_system import AuditedSystem

_STARTED: dict[str, float] = {}


def progress(bench: str, message: str) -> None:
    """One line on stderr per phase, with seconds since the benchmark's first line."""
    t0 = _STARTED.setdefault(bench, time.monotonic())
    print(f"[{bench} +{time.monotonic() - t0:5.1f}s] {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def workdir(prefix: str):
    """A temporary folder for one benchmark (logs, bucket, Redis); kept, and named on stderr, when
    BRIGADE_BENCH_KEEP=1."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if os.environ.get("BRIGADE_BENCH_KEEP") == "1":
            print(f"kept {path}", file=sys.stderr)
        else:
            shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- pure pieces


def theoretical_ratio(speed_factors: Sequence[float]) -> float:
    """How much faster async can be than sync when each step needs one batch from every worker:
    async produces at the sum of the rates; sync at the slowest rate times the number of workers.
    (1, 1, 1, 3) -> (1 + 1 + 1 + 1/3) / (4 x 1/3) = 2.5."""
    if not speed_factors or min(speed_factors) <= 0:
        raise ValueError("speed factors must be positive")
    rates = [1.0 / f for f in speed_factors]
    return sum(rates) / (len(rates) * min(rates))


def process_cpu_s(pid: int | None, children: bool = False) -> float | None:
    """CPU seconds (user + system, every thread, exited ones included) that process `pid` has used,
    with `children` its child processes' too (recursively: `brigade proxy --processes`), from
    Linux's /proc; None for no pid or where /proc cannot tell. In clock ticks (10 ms here): read
    it as a difference over a phase or a mean over many calls, not per call."""
    if (fields := _stat_fields(pid)) is None:
        return None
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split() if children else []
        own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
    theirs = [process_cpu_s(int(kid), children=True) for kid in kids]
    return None if None in theirs else own + sum(theirs)


def process_minor_faults(pid: int | None) -> int | None:
    """Minor page faults process `pid` has taken (each a fresh page of memory mapped in on first
    touch: a new 32 MiB buffer is 8,192 of them), from Linux's /proc; None where it cannot tell."""
    if (fields := _stat_fields(pid)) is None:
        return None
    try:
        return int(fields[7])
    except (IndexError, ValueError):
        return None


def _stat_fields(pid: int | None) -> list[str] | None:
    """/proc/{pid}/stat after the process name (which may hold spaces): field 3 (state) first."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


class Ticks(NamedTuple):
    """Clock ticks of every core of this machine since boot (/proc/stat); a tick is 10 ms here."""

    busy: int   # not idle: user, system, interrupts, and steal (the core was not ours)
    steal: int  # the hypervisor ran another machine while this one wanted the core
    total: int


def machine_ticks() -> Ticks | None:
    """This machine's ticks now; None where there is no /proc/stat. Shares of a window are the
    differences of two readings: read them over many windows, not one."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = ticks[3] + ticks[4]  # idle, iowait
    return Ticks(sum(ticks) - idle, ticks[7], sum(ticks))


def shares(before: Ticks | None, after: Ticks | None) -> tuple[float, float] | None:
    """(busy, stolen) share of the machine's core time between two readings; None when unknown or
    no tick passed. Steal is the hypervisor running other machines while this one wanted the core:
    a VM's neighbours, invisible to its load average, show here."""
    if before is None or after is None or after.total <= before.total:
        return None
    ticks = after.total - before.total
    return (after.busy - before.busy) / ticks, (after.steal - before.steal) / ticks


def percentile(values: Iterable[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 1]; NaN for no values."""
    xs = sorted(values)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# ---------------------------------------------------------------- figures from a run


@dataclass
class Event:
    type: str
    t: float                   # unix seconds
    attrs: dict[str, str] = field(default_factory=dict)


def lease_intervals(events: Sequence[Event]) -> dict[str, list[tuple[float, float | None]]]:
    """worker -> [(granted, ended or None)] from LeaseGranted and what ended each lease."""
    open_: dict[str, tuple[str, float]] = {}
    out: dict[str, list[tuple[float, float | None]]] = {}
    for e in events:
        lease = e.attrs.get("lease", "")
        if e.type == "LeaseGranted":
            open_[lease] = (e.attrs.get("worker", ""), e.t)
        elif e.type in ("RolloutCompleted", "LeaseFailed", "LeaseRevoked", "LeaseExpired") and lease in open_:
            worker, t0 = open_.pop(lease)
            out.setdefault(worker, []).append((t0, e.t))
    for worker, t0 in open_.values():
        out.setdefault(worker, []).append((t0, None))
    return out


def busy_seconds(intervals: Sequence[tuple[float, float | None]], t0: float, t1: float) -> float:
    """Time inside [t0, t1] covered by the intervals (an open interval runs to t1)."""
    spans = sorted((max(a, t0), min(b if b is not None else t1, t1)) for a, b in intervals)
    total, cur_a, cur_b = 0.0, None, None
    for a, b in spans:
        if b <= a:
            continue
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def staleness_counts(metrics: Sequence[dict]) -> dict[int, int]:
    out: dict[int, int] = {}
    for m in metrics:
        for k, v in m.items():
            if k.startswith("staleness/"):
                out[int(k.split("/", 1)[1])] = out.get(int(k.split("/", 1)[1]), 0) + int(v)
    return out


def run_figures(metrics: Sequence[dict], events: Sequence[Event], t_go: float, workers: int,
                killed: dict[str, float] | None = None) -> dict:
    """The figures of one run, from go to its last step in `metrics`.

    learner_idle: time the learner sat waiting for rollouts over steps 2..N (step 1 also waits for
    the pipeline to fill, in both modes; learner_idle_from_go counts it too). rollout_idle: the
    share of worker-seconds from go to step N in which a worker held no lease (`killed`: worker ->
    the time it was killed; the lease it held then is not work from there on)."""
    steps = sorted(metrics, key=lambda m: m["step"])
    if not steps:
        return {"steps": 0}
    t_end = steps[-1]["time_unix"]
    wall = t_end - t_go
    samples = sum(m.get("accepted_samples", 0) for m in steps)
    later = steps[1:]
    idle = (sum(m["wait_s"] for m in later) / max(1e-9, sum(m["step_s"] for m in later))) if later else float("nan")
    first = steps[0]
    pre_go = max(0.0, t_go - (first["time_unix"] - first["step_s"]))
    idle_go = max(0.0, sum(m["wait_s"] for m in steps) - pre_go) / max(wall, 1e-9)
    busy = sum(m["step_s"] - m["wait_s"] for m in later) / max(1, len(later)) if later else float("nan")
    in_window = [e for e in events if e.t <= t_end + 1e-3]
    by_worker = lease_intervals(in_window)
    for worker, t_kill in (killed or {}).items():
        by_worker[worker] = [(a, t_kill if b is None or b > t_kill else b) for a, b in by_worker.get(worker, [])]
    rollout_busy = sum(busy_seconds(iv, t_go, t_end) for iv in by_worker.values())
    stal = staleness_counts(steps)
    accepted = sum(stal.values()) or sum(m.get("accepted_batches", 0) for m in steps)
    rejected = sum(m.get("rejected_batches", 0) for m in steps)
    janitor_removed = sum(1 for e in in_window if e.type == "RolloutRejected")
    revoked = sum(1 for e in in_window if e.type == "LeaseRevoked")
    expired = sum(1 for e in in_window if e.type == "LeaseExpired")
    rewards = [m.get("reward_mean", float("nan")) for m in steps]
    gaps = [b["time_unix"] - a["time_unix"] for a, b in zip(steps, steps[1:], strict=False)]
    return {
        "steps": len(steps),
        "wall_s": wall,
        "samples": samples,
        "samples_per_s": samples / max(wall, 1e-9),
        "steps_per_s": len(steps) / max(wall, 1e-9),
        "learner_idle": idle,
        "learner_idle_from_go": idle_go,
        "learner_busy_per_step_s": busy,
        "rollout_idle": 1.0 - rollout_busy / max(1e-9, workers * wall),
        "staleness_mean": sum(k * n for k, n in stal.items()) / max(1, accepted),
        "staleness_max": max((k for k, n in stal.items() if n), default=0),
        "rejection_rate": (rejected + janitor_removed) / max(1, rejected + janitor_removed + accepted),
        "rejected_batches": rejected + janitor_removed,
        "revoked_leases": revoked,
        "expired_leases": expired,
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "first_step_s": first["time_unix"] - t_go,
        "max_step_gap_s": max([first["time_unix"] - t_go, *gaps]),
    }


def batch_seconds(events: Sequence[Event]) -> dict[str, list[float]]:
    """worker -> durations of its completed leases (granted -> RolloutCompleted)."""
    granted: dict[str, tuple[str, float]] = {}
    out: dict[str, list[float]] = {}
    for e in events:
        if e.type == "LeaseGranted":
            granted[e.attrs.get("lease", "")] = (e.attrs.get("worker", ""), e.t)
        elif e.type == "RolloutCompleted" and e.attrs.get("lease", "") in granted:
            worker, t0 = granted.pop(e.attrs["lease"])
            out.setdefault(worker, []).append(e.t - t0)
    return out


def barrier_release_s(events: Sequence[Event]) -> list[float]:
    """Sync mode: for each lease granted at version v, seconds since AdapterPublished(v). The time a
    worker sits at the barrier after what it waits for exists: the lease poll interval."""
    published: dict[int, float] = {}
    out = []
    for e in events:
        if e.type == "AdapterPublished":
            published[int(e.attrs.get("version", "0"))] = e.t
        elif e.type == "LeaseGranted" and e.attrs.get("attempt") == "1":
            v = int(e.attrs.get("version", "0"))
            if v in published:
                out.append(e.t - published[v])
    return out


def reward_noise_check(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Paired per-step reward difference a - b: (mean, standard error)."""
    d = [x - y for x, y in zip(a, b, strict=False) if x == x and y == y]
    if len(d) < 2:
        return float("nan"), float("nan")
    return statistics.fmean(d), statistics.stdev(d) / math.sqrt(len(d))

# ---------------------------------------------------------------- a run of the system, read back


def run_metrics(sysm: AuditedSystem, run: str) -> tuple[list[dict], object]:
    """The run's step metrics, by step, and its RunState, through the proxy."""
    from brigade_cli.up import poll_run

    metrics, state, _, _ = asyncio.run(poll_run(sysm.proxy, sysm.token, run))
    return sorted(metrics, key=lambda m: m["step"]), state


def run_events(sysm: AuditedSystem, run: str) -> list[Event]:
    """The run's event stream, from Redis."""
    import redis

    from brigade import keys

    r = redis.Redis.from_url(sysm.redis_url)
    try:
        rows = r.xrange(keys.RunKeys(run).events, "-", "+")
    finally:
        r.close()
    out = []
    for entry_id, fields in rows:
        attrs = {k.decode(): v.decode() for k, v in fields.items()}
        out.append(Event(attrs.pop("type", ""), int(entry_id.decode().split("-")[0]) / 1000, attrs))
    return out


def run_result(sysm: AuditedSystem, run: str, steps: int, t_go: float, finished: bool, workers: int,
               killed: dict[str, float] | None = None) -> dict:
    """What a benchmark keeps of a run after `AuditedSystem.run_until`: its first `steps` metrics, its
    events, when it went and ended, and its figures."""
    metrics = run_metrics(sysm, run)[0][:steps]
    events = run_events(sysm, run)
    t_end = metrics[-1]["time_unix"] if metrics else time.time()
    return {"metrics": metrics, "events": events, "t_go": t_go, "t_end": t_end, "finished": finished,
            "figures": run_figures(metrics, events, t_go, workers, killed=killed)}
