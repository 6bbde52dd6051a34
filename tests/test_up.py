"""End to end: `brigade up` runs every service as a process (own redis-server, local bucket,
proxy, janitor, learner, 2 rollout workers, evaluator) for a few demo steps, and leaves a complete
summary, plots, and no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SUMMARY_KEYS = {"run", "steps", "wall_s", "samples", "rejected", "first20_reward", "last20_reward",
                "mean_staleness", "adapter_versions"}


def processes_using(marker: str) -> list[str]:
    """Command lines of live processes whose environment or arguments mention `marker`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            blob = Path(f"/proc/{pid}/environ").read_bytes() + Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in blob:
            found.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_brigade_up_runs_the_demo_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")  # nothing there: up starts its own
    proc = subprocess.run(
        [sys.executable, "-m", "brigade.cli", "up", "--demo", "--run", "e2e", "--max-steps", "40", "--workers", "2",
         "--out", str(out), "--max-wall", "400"],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started redis-server" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= set(summary), SUMMARY_KEYS - set(summary)
    assert summary["run"] == "e2e" and summary["steps"] == 40
    assert summary["adapter_versions"] == 40          # one version per step, none skipped
    assert summary["samples"] >= 40 * 64 * 0.9        # rollouts were accepted (8 prompts x G=8 per step)
    assert 0 <= summary["mean_staleness"] <= 4        # the cap holds
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 41))
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.15, f"reward did not move: first 10 steps {first:.2f}, last 10 {last:.2f}"
    for png in ("curves_vs_step.png", "curves_vs_wall_clock.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every service wrote its log, and every process `up` started is gone
    for name in ("proxy", "janitor", "learner", "rollout-0", "rollout-1", "evaluator"):
        assert (out / "logs" / f"{name}.log").exists()
    assert processes_using(str(out)) == []
