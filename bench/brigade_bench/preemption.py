"""`brigade bench preemption`: kill a rollout worker every K seconds and restart it, against the same
run without kills, in the same benchmark.

The system is the fleet benchmark's (every service a process, simulated device speeds around the
real engine and learner; see `system`), with 4 equal workers and a learner faster than the fleet,
so throughput is set by rollout capacity and a lost worker-second is a lost sample. Every
kill_every_s seconds one worker (round robin) gets SIGKILL, the way a spot VM disappears without
notice: its lease is left to expire (lease_seconds) and the janitor requeues the batch. A new worker
process (new worker id, as a replacement VM would have) starts at once and pays the whole cold
start: Python, torch, the model, the run spec, then its first lease.

Figures: samples per second with and without kills over the same number of learner steps;
throughput_loss = 1 - kill / base; killed_share = the share of worker-seconds the kills took away
(from each kill to the replacement's first lease, plus the in-flight generation the kill threw
away), measured from the event stream. Targets: throughput_loss about killed_share (no more than
1.25 x killed_share + 0.03), and the learner never stalls longer than one lease timeout:
kill_max_step_gap_s < lease_seconds (the largest gap between consecutive learner steps, or from go
to the first step).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from brigade_bench import system
from brigade_bench.fleet import BATCHES_PER_STEP, fleet_spec, out_dir_default
from brigade_testing.audited_system import AuditedSystem
from brigade_testing.slow_engine import DelayModel

WORKERS = 4
FULL = dict(steps=40, kill_every_s=8.0, lease_seconds=8, per_token_ms=25.0, learner_margin=0.6, timeout_s=600)
QUICK = dict(steps=16, kill_every_s=5.0, lease_seconds=6, per_token_ms=25.0, learner_margin=0.6, timeout_s=240)


def killed_share(kills: list[dict], events: list[system.Event], t_go: float, t_end: float, workers: int) -> dict:
    """Worker-seconds each kill took away: down time (kill -> the replacement's first lease) and the
    generation in flight at the kill (its lease was granted before and never completed)."""
    granted: dict[str, list[float]] = {}
    for e in events:
        if e.type == "LeaseGranted":
            granted.setdefault(e.attrs.get("worker", ""), []).append(e.t)
    intervals = system.lease_intervals(events)
    down, wasted = [], []
    for k in kills:
        t_k = k["t"]
        firsts = [t for t in granted.get(k["replacement"], []) if t >= t_k]
        down.append(min(firsts[0] if firsts else t_end, t_end) - t_k)
        open_at_kill = [a for a, b in intervals.get(k["killed"], []) if a <= t_k and (b is None or b > t_k)]
        wasted.append(t_k - open_at_kill[0] if open_at_kill else 0.0)
    lost = sum(d + w for d, w in zip(down, wasted, strict=True))
    return {
        "killed_share": lost / max(1e-9, workers * (t_end - t_go)),
        "restart_s_mean": statistics.fmean(down) if down else float("nan"),
        "restart_s_max": max(down, default=float("nan")),
        "wasted_generation_s_mean": statistics.fmean(wasted) if wasted else float("nan"),
    }


def _plot(out: Path, res: dict, kills: list[dict], every: float, lease_s: float, quick: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for mode, color in (("base", "tab:blue"), ("kill", "tab:red")):
        r = res.get(mode)
        if not r:
            continue
        xs = [0.0] + [m["time_unix"] - r["t_go"] for m in r["metrics"]]
        ax.step(xs, range(len(xs)), where="post", color=color,
                label="no kills" if mode == "base" else f"SIGKILL a worker every {every:g}s")
    if "kill" in res:
        for i, k in enumerate(kills):
            ax.axvline(k["t"] - res["kill"]["t_go"], color="tab:red", lw=0.7, ls=":",
                       label="kill (and restart)" if i == 0 else None)
    ax.set_xlabel("wall clock since go (s)")
    ax.set_ylabel("learner steps")
    ax.set_title(f"preemption: learner progress with and without kills (lease timeout {lease_s:g}s)"
                 + (" [quick]" if quick else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "preemption_steps.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def learner_step_for(delay: DelayModel, margin: float) -> float:
    """The learner's simulated step at which it could consume 1/margin x what the fleet produces."""
    capacity = WORKERS / (delay.per_token_s * delay.mean_tokens())
    return margin * BATCHES_PER_STEP / capacity


def run(quick: bool = False, out_dir: str | Path | None = None) -> dict:
    from brigade.model import resolve_model

    cfg = QUICK if quick else FULL
    out = Path(out_dir) if out_dir is not None else out_dir_default()
    system.progress("preemption", "starting")
    resolve_model("demo")
    delay = DelayModel(per_token_s=cfg["per_token_ms"] / 1000)
    learner_step_s = learner_step_for(delay, cfg["learner_margin"])
    steps, every = cfg["steps"], cfg["kill_every_s"]
    tag = f"{int(time.time()) % 100000}"
    runs = {"base": f"preempt-base-{tag}", "kill": f"preempt-kill-{tag}"}
    res: dict[str, dict] = {}
    kills: list[dict] = []
    with system.workdir("brigade-bench-preempt-") as tmp, \
            AuditedSystem.for_hosts(Path(tmp), janitor_interval=0.5) as sysm:
        for run_id in runs.values():
            sysm.create_run(fleet_spec(run_id, sync=False, steps=steps, max_staleness=4,
                                       lease_seconds=cfg["lease_seconds"]))
        order = list(runs.values())
        learner = sysm.learner_host(order, learner_step_s)
        ids = [f"w{i}" for i in range(WORKERS)]
        slots = {w: sysm.worker_host(w, 1.0, order, delay) for w in ids}
        for mode, run_id in runs.items():
            sysm.wait_signals([f"ready-learner-{run_id}", *(f"ready-{w}-{run_id}" for w in ids)], 180,
                              [learner, *slots.values()])
            current = {w: w for w in ids}

            def tick(t_go: float, mode=mode, run_id=run_id, current=current) -> None:
                if mode != "kill" or time.time() - t_go < every * (len(kills) + 1):
                    return
                slot = ids[len(kills) % WORKERS]
                t_k = time.time()
                sysm.kill(slots[slot].name)  # SIGKILL: no FailLease, the lease must expire
                replacement = f"{slot}-r{len(kills) + 1}"
                slots[slot] = sysm.worker_host(replacement, 1.0, [run_id], delay, name=f"rollout-{replacement}")
                kills.append({"t": t_k, "killed": current[slot], "replacement": replacement, "every": every})
                system.progress("preemption", f"killed {current[slot]}, started {replacement}")
                current[slot] = replacement

            system.progress("preemption", f"{mode} run: go ({steps} steps)")
            t_go, finished = sysm.run_until(run_id, steps, cfg["timeout_s"], [learner], tick=tick)
            system.progress("preemption", f"{mode} run: {'done' if finished else 'TIMED OUT'}, {len(kills)} kills")
            res[mode] = system.run_result(sysm, run_id, steps, t_go, finished, WORKERS,
                                          killed={k["killed"]: k["t"] for k in kills})
            if not finished:
                break
    result: dict = {
        "steps": steps, "workers": WORKERS, "kill_every_s": every, "lease_seconds": cfg["lease_seconds"],
        "per_token_ms": cfg["per_token_ms"], "learner_step_s": round(learner_step_s, 3), "kills": len(kills),
        "quick": quick,
    }
    for mode, r in res.items():
        f = r["figures"]
        result[f"{mode}_finished"] = r["finished"]
        for key in ("wall_s", "samples_per_s", "learner_idle", "rollout_idle", "staleness_mean", "rejection_rate",
                    "expired_leases", "revoked_leases", "max_step_gap_s"):
            v = f.get(key)
            result[f"{mode}_{key}"] = round(v, 4) if isinstance(v, float) else v
    if res.get("base", {}).get("finished") and res.get("kill", {}).get("finished"):
        b, k = res["base"]["figures"], res["kill"]["figures"]
        result["throughput_loss"] = round(1 - k["samples_per_s"] / b["samples_per_s"], 4)
        share = killed_share(kills, res["kill"]["events"], res["kill"]["t_go"], res["kill"]["t_end"], WORKERS)
        result |= {key: round(v, 4) for key, v in share.items()}
        result["loss_over_share"] = round(result["throughput_loss"] / max(1e-9, share["killed_share"]), 3)
        result["stall_within_lease"] = bool(k["max_step_gap_s"] < cfg["lease_seconds"])
    result["plot_steps"] = _plot(out, res, kills, every, cfg["lease_seconds"], quick)
    (out / "preemption_steps.json").write_text(json.dumps(
        {"kills": kills, **{mode: {"t_go": r["t_go"], "step_times": [m["time_unix"] for m in r["metrics"]]}
                            for mode, r in res.items()}}, indent=1))
    return result


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)))
