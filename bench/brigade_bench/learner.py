"""`brigade bench learner`: the learner's real GRPO step against a bare forward and backward.

The step is what the service runs: rollout objects fetched from a file:// bucket through the
learner's prefetcher (sha256-verified, parsed, validated, filtered, the next step's batches
downloading while this one computes), then `Trainer.train_step` (advantages, micro-batches, the
clipped loss, backward, gradient clipping, AdamW). The baseline is the same LoRA model's forward,
cross-entropy on the same completion tokens, and backward, over the same micro-batches: what
any fine-tuning loop pays. Rounds alternate between the two so both see the same machine; figures
are medians. overhead_ratio = step_s / bare_s (target <= 1.3 without KL).

The model is a randomly initialised Llama big enough that compute dominates (about 14M parameters;
--quick: about 4.6M), on one rollout of 8 prompts x 4 samples (about 1600 tokens) a step. The full
run also reports the step with KL to the reference (overhead_ratio_kl).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

FULL = dict(hidden=384, layers=6, heads=6, intermediate=1024, vocab=8192, prompts=8, group=4, batches=1,
            prompt_len=16, completion_len=48, rounds=5)
QUICK = dict(hidden=256, layers=4, heads=4, intermediate=704, vocab=4096, prompts=8, group=4, batches=1,
             prompt_len=16, completion_len=48, rounds=3)


def _bare_step(trainer, rollouts) -> None:
    """Forward, cross-entropy on the completion tokens, backward: same model, tokens and chunks."""
    import torch
    import torch.nn.functional as F

    from brigade.model import position_ids
    from brigade_learner.trainer import batch_advantages, micro_batches

    model, g = trainer.model, trainer.spec.grpo
    model.train()
    # the rows the step runs: without a KL term it leaves out those whose advantage is 0
    advantages = None if g.beta > 0 else batch_advantages(rollouts, g.scale_rewards)
    for mb in micro_batches(rollouts, g.micro_batch_tokens, advantages):
        t = trainer._tensors(rollouts[mb.rollout], mb)  # the step's own slicing of the micro-batch
        ids = torch.cat([t["prompt_ids"], t["completion_ids"]], 1)
        mask = torch.cat([t["prompt_mask"], t["completion_mask"]], 1)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
        p = t["prompt_ids"].shape[1]
        targets = t["completion_ids"].masked_fill(t["completion_mask"] == 0, -100)
        loss = F.cross_entropy(logits[:, p - 1:-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100)
        loss.backward()
    model.zero_grad(set_to_none=True)
    model.eval()


async def _bench(cfg: dict, beta: float) -> dict:
    import torch

    from brigade import keys
    from brigade.bucket import open_bucket, sha256_hex
    from brigade.v1 import brigade_pb2 as pb
    from brigade_learner.ingest import Prefetcher
    from brigade_learner.trainer import Trainer
    from brigade_testing.tiny import scored_rollout, tiny_model, tiny_spec

    rounds, run = cfg["rounds"], "bench"
    with tempfile.TemporaryDirectory(prefix="brigade-bench-learner-") as tmp:
        model_dir = tiny_model(Path(tmp) / "model", hidden=cfg["hidden"], layers=cfg["layers"], heads=cfg["heads"],
                               intermediate=cfg["intermediate"], vocab=cfg["vocab"], max_positions=256, tied=True,
                               eos_boost=1.0)
        spec = tiny_spec(model_dir, run_id=run, lora={"rank": 16, "alpha": 32.0},
                         sampling={"group_size": cfg["group"], "max_new_tokens": cfg["completion_len"]},
                         grpo={"learning_rate": 1e-4, "beta": beta, "loss_agg": "dapo", "micro_batch_tokens": 4096},
                         batches_per_step=cfg["batches"], staleness={"max_staleness": 1000})
        trainer = Trainer.create(spec)
        torch.manual_seed(0)
        # every round's rollout objects, uploaded as a worker would, with their manifests
        steps = rounds + 1
        deliveries = []
        async with open_bucket(f"file://{tmp}/bucket") as bucket:
            for n in range(steps * cfg["batches"]):
                batch = keys.batch_id(run, 0, n)
                r = scored_rollout(trainer.model, run=run, batch_id=batch, version=0, prompts=cfg["prompts"],
                                   group_size=cfg["group"], prompt_len=cfg["prompt_len"],
                                   completion_len=cfg["completion_len"], vocab=cfg["vocab"], seed=n)
                data = r.to_bytes()
                key = keys.rollout_key(run, batch, 1)
                await bucket.put_new(key, data)
                deliveries.append(pb.PulledRollout(delivery_id=f"{n + 1}-0", manifest=pb.RolloutManifest(
                    run_id=run, batch_id=batch, attempt=1, policy_version=0, uri=key, sha256=sha256_hex(data),
                    size_bytes=len(data), num_samples=r.num_samples)))
            object_bytes = len(data)

            async def pull(n: int, include_pending: bool) -> tuple[list, bool]:  # (pulled, a try failed)
                if include_pending:
                    return [], False
                out = deliveries[:n]
                del deliveries[:n]
                if not out:
                    await asyncio.sleep(3600)
                return out, False

            async def ack(delivery_ids, consumed, rejected) -> None:
                return None

            consumed: set[str] = set()
            prefetch = Prefetcher(pull, ack, bucket, run, trainer.vocab_size, want=cfg["batches"],
                                  consumed=consumed, max_staleness=1000)
            prefetch.start()
            step_s, bare_s, wait_s, step_cpu, bare_cpu, tokens = [], [], [], [], [], 0
            try:
                for i in range(steps):
                    c0, t0 = time.process_time(), time.perf_counter()
                    data = await prefetch.take(version=0)
                    rollouts = [a.rollout for a in data.accepted]
                    metrics = await asyncio.to_thread(trainer.train_step, rollouts)
                    consumed.update(a.batch_id for a in data.accepted)
                    t1, c1 = time.perf_counter(), time.process_time()
                    await asyncio.to_thread(_bare_step, trainer, rollouts)
                    t2, c2 = time.perf_counter(), time.process_time()
                    if i == 0:
                        continue  # warm-up: allocator, thread pools, first-touch
                    step_s.append(t1 - t0)
                    bare_s.append(t2 - t1)
                    step_cpu.append(c1 - c0)
                    bare_cpu.append(c2 - c1)
                    wait_s.append(data.wait_s)
                    tokens = sum(int(r.prompt_mask.sum() + r.completion_mask.sum()) for r in rollouts)
            finally:
                await prefetch.stop()
    params = sum(p.numel() for p in trainer.model.parameters())
    step, bare = statistics.median(step_s), statistics.median(bare_s)
    return {
        "step_s": step, "bare_s": bare, "overhead_ratio": step / bare,
        "overhead_ratio_cpu": statistics.median(step_cpu) / statistics.median(bare_cpu),
        "tokens_per_s": tokens / step, "bare_tokens_per_s": tokens / bare,
        "wait_s": statistics.median(wait_s), "tokens_per_step": tokens, "rollout_object_bytes": object_bytes,
        "loss_finite": int(metrics["loss"] == metrics["loss"]), "model_params": params,
        "trainable_params": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "rounds": rounds, "torch_threads": torch.get_num_threads(),
    }


async def run(quick: bool = False) -> dict:
    cfg = QUICK if quick else FULL
    out = await _bench(cfg, beta=0.0)
    if not quick:  # with KL the reference forward (adapter disabled) is one extra forward pass
        kl = await _bench(dict(cfg, rounds=3), beta=0.04)
        out.update({"step_kl_s": kl["step_s"], "overhead_ratio_kl": kl["step_s"] / kl["bare_s"]})
    return out
