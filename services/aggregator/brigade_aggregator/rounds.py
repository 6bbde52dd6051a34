"""The aggregator's round records: its whole state after each round, one create-only object per
global version, `runs/{run}/rounds/v{version:08d}.safetensors`:

    master/<name>     float32: every LoRA tensor of the global adapter (the published payload rounds it)
    momentum/<name>   float32: the outer Nesterov buffer of each trained tensor (empty with `average`)
    metadata "state"  JSON: version, every contribution id ever merged, the round's ack (deliveries,
                      consumed and rejected batches), its metrics, adapter_config.json, creation time

One object, one create-only put: a record is there whole or not at all and never changes, so no
manifest is needed. A restart resumes from the newest record; what that round published and acked is
derived from the record again, so a replay writes the same bytes. Only safetensors and JSON are read.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from brigade import keys
from brigade.bucket import Bucket

FORMAT = "brigade-round-1"
RECORD = re.compile(r"v(\d{8})\.safetensors$")


class RoundError(ValueError):
    """A round record that does not read back: the aggregator stops rather than fork the versions."""


@dataclass
class RoundAck:
    delivery_ids: list[str] = field(default_factory=list)
    consumed: list[str] = field(default_factory=list)   # batches of merged contributions
    rejected: list[str] = field(default_factory=list)   # batches of contributions dropped in this round


@dataclass
class RoundState:
    version: int
    master: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]
    merged: set[str]                 # every contribution id merged into this version or an earlier one
    config_json: bytes               # the adapter's adapter_config.json, as published
    ack: RoundAck = field(default_factory=RoundAck)
    metrics: dict[str, Any] = field(default_factory=dict)
    created_ms: int = field(default_factory=lambda: int(time.time() * 1000))


def encode(run: str, s: RoundState) -> bytes:
    tensors = {f"master/{k}": v.float().contiguous() for k, v in s.master.items()}
    tensors |= {f"momentum/{k}": v.float().contiguous() for k, v in s.momentum.items()}
    doc = {"format": FORMAT, "run_id": run, "version": s.version, "merged": sorted(s.merged),
           "config": s.config_json.decode(), "ack": vars(s.ack), "metrics": s.metrics, "created_ms": s.created_ms}
    return st_save(tensors, metadata={"state": json.dumps(doc, sort_keys=True)})


def decode(run: str, version: int, data: bytes) -> RoundState:
    try:
        doc = json.loads(metadata(data)["state"])
        raw = st_load(data)
        if doc.get("format") != FORMAT or doc.get("run_id") != run or doc.get("version") != version:
            raise ValueError(f"says format {doc.get('format')!r}, run {doc.get('run_id')!r}, "
                             f"version {doc.get('version')!r}")
        return RoundState(
            version=version, master={k[7:]: v for k, v in raw.items() if k.startswith("master/")},
            momentum={k[9:]: v for k, v in raw.items() if k.startswith("momentum/")}, merged=set(doc["merged"]),
            config_json=doc["config"].encode(), ack=RoundAck(**doc["ack"]), metrics=doc["metrics"],
            created_ms=int(doc["created_ms"]))
    except (SafetensorError, ValueError, KeyError, TypeError) as e:
        raise RoundError(f"round record {keys.round_key(run, version)} does not read back: {e}") from None


def metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's __metadata__ (the header is 8 bytes of length, then JSON)."""
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("truncated header")
    return json.loads(data[8:8 + n]).get("__metadata__") or {}


async def versions(bucket: Bucket, run: str) -> list[int]:
    prefix = keys.round_key(run, 0).rsplit("/", 1)[0] + "/"
    return sorted(int(m.group(1)) for key in await bucket.list(prefix) if (m := RECORD.search(key)))


async def latest(bucket: Bucket, run: str) -> RoundState | None:
    found = await versions(bucket, run)
    if not found:
        return None
    return decode(run, found[-1], await bucket.get(keys.round_key(run, found[-1])))


async def prune(bucket: Bucket, run: str, keep: int) -> list[int]:
    """Delete every record but the newest `keep` (0: keep all): each record holds everything a
    restart needs, the merged ids included."""
    if keep <= 0:
        return []
    doomed = (await versions(bucket, run))[:-keep]
    for v in doomed:
        await bucket.delete(keys.round_key(run, v))
    return doomed
