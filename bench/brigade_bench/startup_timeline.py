"""Where `brigade up`'s start goes: the real recipe launched with a few steps, and a timeline of
its first events read back from the run's service logs and metrics, in seconds from the launch.

    python -m brigade_bench.startup_timeline [--sync] [--steps 2] [--out DIR]

Marks (each the first of its kind; absent when the run never got there):
  proxy_up            the proxy's `proxy listening` line (Redis answered before it)
  learner_ready       the learner's `model_ready` line (model and LoRA loaded)
  worker_ready        a worker's `engine ready` line
  evaluator_ready     the evaluator's first line after its imports
  first_lease         the first batch's lease taken (`batch done` less its total_s)
  first_generation_started / first_generation_done   (less generate_s, and the line itself)
  first_step_started  the learner's first train_step began (metrics' time_unix less train_s)
  first_step_done     its metrics line (the figure `up` reports as startup_s)

The machine's load average goes with the figures: on a shared machine they move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path


def _ts(line: dict) -> float | None:
    stamp = line.get("timestamp")
    if not isinstance(stamp, str):
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _lines(path: Path) -> list[dict]:
    out = []
    if path.exists():
        for raw in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if isinstance(doc, dict):
                out.append(doc)
    return out


def _first(path: Path, event: str) -> dict | None:
    return next((d for d in _lines(path) if d.get("event") == event), None)


def timeline(run_dir: Path, launched: float) -> dict[str, float | None]:
    """The marks above, in seconds since `launched` (a unix time)."""
    logs = run_dir / "logs"
    marks: dict[str, float | None] = {}

    def rel(t: float | None) -> float | None:
        return None if t is None else round(t - launched, 2)

    marks["proxy_up"] = rel(_ts(_first(logs / "proxy.log", "proxy listening") or {}))
    marks["learner_ready"] = rel(_ts(_first(logs / "learner.log", "model_ready") or {}))
    ready = [_ts(d) for p in logs.glob("rollout-*.log") if (d := _first(p, "engine ready"))]
    marks["worker_ready"] = rel(min(ready)) if ready else None
    evaluator = _lines(logs / "evaluator.log")
    marks["evaluator_ready"] = rel(_ts(evaluator[0])) if evaluator else None
    done = sorted((_ts(d), d) for p in logs.glob("rollout-*.log") for d in _lines(p) if d.get("event") == "batch done")
    if done:
        t, d = done[0]
        marks["first_lease"] = rel(t - d.get("total_s", 0.0))
        marks["first_generation_started"] = rel(t - d.get("generate_s", 0.0))
        marks["first_generation_done"] = rel(t)
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    if rows:
        marks["first_step_started"] = rel(rows[0]["time_unix"] - rows[0].get("train_s", 0.0))
        marks["first_step_done"] = rel(rows[0]["time_unix"])
        if len(rows) > 1:
            marks["s_per_step"] = round((rows[-1]["time_unix"] - rows[0]["time_unix"]) / (len(rows) - 1), 2)
    return marks


def measure(root: Path, sync: bool, steps: int, workers: int = 1, extra: list[str] | None = None,
            env: dict | None = None) -> dict:
    from brigade_cli.real import write_recipe

    name = "sync" if sync else "async"
    folder = root / name
    spec = write_recipe(folder, f"timeline-{name}-{int(time.time())}", {"max_steps": steps, "sync": sync})
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    launched = time.time()
    code = subprocess.run([sys.executable, "-m", "brigade_cli.main", "up", "--spec", str(spec), "--out",
                           str(folder / "run"), "-n", str(workers), "--max-wall", "600", *(extra or [])],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env).returncode
    return {"mode": name, "exit": code, "load_before": load, **timeline(folder / "run", launched)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sync", action="store_true")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", default="")
    parser.add_argument("up_args", nargs="*", help="more `brigade up` arguments (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="brigade-timeline-") as tmp:
        root = Path(args.out or tmp)
        print(json.dumps(measure(root, args.sync, args.steps, args.workers, args.up_args)), flush=True)


if __name__ == "__main__":
    main()
