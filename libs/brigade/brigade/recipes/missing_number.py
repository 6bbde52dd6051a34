"""The multi-turn recipe: word problems with a number missing, which only the environment knows.

"Mia has some pens and gets 5 more. How many pens does Mia have now?" The model cannot know how
many pens Mia had; the environment does. Two environments pose it, one per contract:

- `Hint` (reset/step, the Gymnasium shape): the model answers; a wrong answer is told the problem
  with the missing number ("Not quite: Mia has 3 pens and gets 5 more. How many pens does Mia have
  now?"), and the model answers once more. `get_reward` is 1 when an answer was right.
- `Counter` (TRL's `environment_factory`): a `count_start` tool returns the missing number; the
  model calls it (`<tool_call>{"name": "count_start", "arguments": {}}</tool_call>` in the `json`
  tool format), then answers; the reward function `final_answer_correct` reads its last answer.

Without the environment a model can only guess (a one-in-nine chance with the known digit 1-9);
with it, the problem becomes the one-step sum of `brigade.recipes.word_problems`, which
SmolLM2-135M-Instruct gets partly right. The data is generated with a fixed seed from the same
(a, b) pairs and held-out split as word_problems, so no held-out sum is trained on.

Torch-free: the proxy reads the dataset and workers import the environments.
"""

from __future__ import annotations

import random
from pathlib import Path

from brigade.recipes.word_problems import (
    _ENDS_WITH_ANSWER,
    ITEMS,
    NAMES,
    SEED,
    final_number,
    sampled_splits,
    write_splits,
)
from brigade.recipes.word_problems import RUN as WORD_PROBLEMS_RUN

SYSTEM = "Answer with the number only."
SYSTEM_TOOL = "Answer with the number only. Use a tool to find a number you do not know."
# word_problems' templates with `a` left out; the environment's reply restates the problem with it
TEMPLATES = [
    ("{name} has some {item} and gets {b} more. How many {item} does {name} have now?",
     "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?"),
    ("{name} had some {item}. A friend gave {name} {b} more {item}. How many {item} does {name} have?",
     "{name} had {a} {item}. A friend gave {name} {b} more {item}. How many {item} does {name} have?"),
    ("There are some {item} in a box and {b} {item} on the table. How many {item} are there in all?",
     "There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?"),
    ("{name} buys some {item}, then {b} more. How many {item} did {name} buy?",
     "{name} buys {a} {item}, then {b} more. How many {item} did {name} buy?"),
]


def make_splits(seed: int = SEED, system: str = SYSTEM) -> dict[str, list[dict]]:
    """{"train": rows, "heldout": rows}; a row is {"prompt": [messages], "answer", "a", "b", "full"}:
    `a` is the missing number, never in the prompt; `full` is the problem with it (the environment's
    reply). Held-out pairs are word_problems'."""
    def row(rng: random.Random, a: int, b: int) -> dict:
        name, item = rng.choice(NAMES), rng.choice(ITEMS)
        asked, full = rng.choice(TEMPLATES)
        return {"prompt": [{"role": "system", "content": system},
                           {"role": "user", "content": asked.format(b=b, name=name, item=item)}],
                "answer": a + b, "a": a, "b": b, "full": full.format(a=a, b=b, name=name, item=item)}

    return sampled_splits(seed, row)


def write_dataset(folder: str | Path, seed: int = SEED, system: str = SYSTEM) -> dict[str, Path]:
    """train.jsonl and heldout.jsonl in `folder`."""
    return write_splits(folder, make_splits(seed, system))


class Hint:
    """A reset/step environment: tells a wrong answer the missing number, once."""

    def reset(self, answer: int, full: str, **row) -> None:
        self.answer, self.full = int(answer), full
        self.solved, self.hinted = False, False

    def step(self, text: str) -> str | None:
        """One answer: None ends the episode (right, or wrong after the hint)."""
        if final_number(text) == self.answer:
            self.solved = True
            return None
        if self.hinted:
            return None
        self.hinted = True
        return f"Not quite: {self.full}"

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0


class Counter:
    """TRL's environment contract: a tool that tells the missing number; the reward reads the answer."""

    def reset(self, answer: int, a: int, **row) -> None:
        self.answer, self.a = int(answer), int(a)
        self.last = ""

    def count_start(self) -> int:
        """Count the items there were at the start of the problem.

        Returns:
            How many items there were at the start.
        """
        return self.a


def final_answer_correct(completions: list, answer: list, **kwargs) -> list[float]:
    """1.0 when the episode's last answer (its last assistant message's last number) is right: a TRL
    reward function over an episode's messages, or over plain completions."""
    return [float(final_number(_last_said(c)) == int(a)) for c, a in zip(completions, answer, strict=True)]


def _last_said(messages) -> str:
    """The last assistant message of an episode (TRL's completion: a list of messages)."""
    if not isinstance(messages, list):
        return str(messages)
    said = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "assistant"]
    return said[-1] if said else ""


def final_answer_format(completions: list, **kwargs) -> list[float]:
    """1.0 when the episode's last answer ends with a number (word_problems' answer_format)."""
    return [float(bool(_ENDS_WITH_ANSWER.search(_last_said(c)))) for c in completions]


# The run spec: word_problems' with the Hint environment. A turn is at most 12 tokens (a number, and
# room to start rambling); 80 tokens hold two turns and the environment's reply (about 40) between.
# Held-out episodes cost as much as training ones: scored every 20 versions and at the end.
RUN = WORD_PROBLEMS_RUN | {
    "max_steps": 40,
    "eval_every": 20,
    "sampling": WORD_PROBLEMS_RUN["sampling"] | {"max_new_tokens": 80},
    "environment": {"factory": "brigade.recipes.missing_number:Hint", "max_turns": 2, "max_turn_tokens": 12},
    "rewards": [{"function": "brigade.recipes.missing_number:final_answer_format", "weight": 0.25}],
}
