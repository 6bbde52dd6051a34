"""Prompt sets, read the way TRL users have them, into `Prompt` messages.

`dataset` names one of:
- `demo` (or `demo:heldout`): the built-in task;
- a local file: JSON Lines or a JSON list of objects (`.jsonl`, `.json`, read as JSON: types are
  exactly the file's), CSV or Parquet (read by `datasets`); a single file is the split `train`;
- a folder written by `datasets`' `save_to_disk` (a Dataset, or a DatasetDict and its splits), or
  a folder of data files;
- a bucket URI (`s3://...`, `file://...`) of any of these, mirrored into the local cache once;
- a Hugging Face Hub id, read by `datasets.load_dataset` through the standard HF cache and its
  environment variables (HF_HOME, HF_HUB_OFFLINE, ...): an offline machine uses what is cached.

`prompt_column` (default `prompt`; a JSONL row may say `text` instead) holds a string or a list
of `{"role", "content"}` messages (rendered later with the model's chat template, see
`brigade.chat`). Every other column travels as JSON in `Prompt.columns_json`, so an int arrives
as an int and a list as a list (`row_columns` decodes it); an `id` column names the prompt too.
Bad input raises DatasetError: one line naming the dataset, the split or column, and the fix.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from brigade.mirror import is_bucket_uri, mirror
from brigade.v1 import brigade_pb2 as pb

JSON_SUFFIXES = (".jsonl", ".json")
DATASETS_SUFFIXES = {".csv": "csv", ".parquet": "parquet"}
SUFFIXES = (*JSON_SUFFIXES, *DATASETS_SUFFIXES)


class DatasetError(ValueError):
    pass


def train_prompts(spec: pb.RunSpec) -> list[pb.Prompt]:
    return load_prompts(spec.dataset, spec.dataset_split or "train", spec.prompt_column or "prompt",
                        spec.dataset_config)


def eval_prompts(spec: pb.RunSpec) -> list[pb.Prompt]:
    """The evaluator's prompts: eval_dataset (or dataset) at eval_split (or dataset_split)."""
    name = spec.eval_dataset or spec.dataset
    config = spec.dataset_config if name == spec.dataset else ""
    return load_prompts(name, spec.eval_split or spec.dataset_split or "train", spec.prompt_column or "prompt", config)


def load_prompts(name: str, split: str = "train", prompt_column: str = "prompt", config: str = "") -> list[pb.Prompt]:
    rows = read_rows(name, split, config)
    if not rows:
        raise DatasetError(f"dataset {name!r}: split {split!r} is empty; name a split that has rows (dataset_split)")
    column = prompt_column
    if column not in rows[0] and column == "prompt" and "text" in rows[0]:
        column = "text"  # brigade's first JSONL format
    if column not in rows[0]:
        raise DatasetError(f"dataset {name!r}: no column {prompt_column!r} (columns: {', '.join(map(str, rows[0]))}); "
                           f"set prompt_column to the one holding the prompts")
    return [to_prompt(name, i, row, column) for i, row in enumerate(rows)]


def to_prompt(name: str, i: int, row: dict[str, Any], column: str) -> pb.Prompt:
    value = row.get(column)
    columns = {k: v for k, v in row.items() if k != column}
    try:
        columns_json = json.dumps(columns)
    except (TypeError, ValueError) as e:
        raise DatasetError(f"dataset {name!r}: row {i + 1}: a column holds a value JSON cannot carry ({e}); "
                           f"cast or drop that column") from e
    prompt = pb.Prompt(id=str(row.get("id", i)), columns_json=columns_json)
    if isinstance(value, str) and value:
        prompt.text = value
    elif is_messages(value):
        prompt.messages_json = json.dumps(value)
        prompt.text = str(value[-1]["content"])
    else:
        raise DatasetError(f"dataset {name!r}: row {i + 1}: column {column!r} must be a non-empty string or a list "
                           f"of {{'role': ..., 'content': ...}} messages, got {type(value).__name__}")
    return prompt


def is_messages(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in value))


def prompt_value(prompt: pb.Prompt) -> str | list[dict]:
    """What reward functions get as the prompt, as TRL hands it: the string, or the messages."""
    return json.loads(prompt.messages_json) if prompt.messages_json else prompt.text


def row_columns(prompt: pb.Prompt) -> dict[str, Any]:
    """The dataset columns of a prompt, with their types (older writers: the string map)."""
    return json.loads(prompt.columns_json) if prompt.columns_json else dict(prompt.columns)


# ---------------------------------------------------------------- sources


def read_rows(name: str, split: str = "train", config: str = "") -> list[dict[str, Any]]:
    if name == "demo" or name.startswith("demo:"):
        from brigade.demo.task import load_prompts as demo_prompts

        return demo_prompts(name.partition(":")[2] or split)
    path = Path(name)
    if is_bucket_uri(name):
        try:
            path = mirror(name, "datasets", single_file=name.endswith(SUFFIXES))
        except Exception as e:  # noqa: BLE001 - any bucket failure is this one line
            raise DatasetError(f"dataset {name!r}: cannot read it from the bucket: {type(e).__name__}: {e}") from e
    if path.is_file():
        return _read_file(name, path, split)
    if path.is_dir():
        return _read_folder(name, path, split)
    if path.suffix in SUFFIXES or name.startswith((".", "/", "~")):
        raise DatasetError(f"dataset {name!r}: no such file or folder (paths are relative to the working "
                           f"directory, {Path.cwd()}, not to the spec file)")
    return _read_hub(name, split, config)


def _read_file(name: str, path: Path, split: str) -> list[dict[str, Any]]:
    if split != "train":
        raise DatasetError(f"dataset {name!r}: a single file is the split 'train', not {split!r}; "
                           f"name another file (eval_dataset) instead of a split")
    if path.suffix in JSON_SUFFIXES:
        return _read_json(name, path)
    if path.suffix in DATASETS_SUFFIXES:
        ds = _datasets().load_dataset(DATASETS_SUFFIXES[path.suffix], data_files=str(path), split="train")
        return ds.to_list()
    raise DatasetError(f"dataset {name!r}: unknown file type {path.suffix!r}; use {', '.join(SUFFIXES)}")


def _read_json(name: str, path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise DatasetError(f"dataset {name!r}: cannot read it: {e.strerror}") from e
    if text.lstrip().startswith("["):  # one JSON list of rows
        try:
            rows = json.loads(text)
        except ValueError as e:
            raise DatasetError(f"dataset {name!r}: not JSON: {e}") from e
        lines = list(enumerate(rows, 1))
    else:
        lines = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    lines.append((n, json.loads(line)))
                except ValueError as e:
                    raise DatasetError(f"dataset {name!r}: line {n} is not JSON: {e}") from e
    for n, row in lines:
        if not isinstance(row, dict):
            raise DatasetError(f"dataset {name!r}: row {n} is a {type(row).__name__}, expected an object of columns")
    return [row for _, row in lines]


def _read_folder(name: str, path: Path, split: str) -> list[dict[str, Any]]:
    datasets = _datasets()
    if (path / "dataset_dict.json").exists() or (path / "state.json").exists():  # save_to_disk
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DatasetError(f"dataset {name!r}: no split {split!r} (splits: {', '.join(ds)}); "
                                   f"set dataset_split")
            ds = ds[split]
        return ds.to_list()
    return _load(name, split, lambda: datasets.load_dataset(str(path), split=split))


def _read_hub(name: str, split: str, config: str) -> list[dict[str, Any]]:
    datasets = _datasets()
    return _load(name, split, lambda: datasets.load_dataset(name, config or None, split=split))


def _load(name: str, split: str, load) -> list[dict[str, Any]]:
    try:
        return load().to_list()
    except ConnectionError as e:  # offline (HF_HUB_OFFLINE=1 or no network) and not in the cache
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0") or os.environ.get("HF_DATASETS_OFFLINE")
        where = "offline and not in the Hugging Face cache" if offline else "not reachable on the Hub"
        raise DatasetError(f"dataset {name!r}: {where} ({e}); run `hf download --repo-type dataset {name}` where "
                           f"there is a network, with the same HF_HOME, or name a local file") from e
    except ValueError as e:  # an unknown split or configuration
        raise DatasetError(f"dataset {name!r}: {e}".splitlines()[0] + " (dataset_split, dataset_config)") from e
    except FileNotFoundError as e:
        raise DatasetError(f"dataset {name!r}: no such file, folder or Hub dataset ({e})".splitlines()[0]) from e


def _datasets():
    try:
        import datasets
    except ImportError as e:
        raise DatasetError("reading CSV, Parquet, save_to_disk folders and Hub datasets needs "
                           "`pip install brigade[hf]` (the `datasets` package)") from e
    return datasets
