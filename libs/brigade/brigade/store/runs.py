"""Runs: creating one, and the immutable part of each (spec and prompts) cached per process."""

from __future__ import annotations

import hashlib
import math
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog

from brigade import keys
from brigade.spec import RUN_ID_RE
from brigade.store.checks import MAX_RUNS, check_id, check_run_spec, short
from brigade.store.errors import AlreadyExists, NotFound
from brigade.store.scripts import Scripts, text
from brigade.v1 import brigade_pb2 as pb

log = structlog.get_logger()


class RunInfo:
    """The immutable part of a run (spec and prompts), cached per process."""

    def __init__(self, spec: pb.RunSpec, spec_bytes: bytes, prompts: list[pb.Prompt]):
        self.spec = spec
        self.spec_bytes = spec_bytes
        self.prompts = prompts
        self.run = spec.run_id
        self.keys = keys.RunKeys(self.run)
        self.lease_prefix = self.keys.lease("")
        st = spec.staleness
        self.lease_ms = max(1, st.lease_seconds) * 1000
        self.max_attempts = max(1, st.max_attempts)
        self.max_staleness = st.max_staleness
        self.batches_per_epoch = max(1, math.ceil(len(prompts) / max(1, spec.prompts_per_batch)))
        self.total_batches = spec.epochs * self.batches_per_epoch  # 0 = unbounded
        self.capacity = max(1, spec.batches_per_step) * (st.max_staleness + 1)
        # a lease hash outlives its lease; once expired/revoked it stays a while so the worker
        # learns why on its next heartbeat instead of hearing "unknown lease"
        self.lease_ttl_ms = self.lease_ms * 2 + 60_000
        self.keep_ms = max(self.lease_ms * 4, 600_000)
        self._perms: OrderedDict[int, list[int]] = OrderedDict()

    def permutation(self, epoch: int) -> list[int]:
        """Deterministic order of the prompts in `epoch`, from (spec.seed, epoch) only.

        Fisher-Yates driven by random.random(), whose sequence for a given seed Python keeps
        stable across versions, so replicas on different Python builds agree."""
        perm = self._perms.get(epoch)
        if perm is None:
            digest = hashlib.sha256(f"brigade-epoch\0{self.spec.seed}\0{epoch}".encode()).digest()
            rng = random.Random(int.from_bytes(digest[:8], "big"))
            perm = list(range(len(self.prompts)))
            for i in range(len(perm) - 1, 0, -1):
                j = int(rng.random() * (i + 1))
                perm[i], perm[j] = perm[j], perm[i]
            self._perms[epoch] = perm
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return perm

    def batch(self, batch_id: str) -> pb.PromptBatch:
        _, epoch, index = keys.parse_batch_id(batch_id)
        ppb = max(1, self.spec.prompts_per_batch)
        order = self.permutation(epoch)[index * ppb:(index + 1) * ppb]
        out = pb.PromptBatch(batch_id=batch_id, run_id=self.run, epoch=epoch, index=index)
        out.prompts.extend(self.prompts[i] for i in order)
        return out


class Runs:
    def __init__(self, redis: aioredis.Redis, scripts: Scripts):
        self.redis = redis
        self.scripts = scripts
        self._cache: dict[str, RunInfo] = {}

    async def ids(self) -> list[str]:
        """The runs of this Redis. One whose id is not a valid run id (stored before ids were
        checked whole) is logged and skipped: it must not make ListRuns fail for everyone."""
        found = sorted(text(r) for r in await self.redis.smembers(keys.RUNS_SET))
        bad = [r for r in found if not RUN_ID_RE.fullmatch(r)]
        if bad:
            log.warning("invalid_run_ids_skipped", run_ids=[short(r) for r in bad[:10]], count=len(bad))
        return [r for r in found if RUN_ID_RE.fullmatch(r)]

    async def get(self, run: str) -> RunInfo:
        """The cached spec and prompts of `run`; NotFound with the known runs if there is none."""
        info = self._cache.get(run)
        if info is not None:
            return info
        check_id("run_id", run)
        k = keys.RunKeys(run)
        async with self.redis.pipeline(transaction=False) as p:
            p.get(k.spec)
            p.lrange(k.prompts, 0, -1)
            spec_bytes, prompt_list = await p.execute()
        if not spec_bytes:
            known = await self.ids()
            shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "") if known else "none"
            raise NotFound(f"no run {short(run)} (known: {shown})")
        spec = pb.RunSpec.FromString(spec_bytes)
        prompts = [pb.Prompt.FromString(b) for b in prompt_list]
        info = RunInfo(spec, spec_bytes, prompts)
        self._cache[run] = info
        return info

    async def exists(self, run: str) -> bool:
        return run in self._cache or bool(await self.redis.exists(keys.RunKeys(run).spec))

    async def create(self, spec: pb.RunSpec, prompts: Sequence[pb.Prompt], exist_ok: bool = False) -> bool:
        """Store the spec and prompts and create the consumer groups. True if created, False if
        an identical run existed and exist_ok; AlreadyExists for a different spec."""
        check_run_spec(spec, prompts)
        run = spec.run_id
        k = keys.RunKeys(run)
        spec_bytes = spec.SerializeToString(deterministic=True)
        existing = await self.redis.get(k.spec)
        if existing is None:
            # the prompts may be many MB: staged in batches, then renamed in place by the script
            staged = f"{k.prompts}:tmp:{uuid.uuid4().hex}"
            async with self.redis.pipeline(transaction=False) as p:
                for i in range(0, len(prompts), 1000):
                    p.rpush(staged, *(x.SerializeToString(deterministic=True) for x in prompts[i:i + 1000]))
                p.pexpire(staged, 600_000)
                await p.execute()
            outcome, *rest = await self.scripts.create_run(
                k, staged=staged, runs=keys.RUNS_SET, spec_bytes=spec_bytes, run=run, now=int(time.time() * 1000), max_runs=MAX_RUNS)
            if text(outcome) == "created":
                return True
            existing = rest[0]
        if existing == spec_bytes:
            if exist_ok:
                return False
            raise AlreadyExists(f"run {run!r} already exists (pass exist_ok to accept an identical spec)")
        raise AlreadyExists(f"run {run!r} already exists with a different spec; pick a new run_id")
