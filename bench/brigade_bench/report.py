"""`brigade bench all --report bench/report.md`: every benchmark in one process, one after the other,
each `--repeat` times in a row (`brigade_bench.repeat`), then a Markdown report with the machine, each
benchmark's settings, its figures (median, worst and every run, with the load average before and
after each run), a table of targets (pass / miss, judged on the worst run) and the PNG plots (of
the last run). Each benchmark's flat JSON summary is printed as it finishes; the summaries and every
run's own figures are kept in results.json next to the report. Every ratio in it compares with a
baseline measured in the same run.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from brigade_bench.repeat import (
    PROBES,
    bench_module,
    default_repeat,
    load_text,
    loadavg,
    run_repeated,
    summarize,
)

ORDER = ["bucket", "proxy", "create-stall", "learner", "rollout", "fleet", "sync-latency", "preemption", "topology", "scale", "real",
         "real-gen"]


# ---------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    bench: str
    what: str
    shown: Callable[[dict], str]          # the measured value, as text
    target: Callable[[dict], str]         # the target, as text (may depend on the run, e.g. a theory)
    value: Callable[[dict], float]        # the figure judged; raises KeyError/TypeError when it is missing
    limit: Callable[[dict], float]        # its bound, from the same run
    higher: bool = False                  # value >= limit passes (else value <= limit)
    strict: bool = False                  # > or < instead
    median: bool = False                  # judged on the median of the runs (a noisy learning curve), not the worst

    def margin(self, r: dict) -> float:
        """How far inside its bound one run's figure is, as a share of the bound (< 0: a miss, NaN: none)."""
        v, bound = float(self.value(r)), float(self.limit(r))
        d = v - bound if self.higher else bound - v
        return d / abs(bound) if bound else d

    def check(self, r: dict) -> bool:
        m = self.margin(r)
        return m > 0 if self.strict else m >= 0


def _f(key: str, fmt: str = "{:.3g}", scale: float = 1.0) -> Callable[[dict], str]:
    return lambda r: fmt.format(r[key] * scale)


def _with_floor(key: str, floor: str) -> Callable[[dict], str]:
    """A latency, and the floor measured beside it in the same run (results from before the floor: alone)."""
    def shown(r: dict) -> str:
        text = f"{r[key]:.1f} ms"
        return text + f", floor {r[floor]:.1f} ms" if floor in r else text
    return shown


def _with_cores(key: str, cores: str, floor: str, floor_cores: str) -> Callable[[dict], str]:
    """A latency and the cores its phase used (proxy, load clients, Redis), and the same against the
    floor server in the same run (results from before these were measured: without them)."""
    def shown(r: dict) -> str:
        text = f"{r[key]:.1f} ms"
        if cores in r:
            text += f", phase used {r[cores]:.2f} cores"
        if floor in r and floor_cores in r:
            text += f"; floor {r[floor]:.1f} ms, {r[floor_cores]:.2f} cores"
        return text
    return shown


CARRIED = 0.95  # a p99 "at 1000 cycles/s" stands only where its phase carried this share of that rate


def _p99_at_rate(what: str, shown: Callable[[dict], str], key: str, rate: str) -> Target:
    """A paced phase's p99 against the proxy's target, judged only where the phase carried CARRIED of
    the target rate (`rate` names the figure it carried): clients that fall behind their schedule catch
    up back to back, so a machine that could not keep up measured that p99 at a lower rate, which says
    nothing of the target's. Such a run is a miss (inf) and its text says what was carried. Results
    from before the rate was kept: the p99 alone."""
    def short(r: dict) -> bool:
        return rate in r and r[rate] < CARRIED * r["target_cycles_per_s"]

    def text(r: dict) -> str:
        if short(r):
            return f"{shown(r)}; carried only {r[rate]:.0f} of the {r['target_cycles_per_s']} cycles/s"
        return shown(r)

    return Target("proxy", what, text, lambda r: f"<= {r['target_acquire_p99_ms']} ms",
                  lambda r: math.inf if short(r) else r[key], _key("target_acquire_p99_ms"))


def _pct(key: str) -> Callable[[dict], str]:
    return lambda r: f"{100 * r[key]:.1f} %"


def _const(text: str) -> Callable[[dict], str]:
    return lambda r: text


def _key(key: str) -> Callable[[dict], float]:
    return lambda r: r[key]


def _num(x: float) -> Callable[[dict], float]:
    return lambda r: x


def _theory_bound(r: dict) -> float:
    """The fleet's speedup target: 95 % of the speed factors' theoretical ratio."""
    return 0.95 * r["theoretical_ratio"]


def _theory_shown(r: dict) -> str:
    return f">= 0.95 x {r['theoretical_ratio']:.2f} = {_theory_bound(r):.2f}x"


TARGETS: list[Target] = [
    Target("bucket", "put 34 MiB, library / raw aiobotocore", _f("put_ratio", "{:.2f}x"), _const("<= 1.10x"),
           _key("put_ratio"), _num(1.10)),
    Target("bucket", "get 34 MiB with sha256 check, library / raw aiobotocore", _f("get_ratio", "{:.2f}x"),
           _const("<= 1.10x"), _key("get_ratio"), _num(1.10)),
    Target("bucket", "the same get into one buffer (get_buffer: how adapter files are read), library / raw "
           "aiobotocore", _f("get_buffer_ratio", "{:.2f}x"), _const("<= 1.10x"), _key("get_buffer_ratio"), _num(1.10)),
    Target("proxy", "lease cycles per second (64 clients, closed loop, two calls a cycle)",
           _f("lease_cycles_per_s", "{:.0f}"),
           lambda r: f">= {r['target_cycles_per_s']}", _key("lease_cycles_per_s"), _key("target_cycles_per_s"),
           higher=True),
    _p99_at_rate("AcquireLease p99 at 1000 cycles/s (two calls a cycle); beside it, the cores the proxy, the "
                 "load clients and Redis used together in that phase, and the same clients' p99 and cores against a "
                 "gRPC server that does no work",
                 _with_cores("acquire_p99_ms", "phase_cores", "floor_acquire_p99_ms", "floor_phase_cores"),
                 "acquire_p99_ms", "paced_cycles_per_s"),
    # the worker's cycle: CompleteLease with `next` hands in a batch and takes the next lease
    Target("proxy", "lease cycles per second, one call a cycle (closed loop)", _f("one_call_cycles_per_s", "{:.0f}"),
           lambda r: f">= {r['target_cycles_per_s']}", _key("one_call_cycles_per_s"), _key("target_cycles_per_s"),
           higher=True),
    _p99_at_rate("CompleteLease-with-next p99 at 1000 cycles/s (one call a cycle), one process; beside it, the "
                 "same clients' p99 against a gRPC server that does no work, that minute",
                 _with_floor("one_call_p99_ms", "floor_one_call_p99_ms"), "one_call_p99_ms",
                 "one_call_paced_cycles_per_s"),
    _p99_at_rate("CompleteLease-with-next p99 at 1000 cycles/s (one call a cycle), `--processes 2`",
                 _f("one_call_processes_p99_ms", "{:.1f} ms"), "one_call_processes_p99_ms",
                 "one_call_processes_paced_cycles_per_s"),
    # libs/brigade/brigade/resp.py, a hand-written Redis client, is kept only while it pays
    Target("proxy", "lease cycles/s, pipelining client / plain redis-py (the same proxy cycle)",
           lambda r: f"{r['lease_cycles_per_s'] / r['redis_py_cycles_per_s']:.2f}x", _const(">= 1.10x"),
           lambda r: r["lease_cycles_per_s"] / r["redis_py_cycles_per_s"], _num(1.10), higher=True),
    # a token holder's largest CreateRun calls (max_prompts prompts, then a max_message_bytes message of empty
    # prompts, max_create_runs at once) must not stall everyone else: 2,124 ms p99 (4.0 s max) before bulk.py
    Target("create-stall", "honest AcquireLease p99 (200 calls/s) while the largest CreateRun calls are in flight; "
           "beside it, the same run's p99 without them",
           lambda r: f"{r['loaded_p99_ms']:.1f} ms ({r['stall_p99_ratio']:.1f}x {r['baseline_p99_ms']:.1f} ms), "
                     f"max {r['loaded_max_ms']:.0f} ms",
           _const("<= 100 ms"), _key("loaded_p99_ms"), _num(100.0)),
    Target("learner", "learner step / bare forward+backward", _f("overhead_ratio", "{:.2f}x"), _const("<= 1.3x"),
           _key("overhead_ratio"), _num(1.3)),
    Target("rollout", "adapter fetch (34 MB) / raw GETs", _f("fetch_ratio", "{:.2f}x"), _const("<= 1.5x"),
           _key("fetch_ratio"), _num(1.5)),
    Target("rollout", "hf engine CPU time / plain generate", _f("generate_ratio", "{:.2f}x"), _const("<= 1.15x"),
           _key("generate_ratio"), _num(1.15)),
    Target("fleet", "async speedup to N steps (sync wall / async wall)", _f("speedup", "{:.2f}x"),
           _const(">= 2.0x"), _key("speedup"), _num(2.0), higher=True),
    Target("fleet", "speedup against the speed factors' theoretical ratio", _f("speedup", "{:.2f}x"),
           _theory_shown, _key("speedup"), _theory_bound, higher=True),
    # the sync run's luck (which batch of each step the straggler leased) taken out: brigade_bench.fleet
    Target("fleet", "the same with the sync run's assignment luck taken out (each sync step at the mean over every "
           "assignment of its batches to the speed factors)", _f("speedup_fair_assignment", "{:.2f}x"),
           _theory_shown, _key("speedup_fair_assignment"), _theory_bound, higher=True),
    Target("fleet", "async learner idle (steps 2..N)", _pct("async_learner_idle"), _const("< 10 %"),
           _key("async_learner_idle"), _num(0.10), strict=True),
    Target("fleet", "reward per step, async - sync (paired, per step)",
           lambda r: f"{r['reward_diff_per_step']:+.3f} +- {r['reward_diff_se']:.3f}",
           _const("within noise (|diff| <= 2 SE)"),
           lambda r: abs(r["reward_diff_per_step"]) / (2 * r["reward_diff_se"]), _num(1.0)),
    Target("sync-latency", "publish -> every worker cached, 7B adapter, p50", _f("7b_ratio", "{:.2f}x"),
           _const("<= 1.25x raw GET"), _key("7b_ratio"), _num(1.25)),
    # the control: the same path with the workers' sha256 check off (brigade_bench.sync_latency)
    Target("sync-latency", "the same with the workers' sha256 check off (a control: 4 workers' checks share this "
           "machine's 2 cores with the S3 server)", _f("7b_unchecked_ratio", "{:.2f}x"),
           _const("<= 1.25x raw GET"), _key("7b_unchecked_ratio"), _num(1.25)),
    Target("sync-latency", "publish -> every worker cached, 7B adapter, p95", _f("7b_p95_ratio", "{:.2f}x"),
           _const("<= 1.5x raw GET"), _key("7b_p95_ratio"), _num(1.5)),
    Target("sync-latency", "publish -> every worker cached, demo adapter, p50", _f("demo_ratio", "{:.2f}x"),
           _const("<= 1.25x raw GET"), _key("demo_ratio"), _num(1.25)),
    Target("sync-latency", "publish -> every worker cached, demo adapter, p95", _f("demo_p95_ratio", "{:.2f}x"),
           _const("<= 1.5x raw GET"), _key("demo_p95_ratio"), _num(1.5)),
    Target("topology", "local_sgd merge (frozen_a): product of averaged factors vs average of products",
           _f("local_sgd_k2_averaging_error", "{:.1e}"), _const("<= 1e-6 (exact)"),
           _key("local_sgd_k2_averaging_error"), _num(1e-6)),
    # a run that did not finish, or where no trainer was killed, cannot pass: its loss counts as infinite
    Target("topology", "a trainer SIGKILLed mid-round: local steps lost; the run still finishes",
           lambda r: f"{r['local_sgd_k2_kill_lost_local_steps']} steps",
           lambda r: f"<= local_steps ({r['local_steps']}), finished",
           lambda r: r["local_sgd_k2_kill_lost_local_steps"]
           if r["local_sgd_k2_kill_finished"] and r["local_sgd_k2_kill_killed"] else math.inf,
           _key("local_steps")),
    Target("preemption", "throughput lost to kills", _pct("throughput_loss"),
           lambda r: f"about the killed share {100 * r['killed_share']:.1f} % (<= 1.25 x + 3 pts)",
           _key("throughput_loss"), lambda r: 1.25 * r["killed_share"] + 0.03),
    Target("preemption", "longest learner stall with kills", _f("kill_max_step_gap_s", "{:.1f} s"),
           lambda r: f"< one lease timeout ({r['lease_seconds']} s)",
           _key("kill_max_step_gap_s"), _key("lease_seconds"), strict=True),
    Target("real", "135M: hf engine CPU time / plain generate", _f("engine_ratio", "{:.2f}x"), _const("<= 1.10x"),
           _key("engine_ratio"), _num(1.10)),
    Target("real", "135M: learner step / bare forward+backward", _f("learner_ratio", "{:.2f}x"), _const("<= 1.3x"),
           _key("learner_ratio"), _num(1.3)),
    Target("real", "`brigade up` to the first learner step (demo, forked)", _f("startup_s", "{:.1f} s"),
           lambda r: f"<= 8 s (not forked: {r['startup_nofork_s']:.1f} s)", _key("startup_s"), _num(8.0)),
    Target("real", "ordered shutdown", _f("shutdown_s", "{:.1f} s"), _const("<= 2 s"), _key("shutdown_s"), _num(2.0)),
    Target("real", "control plane CPU (proxy, janitor, Redis, idle evaluator) during the recipe",
           _pct("control_plane_cpu_frac"), _const("< 5 % of a core"), _key("control_plane_cpu_frac"), _num(0.05),
           strict=True),
    Target("real", "recipe: wall clock to the same held-out accuracy, sync / async",
           lambda r: f"{r['async_over_sync_speedup']:.2f}x ({r['sync_time_to_target_s']:.0f} s / "
                     f"{r['async_time_to_target_s']:.0f} s to {r['target_heldout']:.3f})",
           _const(">= 1.2x (full mode: generation and training overlap)"), _key("async_over_sync_speedup"), _num(1.2),
           higher=True),
    Target("real", "recipe: seconds per step, sync / async", _f("async_over_sync_step_speedup", "{:.2f}x"),
           _const("> 1"), _key("async_over_sync_step_speedup"), _num(1.0), higher=True, strict=True),
    *[Target("real", f"recipe: versions to held-out {x}, async / sync (staleness' cost per step)",
             _f(f"async_over_sync_versions_to_acc{round(100 * x)}_ratio", "{:.2f}x"), _const("<= 1.25x"),
             _key(f"async_over_sync_versions_to_acc{round(100 * x)}_ratio"), _num(1.25), median=True)
      for x in (0.7, 0.9)],
    Target("real", "recipe: seconds from launch to held-out 0.9, async / TRL GRPOTrainer",
           lambda r: f"{r['async_over_trl_time_to_acc90_ratio']:.2f}x ({r['async_time_to_acc90_s']:.0f} s / "
                     f"{r['trl_time_to_acc90_s']:.0f} s)",
           _const("<= 1.1x"), _key("async_over_trl_time_to_acc90_ratio"), _num(1.1), median=True),
    Target("real-gen", "generation-dominated recipe: wall clock to the same held-out accuracy, TRL / async",
           lambda r: f"{r['async_over_trl_speedup']:.2f}x ({r['trl_time_to_target_s']:.0f} s / "
                     f"{r['async_time_to_target_s']:.0f} s to {r['target_heldout']:.3f}; generation "
                     f"{r['gen_batch_s']:.1f} s, training {r['train_step_s']:.1f} s a step)",
           _const(">= 1.3x"), _key("async_over_trl_speedup"), _num(1.3), higher=True, median=True),
    Target("real", "recipe: held-out accuracy, base -> final",
           lambda r: f"{r['heldout_base']:.3f} -> {r['heldout_final']:.3f}", _const("+0.15 (full mode)"),
           lambda r: r["heldout_final"] - r["heldout_base"], _num(0.15), higher=True),
    Target("scale", "AcquireLease p99 at 1,000 workers / at 10 (same offered load)",
           lambda r: f"{r['acquire_p99_ms_at_1000_workers']:.1f} / {r['acquire_p99_ms_at_10_workers']:.1f} ms "
                     f"(k = {r['acquire_p99_vs_workers_exponent']:.2f})",
           _const("k <= 1 (no faster than linear)"), _key("acquire_p99_vs_workers_exponent"), _num(1.0)),
    Target("scale", "CompleteLease p99 growth with workers", _f("complete_p99_vs_workers_exponent", "k = {:.2f}"),
           _const("k <= 1"), _key("complete_p99_vs_workers_exponent"), _num(1.0)),
    Target("scale", "one janitor pass at 100,000 leases in flight, Redis time",
           _f("janitor_sweep_redis_ms_at_100000_leases", "{:.3f} ms"), _const("< 50 ms"),
           _key("janitor_sweep_redis_ms_at_100000_leases"), _num(50.0), strict=True),
    Target("scale", "janitor pass growth with leases in flight", _f("janitor_sweep_vs_leases_exponent", "k = {:.2f}"),
           _const("k <= 1"), _key("janitor_sweep_vs_leases_exponent"), _num(1.0)),
    Target("scale", "CreateRun, first touch growth with prompts",
           lambda r: f"k = {r['create_run_vs_prompts_exponent']:.2f}, {r['first_touch_vs_prompts_exponent']:.2f}",
           _const("k <= 1.1 each"),
           lambda r: max(r["create_run_vs_prompts_exponent"], r["first_touch_vs_prompts_exponent"]), _num(1.1)),
    Target("scale", "Redis bytes per further finished batch (the last two checkpoints)",
           _f("redis_bytes_per_finished_batch", "{:.1f} B"), _const("<= 64 B (bounded)"),
           _key("redis_bytes_per_finished_batch"), _num(64.0)),
]


@dataclass
class Row:
    bench: str
    what: str
    measured: str
    target: str
    status: str   # pass | miss | n/a
    worst_run: str = ""   # which run was the worst, and the load average around it (with several runs)


def _runs(result: dict | list[dict]) -> list[dict]:
    """A benchmark's runs: [{"result": ..., "load_before": ..., ...}], or one bare result."""
    if isinstance(result, dict):
        return [{"result": result}]
    return result


def _judged(t: Target, r: dict) -> float | None:
    """The run's margin for `t` (NaN sorts as the worst), or None when the figure is missing."""
    try:
        m = t.margin(r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return m if m == m else float("-inf")


def evaluate(results: dict[str, dict | list[dict]], targets: list[Target] = TARGETS) -> list[Row]:
    """One row per target whose benchmark ran, judged on its worst run (the one with the least margin:
    a target holds only if it holds in every run). A figure missing from every run (the benchmark
    failed, or a run did not finish) is n/a, never a pass; one missing from some runs is judged on
    the others, and the row says how many."""
    rows = []
    for t in targets:
        if t.bench not in results:
            continue
        runs = _runs(results[t.bench])
        if t.median and len(runs) > 1:
            rows.append(_median_row(t, runs))
            continue
        judged = [(m, i, run) for i, run in enumerate(runs, 1) if (m := _judged(t, run["result"])) is not None]
        if not judged:
            try:
                target = t.target(runs[-1]["result"])
            except (KeyError, TypeError, ValueError):
                target = "?"
            rows.append(Row(t.bench, t.what, "not measured", target, "n/a"))
            continue
        judged.sort(key=lambda x: x[0])
        _, i, worst = judged[0]
        r = worst["result"]
        measured = t.shown(r)
        where = ""
        if len(runs) > 1:
            try:  # the medians of the figures it is made of, as in the benchmark's own table
                measured += f" (median {t.shown(summarize(runs))})"
            except (KeyError, TypeError, ValueError, ZeroDivisionError):
                pass
            if len(judged) < len(runs):
                measured += f", {len(judged)} of {len(runs)} runs measured it"
            where = f"run {i}, load {_load1(worst.get('load_before'))} -> {_load1(worst.get('load_after'))}"
            if worst.get("steal_pct") is not None:
                where += f", steal {worst['steal_pct']:g} %"
        rows.append(Row(t.bench, t.what, measured, t.target(r), "pass" if t.check(r) else "miss", where))
    return rows


def _median_row(t: Target, runs: list[dict]) -> Row:
    """A target judged on the median of its figures over the runs (the median of each run's own value)."""
    r = summarize(runs)
    try:
        measured, target, ok = t.shown(r), t.target(r), t.check(r)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return Row(t.bench, t.what, "not measured", "?", "n/a")
    return Row(t.bench, t.what, f"median {measured}", target, "pass" if ok else "miss",
               f"the median of {len(runs)} runs")


def _load1(load: list | tuple | None) -> str:
    return f"{load[0]:.2f}" if load else "?"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render_table(rows: list[Row]) -> str:
    mark = {"pass": "**pass**", "miss": "**MISS**", "n/a": "n/a"}
    if not any(r.worst_run for r in rows):
        lines = ["| benchmark | figure | measured | target | |", "|---|---|---|---|---|"]
        lines += [f"| {r.bench} | {_cell(r.what)} | {_cell(r.measured)} | {_cell(r.target)} | {mark[r.status]} |"
                  for r in rows]
        return "\n".join(lines)
    lines = ["| benchmark | figure | worst run (median) | target | | worst run: 1-min load before -> after, steal during |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r.bench} | {_cell(r.what)} | {_cell(r.measured)} | {_cell(r.target)} | {mark[r.status]} | "
              f"{_cell(r.worst_run)} |" for r in rows]
    return "\n".join(lines)


def render_figures(result: dict) -> str:
    """Every figure of one benchmark as a two-column table (plots and series are shown elsewhere)."""
    lines = ["| figure | value |", "|---|---|"]
    for k, v in result.items():
        if k.startswith("plot"):
            continue
        shown = f"{v:.4g}" if isinstance(v, float) else v
        lines.append(f"| `{k}` | {_cell(shown)} |")
    return "\n".join(lines)


def _shown(v: object) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def render_runs(runs: list[dict], summary: dict) -> str:
    """Every figure of one benchmark over its runs: median, worst (where the name says which way is
    better) and each run's value; then each run's load average before and after, the probes, the
    hypervisor's steal during it, and its seconds."""
    n = len(runs)
    lines = ["| figure | median | worst | " + " | ".join(f"run {i}" for i in range(1, n + 1)) + " |",
             "|---|---|---|" + "---|" * n]
    for k, v in summary.items():
        if k.startswith("plot") or k.endswith("_worst") or k in ("repeat", "load_before", "load_after", *PROBES):
            continue
        each = [_shown(run["result"].get(k, "")) for run in runs]
        worst = summary.get(f"{k}_worst", "")
        lines.append(f"| `{k}` | {_cell(_shown(v))} | {_cell(_shown(worst))} | " + " | ".join(map(_cell, each)) + " |")
    lines += ["", "| run | load before (1, 5, 15 min) | load after | cpu / net probe before (ms) | steal during (%) "
              "| seconds |", "|---|---|---|---|---|---|"]
    lines += [f"| {i} | {load_text(run.get('load_before'))} | {load_text(run.get('load_after'))} | "
              f"{run.get('cpu_probe_ms', '?')} / {run.get('net_probe_ms', '?')} | {_shown(run.get('steal_pct', '?'))} | "
              f"{run.get('seconds', 0):.0f} |"
              for i, run in enumerate(runs, 1)]
    return "\n".join(lines)


# ---------------------------------------------------------------- machine


def machine_info() -> dict:
    info: dict = {"cores": os.cpu_count() or 0, "python": platform.python_version(), "platform": platform.platform()}
    try:
        info["cores_usable"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        info["cpu"] = platform.processor()
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch"] = "not installed"
    return info


# ---------------------------------------------------------------- notes (from the figures of this run)


def fleet_notes(r: dict) -> str:
    if "async_wall_s" not in r:
        return ""
    out = [
        "How the fleet is simulated: this machine has 2 cores shared by the learner, 4 workers, Redis, the proxy "
        "and the janitor (and, often, other people's jobs), so real generation time would measure CPU contention. "
        f"Each worker's speed is therefore injected as a per-token delay around the real engine: a batch takes "
        f"{r['per_token_ms']:g} ms x speed factor x its longest completion in tokens, drawn per batch from a "
        f"lognormal (median {r['median_tokens']:g}, sigma {r['sigma']:g}, capped at {r['cap_tokens']}; mean "
        f"{r['mean_tokens']:g} tokens) seeded by the batch's prompts, so the same batch takes the same time in both "
        "runs; the real demo model still generates every sample, the rewards are real and the learner trains on "
        f"them. The learner's device is simulated the same way (a GRPO step takes {r['learner_step_s']:g} s, the "
        f"real step inside it), sized so the fleet can deliver {r['capacity_margin']:g}x what the learner consumes: "
        "async keeps the learner busy only if production >= consumption, however deep the queue. The schedule, "
        "not CPU contention, decides the result "
        f"(real generation overran its simulated time in {100 * r.get('async_engine_overrun_frac', 0):.0f} % "
        f"(async) and {100 * r.get('sync_engine_overrun_frac', 0):.0f} % (sync) of the batches).",
    ]
    if "speedup" in r:
        out.append(
            f"Speedup {r['speedup']:.2f}x against a theoretical {r['theoretical_ratio']:.2f}x "
            f"({100 * r['speedup'] / r['theoretical_ratio']:.0f} % of it). The theoretical ratio counts the rollout "
            "schedule only: the synchronous run also waits, every step, for the slowest batch's tail, the learner "
            "step and the barrier, which the asynchronous run overlaps, so the measured speedup can exceed it; in quick "
            "mode a few long-tail draws decide how much. Workers at the barrier wake on the AdapterPublished "
            f"event they wait for: they sat {1000 * r['sync_barrier_release_s']:.0f} ms on average at the barrier "
            "after their adapter was published."
            + (" Which batch of a sync step the straggler leases (whoever asks first gets the next one) sets "
               "that step's length; had the speed factors fallen on each step's batches at random, the sync run "
               f"would have taken {r['sync_assignment_luck_s']:+.1f} s more (over {r['sync_assignment_steps']} "
               f"steps) and the speedup been {r['speedup_fair_assignment']:.2f}x."
               if "speedup_fair_assignment" in r else ""))
        out.append(
            f"Reward: per learner step async - sync = {r['reward_diff_per_step']:+.3f} +- {r['reward_diff_se']:.3f} "
            f"(SE). Async trains at step k on samples generated by adapter version k - staleness (mean "
            f"{r['async_staleness_mean']:.2f}), so while the reward climbs its curve per step lags sync by about "
            "that many steps. By the adapter version that generated the samples (the policy after the same number "
            f"of updates) the difference is {r['reward_diff_per_version']:+.3f} +- "
            f"{r['reward_diff_per_version_se']:.3f}: "
            + ("within noise, so the stale updates learn as much per update." if abs(r["reward_diff_per_version"])
               <= 2 * r["reward_diff_per_version_se"] else "outside noise."))
    if r.get("quick"):
        out.append(f"Quick mode: {r['steps']} steps, so the reward comparison has little statistical power; "
                   "`make bench` runs 30.")
    if "fleet_to_learner_capacity" in r:
        out.append(
            f"Measured in the async run: fast batches {r['async_fast_batch_s']:.2f} s, the straggler's "
            f"{r['async_slow_batch_s']:.2f} s (lease granted to completed), learner {r['async_learner_busy_per_step_s']:.2f}"
            f" s busy per step, so the fleet could deliver {r['fleet_to_learner_capacity']:.2f}x what the learner "
            f"consumed; admission (max_staleness {r['max_staleness']}) held the surplus back, hence rollout idle "
            f"{100 * r['async_rollout_idle']:.0f} % and rejection rate {100 * r['async_rejection_rate']:.0f} % "
            "(the straggler's long-tail batches arriving more than max_staleness versions late).")
    return "\n\n".join(out)


def sync_notes(r: dict) -> str:
    if "7b_ratio" not in r:
        return ""
    return (
        f"Per worker, the 7B adapter's time splits into the WatchRun notification ({r['7b_notify_ms']:g} ms after "
        f"PublishAdapter returned; the event often arrives first), `adapters.read_version` ({r['7b_fetch_ms']:g} ms: "
        f"3 GETs and sha256 checks) and the decode ({r['7b_decode_ms']:g} ms), against {r['7b_raw_worker_p50_ms']:g}"
        f" ms for each worker's raw GETs. With {r['workers']} workers on this machine the sha256 and decode of all of "
        f"them share 2 cores; one worker alone: {r['7b_1w_p50_ms']:g} ms against {r['7b_1w_raw_p50_ms']:g} ms raw "
        f"({r['7b_1w_ratio']:.2f}x; fetch {r['7b_1w_fetch_ms']:g} ms, decode {r['7b_1w_decode_ms']:g} ms). The S3 server "
        f"is {r.get('s3', '?')}." + _sync_control(r))


def _sync_control(r: dict) -> str:
    """What the sha256 check costs: the control side of brigade_bench.sync_latency."""
    if "7b_unchecked_ratio" not in r:
        return ""
    return (
        f" Control, the same path with the workers' sha256 check off: {r['7b_unchecked_ratio']:.2f}x raw with "
        f"{r['workers']} workers, {r['7b_1w_unchecked_ratio']:.2f}x for one alone. Checking the 7B adapter's files costs "
        f"one core {r['7b_sha256_ms']:g} ms. A round of {r['workers']} workers cost the watcher process "
        f"{r['7b_client_cpu_ms']:g} ms of CPU with the check, {r['7b_unchecked_client_cpu_ms']:g} ms without it and "
        f"{r['7b_raw_client_cpu_ms']:g} ms for the raw GETs, and the S3 server {r['7b_s3_cpu_ms']:g}, "
        f"{r['7b_unchecked_s3_cpu_ms']:g} and {r['7b_raw_s3_cpu_ms']:g} ms, on 2 cores "
        f"{100 * r['7b_busy']:.0f} % busy: where no core is free, the check's CPU is added to every worker's wait. "
        f"One worker alone: {r['7b_1w_client_cpu_ms']:g}, {r['7b_1w_unchecked_client_cpu_ms']:g} and "
        f"{r['7b_1w_raw_client_cpu_ms']:g} ms (its event loop, its hashing thread and the S3 server: three busy "
        "threads on 2 cores). A real worker checks on cores of its own.")


def proxy_notes(r: dict) -> str:
    if "phase_cores" not in r or "one_call_phase_cores" not in r:
        return ""
    floor = (f"Against a gRPC server that does no work, the same clients at the same rate used {r['floor_phase_cores']:g} "
             f"cores (the server {r['floor_cpu_ms_per_two_call_cycle']:g} ms a cycle: gRPC alone), with a p99 of "
             f"{r['floor_acquire_p99_ms']:g} ms. ") if "floor_phase_cores" in r else ""
    carried = f" ({r['paced_cycles_per_s']:g} carried)" if "paced_cycles_per_s" in r else ""
    return (
        f"At 1000 cycles/s offered{carried} with two calls a cycle (AcquireLease, then CompleteLease) the proxy spent "
        f"{r['proxy_cpu_ms_per_cycle']:g} ms of CPU a cycle, the load clients {r['clients_cpu_ms_per_cycle']:g} ms and "
        f"Redis {r['redis_cpu_ms_per_cycle']:g} ms: together {r['phase_cores']:g} cores of this machine's "
        f"{os.cpu_count()}, which was {100 * r['machine_busy']:.0f} % busy over the phase"
        + (f" and {100 * r['machine_slow_busy']:.0f} % in the 100 ms windows holding a call over "
           f"{r['target_acquire_p99_ms']:g} ms ({100 * r['over_target_share']:.1f} % of the calls, in stretches of up to "
           f"{r['slow_stretch_s']:g} s)" if r["machine_slow_busy"] == r["machine_slow_busy"] else
           f" (no call over {r['target_acquire_p99_ms']:g} ms)")
        + ". Real workers run on machines of their own; here the load clients take their "
        f"share of the same cores. {floor}The worker's cycle is one call (CompleteLease with `next`): "
        f"{r['one_call_phase_cores']:g} cores for the same rate (proxy {r['one_call_cpu_ms_per_cycle']:g} ms a cycle, "
        f"clients {r['one_call_clients_cpu_ms_per_cycle']:g} ms, Redis {r['one_call_redis_cpu_ms_per_cycle']:g} ms), "
        f"and a p99 of {r['one_call_p99_ms']:g} ms.")


def preemption_notes(r: dict) -> str:
    if "throughput_loss" not in r:
        return ""
    return (
        f"{r['kills']} kills (SIGKILL, every {r['kill_every_s']:g} s, round robin over {r['workers']} workers). A "
        f"replacement process took {r['restart_s_mean']:.1f} s on average (max {r['restart_s_max']:.1f} s) from the "
        "kill to its first lease (Python, torch and the model: the cold start a new spot VM pays, minus the image "
        f"pull), and each kill threw away {r['wasted_generation_s_mean']:.1f} s of generation in flight; together "
        f"{100 * r['killed_share']:.1f} % of the fleet's worker-seconds. Throughput fell "
        f"{100 * r['throughput_loss']:.1f} % ({r['loss_over_share']:.2f}x the killed share). A killed worker's "
        f"lease is taken back by the janitor, when it expires (lease timeout {r['lease_seconds']} s) or earlier "
        "when it has become too stale to be consumed (revoked), and its batch is requeued; within the measured "
        f"window {r['kill_expired_leases']} expired and {r['kill_revoked_leases']} were revoked. The learner does not "
        f"wait for that batch: the longest gap between learner steps was {r['kill_max_step_gap_s']:.1f} s "
        f"(without kills {r['base_max_step_gap_s']:.1f} s).")


def topology_notes(r: dict) -> str:
    if "local_sgd_k2_wall_s" not in r or "central_k2_wall_s" not in r:
        return ""
    ks = sorted({int(key.split("_k")[1].split("_")[0]) for key in r if key.startswith("central_k")})
    rows = ["| configuration | wall s | versions | first 20 batches | last 20 batches | held-out at the end "
            "| bucket bytes / sample | state bytes / version | staleness |", "|---|---|---|---|---|---|---|---|---|"]
    for name in [f"{t}_k{k}" for k in ks for t in ("central", "local_sgd")] + ["local_sgd_k2_kill"]:
        if f"{name}_wall_s" in r:
            rows.append(f"| {name} | {r[f'{name}_wall_s']:.0f} | {r[f'{name}_versions']} | "
                        f"{r[f'{name}_first20_reward']:.3f} | {r[f'{name}_last20_reward']:.3f} | "
                        f"{r.get(f'{name}_heldout_end', float('nan')):.3f} | {r[f'{name}_sync_bytes_per_sample']:.0f} | "
                        f"{r[f'{name}_state_bytes_per_round']:.0f} | {r[f'{name}_staleness_mean']:.2f} |")
    return "\n".join([
        f"Load average {r.get('load_before', '?')} before, {r.get('load_after', '?')} after. Every configuration "
        f"trains on the same {r['budget_batches']} batches of 64 samples; local_sgd in rounds of K x "
        f"{r['local_steps']} batches, so it publishes K x {r['local_steps']} times fewer versions.", "", *rows, "",
        "Held-out scores are the evaluator's (80 samples): differences under about 0.1 are noise. "
        + _kill_note(r)])


def _kill_note(r: dict) -> str:
    if not r.get("local_sgd_k2_kill_killed"):
        return "The kill run's kill did not happen."
    expired = r.get("local_sgd_k2_kill_expired_leases", 0)
    leases = (f"{expired} of its leases expired and their batches were generated again" if expired else
              "its leases had not expired when the run ended (lease_seconds 30), so their batches were still in "
              "flight")
    return (f"The killed trainer lost {r['local_sgd_k2_kill_lost_local_steps']} local steps; {leases}; the kill "
            f"run took {r['local_sgd_k2_kill_wall_s'] - r['local_sgd_k2_wall_s']:+.0f} s against the run without "
            f"it, mostly its replacement's start-up (the round waits for M = K contributions; "
            f"{r.get('local_sgd_k2_kill_deadline_rounds', 0)} rounds closed short at their deadline).")


def scale_notes(r: dict) -> str:
    if "cycles_per_s_at_1_replicas" not in r:
        return ""
    n = max(int(k.split("_")[4]) for k in r if k.startswith("cycles_per_s_at_") and k.endswith("_replicas"))
    return (
        f"Replicas: {r['cycles_per_s_at_1_replicas']:.0f} lease cycles/s through one proxy, "
        f"{r[f'cycles_per_s_at_{n}_replicas']:.0f} through {n} ({r['proxy_scaling_4_over_1']:.2f}x). At {n} replicas "
        f"Redis used {r[f'redis_cores_at_{n}_replicas']:.2f} cores, the proxies {r[f'proxy_cores_at_{n}_replicas']:.2f}, "
        f"the load clients {r[f'client_cores_at_{n}_replicas']:.2f}, out of the machine's 2 (shared with other jobs): "
        "the proxy is stateless and Redis is far from busy, so on a machine with a core per replica the "
        "throughput grows with the replicas until Redis's one core is the limit; here every replica and the "
        "clients share the same 2 cores, so more replicas only split them. "
        f"Workers: the simulated fleet offers {r.get('offered_rate', 100):.0f} cycles/s whatever its size, each "
        "worker heartbeating every lease_seconds / 3 while it holds a lease, so the curves show what the number of "
        "workers costs; their tail on this machine is CPU contention (see the load averages). "
        f"Batches: the run's Redis bytes stop growing once its completed-batch ids reach the 10,000 kept and the "
        f"events, metrics and adapter streams their caps; further batches cost "
        f"{r['redis_bytes_per_finished_batch']:.1f} bytes each (the slope between the last two checkpoints).")


def real_notes(r: dict) -> str:
    """Which recipe the section measured, and why it is that kind: one step's generation and training here."""
    kind = {"generation": "generation-dominated", "training": "training-dominated"}.get(r.get("dominated_by"), "?")
    sides = sorted({k.removesuffix("_wall_s") for k in r if k.endswith("_wall_s") and not k.endswith("_wall_s_worst")})
    reached = "; ".join(
        f"{side}: " + ", ".join(f"{x} at {_secs(r.get(f'{side}_time_to_acc{round(100 * x)}_s'))} "
                                f"(v{r.get(f'{side}_versions_to_acc{round(100 * x)}', '-')})" for x in (0.5, 0.7, 0.9))
        for side in sides)
    return (f"Recipe `{r.get('recipe', '?')}`, {kind}: generating one step's batch takes {r.get('gen_batch_s', '?')} s "
            f"and the learner's step on it {r.get('train_step_s', '?')} s on this machine (one thread each). "
            f"Held-out accuracy reached, seconds from launch (version): {reached}.")


def _secs(v: object) -> str:
    return f"{v:.0f} s" if isinstance(v, int | float) else "never"


NOTES = {"proxy": proxy_notes, "fleet": fleet_notes, "sync-latency": sync_notes, "preemption": preemption_notes, "topology": topology_notes,
         "scale": scale_notes, "real": real_notes, "real-gen": real_notes}


# ---------------------------------------------------------------- the report


def _fewer(runs: dict[str, list[dict]], repeat: int) -> str:
    """" (real: 1)": the benchmarks that ran fewer times than the rest (a long full run)."""
    fewer = {name: len(r) for name, r in runs.items() if len(r) < repeat}
    return " (" + ", ".join(f"{k}: {v}" for k, v in fewer.items()) + ")" if fewer else ""


def render_report(results: dict[str, dict], meta: dict, report_dir: Path,
                  runs: dict[str, list[dict]] | None = None) -> str:
    """`results`: each benchmark's flat summary (medians); `runs`: its runs, when it ran more than once."""
    m = meta["machine"]
    runs = runs or {}
    repeat = meta.get("repeat", 1)
    lines = [
        "# brigade benchmarks",
        "",
        f"Generated by `{meta['command']}` on {meta['date']}; {'quick mode' if meta['quick'] else 'full mode'}, "
        f"{meta['total_s']:.0f} s in all. Every ratio compares with a baseline measured in the same run, on the "
        "same machine; nothing is carried over from another run."
        + (f" Each benchmark ran {repeat} times in a row{_fewer(runs, repeat)}: a figure is shown as its median "
           "and its worst run, and each target is judged on the worst run." if repeat > 1 else ""),
        "",
        "## Machine",
        "",
        f"- CPU: {m.get('cpu', '?')}, {m.get('cores', '?')} cores ({m.get('cores_usable', '?')} usable)",
        f"- memory: {m.get('memory_gib', '?')} GiB",
        f"- torch {m.get('torch', '?')}, Python {m.get('python', '?')}, {m.get('platform', '')}",
        f"- load average (1, 5, 15 min) before: {meta['load_before']}, after: {meta['load_after']} "
        "(a shared machine: other jobs' load shows up in every wall-clock figure; each run's own is in its "
        "benchmark's section)",
        "",
        "## Targets",
        "",
        render_table(evaluate({k: runs.get(k, v) for k, v in results.items()})),
        "",
    ]
    for name in [*ORDER, *(n for n in results if n not in ORDER)]:
        if name not in results:
            continue
        r = results[name]
        secs = meta["seconds"].get(name)
        lines += [f"## {name}", "", f"`brigade bench {name}{' --quick' if meta['quick'] else ''}"
                  + (f" --repeat {repeat}" if repeat > 1 else "") + "`"
                  + (f", {secs:.0f} s" if secs is not None else "") + ".", ""]
        doc = meta["docs"].get(name, "")
        if doc:
            lines += [doc, ""]
        note = NOTES.get(name, lambda r: "")(r)
        if note:
            lines += [(f"From the medians of the {repeat} runs. " if repeat > 1 else "") + note, ""]
        for key, path in r.items():
            if key.startswith("plot") and not key.endswith("_worst") and isinstance(path, str) and path:
                rel = os.path.relpath(Path(path).resolve(), report_dir.resolve())
                lines += [f"![{name} {key}{' (last run)' if repeat > 1 else ''}]({rel})", ""]
        lines += [render_runs(runs[name], r) if len(runs.get(name, ())) > 1 else render_figures(r), ""]
    return "\n".join(lines)


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def run_all(quick: bool, report_path: str | Path, names: list[str] | None = None, repeat: int = 0) -> dict[str, dict]:
    """Every benchmark `repeat` times (0: each its default, brigade_bench.repeat.default_repeat), then
    the report and results.json."""

    report_path = Path(report_path)
    out_dir = report_path.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    seconds: dict[str, float] = {}
    docs: dict[str, str] = {}
    load_before = load_text(loadavg())
    t_all = time.monotonic()
    flags = (" --quick" if quick else "") + (f" --repeat {repeat}" if repeat > 1 else "")
    for name in names or ORDER:
        t0 = time.monotonic()
        print(f"== bench {name}{flags}", flush=True)
        try:
            docs[name] = _first_paragraph(bench_module(name).__doc__)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            docs[name] = ""
            runs[name] = [{"result": {"error": f"{type(e).__name__}: {e}"[:2000]}}]
        else:
            runs[name] = run_repeated(name, quick, repeat or default_repeat(name, quick), out_dir)
        results[name] = summarize(runs[name])
        seconds[name] = time.monotonic() - t0
        print(json.dumps(results[name]), flush=True)
        print(f"== {name}: {seconds[name]:.0f} s", flush=True)
    meta = {
        "command": f"brigade bench all{flags} --report {report_path}",
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "quick": quick,
        "repeat": max((len(r) for r in runs.values()), default=1),
        "total_s": time.monotonic() - t_all, "seconds": seconds, "docs": docs, "machine": machine_info(),
        "load_before": load_before, "load_after": load_text(loadavg()),
    }
    report_path.write_text(render_report(results, meta, out_dir, runs))
    (out_dir / "results.json").write_text(json.dumps({"meta": {k: v for k, v in meta.items() if k != "docs"},
                                                      "results": results, "runs": runs}, indent=1, default=str))
    print(f"report: {report_path} ({meta['total_s']:.0f} s in all)", flush=True)
    return results
