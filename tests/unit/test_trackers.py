"""The experiment trackers (report_to) write what they are given, offline, and a reopened tracker
run knows its last step: each backend's own files are read back with that backend's reader."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest

from brigade.trackers import (
    open_trackers,
    parse_report_to,
    scalars,
    tensorboard_last_step,
    wandb_offline_steps,
)

CONFIG = {"run_id": "r1", "grpo": {"learning_rate": 0.0001}}


def need(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} not installed (pip install 'brigade[{module}]')")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    return tmp_path


def steps(n0: int, n1: int) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "reward_mean": 0.1 * s, "adapter_payload": "bf16", "nan": float("nan")}
            for s in range(n0, n1 + 1)]


def log_twice(names: list[str], directory: str) -> None:
    """Steps 1-3, then a 'restarted learner' that replays 2-3 and goes on to 5."""
    t = open_trackers(names, "r1", CONFIG, directory)
    t.log_steps(steps(1, 3))
    t.close()
    # W&B names an offline run's folder by the second it started: a restart within the same second
    # (instant here, never for a learner that loads a model) would share the first one's folder
    time.sleep(1.05 - time.time() % 1)
    t = open_trackers(names, "r1", CONFIG, directory)
    assert all(v == 3 for v in t.last.values()), t.last
    t.log_steps(steps(2, 5))
    t.log_eval({"reward_mean": 0.7, "scored": 8, "per_function": {"demo_sum": 0.7}, "version": 2}, step=4)
    t.close()


def test_scalars_keep_numbers_only():
    assert scalars({"step": 3, "loss": 0.5, "n": 2, "p": "bf16", "ok": True, "x": float("inf")}) == {
        "loss": 0.5, "n": 2.0}


def test_report_to_flag():
    assert parse_report_to("") is None  # the run spec's
    assert parse_report_to("none") == []
    assert parse_report_to("wandb, tensorboard") == ["wandb", "tensorboard"]
    with pytest.raises(ValueError, match="mlflow"):
        parse_report_to("mlflow")


@need("tensorboard")
def test_tensorboard_resumes_without_duplicates(offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_twice(["tensorboard"], str(offline))
    folder = offline / "tensorboard" / "r1"
    acc = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    acc.Reload()
    assert [e.step for e in acc.Tensors("loss")] == [1, 2, 3, 4, 5]
    assert [e.step for e in acc.Tensors("eval/reward_mean")] == [4]
    assert "eval/reward/demo_sum" in acc.Tags()["tensors"]
    assert tensorboard_last_step(str(folder)) == 5
    assert json.loads((folder / "config.json").read_text()) == CONFIG


@need("wandb")
def test_wandb_offline_resumes_without_duplicates(offline):
    log_twice(["wandb"], str(offline))
    files = sorted((offline / "wandb").glob("offline-run-*-r1/run-r1.wandb"))
    assert len(files) == 2  # one per start; `wandb sync` merges them into run r1
    assert wandb_offline_steps(str(files[0])) + wandb_offline_steps(str(files[1])) == [1, 2, 3, 4, 5]


@need("trackio")
def test_trackio_resumes_without_duplicates(offline):
    log_twice(["trackio"], str(offline))
    from trackio.sqlite_storage import SQLiteStorage  # trackio reads TRACKIO_DIR once, at import

    rows = sorted(SQLiteStorage.get_logs("brigade", "r1"), key=lambda r: r["step"])
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [4]


def test_missing_tracker_is_a_hint_not_a_failure(offline, monkeypatch, capsys):
    import brigade.trackers as trackers

    monkeypatch.setitem(trackers._MODULE, "wandb", "wandb_not_installed_here")
    t = open_trackers(["wandb"], "r1", CONFIG, str(offline))
    assert t.backends == {}
    assert "pip install 'brigade[wandb]'" in capsys.readouterr().out
