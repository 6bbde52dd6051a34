"""The evaluator logs its held-out scores into the run's trackers (report_to) under `eval/`, at the
step of the adapter it scored, once per version even when the job is retried."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
from test_evaluator import _publish

from brigade.store import Store
from brigade.trackers import wandb_offline_steps
from brigade_evaluator import evaluate
from brigade_testing.tiny import demo_prompts, tiny_model, tiny_spec

TRACKERS = [t for t in ("wandb", "tensorboard", "trackio") if importlib.util.find_spec(t) is not None]


@pytest.mark.skipif(not TRACKERS, reason="no tracker installed (pip install 'brigade[wandb,tensorboard,trackio]')")
async def test_evaluator_logs_each_score_once(tmp_path, redis_url, file_bucket_url, monkeypatch):
    monkeypatch.setenv("BRIGADE_TRACKER_DIR", str(tmp_path / "trackers"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    run = f"evtrack-{uuid.uuid4().hex[:8]}"
    spec = tiny_spec(tiny_model(tmp_path / "tiny"), run_id=run, dataset="demo", eval_dataset="demo:heldout",
                     report_to=TRACKERS)
    store = Store(redis_url)
    await store.runs.create(spec, demo_prompts(8))
    for version in (1, 2):  # version v is written at learner step v
        await _publish(store, file_bucket_url, spec, version)
    await store.close()
    try:
        result = await evaluate._evaluate(run, 2, file_bucket_url, redis_url)
        await evaluate._evaluate(run, 2, file_bucket_url, redis_url)  # a retried job: logged once
    finally:
        evaluate._trackers.pop(run).close()

    if "tensorboard" in TRACKERS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tmp_path / "trackers" / "tensorboard" / run), size_guidance={"tensors": 0})
        acc.Reload()
        scores = acc.Tensors("eval/reward_mean")
        assert [e.step for e in scores] == [2]
        assert "eval/reward/demo_sum" in acc.Tags()["tensors"]
    if "trackio" in TRACKERS:  # trackio reads TRACKIO_DIR once, at import: ask it where it keeps the run
        from trackio.sqlite_storage import SQLiteStorage

        rows = SQLiteStorage.get_logs("brigade", run)
        assert [(r["step"], r["eval/reward_mean"]) for r in rows] == [(2, pytest.approx(result["reward_mean"]))]
    if "wandb" in TRACKERS:
        files = list((tmp_path / "trackers" / "wandb").glob(f"offline-run-*-{run}/run-{run}.wandb"))
        assert len(files) == 1 and wandb_offline_steps(str(files[0])) == []  # eval/* only: not learner steps
