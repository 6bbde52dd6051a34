"""`brigade bench topology`: topology local_sgd (K local trainers and an aggregator) against central
(one learner and K rollout workers: the same number of training processes), on the demo task with
the same sample budget, each a real `brigade up`-style system of processes (redis-server, a
local-folder bucket, proxy, janitor); plus local_sgd with K = 2 where one trainer is SIGKILLed mid-round
and restarted, as `brigade up` restarts a service that dies.

Each topology runs at its own tuned settings: central at the demo's (brigade.demo.task.DEMO_RUN),
local_sgd at DEMO_LOCAL_SGD over them (merge frozen_a, plain averaging, twice the inner learning
rate), local_steps H = 4 and M = K (each round waits for every trainer, up to its 30 s
deadline); its number of rounds is the budget over K x H batches. Nothing
is simulated: the real demo model generates on every process, on a 2-core machine that K + 3
processes share, so every wall-clock figure includes CPU contention (and the load of other jobs: the
report gives the load average).

Figures, per configuration (keys start with it: central_k2_, local_sgd_k4_, local_sgd_k2_kill_, ...):
wall_s (from spawning the training processes to the last version, their start-up included),
versions, samples, first20_reward / last20_reward (the mean reward of the first / last 20 batches
trained on, 1,280 samples), heldout_end (the evaluator's score of the last version: 20 held-out
prompts x 4 samples), sync_bytes_per_round and _per_sample (what the bucket carries for training:
written, measured from the bucket; read, counted from the design: the learner reads every rollout,
each of K processes every version; a round is one version), state_bytes_per_round (checkpoints or
round records), staleness_mean; local_sgd also averaging_error (mean over rounds) and
deadline_rounds; the kill run its expired leases and the local steps the killed trainer lost.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import statistics
import time
import uuid
from pathlib import Path

from brigade_bench import system
from brigade_bench.report import loadavg
from brigade_harness.system import read_json_lines

FULL = dict(budget_batches=96, ks=(2, 4), local_steps=4, timeout_s=600)
QUICK = dict(budget_batches=48, ks=(2,), local_steps=4, timeout_s=300)
BATCH_SAMPLES = 8 * 8          # the demo's 8 prompts x 8 completions
LAST_BATCHES = 20


def topology_spec(topology: str, k: int, run_id: str, budget_batches: int, local_steps: int):
    """The demo run (brigade.demo.task.DEMO_RUN) at `budget_batches` batches of training."""
    from brigade.demo.task import DEMO_LOCAL_SGD, DEMO_RUN
    from brigade.spec_file import build_spec, merge_spec_data

    spec = copy.deepcopy(DEMO_RUN)
    spec.update(run_id=run_id, device="cpu", seed=0, eval_every=0, topology=topology, max_steps=budget_batches)
    if topology == "local_sgd":
        spec = merge_spec_data(spec, DEMO_LOCAL_SGD)
        spec["max_steps"] = max(1, budget_batches // (k * local_steps))
        spec["local_sgd"].update(local_steps=local_steps, min_contributions=k, round_timeout_s=30.0)
    return build_spec(spec)


def reward_by_batches(metrics: list[dict], n_batches: int, last: bool) -> float:
    """The sample-weighted mean reward of the first (or last) `n_batches` batches trained on, from
    per-step metrics (a central step holds one batch, a round every batch its contributions trained)."""
    steps = sorted(metrics, key=lambda m: m["step"], reverse=last)
    total = weight = 0.0
    for m in steps:
        batches = m.get("accepted_batches", 1)
        take = min(batches, n_batches - weight)
        if take <= 0:
            break
        total += m["reward_mean"] * take
        weight += take
    return total / weight if weight else float("nan")


def bucket_bytes(root: Path) -> dict[str, int]:
    """Bytes under each top-level folder of a run's prefix in a local-folder bucket."""
    out: dict[str, int] = {}
    for path in root.rglob("*"):
        if path.is_file():
            top = path.relative_to(root).parts[0]
            out[top] = out.get(top, 0) + path.stat().st_size
    return out


def traffic(sizes: dict[str, int], rollout_read: int, k: int, topology: str) -> tuple[int, int]:
    """(training bytes the bucket carries, state bytes written): written as measured, plus what the
    design reads: the learner every rollout object once and each of its K workers every version
    (they prefetch each one published); the aggregator every contribution once and each of the K
    trainers every version it starts a round from (one per round)."""
    adapter_bytes = sizes.get("adapters", 0)
    if topology == "central":
        written = sizes.get("rollouts", 0) + adapter_bytes
        read = rollout_read + k * adapter_bytes
        state = sizes.get("checkpoints", 0)
    else:
        written = sizes.get("contributions", 0) + adapter_bytes
        read = sizes.get("contributions", 0) + k * adapter_bytes
        state = sizes.get("rounds", 0)
    return written + read, state


def run_config(root: Path, topology: str, k: int, cfg: dict, kill: bool = False) -> dict:
    from brigade_cli.up import poll_run, spawn_training, write_spec
    from brigade_evaluator.evaluate import evaluate
    from brigade_harness.system import LocalSystem

    name = f"{topology}_k{k}" + ("_kill" if kill else "")
    run_id = f"topo-{name.replace('_', '-')}-{uuid.uuid4().hex[:6]}"
    spec = topology_spec(topology, k, run_id, cfg["budget_batches"], cfg["local_steps"])
    folder = root / name
    folder.mkdir(parents=True)
    out: dict = {"finished": False}
    with LocalSystem(folder, run=run_id) as sysm:
        sysm.start_servers()
        sysm.start_proxy()
        sysm.create_run(spec)
        write_spec(folder, spec)
        sysm.spawn("janitor", ["janitor"])
        system.progress("topology", f"{name}: {spec.max_steps} {'rounds' if topology == 'local_sgd' else 'steps'}")
        t0 = time.time()
        driver, _ = spawn_training(sysm, spec, k, folder / "run.yaml")
        deadline, killed_at, armed, step = time.monotonic() + cfg["timeout_s"], None, False, 0
        tail = LogTail(sysm.logs / "trainer-0.log")
        while driver.alive() or driver.crashed():
            if time.monotonic() > deadline or sysm.restart_crashed(3):
                break
            time.sleep(0.05 if armed else 0.5)
            if armed and killed_at is None and tail.saw_local_step(2):
                killed_at = time.time()   # mid-round: 2 local steps taken, its leases held, more to come
                sysm.kill("trainer-0", signal.SIGKILL)  # restarted by restart_crashed, as `up` does
                system.progress("topology", f"{name}: trainer-0 SIGKILLed mid-round {step + 1}")
            elif not armed:
                step = sysm.get_run(run_id).learner_step
                armed = kill and step >= spec.max_steps // 3
                tail.skip()  # only steps logged from now on count
        metrics, state, _, _ = asyncio.run(poll_run(sysm.proxy, "", run_id))
        out["finished"] = state.learner_step >= spec.max_steps
        if metrics and state.latest_version:
            out["heldout_end"] = evaluate(run_id, state.latest_version, sysm.bucket, sysm.redis_url)["reward_mean"]
        sizes = bucket_bytes(folder / "bucket" / "runs" / run_id)
        rollout_read = sum(p.stat().st_size for p in (folder / "bucket" / "runs" / run_id).rglob("*.safetensors")
                           if "rollouts" in p.parts)
        out.update(_figures(metrics, state, t0, sizes, rollout_read, k, topology))
        if kill:
            out["killed"] = killed_at is not None
            out["lost_local_steps"] = _lost_steps(sysm.logs / "trainer-0.log", killed_at)
        out["series"] = [(m["time_unix"] - t0, sum(x.get("accepted_samples", 0) for x in metrics if x["step"] <= m["step"]),
                          m["reward_mean"]) for m in sorted(metrics, key=lambda m: m["step"])]
    return out


class LogTail:
    """The new JSON lines of a service's log, read as they come."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def skip(self) -> None:
        _, self.pos = read_json_lines(self.path, self.pos)

    def saw_local_step(self, n: int) -> bool:
        events, self.pos = read_json_lines(self.path, self.pos)
        return any(e.get("event") == "local_step" and e.get("step") == n for e in events)


def _lost_steps(log: Path, killed_at: float | None) -> int:
    """Local steps trainer-0 took after its last contribution, up to the kill: what the kill cost."""
    import datetime as dt

    lost = 0
    for e in read_json_lines(log)[0] if killed_at else []:
        try:
            stamp = dt.datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if stamp > killed_at:
            break
        lost = lost + 1 if e.get("event") == "local_step" else 0 if e.get("event") in (
            "contribution_submitted", "round_lost") else lost
    return lost


def _figures(metrics: list[dict], state, t0: float, sizes: dict[str, int], rollout_read: int, k: int,
             topology: str) -> dict:
    if not metrics:
        return {}
    versions = len(metrics)
    samples = sum(m.get("accepted_samples", 0) for m in metrics)
    moved, state_bytes = traffic(sizes, rollout_read, k, topology)
    out = {
        "wall_s": max(m["time_unix"] for m in metrics) - t0, "versions": versions, "samples": samples,
        "first20_reward": reward_by_batches(metrics, LAST_BATCHES, last=False),
        "last20_reward": reward_by_batches(metrics, LAST_BATCHES, last=True),
        "sync_bytes_per_round": moved / versions, "sync_bytes_per_sample": moved / max(samples, 1),
        "state_bytes_per_round": state_bytes / versions,
        "staleness_mean": statistics.fmean(m.get("staleness_mean", 0.0) for m in metrics),
        "rejected": int(state.rejected + state.stale_removed), "expired_leases": int(state.expired),
    }
    if topology == "local_sgd":
        out["averaging_error"] = statistics.fmean(m.get("averaging_error", 0.0) for m in metrics)
        out["deadline_rounds"] = sum(1 for m in metrics if m.get("contributions", 0) < k)
    return out


def _plot(out: Path, series: dict[str, list], quick: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name, points in series.items():
        if not points:
            continue
        wall, samples, reward = zip(*points, strict=True)
        style = "-o" if name.startswith("local_sgd") else "-"
        axes[0].plot(wall, reward, style, ms=3, label=name)
        axes[1].plot(samples, reward, style, ms=3, label=name)
    axes[0].set_xlabel("wall clock since the training processes were spawned (s)")
    axes[1].set_xlabel("samples trained on")
    for ax in axes:
        ax.set_ylabel("mean reward (accuracy)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("topology: central (learner + K workers) vs local_sgd (K trainers + aggregator)"
                 + (" [quick]" if quick else ""))
    fig.tight_layout()
    path = out / "topology_reward.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, out_dir: str | Path | None = None) -> dict:
    from brigade.model import resolve_model

    cfg = QUICK if quick else FULL
    out = Path(out_dir) if out_dir is not None else Path(os.environ.get("BRIGADE_BENCH_OUT", "bench"))
    system.progress("topology", "starting")
    resolve_model("demo")
    configs = [(t, k, False) for k in cfg["ks"] for t in ("central", "local_sgd")] + [("local_sgd", 2, True)]
    result: dict = {"quick": quick, "budget_batches": cfg["budget_batches"], "local_steps": cfg["local_steps"],
                    "load_before": loadavg()}
    series = {}
    with system.workdir("brigade-bench-topology-") as tmp:
        for topology, k, kill in configs:
            name = f"{topology}_k{k}" + ("_kill" if kill else "")
            r = run_config(Path(tmp), topology, k, cfg, kill)
            series[name] = r.pop("series", [])
            result.update({f"{name}_{key}": round(v, 6) if isinstance(v, float) else v for key, v in r.items()})
            system.progress("topology", f"{name}: done in {r.get('wall_s', float('nan')):.0f} s, last20 reward "
                                        f"{r.get('last20_reward', float('nan')):.3f}")
    result["load_after"] = loadavg()
    result["plot_reward"] = _plot(out, series, quick)
    (out / "topology_series.json").write_text(json.dumps(series))
    system.progress("topology", "done")
    return result


if __name__ == "__main__":
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)))
