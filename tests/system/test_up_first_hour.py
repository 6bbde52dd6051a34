"""A newcomer's first hour with `brigade up`, `ctl` and `cost`, through the CLI as a user runs them:
mistakes caught before anything starts, SIGTERM handled like Ctrl-C, a finished run still readable
without flags, a reused run id refused unless resumed, and a run whose every batch fails stopped
with its cause."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_up import processes_using

NO_REDIS = "redis://127.0.0.1:1/0"  # nothing answers there: `up` starts a redis-server of its own


def brigade(args: list[str], cwd: Path, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = dict(os.environ, BRIGADE_REDIS_URL=NO_REDIS, PYTHONPATH=str(cwd))
    env.pop("BRIGADE_PROXY", None)
    env.pop("BRIGADE_RUN", None)
    return subprocess.run([sys.executable, "-m", "brigade_cli.main", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, **kw)


def test_mistakes_are_named_before_anything_starts(tmp_path):
    (tmp_path / "spec.yaml").write_text(
        "model: ./no-such-model\ndataset: prompts.jsonl\neval_dataset: held.jsonl\nmax_steps: 5\n"
        "rewards:\n  - function: mymodule:score\n")
    t0 = time.monotonic()
    proc = brigade(["up", "--spec", "spec.yaml"], tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - t0 < 30
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: model: no folder ./no-such-model")
    assert any(line.startswith("dataset 'prompts.jsonl': no such file") and "working directory" in line
               for line in lines), lines
    assert any(line.startswith("eval: dataset 'held.jsonl': no such file") for line in lines), lines
    assert any(line.startswith("rewards[0]:") and "mymodule" in line and "PYTHONPATH" in line
               for line in lines), lines
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "brigade-runs").exists()  # nothing was started or written
    (tmp_path / "empty-model").mkdir()
    (tmp_path / "spec.yaml").write_text("model: empty-model\ndataset: demo\nmax_steps: 5\n")
    proc = brigade(["up", "--spec", "spec.yaml"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: model: empty-model has no config.json"), proc.stderr


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in (path.read_text() if path.exists() else ""):
        assert proc.poll() is None, f"up exited with {proc.returncode} before {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout}s"
        time.sleep(0.3)


@pytest.mark.timeout(900)
def test_sigterm_snapshot_ctl_reuse_and_resume(tmp_path):
    """SIGTERM mid-run: ordered stop, summary, exit 143, nothing left running. Then, with no flags,
    `ctl status` and `cost --run` read the finished run; the same run id is refused; --resume
    finishes it."""
    env = dict(os.environ, BRIGADE_REDIS_URL=NO_REDIS)
    env.pop("BRIGADE_PROXY", None)
    out = tmp_path / "stdout.txt"
    with out.open("w") as stdout:
        proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--run", "hour",
                                 "--max-steps", "100", "--no-evaluator"], cwd=tmp_path, env=env, stdout=stdout,
                                stderr=subprocess.PIPE, text=True)
        try:
            wait_for(out, "step    3/100", proc, 300)
            # while it runs, ctl finds it without --proxy (the port was picked at random)
            live = brigade(["ctl", "status", "--json"], tmp_path, timeout=60)
            assert live.returncode == 0, live.stderr
            assert json.loads(live.stdout)["spec"]["run_id"] == "hour"
            proc.send_signal(signal.SIGTERM)
            _, stderr = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "SIGTERM: stopping every process" in stderr
    folder = tmp_path / "brigade-runs" / "hour"
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["outcome"] == "terminated" and 3 <= summary["steps"] < 100, summary
    assert processes_using(str(folder)) == {}

    status = brigade(["ctl", "status", "--json"], tmp_path)  # no proxy any more: the snapshot
    assert status.returncode == 0, status.stderr
    assert "has ended; reading the snapshot" in status.stderr
    state = json.loads(status.stdout)
    assert state["spec"]["run_id"] == "hour" and int(state["learner_step"]) == summary["steps"]
    metrics = brigade(["ctl", "metrics", "--json", "--last", "2"], tmp_path)
    assert [s["step"] for s in json.loads(metrics.stdout)["steps"]] == [summary["steps"] - 1, summary["steps"]]
    cost = brigade(["cost", "--run", "hour", "--json"], tmp_path)
    assert cost.returncode == 0, cost.stderr
    assert json.loads(cost.stdout)["rejection_rate"] >= 0

    again = brigade(["up", "--demo", "--run", "hour", "--max-steps", "100"], tmp_path)
    assert again.returncode == 2 and "already ran" in again.stderr and "--resume" in again.stderr, again.stderr
    assert json.loads((folder / "summary.json").read_text()) == summary  # the refused launch changed nothing

    resumed = brigade(["up", "--demo", "--run", "hour", "--max-steps", "100", "--no-evaluator", "--resume"], tmp_path,
                      timeout=400)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = json.loads((folder / "summary.json").read_text())
    assert final["outcome"] == "finished" and final["steps"] == 100 and final["adapter_versions"] == 100, final
    first_shown = next(line for line in resumed.stdout.splitlines() if line.startswith("step"))
    assert int(first_shown.split()[1].split("/")[0]) > summary["steps"]  # only the new steps are shown


def test_a_run_whose_every_batch_fails_stops_with_the_cause(tmp_path):
    # a reward that never applies: the check before the start only warns (None is legal), then the
    # learner drops every sample and rejects every batch; a reward that raises is refused sooner
    # (tests/system/test_fail_fast.py)
    (tmp_path / "broken_reward.py").write_text(
        "def score(prompts, completions, **columns):\n    return [None] * len(completions)\n")
    (tmp_path / "spec.yaml").write_text(
        "model: demo\ndataset: demo\nmax_steps: 5\nrewards:\n  - function: broken_reward:score\n")
    t0 = time.monotonic()
    proc = brigade(["up", "--spec", "spec.yaml", "--no-evaluator", "--stall-timeout", "10", "--workers", "1"],
                   tmp_path, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert time.monotonic() - t0 < 240
    assert "no step trained" in proc.stderr
    # the worker's own line, not a symptom (whichever of its warnings about the Nones is newest)
    assert re.search(r"rollout-0: (no sample of the batch was scored|all reward functions returned None|"
                     r"reward function returned None)", proc.stderr), proc.stderr[-2000:]
    (folder,) = (tmp_path / "brigade-runs").iterdir()
    assert folder.name.startswith("spec-")  # no run_id in the spec: one of its own, not `demo`
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["outcome"] == "failed" and summary["steps"] == 0
    assert summary["first20_reward"] is None and summary["last20_reward"] is None
