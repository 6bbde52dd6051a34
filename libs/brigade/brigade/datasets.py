"""Prompt sets: the built-in demo task, or a JSONL file (one object a line with `prompt` or `text`,
an optional `id`, and any other string columns, handed to reward functions)."""

from __future__ import annotations

import json
from pathlib import Path

from brigade.v1 import brigade_pb2 as pb


class DatasetError(ValueError):
    pass


def load_prompts(name: str) -> list[pb.Prompt]:
    if name == "demo" or name.startswith("demo:"):
        from brigade.demo.task import load_prompts as demo_prompts

        split = name.partition(":")[2] or "train"
        rows = demo_prompts(split)
    else:
        rows = _read_jsonl(Path(name))
    prompts = []
    for i, row in enumerate(rows):
        text = row.get("text", row.get("prompt"))
        if not isinstance(text, str) or not text:
            raise DatasetError(f"{name}: row {i + 1} has no 'prompt' or 'text' string")
        columns = {k: str(v) for k, v in row.items() if k not in ("id", "text", "prompt")}
        prompts.append(pb.Prompt(id=str(row.get("id", i)), text=text, columns=columns))
    if not prompts:
        raise DatasetError(f"{name}: the prompt set is empty")
    return prompts


def _read_jsonl(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read prompt set {path}: {e.strerror}") from e
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DatasetError(f"{path}:{n}: not JSON: {e}") from e
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{n}: expected an object")
        rows.append(row)
    return rows
