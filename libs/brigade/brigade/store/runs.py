"""Runs: creating one, and the immutable part of each (spec and prompts) cached per process.

Touching a run (GetRun, ListRuns, heartbeats, pulls, sweeps) reads its spec and prompt count
only; the prompts themselves are read once per process, by the first lease that needs them
(concurrent first leases share that one read), in chunks. They are kept as each prompt's bytes and
parsed per batch: a bytes object is invisible to the garbage collector, a parsed message is not,
and a million of those would make every full collection (a pause of the whole proxy) scan them."""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import math
import random
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence

import redis.asyncio as aioredis
import structlog

from brigade import keys
from brigade.errors import AlreadyExists, FailedPrecondition, InvalidArgument, LegacyKeys, NotFound
from brigade.spec import RUN_ID_RE, admission_capacity
from brigade.store.scripts import Scripts, text
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_RUNS, check_id, check_run_spec, short

log = structlog.get_logger()
PROMPT_CHUNK = 10_000  # prompts per LRANGE: a big prompt set never blocks Redis in one command
# prompts per pipeline when a run is created: packing one is work on the event loop (~3 ms for 5,000
# short prompts), and Redis runs a pipeline's pushes back to back, everyone else's calls after them
STAGE_CHUNK = 5_000
BREATHE_EVERY = 2_000  # prompts of bulk work in a thread (a few ms) between two breaths
BREATHE_S = 0.0002


# held by each piece of bulk work in a thread (parsing, encoding a CreateRun's prompts): with the GIL two
# such threads cannot run at once anyway, and one at a time leaves the event loop one rival, not two
BULK_WORK = threading.Lock()


def breathe() -> None:
    """Let the event loop have the GIL. Work in a thread holds the GIL until asked for it, then up to
    5 ms more (sys.getswitchinterval), and with two such threads the loop can lose it again and again:
    honest calls waited 30-90 ms at a time while two big CreateRuns were encoded. A short sleep hands
    it over every BREATHE_EVERY items of bulk work (costs ~10 % of that work's time)."""
    time.sleep(BREATHE_S)


class RunInfo:
    """The immutable part of a run (spec and prompt count; the prompts once loaded), cached per process."""

    def __init__(self, spec: pb.RunSpec, spec_bytes: bytes, prompt_bytes: Sequence[bytes] | None = None, *,
                 num_prompts: int | None = None):
        self.spec = spec
        self.spec_bytes = spec_bytes
        # each prompt serialized, a tuple (of bytes only, so the garbage collector stops tracking it: a
        # list of a million is walked by every full collection, ~10 ms each); None until Runs.load_prompts
        self.prompt_bytes = None if prompt_bytes is None else tuple(prompt_bytes)
        self.num_prompts = (len(prompt_bytes) if num_prompts is None and prompt_bytes is not None
                            else num_prompts or 0)
        self._loading: asyncio.Future | None = None
        self.run = spec.run_id
        self.keys = keys.RunKeys(self.run)
        self.lease_prefix = self.keys.lease("")
        st = spec.staleness
        self.lease_ms = max(1, st.lease_seconds) * 1000
        self.max_attempts = max(1, st.max_attempts)
        self.max_staleness = st.max_staleness
        self.batches_per_epoch = max(1, math.ceil(self.num_prompts / max(1, spec.prompts_per_batch)))
        self.total_batches = spec.epochs * self.batches_per_epoch  # 0 = unbounded
        self.capacity = admission_capacity(spec)
        # acquire.lua's lookahead: local_sgd trainers generate on-policy (no lookahead); 0 = measured
        self.lookahead = ("off" if spec.topology == "local_sgd"
                          else str(st.lookahead) if st.lookahead else "auto")
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
            perm = list(range(self.num_prompts))
            for i in range(len(perm) - 1, 0, -1):
                j = int(rng.random() * (i + 1))
                perm[i], perm[j] = perm[j], perm[i]
            self._perms[epoch] = perm
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return perm

    def has_permutation(self, epoch: int) -> bool:
        return epoch in self._perms

    def batch(self, batch_id: str) -> pb.PromptBatch:
        """The batch's prompts; needs them loaded (Runs.load_prompts)."""
        _, epoch, index = keys.parse_batch_id(batch_id)
        ppb = max(1, self.spec.prompts_per_batch)
        order = self.permutation(epoch)[index * ppb:(index + 1) * ppb]
        return pb.PromptBatch.FromString(prompt_bundle(self.run, [self.prompt_bytes[i] for i in order],
                                                       batch_id=batch_id, epoch=epoch, index=index))


def require_topology(info: RunInfo, topology: str, call: str) -> None:
    """FailedPrecondition when `call` does not belong to the run's topology (a rollout worker on a
    local_sgd run, a trainer on a central one): its batches would reach nobody."""
    if info.spec.topology != topology:
        raise FailedPrecondition(f"run {info.run} has topology {info.spec.topology}; {call} belongs to "
                                 f"topology {topology}")


class Runs:
    def __init__(self, redis: aioredis.Redis, scripts: Scripts):
        self.redis = redis
        self.scripts = scripts
        self._cache: dict[str, RunInfo] = {}

    async def ids(self) -> list[str]:
        """Every run of this Redis, in byte order (at most MAX_RUNS)."""
        return (await self.page("", MAX_RUNS))[0]

    async def page(self, token: str = "", limit: int = 100) -> tuple[list[str], str]:
        """Up to `limit` run ids in byte order, from the first ('' token) or after the page `token`
        ends, and the token of the next page ('' = this was the last): the hex of the last id read,
        valid or not. One whose id is not a valid run id (stored before ids were checked whole) is
        logged and skipped: it must not make ListRuns fail for everyone."""
        try:
            start = "(" + bytes.fromhex(token).decode() if token else "-"
        except ValueError:
            raise InvalidArgument("page_token is not one ListRuns answered; start with an empty one") from None
        found = [text(r) for r in await self.redis.zrangebylex(keys.RUN_INDEX, start, "+", 0, limit)]
        bad = [r for r in found if not RUN_ID_RE.fullmatch(r)]
        if bad:
            log.warning("invalid_run_ids_skipped", run_ids=[short(r) for r in bad[:10]], count=len(bad))
        return [r for r in found if RUN_ID_RE.fullmatch(r)], found[-1].encode().hex() if len(found) == limit else ""

    async def check_layout(self) -> None:
        """LegacyKeys when this Redis holds runs in the key layout before hash tags, which this
        version does not read: `brigade migrate-keys` moves them."""
        if await self.redis.exists(keys.LEGACY_RUNS_SET):
            n = await self.redis.scard(keys.LEGACY_RUNS_SET)
            raise LegacyKeys(f"this Redis holds {n} run(s) in the key layout before hash tags "
                             f"({keys.LEGACY_RUNS_SET}, brigade:<run>:*), which this version does not read; stop "
                             "every brigade service and run `brigade migrate-keys --redis-url URL` once")

    async def _hint(self, run: str) -> str:
        """The run ids closest to a missing one (a typo), else the first few: from one bounded page,
        so a stream of lookups for missing runs costs Redis little however many runs it holds."""
        known, more = await self.page("", 500)
        if not known:
            return "no run is known"
        if close := difflib.get_close_matches(run, known, n=5, cutoff=0.6):
            return "did you mean " + ", ".join(close)
        return "known: " + ", ".join(known[:8]) + (", ...; `brigade ctl runs` lists them" if more or known[8:] else "")

    async def get(self, run: str) -> RunInfo:
        """The cached spec of `run` (prompts not loaded); NotFound with the known runs if there is none."""
        info = self._cache.get(run)
        if info is not None:
            return info
        check_id("run_id", run)
        k = keys.RunKeys(run)
        async with self.redis.pipeline(transaction=False) as p:
            p.get(k.spec)
            p.llen(k.prompts)
            spec_bytes, num_prompts = await p.execute()
        if not spec_bytes:
            raise NotFound(f"no run {short(run)} ({await self._hint(run)})")
        info = self._cache.setdefault(run, RunInfo(pb.RunSpec.FromString(spec_bytes), spec_bytes,
                                                   num_prompts=int(num_prompts)))
        return info

    async def load_prompts(self, info: RunInfo) -> Sequence[bytes]:
        """The run's prompts (each one's bytes), read from Redis once per process however many callers
        ask at once."""
        if info.prompt_bytes is not None:
            return info.prompt_bytes
        if info._loading is None or (info._loading.done() and info._loading.exception() is not None):
            info._loading = asyncio.ensure_future(self._read_prompts(info))
        info.prompt_bytes = await asyncio.shield(info._loading)
        return info.prompt_bytes

    async def _read_prompts(self, info: RunInfo) -> tuple[bytes, ...]:
        raw: list[bytes] = []
        for start in range(0, info.num_prompts, PROMPT_CHUNK):
            raw += await self.redis.lrange(info.keys.prompts, start, start + PROMPT_CHUNK - 1)
        return tuple(raw)  # untracked by the garbage collector (RunInfo.prompt_bytes)

    async def exists(self, run: str) -> bool:
        return run in self._cache or bool(await self.redis.exists(keys.RunKeys(run).spec))

    async def claim(self, run: str, credential: str, max_runs: int) -> None:
        """Count a new run against `credential`'s quota of `max_runs` (claim_run.lua): the proxy's
        runs per credential. An existing run, or a run id that is not valid (CreateRun refuses it), is
        not counted; beyond the quota: ResourceExhausted."""
        if not RUN_ID_RE.fullmatch(run) or await self.exists(run):
            return
        await self.scripts.claim_run(owners=keys.RUN_OWNERS, run=run, credential=credential, max_runs=max_runs)

    async def create(self, spec: pb.RunSpec, prompts: Sequence[pb.Prompt], exist_ok: bool = False,
                     encoded: Sequence[bytes] | None = None) -> bool:
        """Store the spec and prompts and create the consumer groups. True if created, False if
        an identical run existed and exist_ok; AlreadyExists for a different spec. `encoded`: the
        prompts' deterministic bytes, when the caller has them already."""
        # checking and encoding a million prompts takes seconds: off the event loop
        await asyncio.to_thread(check_run_spec, spec, prompts)
        run = spec.run_id
        k = keys.RunKeys(run)
        spec_bytes = spec.SerializeToString(deterministic=True)
        existing = await self.redis.get(k.spec)
        if existing is None:
            if encoded is None:
                encoded = await asyncio.to_thread(lambda: [x.SerializeToString(deterministic=True) for x in prompts])
            # listed first: a run that exists is always in the index (the janitor sweeps what is listed)
            await self.scripts.register_run(index=keys.RUN_INDEX, run=run, max_runs=MAX_RUNS)
            # the prompts may be many MB: staged in batches, then renamed in place by the script; one
            # round trip per STAGE_CHUNK prompts, so packing a million of them never holds the event loop
            staged = f"{k.prompts}:tmp:{uuid.uuid4().hex}"
            for start in range(0, len(encoded), STAGE_CHUNK):
                async with self.redis.pipeline(transaction=False) as p:
                    for i in range(start, min(start + STAGE_CHUNK, len(encoded)), 1000):
                        p.rpush(staged, *encoded[i:i + 1000])
                    p.pexpire(staged, 600_000)  # from the first push on: a push refused half-way leaves no orphan
                    await p.execute()
            outcome, *rest = await self.scripts.create_run(k, staged=staged, spec_bytes=spec_bytes,
                                                           now=int(time.time() * 1000))
            if text(outcome) == "created":
                self._cache[run] = RunInfo(spec, spec_bytes, encoded)  # kept as a tuple (no copy if one)
                return True
            existing = rest[0]
        if existing == spec_bytes:
            if exist_ok:
                return False
            raise AlreadyExists(f"run {run!r} already exists (pass exist_ok to accept an identical spec)")
        raise AlreadyExists(f"run {run!r} already exists with a different spec; pick a new run_id")



def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_PROMPTS_TAG = _varint(pb.PromptBatch.PROMPTS_FIELD_NUMBER << 3 | 2)  # length-delimited


def prompt_bundle(run: str, encoded: Sequence[bytes], **fields: object) -> bytes:
    """PromptBatch(run_id=run, prompts=..., **fields) serialized (deterministically when `fields` are
    unset), from each prompt's bytes, piece by piece: one protobuf call over a million prompts (building,
    serializing or list() of the repeated field) holds the GIL, and so the event loop, for seconds."""
    head = pb.PromptBatch(run_id=run, **fields).SerializeToString(deterministic=True)
    if len(encoded) <= BREATHE_EVERY:  # a batch, on the event loop
        return head + b"".join(_PROMPTS_TAG + _varint(len(b)) + b for b in encoded)
    parts = [head]  # a whole prompt set, in a thread: breathing
    with BULK_WORK:
        for start in range(0, len(encoded), BREATHE_EVERY):
            parts.append(b"".join(_PROMPTS_TAG + _varint(len(b)) + b for b in encoded[start:start + BREATHE_EVERY]))
            breathe()
    return b"".join(parts)
