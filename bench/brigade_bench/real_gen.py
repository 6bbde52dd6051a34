"""`brigade bench real-gen`: `brigade bench real` on the generation-dominated recipe (`gen` in
`brigade.recipes.word_problems.RECIPES`: the model works before it answers, up to 128 new tokens),
the same sides and figures; there async should reach the same held-out accuracy >= 1.3x sooner than
TRL's GRPOTrainer, its worker generating while its learner trains.
"""

from __future__ import annotations

from brigade_bench import real

FULL_REPEAT = real.FULL_REPEAT


def run(quick: bool = False) -> dict:
    return real.run(quick, recipe="gen")
