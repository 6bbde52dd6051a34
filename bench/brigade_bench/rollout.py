"""`brigade bench rollout`: the rollout worker's adapter hot-swap and generation overhead.

Adapter swap, for a 7B-sized adapter: LoRA rank 16 on q/k/v/o of Llama-2-7B's 32 layers
(hidden 4096), 16.8 M parameters = 32 MiB in bf16, in PEFT naming.
- fetch: `adapters.read_version` (manifest + files through the bucket library, every file
  sha256-checked) against raw aiobotocore GETs of the same three objects, on the same S3 server
  in the same run. fetch_ratio = ours / raw (target <= 1.5).
- load: decode (safetensors views, bf16 as sent) + apply (shape and finiteness checks, copy into the model);
  swap: apply alone, which is all that is left on the critical path once a version was prefetched.
  The model is Llama-2-7B's skeleton on the meta device with only its LoRA weights materialised,
  so the copy is real and the 13 GB base is not needed.

Generation: samples per second of the hf engine (`HFEngine.generate`: processed log-probs, stop
checks, explicit position ids) against plain `model.generate` with the same prompts, settings and
seed, on the demo model's architecture, one torch thread. generate_ratio = our CPU time / plain CPU
time (target <= 1.15); generate_wall_ratio is the same in wall time, which on a shared machine
mostly measures the neighbours. Both sample the same tokens (checked), so the ratio is pure overhead.

Rounds alternate who goes first; figures are medians. S3: BRIGADE_BENCH_S3 if set, else
AWS_ENDPOINT_URL(_S3) with a throwaway bucket, else a moto server started here.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from brigade import adapters, keys
from brigade_bench.bucket import with_s3

LLAMA7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]


def skeleton_with_lora(rank: int = 16):
    """A PeftModel over Llama-2-7B shapes: base weights on `meta` (no memory), LoRA weights real."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        base = LlamaForCausalLM(LlamaConfig(**LLAMA7B))
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ATTN))
    for name, module in model.named_modules():
        if name.endswith(("lora_A", "lora_B")):
            module.to_empty(device="cpu")
    return model


def _median_ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 1)


# ---------------------------------------------------------------- adapter fetch and load


async def _adapter_bench(url: str, rounds: int) -> dict:
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    from brigade.bucket import open_bucket
    from brigade.bucket.s3 import S3Bucket

    model = skeleton_with_lora()
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in adapters.adapter_state(model).items()}
    files, _ = adapters.encode(state, adapters.adapter_config_json(model))
    run = f"bench-{uuid.uuid4().hex[:8]}"
    bucket = open_bucket(url)
    assert isinstance(bucket, S3Bucket)
    await bucket.ensure()
    await adapters.write_version(bucket, run, 1, 1, files, "bf16")
    prefix = keys.adapter_prefix(run, 1)
    names = [adapters.MANIFEST, *sorted(files)]  # read_version's order: the manifest, then each file
    full = [f"{bucket.prefix}/{prefix}{n}" if bucket.prefix else prefix + n for n in names]

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = AioConfig(region_name=region, s3={"addressing_style": "path" if endpoint else "auto"},
                       request_checksum_calculation="when_required", response_checksum_validation="when_required")
    times: dict[str, list[float]] = {"fetch": [], "raw": [], "decode": [], "apply": []}
    async with get_session().create_client("s3", endpoint_url=endpoint, config=config) as raw:

        async def ours():
            _, got = await adapters.read_version(bucket, run, 1)
            return got

        async def baseline():
            for key in full:
                resp = await raw.get_object(Bucket=bucket.name, Key=key)
                async with resp["Body"] as body:
                    await body.read()

        try:
            await ours()
            await baseline()  # warm connections and the server
            for r in range(rounds):
                pair = [("fetch", ours), ("raw", baseline)]
                for name, fn in pair[:: -1 if r % 2 else 1]:
                    t0 = time.perf_counter()
                    got = await fn()
                    times[name].append(time.perf_counter() - t0)
                    if name == "fetch":
                        fetched = got
                t0 = time.perf_counter()
                decoded = await asyncio.to_thread(adapters.decode, fetched, False)  # as the worker's cache does
                times["decode"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                await asyncio.to_thread(adapters.apply, model, decoded)
                times["apply"].append(time.perf_counter() - t0)
        finally:
            for n in names:
                await bucket.delete(prefix + n)
            await bucket.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    size = sum(len(b) for b in files.values())
    return {
        "adapter_mib": round(size / 2**20, 1),
        "adapter_params_m": round(sum(v.numel() for v in state.values()) / 1e6, 1),
        "fetch_ms": _median_ms(times["fetch"]),
        "raw_fetch_ms": _median_ms(times["raw"]),
        "fetch_ratio": round(med["fetch"] / med["raw"], 3),
        "decode_ms": _median_ms(times["decode"]),
        "swap_ms": _median_ms(times["apply"]),
        "load_ms": round((med["decode"] + med["apply"]) * 1e3, 1),
    }


# ---------------------------------------------------------------- generation overhead


def _generate_bench(rounds: int, prompts_n: int = 8, group: int = 8, max_new_tokens: int = 16) -> dict:
    from brigade.demo.build import MODEL_CONFIG
    from brigade.demo.task import load_prompts
    from brigade.engine.hf import HFEngine
    from brigade.model import attach_lora, load_base
    from brigade_testing.tiny import tiny_model, tiny_spec

    with tempfile.TemporaryDirectory() as tmp:
        c = MODEL_CONFIG  # the demo model's shape
        model_dir = tiny_model(Path(tmp) / "model", hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                               heads=c["num_attention_heads"], intermediate=c["intermediate_size"],
                               max_positions=c["max_position_embeddings"], tied=c["tie_word_embeddings"])
        spec = tiny_spec(model_dir, seed=0, lora={"target_modules": ["q_proj", "v_proj"]},
                         sampling={"group_size": group, "max_new_tokens": max_new_tokens})
        model, tok = load_base(spec)
    engine = HFEngine(attach_lora(model, spec), tok)
    prompts = [p["text"] for p in load_prompts("train")[:prompts_n]]
    rows = [p for p in prompts for _ in range(group)]
    s = spec.sampling

    def ours(seed):
        return [x.completion_ids for x in engine.generate(prompts, s, seed, 0, lambda: False)]

    @torch.inference_mode()
    def plain(seed):
        torch.manual_seed(seed)
        enc = tok(rows, return_tensors="pt", padding=True, padding_side="left")
        out = engine.model.generate(**enc, do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                    max_new_tokens=s.max_new_tokens, pad_token_id=tok.pad_token_id)
        return out[:, enc["input_ids"].shape[1]:].tolist()

    def trim(ids):  # plain generate pads after eos; ours stops at it
        return [r[: r.index(tok.eos_token_id) + 1] if tok.eos_token_id in r else r for r in ids]

    same = trim(plain(123)) == ours(123)
    # one thread and process CPU time: on a shared machine, wall time mostly measures the neighbours
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cpu: dict[str, list[float]] = {"hf": [], "plain": []}
    wall: dict[str, list[float]] = {"hf": [], "plain": []}
    try:
        for r in range(rounds):
            pair = [("hf", ours), ("plain", plain)]
            for name, fn in pair[:: -1 if r % 2 else 1]:
                c0, w0 = time.process_time(), time.perf_counter()
                for i in range(3):  # a few batches per timing: one tiny batch is all noise
                    fn(1000 * r + i)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    finally:
        torch.set_num_threads(threads)
    c = {k: statistics.median(v) for k, v in cpu.items()}
    w = {k: statistics.median(v) for k, v in wall.items()}
    n = 3 * len(rows)
    return {
        "hf_samples_per_s": round(n / w["hf"], 1),
        "plain_samples_per_s": round(n / w["plain"], 1),
        "generate_ratio": round(c["hf"] / c["plain"], 3),
        "generate_wall_ratio": round(w["hf"] / w["plain"], 3),
        "same_completions_as_plain": same,
        "generate_rows": len(rows),
        "max_new_tokens": max_new_tokens,
    }


def run(quick: bool = False) -> dict:
    rounds = 5 if quick else 11
    out = asyncio.run(with_s3(lambda url, _server_pid: _adapter_bench(url, rounds)))
    out |= _generate_bench(rounds=7 if quick else 21)
    return out


if __name__ == "__main__":
    import json
    import sys

    print(json.dumps(run(quick="--quick" in sys.argv)))
