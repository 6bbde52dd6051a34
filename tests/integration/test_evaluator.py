"""The evaluator against a real Redis, a real bucket and a real (tiny) model and PEFT adapter:
versions are scored on held-out prompts, results land once in the bucket and in Redis, and the
watcher enqueues exactly the eval_every-th published versions and the run's last as rq jobs."""

from __future__ import annotations

import asyncio
import json
import sys

import pytest
import torch
from redis import Redis
from rq import Queue as RqQueue

from brigade import adapters, keys
from brigade.bucket import open_bucket
from brigade.model import attach_lora, load_base
from brigade.store import Store
from brigade_evaluator.cli import watch
from brigade_evaluator.evaluate import _evaluate
from brigade_testing.tiny import tiny_model, tiny_spec


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


async def _publish(store: Store, bucket_url: str, spec, version: int) -> None:
    """Write a perturbed adapter as `version` and publish it, the way the learner does."""
    model, _ = load_base(spec)
    peft = attach_lora(model, spec)
    state = adapters.adapter_state(peft)
    torch.manual_seed(version)
    state = {k: v + 0.05 * torch.randn_like(v) for k, v in state.items()}
    files, _ = adapters.encode(state, adapters.adapter_config_json(peft), "bf16")
    async with open_bucket(bucket_url) as bucket:
        manifest = await adapters.write_version(bucket, spec.run_id, version, version, files, "bf16")
    await store.learner.publish(spec.run_id, manifest)


def test_the_evaluator_scores_every_nth_version_and_the_last():
    assert [v for v in range(8) if keys.evaluates(v, v, 3, 0)] == [3, 6]
    assert [v for v in range(8) if keys.evaluates(v, v, 3, 7)] == [3, 6, 7]  # step 7 of 7: the run's last
    assert [v for v in range(5) if keys.evaluates(v, 2 * v, 3, 8)] == [3, 4]  # publish_every 2: v4 is step 8
    assert not any(keys.evaluates(v, v, 0, 4) for v in range(5))


async def test_evaluate_scores_a_version_and_writes_once(redis_url, file_bucket_url, model_dir):
    from brigade_testing.tiny import demo_prompts

    spec = tiny_spec(model_dir, run_id="eval-a", dataset="demo", eval_dataset="demo:heldout")
    store = Store(redis_url)
    await store.runs.create(spec, demo_prompts(8))
    await _publish(store, file_bucket_url, spec, 1)
    result = await _evaluate("eval-a", 1, file_bucket_url, redis_url)
    assert result["version"] == 1 and result["prompts"] == 20 and result["samples"] == 80
    assert result["scored"] == 80 and 0.0 <= result["reward_mean"] <= 1.0
    async with open_bucket(file_bucket_url) as bucket:
        stored = json.loads(await bucket.get(keys.eval_key("eval-a", 1)))
    assert stored["reward_mean"] == result["reward_mean"]
    assert json.loads(await store.redis.hget(keys.RunKeys("eval-a").evals, "1"))["version"] == 1
    # same version, same seed: a retried job computes the same score and keeps the first file
    again = await _evaluate("eval-a", 1, file_bucket_url, redis_url)
    assert again["reward_mean"] == result["reward_mean"]
    # the proxy's adapter listing carries the evaluation
    listed = {a.version: a for a in await store.views.list_adapters("eval-a")}
    assert json.loads(listed[1].eval_json)["reward_mean"] == result["reward_mean"]
    await store.close()


async def test_watcher_enqueues_every_nth_version_and_the_job_runs(redis_cluster_url, redis_url, file_bucket_url,
                                                                   model_dir):
    """The deployment a Redis Cluster needs: the run's state on the cluster, rq's queue on a
    single-node Redis (rq cannot use a cluster), the job told both."""
    from brigade_testing.tiny import demo_prompts

    spec = tiny_spec(model_dir, run_id="eval-b", dataset="demo", eval_dataset="demo:heldout", eval_every=2, max_steps=5)
    store = Store(redis_cluster_url)
    await store.runs.create(spec, demo_prompts(8))
    for version in (1, 2, 3, 4, 5):
        await _publish(store, file_bucket_url, spec, version)

    import structlog

    with pytest.raises(ValueError, match="BRIGADE_RQ_REDIS_URL"):  # rq on the cluster is refused in words
        await watch(redis_cluster_url, file_bucket_url, "eval-b", structlog.get_logger())
    task = asyncio.create_task(watch(redis_cluster_url, file_bucket_url, "eval-b", structlog.get_logger(), redis_url))
    conn = Redis.from_url(redis_url)
    rq_queue = RqQueue(keys.eval_queue("eval-b"), connection=conn)
    for _ in range(100):
        if len(rq_queue.job_ids) >= 3:
            break
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)  # would a wrong version slip in behind them?
    task.cancel()
    assert sorted(rq_queue.job_ids) == ["eval-eval-b-v2", "eval-eval-b-v4", "eval-eval-b-v5"]  # v5: the last
    # run the queued jobs with the worker `brigade evaluator` starts (SimpleWorker), in burst mode
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rq.cli", "worker", "--burst", "--url", redis_url, "--worker-class",
        "rq.worker.SimpleWorker", keys.eval_queue("eval-b"))
    assert await asyncio.wait_for(worker.wait(), 240) == 0
    evals = await store.redis.hgetall(keys.RunKeys("eval-b").evals)
    assert sorted(int(v) for v in evals) == [2, 4, 5]
    conn.close()
    await store.close()
