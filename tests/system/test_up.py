"""End to end: `brigade up` runs every service as a process (own redis-server, local bucket,
proxy, janitor, learner, 2 rollout workers, evaluator) for a few demo steps, and leaves a complete
summary, plots, and no process behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SUMMARY_KEYS = {"run", "steps", "wall_s", "samples", "rejected", "first20_reward", "last20_reward",
                "mean_staleness", "adapter_versions"}


def processes_using(marker: str) -> dict[int, str]:
    """Command lines of live processes whose environment, arguments or log (stdout) mention `marker`,
    by pid, with the log's path appended: a service forked from `up`'s fork server has the fork
    server's command line and initial environment, and its own log on stdout."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():
            continue
        try:
            blob = Path(f"/proc/{pid}/environ").read_bytes() + Path(f"/proc/{pid}/cmdline").read_bytes()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            stdout = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            continue
        if marker.encode() in blob or marker in stdout:
            found[int(pid)] = f"{cmdline} > {stdout}"
    return found


def test_brigade_up_runs_the_demo_end_to_end(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")  # nothing there: up starts its own
    proc = subprocess.run(
        [sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--run", "e2e", "--max-steps", "40", "--workers", "2",
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
    # TRL's names (brigade.metric_names), brigade's own figures beside them
    trl = {"reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean",
           "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length", "completions/clipped_ratio",
           "num_tokens", "grad_norm", "learning_rate", "loss", "rewards/demo_sum/mean"}
    assert all(trl <= set(m) for m in metrics), trl - set(metrics[-1])
    assert all({"staleness_mean", "rejection_rate", "dollars_per_sample"} <= set(m) for m in metrics)
    tokens = [m["num_tokens"] for m in metrics]
    assert tokens == sorted(tokens) and tokens[0] > 0 and 0 < metrics[-1]["entropy"]  # cumulative, as TRL's
    rewards = [m["reward"] for m in metrics]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.15, f"reward did not move: first 10 steps {first:.2f}, last 10 {last:.2f}"
    for png in ("curves_vs_step.png", "curves_vs_wall_clock.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # every service wrote its log, and every process `up` started is gone
    for name in ("proxy", "janitor", "learner", "rollout-0", "rollout-1", "evaluator"):
        assert (out / "logs" / f"{name}.log").exists()
    assert processes_using(str(out)) == {}


def learner_steps(log: Path) -> int:
    steps = 0
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "step":
            steps = max(steps, int(event.get("step", 0)))
    return steps


def test_brigade_up_restarts_a_service_that_dies(tmp_path):
    """SIGKILL the learner and a rollout worker mid-run: `up` starts them again, the learner resumes
    from its checkpoint, and the run still ends with every step and every version."""
    out = tmp_path / "run"
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")
    proc = subprocess.Popen(
        [sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--run", "kill", "--max-steps", "30", "--workers", "2",
         "--out", str(out), "--max-wall", "400", "--no-evaluator"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        while learner_steps(out / "logs" / "learner.log") < 5:
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached step 5"
            time.sleep(0.2)
        ours = processes_using(str(out))
        victims = [pid for pid, cmd in ours.items() if cmd.endswith(("/learner.log", "/rollout-0.log"))]
        assert len(victims) == 2, ours
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "learner exited with -9: restarting it (1/3)" in stderr, stderr[-3000:]
    assert "rollout-0 exited with -9: restarting it (1/3)" in stderr, stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["adapter_versions"] == 30, summary
    log = (out / "logs" / "learner.log").read_text()
    assert '"event": "resumed"' in log  # the second learner continued from a checkpoint
    assert processes_using(str(out)) == {}
