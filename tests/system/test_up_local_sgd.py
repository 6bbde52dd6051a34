"""End to end, topology local_sgd: `brigade up --topology local_sgd` runs every service as a process
(own redis-server, local bucket, proxy, janitor, the aggregator and 2 local trainers) on the demo task;
the reward climbs over the rounds, every round is a contiguous adapter version published as the
learner publishes (so `ctl adapters` lists them), its merge is exact (frozen_a), and no process is
left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_up import processes_using

ROUNDS = 10


def test_brigade_up_local_sgd_climbs(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0")  # nothing there: up starts its own
    proc = subprocess.run(
        [sys.executable, "-m", "brigade_cli.main", "up", "--demo", "--topology", "local_sgd", "--run", "e2e-local",
         "--max-steps", str(ROUNDS), "--workers", "2", "--no-evaluator", "--out", str(out), "--max-wall", "300"],
        capture_output=True, text=True, env=env, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "2 local trainers" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == ROUNDS and summary["adapter_versions"] == ROUNDS, summary
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, ROUNDS + 1))
    # each round merges at least one contribution of local_steps (4) steps of 8 prompts x 8 samples
    assert all(m["contributions"] >= 1 and m["accepted_samples"] >= 4 * 64 for m in metrics), metrics
    assert all(m["averaging_error"] < 1e-6 for m in metrics)  # frozen_a: the merge is exact
    assert all(0 <= m["staleness_mean"] <= 4 for m in metrics)
    rewards = [m["reward"] for m in metrics]
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.15, f"reward did not climb: first 3 rounds {first:.2f}, last 3 {last:.2f}"
    snapshot = json.loads((out / "snapshot.json").read_text())
    assert [int(a["version"]) for a in snapshot["ListAdapters"]["adapters"]] == list(range(1, ROUNDS + 1))
    for name in ("proxy", "janitor", "aggregator", "trainer-0", "trainer-1"):
        assert (out / "logs" / f"{name}.log").exists()
    assert '"event": "contribution_submitted"' in (out / "logs" / "trainer-1.log").read_text()
    assert processes_using(str(out)) == {}
