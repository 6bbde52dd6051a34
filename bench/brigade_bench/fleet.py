"""`brigade bench fleet`: the same GRPO run, asynchronous (as designed) and synchronous (spec.sync:
a batch of step n is granted only once adapter v >= n is published, so every worker waits at a
barrier for the new adapter before its next batch, as NCCL-coupled GRPO does), on one
heterogeneous fleet, in the same benchmark.

Fleet: 4 rollout workers with speed factors 1, 1, 1 and 3 (one straggler three times slower) and
long-tailed completion lengths, batches_per_step = 4 (sync: one batch per worker per step). On a
2-core machine the device speeds are simulated by a per-token delay around the real engine
(`brigade_testing.slow_engine`: the batch takes per_token_ms x factor x its longest completion in tokens,
a capped lognormal draw seeded by the batch), so the schedule, not CPU contention, decides the
result. Everything else is real: the demo model generates, rewards are scored, rollouts go through
the bucket, the proxy leases, the janitor sweeps, the learner trains, checkpoints and publishes.

Figures (async_*, sync_*): wall clock from go to N learner steps, accepted samples per second,
learner idle fraction (waiting for rollouts, steps 2..N), rollout idle fraction (worker-seconds
holding no lease), mean and max staleness of what was trained on, rejection rate, mean reward.
speedup = sync wall / async wall; theoretical_ratio = sum of rates / (slowest rate x workers).
Targets: speedup >= 2.0 and >= 0.95 x theoretical_ratio; async learner idle < 10 %; reward per step
within noise of sync (paired per-step difference within 2 standard errors of 0).

Sizing: async keeps the learner busy only if the fleet produces batches at least as fast as the
learner consumes them, whatever the queue depth (admission only smooths the variance), exactly as
one sizes a real spot fleet to its learner. The learner's device is simulated too (a GRPO step takes
learner_step_s, the real step running inside it), set so that the fleet's capacity is
capacity_margin (1.2) x what the learner consumes; fleet_to_learner_capacity is what the run
measured. The sync run then pays, per step, the slowest batch of the step plus the learner step
plus the barrier; the async run overlaps them. That is why the measured speedup can exceed
theoretical_ratio, which counts the rollout schedule alone. A worker refused at the sync barrier
wakes on the AdapterPublished event it waits for; sync_barrier_release_s is how long it sat at the
barrier after its adapter was published.

Which batch of a sync step the straggler happens to lease (whoever asks first after the barrier
gets the next batch) decides that step's length: 3x a long-tail draw, or 3x a short one. In a short
run that luck moves the sync wall clock, and so the speedup, by a quarter either way while the async
run, which averages over every draw, stays within a few per cent. sync_assignment_luck_s measures it:
for each sync step in which every worker ran one batch, the step's rollout time had the speed factors
fallen on its batches at random (the mean over every assignment), minus what it was; positive when
the straggler drew short batches. speedup_fair_assignment = (sync wall + that) / async wall.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import statistics
import time
from pathlib import Path

from brigade_bench import system
from brigade_testing.audited_system import AuditedSystem
from brigade_testing.slow_engine import DelayModel

FACTORS = (1.0, 1.0, 1.0, 3.0)
BATCHES_PER_STEP = 4
PROMPTS_PER_BATCH = 8
# max_staleness 2: admission holds at most 3 steps of work outstanding, which keeps the learner fed
# through the long tail while staleness (and so the per-step reward lag) stays low; capacity_margin:
# the fleet can deliver 1.2x what the learner consumes (measured: fleet_to_learner_capacity).
FULL = dict(steps=30, max_staleness=2, per_token_ms=25.0, median_tokens=24, sigma=0.6, cap_tokens=96,
            capacity_margin=1.2, timeout_s=900)
QUICK = dict(steps=12, max_staleness=2, per_token_ms=25.0, median_tokens=24, sigma=0.6, cap_tokens=96,
             capacity_margin=1.2, timeout_s=240)


def out_dir_default() -> Path:
    return Path(os.environ.get("BRIGADE_BENCH_OUT", "bench"))


def fleet_spec(run_id: str, *, sync: bool, steps: int, max_staleness: int, lease_seconds: int = 60,
               batches_per_step: int = BATCHES_PER_STEP):
    """The demo run (`brigade.demo.task.DEMO_RUN`: model, LoRA, learning rate, KL anchor and sampling
    verified to climb) at `batches_per_step` batches of 8 prompts a step, without the evaluator."""
    import copy

    from brigade.demo.task import DEMO_RUN
    from brigade.spec_file import build_spec

    spec = copy.deepcopy(DEMO_RUN)
    spec.update({"run_id": run_id, "device": "cpu", "seed": 0, "prompts_per_batch": PROMPTS_PER_BATCH,
                 "batches_per_step": batches_per_step, "max_steps": steps, "sync": sync, "eval_every": 0})
    spec["staleness"] = dict(spec.get("staleness", {}), max_staleness=max_staleness, lease_seconds=lease_seconds)
    return build_spec(spec)


def sizing(delay: DelayModel, margin: float) -> float:
    """The learner's simulated step (seconds) at which the fleet's capacity is `margin` x what the
    learner consumes: sum over workers of 1 / mean batch time = margin x batches_per_step / step."""
    capacity = sum(1.0 / (delay.per_token_s * f * delay.mean_tokens()) for f in FACTORS)   # batches/s
    return margin * BATCHES_PER_STEP / capacity


def _sem(values: list[float]) -> float:
    """Standard error of the mean; 0 for a single value."""
    return statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0


def _plots(out: Path, res: dict, quick: bool) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    colors = {"async": "tab:blue", "sync": "tab:orange"}
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for mode, r in res.items():
        steps = [m["step"] for m in r["metrics"]]
        reward = [m.get("reward_mean", float("nan")) for m in r["metrics"]]
        wall = [m["time_unix"] - r["t_go"] for m in r["metrics"]]
        # each point averages a step's samples: a band of one standard error (std / sqrt(samples))
        err = [m.get("reward_std", 0.0) / max(m.get("accepted_samples", 1), 1) ** 0.5 for m in r["metrics"]]
        for ax, x in ((axes[0], steps), (axes[1], wall)):
            ax.plot(x, reward, "-o", ms=3, color=colors[mode], label=mode)
            ax.fill_between(x, [y - e for y, e in zip(reward, err, strict=True)],
                            [y + e for y, e in zip(reward, err, strict=True)], color=colors[mode], alpha=0.2, lw=0)
        versions = sorted(v for v in r["by_version"] if v < len(r["metrics"]))
        # each point averages the batches one version generated: error bars of one standard error
        axes[2].errorbar(versions, [statistics.fmean(r["by_version"][v]) for v in versions],
                         yerr=[_sem(r["by_version"][v]) for v in versions], fmt="-o", ms=3, capsize=2,
                         color=colors[mode], label=mode)
    axes[0].set_xlabel("learner step (reward of the samples it trained on)")
    axes[1].set_xlabel("wall clock since go (s)")
    axes[2].set_xlabel("adapter version that generated the samples")
    for ax in axes:
        ax.set_ylabel("mean reward (accuracy)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("fleet: reward, async vs sync (4 workers, speed factors 1,1,1,3)" + (" [quick]" if quick else ""))
    fig.tight_layout()
    reward_png = out / "fleet_reward.png"
    fig.savefig(reward_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(2, 1, figsize=(10, 5.2), sharex=True)
    for ax, (mode, r) in zip(axes, res.items(), strict=False):
        t_go = r["t_go"]
        intervals = system.lease_intervals(r["events"])
        workers = sorted(intervals)
        for i, w in enumerate(workers):
            spans = [(a - t_go, ((b if b is not None else r["t_end"]) - a)) for a, b in intervals[w]]
            ax.broken_barh(spans, (i - 0.35, 0.7), color=colors[mode], alpha=0.8)
        for m in r["metrics"]:
            ax.axvline(m["time_unix"] - t_go, color="k", lw=0.6, alpha=0.5)
        ax.set_yticks(range(len(workers)), [f"{w} (x{r['factors'].get(w, 1):g})" for w in workers])
        ax.set_title(f"{mode}: leases held per worker (bars) and learner steps (lines)", fontsize=10)
        ax.set_xlim(0, max(rr["t_end"] - rr["t_go"] for rr in res.values()) * 1.02)
    axes[-1].set_xlabel("wall clock since go (s)")
    fig.tight_layout()
    timeline_png = out / "fleet_timeline.png"
    fig.savefig(timeline_png, dpi=110)
    plt.close(fig)
    return {"plot_reward": str(reward_png), "plot_timeline": str(timeline_png)}


def run(quick: bool = False, out_dir: str | Path | None = None) -> dict:
    from brigade.model import resolve_model

    cfg = QUICK if quick else FULL
    out = Path(out_dir) if out_dir is not None else out_dir_default()
    system.progress("fleet", "starting")
    resolve_model("demo")  # build the demo model once, before the processes race to
    delay = DelayModel(per_token_s=cfg["per_token_ms"] / 1000, median_tokens=cfg["median_tokens"],
                       sigma=cfg["sigma"], cap_tokens=cfg["cap_tokens"])
    learner_step_s = sizing(delay, cfg["capacity_margin"])
    steps = cfg["steps"]
    tag = f"{int(time.time()) % 100000}"
    runs = {"async": f"fleet-async-{tag}", "sync": f"fleet-sync-{tag}"}
    res: dict[str, dict] = {}
    with system.workdir("brigade-bench-fleet-") as tmp, AuditedSystem.for_hosts(Path(tmp)) as sysm:
        for mode, run_id in runs.items():
            sysm.create_run(fleet_spec(run_id, sync=mode == "sync", steps=steps, max_staleness=cfg["max_staleness"]))
        order = list(runs.values())
        learner = sysm.learner_host(order, learner_step_s)
        ids = [f"w{i}" for i in range(len(FACTORS))]
        hosts = [learner] + [sysm.worker_host(w, f, order, delay) for w, f in zip(ids, FACTORS, strict=True)]
        for mode, run_id in runs.items():
            sysm.wait_signals([f"ready-learner-{run_id}", *(f"ready-{w}-{run_id}" for w in ids)], 180, hosts)
            system.progress("fleet", f"{mode} run: go ({steps} steps)")
            t_go, finished = sysm.run_until(run_id, steps, cfg["timeout_s"], hosts)
            system.progress("fleet", f"{mode} run: {'done' if finished else 'TIMED OUT'}")
            res[mode] = {**system.run_result(sysm, run_id, steps, t_go, finished, len(FACTORS)),
                         "engine": sysm.engine_log(run_id), "factors": dict(zip(ids, FACTORS, strict=True)),
                         "by_version": sysm.rollout_rewards(run_id)}
            if not finished:
                break
    out.mkdir(parents=True, exist_ok=True)
    keep = ("step", "time_unix", "reward_mean", "staleness_mean", "wait_s", "step_s", "accepted_samples",
            "rejected_batches", "loss", "kl", "clip_low_frac", "clip_high_frac", "real_train_s")
    (out / "fleet_steps.json").write_text(json.dumps(
        {mode: {"t_go": r["t_go"], "steps": [{k: m[k] for k in keep if k in m} for m in r["metrics"]]}
         for mode, r in res.items()}, indent=1))
    result = summarize(res, cfg, delay, learner_step_s, quick) | _plots(out, res, quick)
    system.progress("fleet", "done")
    return result


def assignment_luck_s(engine: list[dict], events: list[system.Event], delay: DelayModel) -> tuple[float, int]:
    """Sync run: (seconds, steps counted) by which its rollout critical path was shorter than with
    the speed factors assigned to each step's batches at random (see the module doc). A step's batches
    are those started between AdapterPublished(v) and AdapterPublished(v + 1): in sync mode no batch
    of step v starts before v is published, and v + 1 is published only after all of them. Steps in
    which a worker ran two batches (or a batch was retried) are left out."""
    published = sorted(e.t for e in events if e.type == "AdapterPublished")
    steps: dict[int, list[dict]] = {}
    for row in engine:
        steps.setdefault(bisect.bisect_right(published, row["t0"]), []).append(row)
    assignments = list(itertools.permutations(FACTORS))
    luck, counted = 0.0, 0
    for rows in steps.values():
        if sorted(r["factor"] for r in rows) != sorted(FACTORS):  # one batch a worker, no more, no fewer
            continue
        tokens = [r["tokens"] for r in rows]
        actual = max(r["factor"] * r["tokens"] for r in rows)
        expected = statistics.fmean(max(f * t for f, t in zip(a, tokens, strict=True)) for a in assignments)
        luck += (expected - actual) * delay.per_token_s
        counted += 1
    return luck, counted


def summarize(res: dict, cfg: dict, delay: DelayModel, learner_step_s: float, quick: bool) -> dict:
    theory = system.theoretical_ratio(FACTORS)
    out: dict = {
        "steps": cfg["steps"], "workers": len(FACTORS), "speed_factors": ",".join(f"{f:g}" for f in FACTORS),
        "batches_per_step": BATCHES_PER_STEP, "samples_per_batch": PROMPTS_PER_BATCH * 8,
        "max_staleness": cfg["max_staleness"], "per_token_ms": round(delay.per_token_s * 1e3, 2),
        "median_tokens": delay.median_tokens, "sigma": delay.sigma, "cap_tokens": delay.cap_tokens,
        "mean_tokens": round(delay.mean_tokens(), 2), "learner_step_s": round(learner_step_s, 3),
        "capacity_margin": cfg["capacity_margin"],
        "theoretical_ratio": round(theory, 3), "quick": quick,
    }
    for mode, r in res.items():
        f = r["figures"]
        out[f"{mode}_finished"] = r["finished"]
        for key in ("steps", "wall_s", "samples_per_s", "learner_idle", "learner_idle_from_go", "rollout_idle",
                    "staleness_mean", "staleness_max", "rejection_rate", "revoked_leases", "reward_mean",
                    "learner_busy_per_step_s", "max_step_gap_s"):
            if key in f:
                v = f[key]
                out[f"{mode}_{key}"] = round(v, 4) if isinstance(v, float) else v
        eng = r["engine"]
        out[f"{mode}_engine_overrun_frac"] = round(sum(e["overrun"] for e in eng) / max(1, len(eng)), 4)
    a, s = res.get("async"), res.get("sync")
    if a and s and a["finished"] and s["finished"]:
        speedup = s["figures"]["wall_s"] / a["figures"]["wall_s"]
        out["speedup"] = round(speedup, 3)
        out["speedup_vs_theory"] = round(speedup / theory, 3)
        release = system.barrier_release_s(s["events"])
        rel = statistics.fmean(release) if release else 0.0
        out["sync_barrier_release_s"] = round(rel, 3)
        luck, counted = assignment_luck_s(s["engine"], s["events"], delay)
        out["sync_assignment_luck_s"] = round(luck, 2)
        out["sync_assignment_steps"] = counted
        out["speedup_fair_assignment"] = round((s["figures"]["wall_s"] + luck) / a["figures"]["wall_s"], 3)
        ra = [m.get("reward_mean", float("nan")) for m in a["metrics"]]
        rs = [m.get("reward_mean", float("nan")) for m in s["metrics"]]
        diff, se = system.reward_noise_check(ra, rs)
        out["reward_diff_per_step"] = round(diff, 4)
        out["reward_diff_se"] = round(se, 4)
        out["reward_within_noise"] = bool(abs(diff) <= 2 * se) if se == se else False
        # the same comparison by the adapter version that generated the samples (async trains at step
        # k on samples of version k - staleness): does a stale update learn less per version?
        common = sorted(set(a["by_version"]) & set(s["by_version"]) & set(range(len(s["metrics"]))))
        va = [statistics.fmean(a["by_version"][v]) for v in common]
        vs = [statistics.fmean(s["by_version"][v]) for v in common]
        diff_v, se_v = system.reward_noise_check(va, vs)
        out["reward_diff_per_version"] = round(diff_v, 4)
        out["reward_diff_per_version_se"] = round(se_v, 4)
    if a:
        per_worker = system.batch_seconds(a["events"])
        fast = [x for w, xs in per_worker.items() if a["factors"].get(w, 1) == 1 for x in xs]
        slow = [x for w, xs in per_worker.items() if a["factors"].get(w, 1) != 1 for x in xs]
        out["async_fast_batch_s"] = round(statistics.fmean(fast), 3) if fast else float("nan")
        out["async_slow_batch_s"] = round(statistics.fmean(slow), 3) if slow else float("nan")
        # capacity the fleet could deliver (every worker always busy) over what the learner consumes
        capacity = sum(1.0 / statistics.fmean(xs) for xs in per_worker.values() if xs)
        busy = a["figures"].get("learner_busy_per_step_s", float("nan"))
        out["fleet_to_learner_capacity"] = round(capacity * busy / BATCHES_PER_STEP, 3) if busy == busy else float("nan")
    return out


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)))
