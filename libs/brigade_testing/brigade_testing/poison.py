"""Poison rollout objects for the hostile-input tests: valid safetensors with a header edited."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def with_header(data: bytes, edit: Callable[[dict], Any]) -> bytes:
    """`data` with its safetensors JSON header replaced by edit(header) (a value to dump as JSON,
    or raw bytes); the tensor bytes after it are unchanged."""
    n = int.from_bytes(data[:8], "little")
    raw = edit(json.loads(data[8:8 + n]))
    raw = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw + data[8 + n:]


def with_metadata(data: bytes, **meta: Any) -> bytes:
    """`data` with these `__metadata__` entries set (values of any JSON type)."""
    return with_header(data, lambda h: {**h, "__metadata__": {**h.get("__metadata__", {}), **meta}})
