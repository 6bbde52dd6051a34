"""`python -m brigade_bench.vllm_real`: the real-model recipe with `--engine vllm` on a CUDA GPU.

Runs the recipe (`brigade.recipes.word_problems`, SmolLM2-135M-Instruct) through `brigade up`
for a few steps with every rollout worker on the vllm engine (BRIGADE_ENGINE=vllm), reads each
batch's generated tokens and generation seconds from the workers' logs, then generates the same
number of prompts of the recipe with plain vLLM (`LLM.generate`, the same model folder, sampling
settings and LoRA rank, no adapter) and prints both in tokens/s and their ratio as one JSON line.

Not part of `brigade bench all`: it needs `pip install brigade[vllm]` and a CUDA GPU, and exits 2
with one line where either is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker_tokens_per_s(logs: Path) -> tuple[int, float]:
    """(tokens, generation seconds) over every rollout worker's "batch done" lines."""
    tokens, seconds = 0, 0.0
    for path in logs.glob("rollout-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue
            if isinstance(doc, dict) and doc.get("event") == "batch done":
                tokens += int(doc.get("tokens", 0))
                seconds += float(doc.get("generate_s", 0.0))
    return tokens, seconds


def plain_vllm_tokens_per_s(spec_path: Path, rounds: int) -> tuple[int, float]:
    """The recipe's training prompts through plain vLLM, `rounds` batches of prompts_per_batch."""
    from vllm import LLM, SamplingParams

    from brigade.chat import prompt_ids
    from brigade.datasets import prompt_value, train_prompts
    from brigade.engine.vllm import llm_kwargs
    from brigade.model import resolve_model
    from brigade.spec_file import build_spec

    spec = build_spec(path=str(spec_path))
    kw = llm_kwargs(spec, resolve_model(spec.model))
    kw.pop("logprobs_mode", None)
    llm = LLM(**kw)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": prompt_ids(tok, prompt_value(p))} for p in train_prompts(spec)]
    s = spec.sampling
    n = spec.prompts_per_batch
    tokens, seconds = 0, 0.0
    for r in range(rounds + 1):
        batch = prompts[r * n:(r + 1) * n]
        params = SamplingParams(n=s.group_size, temperature=s.temperature, top_p=s.top_p or 1.0,
                                max_tokens=s.max_new_tokens, seed=r)
        t0 = time.perf_counter()
        out = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        if r == 0:
            continue  # warm-up: CUDA graphs, first allocations
        seconds += dt
        tokens += sum(len(c.token_ids) for o in out for c in o.outputs)
    return tokens, seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m brigade_bench.vllm_real", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8, help="learner steps of the recipe")
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError:
        print("error: needs `pip install brigade[vllm]` and a CUDA GPU", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible; the vllm engine runs on CUDA only", file=sys.stderr)
        return 2
    from brigade_cli.real import write_recipe

    with tempfile.TemporaryDirectory(prefix="brigade-vllm-real-") as tmp:
        folder = Path(tmp)
        run_id = time.strftime("vllm-real-%Y%m%d-%H%M%S")
        # on a GPU: the learner trains there too, bf16 (dtype auto)
        spec_path = write_recipe(folder, run_id, {"device": "auto", "dtype": "auto", "max_steps": args.steps})
        env = dict(os.environ, BRIGADE_ENGINE="vllm")
        t0 = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "brigade_cli.main", "up", "--spec", str(spec_path), "--out",
                                str(folder / "run"), "-n", str(args.workers), "--no-evaluator"], env=env)
        wall = time.monotonic() - t0
        tokens, seconds = worker_tokens_per_s(folder / "run" / "logs")
        plain_tokens, plain_seconds = plain_vllm_tokens_per_s(spec_path, rounds=args.steps)
    ours = tokens / seconds if seconds else float("nan")
    plain = plain_tokens / plain_seconds if plain_seconds else float("nan")
    print(json.dumps({"up_exit": code, "steps": args.steps, "wall_s": round(wall, 1), "engine_tokens": tokens,
                      "engine_tokens_per_s": round(ours, 1), "plain_vllm_tokens_per_s": round(plain, 1),
                      "plain_over_engine": round(plain / ours, 3) if ours == ours and ours else None,
                      "gpu": torch.cuda.get_device_name(0)}))
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
