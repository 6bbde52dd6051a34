"""What `brigade up` checks before it starts anything: every mistake that can be seen from here
gets one line naming the field, the file or the function and what to do, instead of a service
that dies a minute later with the cause buried in its log."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from brigade.config import ConfigError
from brigade.v1 import brigade_pb2 as pb

# what a Hugging Face model id looks like (org/name); anything else that is not a folder is a typo
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def check_model(model: str) -> str | None:
    if model == "demo" or "://" in model:
        return None
    if Path(model).is_dir():
        if (Path(model) / "config.json").exists():
            return None
        return (f"model: {model} has no config.json; a model folder is what `save_pretrained` writes "
                f"(config.json, the weights, the tokenizer files)")
    if Path(model).exists():
        return f"model: {model} is a file, not a model folder (a folder with config.json and the weights)"
    if _HUB_ID.fullmatch(model) and not model.startswith("."):
        return None  # a Hub id: the services resolve it through the Hugging Face cache
    return (f"model: no folder {model} (from {Path.cwd()}); give a model folder, a Hugging Face id "
            f"such as HuggingFaceTB/SmolLM2-135M-Instruct, or `demo`")


def check_dataset(field: str, name: str) -> str | None:
    from brigade.datasets import DatasetError, load_prompts

    try:
        load_prompts(name)
    except DatasetError as e:
        hint = "" if Path(name).is_absolute() else f" (paths are relative to the working directory, {Path.cwd()})"
        return f"{field}: {e}{hint}"
    return None


def check_rewards(rewards) -> list[str]:
    from brigade.rewards import resolve

    # the services run as `python -m ...` from this folder, which puts it on sys.path: so do we
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    problems = []
    for i, r in enumerate(rewards):
        try:
            resolve(r.function)
        except ValueError as e:
            problems.append(f"rewards[{i}].function: {e} (a module of yours must be importable from the working "
                            f"directory or PYTHONPATH)")
    return problems


def unknown_characters(spec: pb.RunSpec) -> str | None:
    """A warning when prompts hold characters the model's tokenizer maps to its unknown token (a
    character-level vocabulary such as the demo model's), which the model then never sees."""
    if spec.model != "demo" and not Path(spec.model).is_dir():
        return None  # a Hub id: not loaded here
    from transformers import AutoTokenizer

    from brigade.datasets import load_prompts
    from brigade.model import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(spec.model))
    unk = tokenizer.unk_token_id
    if unk is None:
        return None  # byte-level BPE: every character has tokens
    bad = [(i, p.text) for i, p in enumerate(load_prompts(spec.dataset))
           if unk in tokenizer(p.text, add_special_tokens=False)["input_ids"]]
    if not bad:
        return None
    row, text = bad[0]
    chars = sorted({c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]})
    return (f"warning: dataset: {len(bad)} prompts hold characters the model's tokenizer does not know "
            f"(first: row {row + 1}, {''.join(chars)[:20]!r}); they reach the model as {tokenizer.unk_token}")


def preflight(spec: pb.RunSpec) -> None:
    """Raise ConfigError with one line per problem found."""
    problems = [p for p in (check_model(spec.model), check_dataset("dataset", spec.dataset)) if p]
    if spec.eval_dataset and spec.eval_dataset != spec.dataset:
        problems += [p for p in (check_dataset("eval_dataset", spec.eval_dataset),) if p]
    problems += check_rewards(spec.rewards)
    if problems:
        raise ConfigError("\n".join(problems))
