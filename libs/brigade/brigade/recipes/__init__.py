"""Recipes: a task, its data, its reward functions and a run spec, verified on a real model.

`RECIPES` names the ones `brigade real --recipe` runs: name -> (run spec, dataset writer), the
writer taking the folder the data goes in.
"""

from __future__ import annotations

import functools

from brigade.recipes import missing_number, word_problems

RECIPES = {
    **{name: (run, functools.partial(word_problems.write_dataset, system=system))
       for name, (run, system) in word_problems.RECIPES.items()},
    "episodes": (missing_number.RUN, missing_number.write_dataset),
}
