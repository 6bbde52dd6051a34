"""The janitor: requeues leases whose worker went silent, revokes leases too stale to be consumed,
and drops completed manifests the learner could no longer train on. All of it is Lua in
`brigade.store` (store.sweeps); this module is the loop around it and the singleton lock.

Exactly one janitor sweeps at a time: it holds `brigade:janitor:lock` (SET NX PX) and renews it
every loop with a compare-and-renew script. Others wait, and one takes over within
`lock_ttl_ms` + `interval` of the holder dying. (Two janitors sweeping at once would still be safe,
since every sweep step is atomic in Redis; the lock only avoids the wasted work and the noise.)
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Sequence

import redis.exceptions
import structlog

from brigade import keys
from brigade.errors import LegacyKeys
from brigade.store import NotFound, Store, SweepResult
from brigade_janitor import metrics

LOCK_KEY = keys.JANITOR_LOCK
PRUNE_EVERY_S = 60.0  # idle group consumers are forgotten, finished epochs compacted, at most this often per run

log = structlog.get_logger("brigade.janitor")


def default_janitor_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Janitor:
    def __init__(
        self,
        store: Store,
        *,
        interval: float = 1.0,
        lock_ttl_ms: int = 5_000,
        janitor_id: str | None = None,
        runs: Sequence[str] | None = None,
    ):
        if lock_ttl_ms <= interval * 1000:
            raise ValueError(f"lock_ttl_ms ({lock_ttl_ms}) must exceed the interval ({interval}s) or the lock lapses")
        self.store = store
        self.sweeps = store.sweeps
        self.interval = interval
        self.lock_ttl_ms = lock_ttl_ms
        self.id = janitor_id or default_janitor_id()
        self.runs = list(runs) if runs is not None else None  # None = every run in the run index
        self.holding = False
        self._last_holder: str | None = None
        self.totals = SweepResult()
        self._pruned: dict[str, float] = {}
        self._layout_checked = False

    # -------------------------------------------------------------- lock

    async def hold_lock(self) -> bool:
        """Renew the lock if we hold it, else try to take it. True while we are the janitor."""
        if self.holding:
            if await self.sweeps.lock_renew(LOCK_KEY, self.id, self.lock_ttl_ms):
                return True
            self.holding = False
            log.warning("janitor lock lost", janitor=self.id)
        if await self.sweeps.lock_acquire(LOCK_KEY, self.id, self.lock_ttl_ms):
            self.holding = True
            self._last_holder = self.id
            log.info("janitor lock acquired; sweeping", janitor=self.id)
            return True
        holder = await self.sweeps.lock_holder(LOCK_KEY)
        if holder != self._last_holder:
            self._last_holder = holder
            log.info("janitor waiting: another janitor holds the lock", janitor=self.id, holder=holder or None)
        return False

    async def release(self) -> None:
        if self.holding:
            self.holding = False
            await self.sweeps.lock_release(LOCK_KEY, self.id)
            log.info("janitor lock released", janitor=self.id)

    # -------------------------------------------------------------- sweeping

    async def sweep_run(self, run: str) -> SweepResult:
        result = await self.sweeps.sweep(run)
        now = time.monotonic()
        if now - self._pruned.get(run, 0.0) > PRUNE_EVERY_S:
            self._pruned[run] = now
            pruned = await self.sweeps.prune_consumers(run)
            if pruned:
                log.info("forgot idle consumers", run=run, consumers=pruned)
            compacted = await self.sweeps.compact_epochs(run)
            if compacted:
                log.info("compacted finished epochs", run=run, batch_ids=compacted)
        if result.expired or result.revoked or result.stale_removed or result.deadlettered:
            log.info("swept", run=run, expired=result.expired, revoked=result.revoked,
                     stale_removed=result.stale_removed, deadlettered=result.deadlettered)
        t = self.totals
        t.expired += result.expired
        t.revoked += result.revoked
        t.stale_removed += result.stale_removed
        t.deadlettered += result.deadlettered
        return result

    async def sweep_all(self) -> dict[str, SweepResult]:
        runs = self.runs if self.runs is not None else await self.store.runs.ids()
        out: dict[str, SweepResult] = {}
        for run in runs:
            try:
                out[run] = await self.sweep_run(run)
            except NotFound:
                continue
            except redis.exceptions.ConnectionError:
                raise
            except Exception as e:  # noqa: BLE001 - one broken run must not stop the others
                log.error("sweep failed", run=run, error=repr(e), exc_info=e)
            # a long sweep over many runs must not let the lock lapse under us
            if self.holding and not await self.sweeps.lock_renew(LOCK_KEY, self.id, self.lock_ttl_ms):
                self.holding = False
                log.warning("janitor lock lost during a sweep", janitor=self.id)
                break
        return out

    async def tick(self) -> bool:
        """One loop iteration: hold the lock, sweep if we do. True if we swept."""
        if not self._layout_checked:  # LegacyKeys stops the janitor: it would sweep nothing of those runs
            await self.store.runs.check_layout()
            self._layout_checked = True
        holding = await self.hold_lock()
        metrics.HOLDING.set(int(holding))
        if not holding:
            return False
        started = time.perf_counter()
        results = await self.sweep_all()
        metrics.observe_sweep(time.perf_counter() - started, results.values())
        return True

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Loop until `stop` is set (or the task is cancelled); release the lock on the way out."""
        stop = stop or asyncio.Event()
        log.info("janitor started", janitor=self.id, interval_s=self.interval, lock_ttl_ms=self.lock_ttl_ms,
                 redis=self.store.redis_url)
        redis_down = False
        try:
            while not stop.is_set():
                try:
                    await self.tick()
                    if redis_down:
                        log.info("redis reachable again")
                        redis_down = False
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as e:
                    if not redis_down:
                        log.error("redis unreachable; retrying", error=str(e))
                        redis_down = True
                    self.holding = False  # our lock may lapse meanwhile; take it again properly
                except LegacyKeys:
                    raise
                except Exception as e:  # noqa: BLE001 - keep the janitor alive
                    log.error("janitor loop error", error=repr(e), exc_info=e)
                try:
                    await asyncio.wait_for(stop.wait(), timeout=self.interval)
                except TimeoutError:
                    pass
        finally:
            try:
                await asyncio.shield(self.release())
            except Exception:  # noqa: BLE001 - Redis may be gone; the lock then simply expires
                pass
            log.info("janitor stopped", janitor=self.id)


async def run_janitor(redis_url: str, *, interval: float = 1.0, lock_ttl_ms: int = 5_000,
                      janitor_id: str | None = None) -> None:
    """The service: a Janitor until SIGTERM / SIGINT."""
    import signal

    store = Store(redis_url, max_connections=8, blocking_connections=1)
    janitor = Janitor(store, interval=interval, lock_ttl_ms=lock_ttl_ms, janitor_id=janitor_id)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await janitor.run(stop)
    finally:
        await store.close()
