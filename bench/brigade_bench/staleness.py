"""`python -m brigade_bench.staleness`: the staleness comparison of `brigade bench real`, on its own
and shorter, for a session that cannot spend an hour a repeat: the recipe through `brigade up` on
each named side (spec overrides), then TRL's GRPOTrainer on the same recipe, settings and cores,
each side's held-out curve scored right after its run (so a cut-short measurement keeps what it
has), one JSON line per side appended to OUT.

    python -m brigade_bench.staleness OUT --steps 18 --samples 2 --sides async,sync,trl --seed 1
    python -m brigade_bench.staleness OUT --recipe gen --steps 6 --every 3   # where a gen step goes
    python -m brigade_bench.staleness OUT --summary     # the tables of bench/report.md's "Staleness"

Sides: `async` (the defaults: automatic lookahead, the decoupled objective), `sync`, `trl`, and the
ablations `async_clip` (tis_cap 0: the ratio clipped around the behaviour policy, lookahead
automatic) and `async_clip_la2` (tis_cap 0 and lookahead 2: brigade before automatic lookahead and
the decoupled objective), and `async_learner2` (the learner on two torch threads beside a one-thread
worker: the second core is the worker's only while it generates). Each line also counts, for an async side, the batches during whose
generation a newer version was published (what an in-flight adapter swap, PipelineRL's, could
have used).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

SIDES = {  # name -> (spec overrides, `brigade up` arguments)
    "async": ({}, ()),
    "sync": ({"sync": True}, ()),
    "async_clip": ({"grpo": {"tis_cap": 0}}, ()),
    "async_clip_la2": ({"grpo": {"tis_cap": 0}, "staleness": {"lookahead": 2}}, ()),
    "async_learner2": ({}, ("--threads", "2,1")),
}


def publishes_during_generation(run_dir: Path, published_unix: dict[int, float]) -> dict:
    """Batches whose generation a newer version's publish overlapped, and the median seconds a batch
    took to generate, from the worker's log."""
    done, overlapped, generate_s = 0, 0, []
    for log in run_dir.glob("logs/rollout-*.log"):
        for line in log.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") != "batch done":
                continue
            end = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
            start = end - float(e.get("total_s", 0))
            done += 1
            generate_s.append(float(e.get("generate_s", 0)))
            newer = [t for v, t in published_unix.items() if v > int(e["version"])]
            overlapped += any(start < t < end for t in newer)
    return {"batches": done, "batches_with_a_publish_mid_generation": overlapped,
            "generate_s_median": round(statistics.median(generate_s), 2) if generate_s else None}


def main() -> None:
    import torch

    from brigade.engine.hf import HFEngine
    from brigade_bench.real import _load, _spec, curve_versions, heldout_curve, recipe_run
    from brigade_bench.startup_timeline import timeline
    from brigade_bench.trl_side import load_state, trl_run
    from brigade_cli.real import final_adapter, heldout_accuracy, write_recipe

    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=18)
    p.add_argument("--every", type=int, default=1,
                   help="score every n-th version (1: a ratio of versions is not rounded to n-version steps)")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--sides", default="async,sync,trl")
    p.add_argument("--tag", default="")
    p.add_argument("--recipe", default="short", help="a recipe of `brigade real --recipe` (short or gen)")
    p.add_argument("--seed", type=int, default=0, help="the spec's seed for every side (a repeat needs its own)")
    p.add_argument("--summary", action="store_true", help="print OUT's lines as markdown tables and stop")
    a = p.parse_args()
    if a.summary:
        print(summary([json.loads(x) for x in a.out.read_text().splitlines()]))
        return
    cfg = {"eval_samples": a.samples}
    with tempfile.TemporaryDirectory(prefix="brigade-staleness-") as tmp:
        root = Path(tmp)
        spec = _spec(root / "spec", "bench-real", recipe=a.recipe)
        engine = None
        for name in a.sides.split(","):
            load_before = _load()
            t0 = time.time()
            if name == "trl":
                trl_spec = write_recipe(root / "trl", "bench-real-trl", {"max_steps": a.steps, "seed": a.seed},
                                         a.recipe)
                r = trl_run(trl_spec, root / "trl" / "out", set(curve_versions(a.steps, a.every)))
                versions = sorted(r["published_s"])
                state = lambda v: load_state(root / "trl" / "out", v)  # noqa: E731
            else:
                overrides, up_args = SIDES[name]
                r = recipe_run(root, name, overrides | {"seed": a.seed}, a.steps, a.recipe, up_args=up_args)
                versions = curve_versions(r["version"], a.every)
                state = lambda v, r=r: final_adapter(r["bucket"], r["run"], v)  # noqa: E731
                metrics = [json.loads(x) for x in (root / name / "run" / "metrics.jsonl").read_text().splitlines()]
                r["staleness_by_step"] = [m.get("staleness_mean") for m in metrics]
                r["wait_frac_by_step"] = [round(m.get("wait_frac", 0), 3) for m in metrics]
                r["is_weight_capped_frac"] = [m.get("is_weight_capped_frac") for m in metrics]
                train_s = [m["train_s"] for m in metrics if m.get("train_s") is not None]
                r["train_s_median"] = round(statistics.median(train_s), 2) if train_s else None
                r |= publishes_during_generation(root / name / "run",
                                                 {int(m["version"]): m["time_unix"] for m in metrics})
                if metrics and r.get("startup_s") is not None:  # where the start went, from the launch
                    r["timeline"] = timeline(root / name / "run", metrics[0]["time_unix"] - r["startup_s"])
            run_s = time.time() - t0
            load_after = _load()
            torch.set_num_threads(os.cpu_count() or 1)  # scoring is not a measured figure
            engine = engine or HFEngine.from_spec(spec)
            curve = heldout_curve(spec, engine, name, versions, state, cfg)
            base = heldout_accuracy(spec, {0: None}, samples=a.samples, engine=engine)[0]
            torch.set_num_threads(1)
            line = {"tag": a.tag, "seed": a.seed, "recipe": a.recipe, "side": name, "steps": a.steps, "run_s": round(run_s, 1),
                    "load_before": load_before, "load_after": load_after, "heldout_base": base,
                    "curve": curve, "published_s": r.pop("published_s"), **r}
            with open(a.out, "a") as f:
                f.write(json.dumps(line) + "\n")
            print(json.dumps({k: line[k] for k in ("side", "run_s", "curve", "load_before", "load_after")}),
                  flush=True)



def summary(lines: list[dict]) -> str:
    """The comparison as markdown: per side and repeat, versions and seconds from launch to held-out
    0.5 / 0.7 / 0.9, seconds per step, staleness, learner idle; then the issue's ratios per repeat
    (async / sync in versions, async / TRL in seconds) and their medians."""
    from brigade_bench.curves import THRESHOLDS, first_reach

    def fmt(x, unit=""):
        return "-" if x is None else f"{x:g}{unit}"

    rows, reach = [], {}
    for e in lines:
        curve = {int(v): x for v, x in e["curve"].items()}
        published = {int(v): t for v, t in e["published_s"].items()}
        got = {lv: first_reach(curve, published, lv) for lv in THRESHOLDS}
        reach[(e["tag"], e["side"])] = got
        steps = [s for s in e.get("staleness_by_step", [])[1:] if s is not None]
        idle = e.get("wait_frac_by_step", [])[1:]
        rows.append(
            f"| {e['side']} | {e['tag']} | " + " | ".join(f"{fmt(got[lv][0])} / {fmt(got[lv][1], ' s')}"
                                                        for lv in THRESHOLDS)
            + f" | {max(curve.values()):.3f} | {fmt(e.get('s_per_step'))} | "
            + (f"{statistics.mean(steps):.2f} | {100 * statistics.mean(idle):.0f} % | "
               f"{e.get('batches_with_a_publish_mid_generation', '-')} of {e.get('batches', '-')}"
               if steps else "- | - | -")
            + f" | {fmt(e.get('generate_s_median'))} / {fmt(e.get('train_s_median'))}"
            + f" | {e['load_before'].split()[0]} -> {e['load_after'].split()[0]} |")
    out = ["| side | run | to 0.5 (version / s) | to 0.7 | to 0.9 | best held-out | s per step | staleness "
           "(steps 2..) | learner idle (steps 2..) | batches with a publish mid-generation | generate / train s "
           "(medians) | load (1 min) |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    ratios: dict[str, list[float]] = {}
    for (tag, side), got in reach.items():
        if side in ("sync", "trl"):
            continue
        for lv in THRESHOLDS:
            sync, trl = reach.get((tag, "sync")), reach.get((tag, "trl"))
            if sync and got[lv][0] and sync[lv][0]:
                ratios.setdefault(f"{side} / sync, versions to {lv}", []).append(got[lv][0] / sync[lv][0])
            if trl and got[lv][1] and trl[lv][1]:
                ratios.setdefault(f"{side} / TRL, seconds to {lv}", []).append(got[lv][1] / trl[lv][1])
    if ratios:
        out += ["| ratio | per run | median |", "|---|---|---|"]
        out += [f"| {k} | {', '.join(f'{x:.2f}' for x in v)} | {statistics.median(v):.2f} |"
                for k, v in sorted(ratios.items())]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    main()
