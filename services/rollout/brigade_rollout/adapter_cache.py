"""Recent adapter versions, fetched and decoded ahead of use.

`get(v)` returns version v's decoded tensors (bf16 as sent, or int8 dequantized), and only v's: entries are keyed by the version the
manifest in the bucket declares (adapters.read_version checks it and every file's sha256). A fetch
already in flight (a prefetch started by an AdapterPublished event) is joined, not repeated, so the
lease that needs the version waits only for what is left of it. Version 0 is the fresh LoRA every
process builds from the run seed: nothing to fetch.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass

import structlog
import torch

from brigade import adapters
from brigade.bucket import Bucket

log = structlog.get_logger()


@dataclass(frozen=True)
class CachedAdapter:
    version: int
    payload: str                             # bf16 | int8, reported in the rollout manifest
    state: dict[str, torch.Tensor] | None    # None = version 0


class AdapterCache:
    def __init__(self, bucket: Bucket, run: str, capacity: int = 4):
        self.bucket, self.run, self.capacity = bucket, run, max(1, capacity)
        self._entries: OrderedDict[int, CachedAdapter] = OrderedDict()
        self._inflight: dict[int, asyncio.Task[CachedAdapter]] = {}
        self.fetches = 0  # bucket reads, for tests and logs

    def __contains__(self, version: int) -> bool:
        return version in self._entries

    async def get(self, version: int) -> CachedAdapter:
        if version == 0:
            return CachedAdapter(0, "bf16", None)
        if (hit := self._entries.get(version)) is not None:
            self._entries.move_to_end(version)
            return hit
        task = self._inflight.get(version) or self._start(version)
        # shield: a cancelled lease must not cancel a fetch another caller (or the next lease) shares
        entry = await asyncio.shield(task)
        if entry.version != version:  # cannot happen with read_version's check; never serve another
            raise adapters.InvalidAdapter(f"asked the cache for v{version}, got v{entry.version}")
        return entry

    def prefetch(self, version: int) -> None:
        """Start fetching `version` in the background (no-op if cached or already in flight)."""
        if version == 0 or version in self._entries or version in self._inflight:
            return
        self._start(version)

    def _start(self, version: int) -> asyncio.Task[CachedAdapter]:
        task = asyncio.create_task(self._fetch(version), name=f"adapter-v{version}")
        self._inflight[version] = task
        task.add_done_callback(lambda t: self._done(version, t))
        return task

    def _done(self, version: int, task: asyncio.Task) -> None:
        self._inflight.pop(version, None)
        if task.cancelled():
            return
        if (err := task.exception()) is not None:
            log.warning("adapter fetch failed", version=version, error=str(err))
            return
        self._entries[version] = task.result()
        self._entries.move_to_end(version)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    async def _fetch(self, version: int) -> CachedAdapter:
        self.fetches += 1
        manifest, files = await adapters.read_version(self.bucket, self.run, version)
        # CPU work off the event loop. bf16 stays bf16: the engine copies it into its own parameters
        # (HF: load_state_dict, converting in the copy; vLLM: a bf16 file), so a float32 copy here
        # would be one more pass over every weight and twice the memory, on the path to a new policy
        state = await asyncio.to_thread(adapters.decode, files, False)
        log.info("adapter fetched", version=version, payload=manifest.payload,
                 bytes=sum(len(b) for b in files.values()))
        return CachedAdapter(version, manifest.payload or "bf16", state)

    async def close(self) -> None:
        for task in list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
