"""`brigade up` on episodes: a real proxy, learner, rollout worker, evaluator, Redis and bucket, the
tiny chat model, and environments from a module of the test's own. Some episodes' environments
raise: they cost their episodes, never the worker, and the run trains on the rest. The rollouts
carry an env_mask the learner accepts, the environment's reward is a reward part named after its
class, and the episode metrics reach metrics.jsonl and the evaluator's results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

from brigade_testing.tiny import chat_tokenizer, tiny_model

ENVS = '''
class Echo:
    """A reset/step environment: replies "yes" twice, then ends; a prompt marked broken raises."""

    def reset(self, broken=False, **row):
        if broken:
            raise RuntimeError("this level does not exist")
        self.turns, self.said = 0, []

    def step(self, text):
        self.turns += 1
        self.said.append(text)
        return None if self.turns == 3 else "yes"

    def get_reward(self):
        return float(sum(len(t) for t in self.said) % 3)
'''
WORDS = ["What is 2+2?", "What is 3+4?", "Be brief.", "The answer"]


def test_up_trains_on_episodes_and_a_raising_environment_costs_only_its_episodes(tmp_path):
    model = tiny_model(tmp_path / "model", tokenizer=chat_tokenizer(), eos_boost=3.0)
    (tmp_path / "test_envs.py").write_text(ENVS)
    rows = [{"prompt": [{"role": "user", "content": WORDS[i % 4]}], "broken": i % 4 == 3} for i in range(16)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {"run_id": "episodes", "model": str(model), "dataset": "train.jsonl", "eval_dataset": "train.jsonl",
            "dtype": "float32", "device": "cpu", "max_steps": 3, "eval_every": 3, "prompts_per_batch": 4,
            "lora": {"rank": 4, "alpha": 8.0},
            "sampling": {"group_size": 4, "temperature": 1.0, "max_new_tokens": 24},
            "grpo": {"learning_rate": 1e-2},
            "environment": {"factory": "test_envs:Echo", "max_turns": 4, "max_turn_tokens": 4}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "brigade_cli.main", "up", "--spec", "spec.yaml", "-n", "1",
                           "--max-wall", "200", "--out", "run"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}"
                                                f"{os.environ.get('PYTHONPATH', '')}"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["rejected"] == 0, summary
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 3
    for m in metrics:  # a batch may hold mostly broken prompts (0 turns): judge the run
        assert "rewards/Echo/mean" in m  # the environment's reward part
    assert sum(m["episode/turns"] for m in metrics) / 3 > 1 and all(m["episode/env_tokens"] > 0 for m in metrics)
    assert sum(m["completion_tokens"] for m in metrics) < sum(m["episode/length"] * m["sequences"] for m in metrics)
    assert any(m["episode/end_failed"] > 0 for m in metrics)  # a quarter of the prompts are broken
    worker_log = (out / "logs" / "rollout-0.log").read_text()
    assert "episodes failed; their samples are dropped" in worker_log and "this level does not exist" in worker_log
    rollouts = sorted((out / "bucket").rglob("attempt-*.json"))
    doc = json.loads(rollouts[0].read_text())
    broken = [s for s in doc["samples"] if s["reward"] is None]
    assert broken and all(s["prompt"][0]["content"] == WORDS[3] for s in broken)
    evals = sorted((out / "bucket").rglob("evals/v*.json"))
    episodes = json.loads(evals[-1].read_text())["episodes"]
    assert episodes["episode/turns"] > 1 and 0 <= episodes["episode/env_time_frac"] < 1  # a share of its generation


def test_an_environment_the_host_does_not_allow_is_refused_before_anything_runs(tmp_path):
    spec = {"run_id": "refused", "model": "demo", "dataset": "demo", "max_steps": 1,
            "environment": {"factory": "not_allowed_envs:Env"}, "rewards": [{"function": "demo_sum"}]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "brigade_cli.main", "up", "--spec", "spec.yaml", "-n", "1",
                           "--max-wall", "60"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "environment.factory" in proc.stderr and "not_allowed_envs" in proc.stderr, proc.stderr[-2000:]
    assert Path(tmp_path).is_dir()
