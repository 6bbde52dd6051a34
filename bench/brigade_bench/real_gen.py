"""`brigade bench real-gen`: `brigade bench real` on the long-completion recipe (`gen` in
`brigade.recipes.word_problems.RECIPES`: the model works before it answers, up to 128 new tokens),
the same sides and figures; there async should reach the same held-out accuracy >= 1.3x sooner than
TRL's GRPOTrainer, its worker generating while its learner trains. `dominated_by` says which phase
the recipe's step spends most on here (on a 2-core CPU, training: bench/report.md, "staleness").
"""

from __future__ import annotations

from brigade_bench import real

FULL_REPEAT = real.FULL_REPEAT


def run(quick: bool = False) -> dict:
    return real.run(quick, recipe="gen")
