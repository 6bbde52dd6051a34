"""What the janitor calls: expire silent leases, revoke stale ones, drop stale manifests, forget
idle consumers, and the compare-and-renew lock that keeps one janitor sweeping."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from brigade import keys
from brigade.store.runs import RunInfo, Runs
from brigade.store.scripts import Script, Scripts, number, text

SWEEP_COUNT = 200             # entries one sweep script call looks at
CONSUMER_IDLE_MS = 3_600_000  # group consumers idle this long and holding nothing are forgotten (workers' stats too)
PRUNE_SLICE = 100             # consumers one prune script call deletes
COMPACT_SLICE = 1_000         # batch ids one compact script call removes
COMPACT_KEEP = 10_000         # finished epochs are compacted only while `completed` holds more ids than this
SCAN_PAGE = 1_000             # stream entries one read returns when looking for an epoch's batches in flight
STALE_RECHECK_S = 30.0        # sweep(): waiting manifests are re-read when a version is published, or this often


@dataclass
class SweepResult:
    expired: int = 0
    revoked: int = 0
    stale_removed: int = 0
    deadlettered: int = 0


async def _pages(script: Script, ri: RunInfo, **values: object) -> tuple[int, int]:
    """Call a sweep script, SWEEP_COUNT entries a call, until it says done (''): (sum of the first
    count, sum of the second, e.g. expired and dead-lettered). A script that pages by cursor gets
    back the one it answered; the index sweeps (expire, revoke) take what is left each time."""
    total, dead, cursor = 0, 0, ""
    paged = "cursor" in script.declaration.args
    while True:
        cursor, n, *more = await script(ri.keys, count=SWEEP_COUNT, **values, **({"cursor": cursor} if paged else {}))
        total += int(n)
        dead += int(more[0]) if more else 0
        if not text(cursor):
            return total, dead


class Sweeps:
    def __init__(self, redis: aioredis.Redis, runs: Runs, scripts: Scripts):
        self.redis = redis
        self.runs = runs
        self.scripts = scripts
        self._stale_read: dict[str, tuple[bytes | None, float]] = {}  # run -> (latest version, when) of the last pass

    async def expire_leases(self, run: str, min_idle_ms: int | None = None) -> SweepResult:
        """Requeue (or dead-letter) every lease not heartbeated for lease_seconds (`min_idle_ms`
        instead: 0 takes back every lease)."""
        ri = await self.runs.get(run)
        grace = 0 if min_idle_ms is None else ri.lease_ms - min_idle_ms
        expired, dead = await _pages(self.scripts.expire, ri, grace_ms=grace, max_attempts=ri.max_attempts,
                                     lease_prefix=ri.lease_prefix, keep_ms=ri.keep_ms)
        return SweepResult(expired=expired, deadlettered=dead)

    async def revoke_stale(self, run: str) -> SweepResult:
        """Revoke in-flight leases whose adapter version is more than max_staleness behind."""
        ri = await self.runs.get(run)
        revoked, dead = await _pages(self.scripts.revoke, ri, max_staleness=ri.max_staleness,
                                     max_attempts=ri.max_attempts, lease_prefix=ri.lease_prefix, keep_ms=ri.keep_ms)
        return SweepResult(revoked=revoked, deadlettered=dead)

    async def remove_stale_manifests(self, run: str) -> SweepResult:
        """Drop completed manifests, not yet handed to the learner, that are too stale to train on."""
        ri = await self.runs.get(run)
        removed, _ = await _pages(self.scripts.remove_stale, ri, max_staleness=ri.max_staleness)
        return SweepResult(stale_removed=removed)

    async def prune_consumers(self, run: str, min_idle_ms: int = CONSUMER_IDLE_MS) -> int:
        """Forget group consumers (worker / learner ids) idle for `min_idle_ms` that hold nothing,
        and those workers' stats (which frees their places under MAX_WORKERS_PER_RUN). The list is
        read once (at most that many workers, plus the learners) and deleted PRUNE_SLICE at a time."""
        k = (await self.runs.get(run)).keys
        removed = 0
        for stream, group, forget in ((k.work, keys.WORK_GROUP, 1), (k.rollouts, keys.LEARNER_GROUP, 0)):
            idle = [c["name"] for c in await self.redis.xinfo_consumers(stream, group)
                    if int(c["pending"]) == 0 and int(c["idle"]) > min_idle_ms]
            for i in range(0, len(idle), PRUNE_SLICE):
                (n,) = await self.scripts.prune_consumers(stream=stream, workers=k.workers, stats=k.stats, group=group,
                                                          forget_workers=forget, names=idle[i:i + PRUNE_SLICE])
                removed += int(n)
        return removed

    async def compact_epochs(self, run: str, keep: int = COMPACT_KEEP) -> int:
        """Forget the ids of finished epochs (compact.lua): first what is left of one begun, then each
        epoch cut whole with no batch in flight (a work or rollouts entry), oldest first, while the
        `completed` set holds more than `keep` ids (a short run keeps every id, for audits and
        `redis-cli`; a long one holds its current epoch and about `keep` more). The cursor is read before
        the streams, so no batch of that epoch can appear after the look; ids removed in all."""
        ri = await self.runs.get(run)
        k, bpe = ri.keys, ri.batches_per_epoch
        removed, epoch = 0, -1
        while True:
            more, n = await self.scripts.compact(k, run=run, batches_per_epoch=bpe, epoch=epoch, slice=COMPACT_SLICE)
            removed += int(n)
            if text(more):
                epoch = -1
                continue
            async with self.redis.pipeline(transaction=False) as p:
                p.get(k.cursor)
                p.hget(k.stats, "epochs_done")
                p.scard(k.completed)
                cut, done, held = await p.execute()
            done = number(done)
            if (epoch == done or held <= keep or number(cut) < (done + 1) * bpe
                    or await self._in_flight(k, done)):
                return removed
            epoch = done

    async def _in_flight(self, k: keys.RunKeys, epoch: int) -> bool:
        """Whether a batch of `epoch` is queued, leased, or completed and not yet consumed or rejected."""
        for stream in (k.work, k.rollouts):  # in this order: a batch moves from work to rollouts, never back
            start = "-"
            while True:
                rows = await self.redis.xrange(stream, start, "+", count=SCAN_PAGE)
                for _id, fields in rows:
                    batch = text(fields.get(b"batch"))
                    if batch and keys.parse_batch_id(batch)[1] == epoch:
                        return True
                if len(rows) < SCAN_PAGE:
                    break
                start = "(" + text(rows[-1][0])
        return False

    async def sweep(self, run: str) -> SweepResult:
        """One janitor pass over a run. Expiry and revocation read only what is due (their indexes);
        the waiting manifests are read only when they can have turned stale (a new version) and every
        STALE_RECHECK_S, since a manifest's version never changes: so a pass over a run with nothing
        to do costs a few commands, whatever the number of leases and manifests in flight."""
        a = await self.expire_leases(run)
        b = await self.revoke_stale(run)
        c = SweepResult()
        latest = await self.redis.get((await self.runs.get(run)).keys.adapter_latest)
        seen, when = self._stale_read.get(run, (None, 0.0))
        now = time.monotonic()
        if latest != seen or now - when > STALE_RECHECK_S:
            c = await self.remove_stale_manifests(run)
            self._stale_read[run] = (latest, now)
        return SweepResult(a.expired, b.revoked, c.stale_removed, a.deadlettered + b.deadlettered)

    # -------------------------------------------------------------- the janitor lock

    async def lock_acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self.redis.set(name, owner, nx=True, px=ttl_ms))

    async def lock_renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        (renewed,) = await self.scripts.lock_renew(lock=name, owner=owner, ttl_ms=ttl_ms)
        return bool(renewed)

    async def lock_release(self, name: str, owner: str) -> bool:
        (released,) = await self.scripts.lock_release(lock=name, owner=owner)
        return bool(released)

    async def lock_holder(self, name: str) -> str:
        return text(await self.redis.get(name))
