"""Mistakes that fail in seconds, as `brigade up` meets them: a model id that does not resolve is
refused before any service starts (the Hub asked when online, the cache when offline); a reward
function that raises or returns something unusable is refused by the check that calls it on the
first rows; one that fails only on real completions stops the run after FAIL_FAST_BATCHES
batches with its own error, not after the minute of the stall timeout; one that returns None for
every completion beside a working one is a warning and a metric, and the run trains.

The Hub is brigade_testing.fake_hub (the one fake); the rest is real."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from brigade.demo.task import DEMO_RUN
from brigade_testing.fake_hub import FakeHub

REWARDS = '''
def raises(completions, **kwargs):
    return [float(kwargs["solution"]) for _ in completions]


def returns_none(completions, **kwargs):
    return None


def all_none(completions, **kwargs):
    return [None] * len(completions)


def fails_on_text(completions, **kwargs):  # passes the check's empty completion, fails on the model's
    if any(c.strip() for c in completions):
        raise KeyError("solution")
    return [0.0] * len(completions)
'''

CHECK_MODEL = "import sys; from brigade_cli.preflight import check_model; print(check_model(sys.argv[1]))"


def up(folder: Path, env: dict | None = None, timeout: float = 240, **spec) -> tuple[subprocess.CompletedProcess, float]:
    (folder / "spec.yaml").write_text(yaml.safe_dump(dict(DEMO_RUN, eval_every=0, **spec)))
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "brigade_cli.main", "up", "--spec", "spec.yaml", "-n", "1",
                           "--max-wall", "200"], cwd=folder, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, BRIGADE_REDIS_URL="redis://127.0.0.1:1/0", **(env or {})))
    return proc, time.monotonic() - started


def ask(model: str, env: dict) -> str:
    """check_model in a fresh process: huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE at import."""
    return subprocess.run([sys.executable, "-c", CHECK_MODEL, model], env=env, capture_output=True, text=True,
                          timeout=60).stdout.strip()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    return tmp_path


def test_a_model_id_that_does_not_resolve_is_refused_before_anything_starts(folder):
    hub = FakeHub()
    hub.models.add("someone/real-model")
    try:
        online = dict(os.environ, HF_ENDPOINT=hub.url, HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_OFFLINE="0")
        assert ask("someone/real-model", online) == "None"  # the Hub has it: fine, not downloaded here
        assert "no model nobody/nothing-here on the Hub" in ask("nobody/nothing-here", online)
        unreachable = dict(online, HF_ENDPOINT="http://127.0.0.1:1")
        assert "cannot reach the Hub" in ask("nobody/nothing-here", unreachable)
    finally:
        hub.close()
    proc, seconds = up(folder, env={"HF_HUB_OFFLINE": "1"}, model="nobody/nothing-here", max_steps=2)
    assert proc.returncode == 2, proc.stderr
    assert "nobody/nothing-here is not in the local Hugging Face cache" in proc.stderr and "offline" in proc.stderr
    assert not list(folder.glob("brigade-runs/*/logs/*.log"))  # no service was started
    assert seconds < 30, seconds


@pytest.mark.parametrize(("function", "words"), [("raises", "raised KeyError: 'solution'"),
                                                 ("returns_none", "returned a NoneType")])
def test_a_reward_that_fails_on_every_call_is_refused_in_seconds(folder, function, words):
    proc, seconds = up(folder, max_steps=2, rewards=[{"function": "demo_sum"}, {"function": f"rw:{function}"}])
    assert proc.returncode == 2, proc.stderr
    assert f"reward function 'rw:{function}' {words}" in proc.stderr, proc.stderr
    assert not list(folder.glob("brigade-runs/*/logs/*.log"))
    assert seconds < 30, seconds


def test_a_reward_that_fails_on_the_models_completions_stops_the_run_with_its_error(folder):
    proc, seconds = up(folder, max_steps=20, rewards=[{"function": "rw:fails_on_text"}])
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "batches were left unscored by a reward function: rw:fails_on_text raised KeyError: 'solution'" \
        in proc.stderr, proc.stderr[-2000:]
    assert "since batches began to fail" not in proc.stderr  # not the stall timeout
    assert seconds < 60, seconds  # the stall timeout alone is 60 s


def test_a_reward_that_returns_none_for_everything_is_a_warning_and_a_metric(folder):
    proc, _ = up(folder, max_steps=3, rewards=[{"function": "demo_sum"}, {"function": "rw:all_none"}])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "warning: reward function 'rw:all_none' returned None for every completion" in proc.stderr
    metrics = [json.loads(line) for line in next(folder.glob("brigade-runs/*/metrics.jsonl")).read_text().splitlines()]
    assert len(metrics) == 3
    assert all(m["rewards/all_none/none_frac"] == 1.0 and m["rewards/demo_sum/none_frac"] == 0.0 for m in metrics)
    worker_log = next(folder.glob("brigade-runs/*/logs/rollout-0.log")).read_text()
    assert "reward function returned None for every completion of the batch" in worker_log
