"""Poison rollouts through the real learner (in process, real proxy, real bucket, tiny model): each is
rejected with a reason and counted, and the run reaches max_steps on the good ones. Before, the
first of them made the learner exit (and again after every restart: the delivery stayed pending),
and a 60,000-token completion reached the training step."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import torch
from proxy_support import new_run_id

from brigade import keys
from brigade.bucket import open_bucket
from brigade.rollout_format import Rollout
from brigade.rpc import ProxyClient
from brigade.v1 import brigade_pb2 as pb
from brigade_learner.trainer import Trainer
from brigade_testing.poison import with_header, with_metadata
from brigade_testing.tiny import encode_prompts, make_rollout, tiny_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]


def long_completion(r: Rollout, c: int = 60_000) -> bytes:
    n = r.num_samples
    pad = c - r.completion_ids.shape[1]
    return Rollout(**{**r.__dict__, "completion_ids": torch.cat([r.completion_ids, torch.zeros(n, pad, dtype=torch.int64)], 1),
                      "completion_mask": torch.cat([r.completion_mask, torch.ones(n, pad, dtype=torch.int8)], 1),
                      "logprobs": torch.cat([r.logprobs, torch.full((n, pad), -1.0)], 1)}).to_bytes()


POISONS = [  # what a worker token holder can upload, one batch each
    lambda r: with_metadata(r.to_bytes(), reward_names="123"),
    lambda r: with_header(r.to_bytes(), lambda h: {**h, "__metadata__": [1, 2]}),
    lambda r: with_metadata(r.to_bytes(), reward_names="[" * 60_000 + "]" * 60_000),
    long_completion,
    lambda r: Rollout(**{**r.__dict__, "completion_mask": -r.completion_mask}).to_bytes(),
    lambda r: Rollout(**{**r.__dict__, "logprobs": r.logprobs.abs() + 1.0}).to_bytes(),
]


async def drive(addr: str, bucket_url: str, run: str, model_dir, stop: asyncio.Event) -> int:
    """A worker that hands in the poisons first, then good rollouts (sampled at v0 throughout)."""
    from transformers import AutoTokenizer

    sent = 0
    async with ProxyClient.connect(addr) as client, open_bucket(bucket_url) as bucket:
        while True:
            try:
                spec = (await client.runs.GetRun(pb.RunRef(run_id=run), timeout=5)).spec
                break
            except Exception:
                await asyncio.sleep(0.2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        sampler = Trainer.create(spec)
        while not stop.is_set():
            resp = await client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id="w"), timeout=10)
            if not resp.granted:
                if resp.reason == "finished":
                    return sent
                await asyncio.sleep(min(resp.retry_after_ms, 300) / 1000)
                continue
            lease = resp.lease
            ids, mask = encode_prompts(tokenizer, [p.text for p in lease.batch.prompts])
            r = make_rollout(sampler.model, ids, mask, run=run, batch_id=lease.batch.batch_id, attempt=lease.attempt,
                             version=lease.adapter_version, group_size=spec.sampling.group_size,
                             max_new_tokens=spec.sampling.max_new_tokens, seed=lease.seed % 2**31,
                             eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
            data = POISONS[sent](r) if sent < len(POISONS) else r.to_bytes()
            key = keys.rollout_key(run, lease.batch.batch_id, lease.attempt)
            sha = await bucket.put_new(key, data)
            manifest = pb.RolloutManifest(
                run_id=run, batch_id=lease.batch.batch_id, attempt=lease.attempt, worker_id="w",
                policy_version=lease.adapter_version, uri=key, sha256=sha, size_bytes=len(data),
                num_samples=r.num_samples, created_ms=int(time.time() * 1000))
            await client.lease.CompleteLease(pb.CompleteLeaseRequest(
                run_id=run, lease_id=lease.lease_id, worker_id="w", manifest=manifest), timeout=10)
            sent += 1
    return sent


async def test_the_learner_rejects_every_poison_and_finishes_the_run(tmp_path, redis_url, file_bucket_url):
    import yaml

    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import serve
    from brigade_proxy.server import start_server

    run = new_run_id("poison")
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(20)))
    spec = {"run_id": run, "model": str(model_dir), "dtype": "float32", "device": "cpu", "dataset": str(prompts),
            "max_steps": 2, "prompts_per_batch": 2, "batches_per_step": 1, "eval_every": 0,
            "lora": {"rank": 4, "alpha": 8.0}, "sampling": {"group_size": 4, "max_new_tokens": 6},
            "staleness": {"max_staleness": 8}, "rewards": [{"function": "demo_sum"}]}
    spec_path = tmp_path / "run.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=file_bucket_url, monitor_redis=False)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive(addr, file_bucket_url, run, model_dir, stop))
    try:
        await asyncio.wait_for(serve(LearnerConfig(proxy=addr, bucket=file_bucket_url, run=run,
                                                   spec_path=str(spec_path), pull_wait_ms=200)), 150)
        async with ProxyClient.connect(addr) as client:
            state = await client.runs.GetRun(pb.RunRef(run_id=run), timeout=5)
    finally:
        stop.set()
        driver.cancel()
        await server.stop(0)
    assert state.learner_step == 2 and state.finished
    assert state.rejected == len(POISONS) and state.consumed == 2
