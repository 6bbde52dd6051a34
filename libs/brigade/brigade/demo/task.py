"""The demo task: single-digit addition ("3+5=" -> "8"), scored 1/0 by exact match.

Torch-free on purpose: the proxy loads the prompt set and must not import torch.
The base model (build.py) is right ~35% of the time when sampled at temperature 1 and GRPO
takes that above 0.9 in a few dozen steps, so the mean reward reads directly as accuracy.
Greedy decoding starts at ~0.9 already: evaluate with sampled accuracy (DEMO_SAMPLING).
"""

from __future__ import annotations

import json
import os
import random
from functools import cache
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
SPLITS = ("train", "heldout")

# LoRA on every linear layer of the tiny Llama. Attention only (q/k/v/o) also climbs, but
# needs twice the learning rate and ends lower (~0.85 after 100 steps instead of ~0.97).
DEFAULT_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Verified with a standalone GRPO loop (G=8, 8 prompts per step, AdamW, clipped token ratios,
# rollouts 0-4 versions stale): sampled reward 0.35 -> 0.85 by step ~30, ~0.97 by step 60-100,
# and heldout prompts follow (0.38 -> 0.94).
# 5e-3 climbs as fast but oscillates (0.6-0.9); 1e-3 needs ~45 steps.
DEMO_LORA = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=DEFAULT_TARGET_MODULES)
DEMO_LR = 2e-3
DEMO_PROMPTS_PER_STEP = 8
# Answers are at most two characters plus the eos; one token of slack.
DEMO_SAMPLING = dict(group_size=8, temperature=1.0, top_p=1.0, max_new_tokens=4)

# The whole demo run, as run spec overrides (`brigade up --demo`): the settings above, 100 learner
# steps of one 8-prompt batch each, a small KL anchor (beta 0.01) and the staleness cap of 4 versions.
DEMO_RUN = {
    "run_id": "demo",
    "model": "demo",
    "dataset": "demo",
    "eval_dataset": "demo:heldout",
    "max_steps": 100,
    "prompts_per_batch": DEMO_PROMPTS_PER_STEP,
    "batches_per_step": 1,
    "eval_every": 10,
    "lora": {"rank": DEMO_LORA["r"], "alpha": float(DEMO_LORA["lora_alpha"]), "dropout": 0.0,
             "target_modules": DEFAULT_TARGET_MODULES},
    "sampling": dict(DEMO_SAMPLING),
    "grpo": {"learning_rate": DEMO_LR, "loss_agg": "dapo", "scale_rewards": "group", "beta": 0.01},
    "staleness": {"max_staleness": 4, "lease_seconds": 30, "max_attempts": 3},
    "rewards": [{"function": "demo_sum", "weight": 1.0}],
}

# The demo under topology local_sgd (`brigade up --demo --topology local_sgd`, `brigade bench topology`),
# over DEMO_RUN: A being frozen (merge frozen_a: half the parameters move), twice the inner learning
# rate, and plain averaging. Single runs of 12 rounds of 2 trainers x 4 local steps (load average ~6),
# round rewards: averaging at 4e-3 passed 0.9 by round 9 (0.94 at 12); Nesterov with DiLoCo's outer
# lr 0.7 and momentum 0.9 at 4e-3 stalled at 0.6 in one run, 0.78 in another (too much momentum for
# 4 local steps); Nesterov with momentum 0.5, and averaging with outer lr 1.5 (4e-3) or 2 (2e-3),
# also passed 0.9 by round 9-10; averaging at 2e-3 reached 0.83 at round 12.
DEMO_LOCAL_SGD = {"local_sgd": {"local_steps": 4}, "grpo": {"learning_rate": 2 * DEMO_LR}}

# Special tokens as they appear in decoded text when skip_special_tokens=False.
BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"


def all_problems() -> list[tuple[int, int]]:
    return [(a, b) for a in range(10) for b in range(10)]


def prompt_text(a: int, b: int) -> str:
    return f"{a}+{b}="


def make_splits(heldout: int = 20, seed: int = 0) -> dict[str, list[dict]]:
    """The 100 problems, shuffled once and cut into disjoint train/heldout lists (what data/ holds)."""
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    rows = [{"id": f"add-{a}-{b}", "text": prompt_text(a, b), "answer": str(a + b)} for a, b in problems]
    return {"train": rows[heldout:], "heldout": rows[:heldout]}


def default_model_dir() -> Path:
    """Where the demo model is built (build.py); here so that torch-free code can find it."""
    return Path(os.environ.get("BRIGADE_CACHE", "~/.cache/brigade")).expanduser() / "demo-model"


@cache
def _load(split: str) -> tuple[dict, ...]:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}, expected one of {SPLITS}")
    with open(DATA_DIR / f"{split}.jsonl") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def load_prompts(split: str = "train") -> list[dict]:
    """[{"id", "text", "answer"}, ...] from the shipped JSONL; a fresh list of fresh dicts each call."""
    return [dict(row) for row in _load(split)]


def clean_completion(text: str) -> str:
    """What the model answered: text up to the first eos, without pad/bos tokens or whitespace.
    Works whether the caller decoded with skip_special_tokens or not."""
    text = text.split(EOS, 1)[0]
    for tok in (PAD, BOS):
        text = text.replace(tok, "")
    return "".join(text.split())


def demo_reward(
    prompts: list[str],
    completions: list[str],
    completion_ids: list[list[int]] | None = None,
    **columns,
) -> list[float | None]:
    """TRL-style reward: 1.0 for exactly the right answer, else 0.0. columns["answer"] holds one
    answer per completion (the caller repeats each prompt's columns group_size times); a row
    without an answer gets None (not scored), never a fake 0."""
    answers = columns.get("answer")
    if answers is None:
        return [None] * len(completions)
    if len(answers) != len(completions):
        raise ValueError(f"{len(answers)} answers for {len(completions)} completions")
    return [
        None if ans is None else float(clean_completion(c) == str(ans).strip())
        for c, ans in zip(completions, answers, strict=True)
    ]
