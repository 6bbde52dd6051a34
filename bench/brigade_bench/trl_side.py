"""The TRL side of `brigade bench real`: TRL's GRPOTrainer on the same recipe, settings and cores as
brigade, in a process of its own, so its wall clock from launch holds its imports and model load as
brigade's holds `brigade up`'s launch.

Mapped from the run spec, not restated: one optimizer step per batch of prompts_per_batch prompts
x group_size completions (per_device_train_batch_size = their product, gradient_accumulation_steps
1, num_iterations 1), the spec's sampling (temperature, top_p, top_k, max_new_tokens), learning
rate and its constant schedule, weight decay, gradient clip, ratio clip (eps_low / eps_high),
loss_agg (TRL's loss_type), scale_rewards, beta, the reward functions and weights, the LoRA
(brigade.model.lora_config, initialised from the same seed) on the model as brigade loads it, and
the training prompts in the order brigade's proxy cuts them (its epoch permutations; TRL's own
shuffle off). No vLLM, CPU, torch threads = the cores this benchmark has; no saving or evaluation
inside the run. At each step's end a callback notes the seconds since launch and, for the versions
the held-out curve scores, writes the LoRA state as brigade publishes one (bf16 safetensors under
brigade's adapter key names), so the curve is scored afterwards exactly as brigade's versions are.

`python -m brigade_bench.trl_side SPEC OUT --launched T --steps N --save 5,10 --threads K`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

INDEX = "versions.jsonl"  # one line per optimizer step: {"version", "seconds" (from launch), "step_s"}


def state_path(out: Path, version: int) -> Path:
    from brigade.adapters import WEIGHTS

    return out / f"v{version}" / WEIGHTS


def load_state(out: Path, version: int) -> dict:
    """A saved version's adapter state, decoded as a worker decodes a published one."""
    from brigade import adapters

    return adapters.decode({adapters.WEIGHTS: state_path(out, version).read_bytes()})


def train_rows(spec) -> list[dict]:
    """The training prompts as TRL's conversational rows ({"prompt": messages, **columns}), in the
    order brigade's proxy leases them: epoch by epoch, each in its seeded permutation, for as many
    epochs as max_steps needs."""
    from brigade.datasets import prompt_value, row_columns, train_prompts
    from brigade.store.runs import RunInfo

    prompts = train_prompts(spec)
    info = RunInfo(spec, b"", num_prompts=len(prompts))
    epochs = max(1, math.ceil(spec.max_steps * spec.prompts_per_batch * spec.batches_per_step / len(prompts)))
    order = [i for e in range(epochs) for i in info.permutation(e)]
    return [{"prompt": prompt_value(prompts[i]), **row_columns(prompts[i])} for i in order]


def grpo_config(spec, out: Path):
    from trl import GRPOConfig

    s, g = spec.sampling, spec.grpo
    return GRPOConfig(
        output_dir=str(out / "trainer"), max_steps=spec.max_steps, seed=spec.seed,
        per_device_train_batch_size=spec.prompts_per_batch * spec.batches_per_step * s.group_size,
        gradient_accumulation_steps=1, num_generations=s.group_size, num_iterations=1,
        max_completion_length=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        learning_rate=g.learning_rate, lr_scheduler_type=g.lr_schedule, warmup_steps=g.warmup_steps,
        weight_decay=g.weight_decay, max_grad_norm=g.max_grad_norm, epsilon=g.eps_low, epsilon_high=g.eps_high,
        loss_type=g.loss_agg, scale_rewards=g.scale_rewards, beta=g.beta,
        reward_weights=[r.weight for r in spec.rewards],
        use_vllm=False, use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False,
        shuffle_dataset=False, dataloader_num_workers=0, dataloader_pin_memory=False,
        logging_steps=1, save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True,
    )


def _saver(out: Path, launched: float, save: set[int]):
    """The step-end callback (a class built here: transformers loads only in the TRL process)."""
    from transformers import TrainerCallback

    from brigade import adapters

    class SaveVersions(TrainerCallback):
        def __init__(self):
            self.began = time.time()

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.time()

        def on_step_end(self, args, state, control, model=None, **kwargs):
            now = time.time()  # the version exists now: writing it is the benchmark's, not TRL's, time
            version = state.global_step
            if version in save:
                files, _ = adapters.encode(adapters.adapter_state(model), adapters.adapter_config_json(model), "bf16")
                path = state_path(out, version)
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(files[adapters.WEIGHTS])
            with open(out / INDEX, "a") as f:
                f.write(json.dumps({"version": version, "seconds": round(now - launched, 2),
                                    "step_s": round(now - self.began, 2)}) + "\n")

    return SaveVersions()


def train(spec_path: str, out: Path, launched: float, save: set[int], threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from trl import GRPOTrainer

    from brigade.model import load_base, lora_config
    from brigade.rewards import resolve
    from brigade.spec_file import build_spec

    spec = build_spec(path=spec_path)
    model, tokenizer = load_base(spec)
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, args=grpo_config(spec, out),
                          reward_funcs=[resolve(r.function) for r in spec.rewards],
                          train_dataset=Dataset.from_list(train_rows(spec)), peft_config=lora_config(spec),
                          callbacks=[_saver(out, launched, save)])
    trainer.train()


def trl_run(spec_path: Path, out: Path, save: set[int], threads: int | None = None) -> dict:
    """TRL's GRPOTrainer on the spec at `spec_path`, launched now as its own process; the run's exit
    code, wall clock, seconds per step (median over its steps) and {version: seconds from launch}
    for the versions saved in `out` (load_state reads them)."""
    import statistics

    out.mkdir(parents=True, exist_ok=True)
    threads = threads or len(os.sched_getaffinity(0))
    launched = time.time()
    with open(out / "trl.log", "w") as log:
        code = subprocess.call([sys.executable, "-m", "brigade_bench.trl_side", str(spec_path), str(out),
                                "--launched", repr(launched), "--save", ",".join(map(str, sorted(save))),
                                "--threads", str(threads)], stdout=log, stderr=subprocess.STDOUT)
    wall = time.time() - launched
    index = [json.loads(x) for x in (out / INDEX).read_text().splitlines()] if (out / INDEX).exists() else []
    if code:
        print((out / "trl.log").read_text()[-3000:], file=sys.stderr, flush=True)
    return {"exit": code, "wall_s": round(wall, 1), "steps": len(index),
            "s_per_step": round(statistics.median(r["step_s"] for r in index), 2) if index else None,
            "first_step_s": index[0]["seconds"] if index else None,
            "published_s": {r["version"]: r["seconds"] for r in index if r["version"] in save}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="brigade_bench.trl_side", description=__doc__.split("\n\n")[0])
    p.add_argument("spec")
    p.add_argument("out", type=Path)
    p.add_argument("--launched", type=float, required=True, help="unix time the parent launched this process")
    p.add_argument("--save", default="", help="comma-separated versions (steps) whose LoRA state to write")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    train(a.spec, a.out, a.launched, {int(v) for v in a.save.split(",") if v}, a.threads)


if __name__ == "__main__":
    main()
