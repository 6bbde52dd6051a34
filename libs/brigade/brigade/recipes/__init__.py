"""Recipes: a task, its data, its reward functions and a run spec, verified on a real model."""
