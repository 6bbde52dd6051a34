"""report_to across learner restarts: the real `brigade learner` command trains the tiny model with
W&B (offline), TensorBoard and trackio on, is SIGKILLed after writing a checkpoint and again after
training a step it never committed, and each tracker must end up with every step exactly once. The
first life's W&B records are then
lost, as a SIGKILL can lose them, and the restart must log them again from the bucket. The
second life also serves /metrics, scraped over HTTP while it runs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import shutil
import sqlite3
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_learner_service import drive_workers, run_learner, write_spec

from brigade.trackers import wandb_offline_steps
from brigade_harness.devservers import free_port, start_redis
from brigade_testing.tiny import tiny_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]

STEPS = 4
TRACKERS = [t for t in ("wandb", "tensorboard", "trackio") if importlib.util.find_spec(t) is not None]


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = start_redis(tmp_path_factory.mktemp("trackers-redis"))
    yield server.url
    server.stop()


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


async def scrape_until_a_step(port: int, seen: dict) -> None:
    while True:
        try:
            samples = await asyncio.to_thread(scrape, port)
            if "brigade_learner_wait_fraction" in samples:  # served from start, before the model loads
                seen.update(samples)
                return
        except OSError:
            pass  # not serving yet
        await asyncio.sleep(0.1)


@pytest.mark.skipif(not TRACKERS, reason="no tracker installed (pip install 'brigade[wandb,tensorboard,trackio]')")
async def test_trackers_hold_every_step_once_across_restarts(tmp_path, redis_url, file_bucket_url, monkeypatch):
    from brigade_proxy.server import start_server

    run = f"track-{os.getpid()}-{int(time.time())}"
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir, max_steps=STEPS, report_to=TRACKERS)
    tracker_dir = tmp_path / "trackers"
    monkeypatch.setenv("BRIGADE_TRACKER_DIR", str(tracker_dir))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    # a wandb service this test process started (WANDB_SERVICE) must not be shared with the learners:
    # a SIGKILLed learner's run would stay "in use" there
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=file_bucket_url)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive_workers(addr, file_bucket_url, run, model_dir, stop))
    log_path = tmp_path / "learner.log"
    scraped: dict = {}
    try:
        # after checkpoint 2, before its metrics reached the trackers; then right after step 3 trained
        rc, _ = await asyncio.wait_for(run_learner(addr, file_bucket_url, run, spec_path, log_path,
                                                   die_at="after_checkpoint@2"), 120)
        assert rc < 0, log_path.read_text()[-3000:]
        # a tracker's writer killed with the learner can lose records of steps before the checkpoint
        # (W&B's service flushes its log every 0.2 s): lose all of the first life's, as the worst case
        for folder in (tracker_dir / "wandb").glob(f"offline-run-*-{run}"):
            shutil.rmtree(folder)
        port = free_port()
        monkeypatch.setenv("BRIGADE_METRICS_PORT", str(port))
        scraper = asyncio.create_task(scrape_until_a_step(port, scraped))
        rc, _ = await asyncio.wait_for(run_learner(addr, file_bucket_url, run, spec_path, log_path,
                                                   kill_after_step=3), 120)
        assert rc < 0, log_path.read_text()[-3000:]
        await asyncio.wait_for(scraper, 5)
        rc, events = await asyncio.wait_for(run_learner(addr, file_bucket_url, run, spec_path, log_path), 120)
        assert rc == 0, log_path.read_text()[-3000:]
    finally:
        stop.set()
        driver.cancel()
        await server.stop(0)
    assert not [e for e in events if e.get("event") == "tracker_missing"]
    assert "brigade_learner_wait_fraction" in scraped and "brigade_learner_staleness_mean" in scraped
    assert "brigade_learner_step_duration_seconds_count" in scraped

    everything = list(range(1, STEPS + 1))
    if "tensorboard" in TRACKERS:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(tracker_dir / "tensorboard" / run), size_guidance={"tensors": 0})
        acc.Reload()
        assert [e.step for e in acc.Tensors("reward")] == everything
        assert json.loads((tracker_dir / "tensorboard" / run / "config.json").read_text())["run_id"] == run
    if "wandb" in TRACKERS:
        files = sorted((tracker_dir / "wandb").glob(f"offline-run-*-{run}/run-{run}.wandb"))
        assert [s for f in files for s in wandb_offline_steps(str(f))] == everything
    if "trackio" in TRACKERS:
        db = sqlite3.connect(tmp_path / "trackio" / "brigade.db")
        rows = db.execute("SELECT step FROM metrics WHERE run_name = ? ORDER BY step", (run,)).fetchall()
        assert [s for (s,) in rows] == everything
