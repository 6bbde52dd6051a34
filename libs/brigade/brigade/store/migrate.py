"""`brigade migrate-keys`: move a Redis of the key layout before hash tags (run keys
`brigade:<run>:<name>`, the run list a plain set `brigade:runs`) to the current one (run keys
`brigade:{<run>}:<name>`, the run index a sorted set), in place, run by run.

Every key of a run is RENAMEd (values, TTLs, consumer groups and pending entries move with it; a
lease in flight stays the worker's), its leases in flight are entered in the janitor's deadline and
version indexes (which the old layout did not have), then the run is listed in the index; the old
set goes last.
A run whose keys are already moved only gets listed, so a migration that stopped half-way is
finished by running it again. Stop every brigade service first: an old proxy would go on writing
the old keys. Old data can only be on a single Redis (the old scripts could not run on a cluster);
to move to a cluster afterwards, `redis-cli --cluster import` copies the migrated keys."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from brigade import keys
from brigade.redis_clients import AnyRedis
from brigade.spec import RUN_ID_RE
from brigade.store.scripts import text

SCAN_COUNT = 1_000


@dataclass
class Migration:
    runs: list[str] = field(default_factory=list)       # listed in the index
    keys_moved: int = 0
    skipped: list[str] = field(default_factory=list)    # ids that are not valid run ids (left as they are)
    conflicts: list[str] = field(default_factory=list)  # old keys whose new name is taken (left as they are)


async def _index_leases(redis: AnyRedis, k: keys.RunKeys) -> None:
    """Every pending work entry (a lease) into lease_deadlines and lease_versions, from its lease
    hash; one whose hash is gone gets deadline 0 and version 0, so the janitor takes it back."""
    if not await redis.exists(k.work):
        return
    start = "-"
    while True:
        rows = await redis.xpending_range(k.work, keys.WORK_GROUP, start, "+", SCAN_COUNT)
        if not rows:
            return
        async with redis.pipeline(transaction=False) as p:
            for row in rows:
                p.hmget(k.lease(text(row["message_id"])), "deadline_ms", "version")
            found = await p.execute()
        deadlines = {text(row["message_id"]): int(d or 0) for row, (d, _v) in zip(rows, found, strict=True)}
        versions = {text(row["message_id"]): int(v or 0) for row, (_d, v) in zip(rows, found, strict=True)}
        await redis.zadd(k.lease_deadlines, deadlines)
        await redis.zadd(k.lease_versions, versions)
        start = "(" + text(rows[-1]["message_id"])


def _glob_escape(value: str) -> str:
    return re.sub(r"([*?\[\]\\])", r"\\\1", value)


async def migrate_keys(redis: AnyRedis, *, dry_run: bool = False,
                       progress: Callable[[str], None] = lambda line: None) -> Migration:
    """Move every run of the legacy set to the current layout; `dry_run` only counts."""
    out = Migration()
    legacy = sorted(text(r) for r in await redis.smembers(keys.LEGACY_RUNS_SET))
    for run in legacy:
        if not RUN_ID_RE.fullmatch(run):
            out.skipped.append(run)
            continue
        old, new = keys.legacy_run_prefix(run), keys.RunKeys(run).prefix
        moved = 0
        async for key in redis.scan_iter(match=_glob_escape(old) + "*", count=SCAN_COUNT):
            name = text(key)[len(old):]
            if dry_run:
                moved += 1
            elif await redis.renamenx(key, new + name):
                moved += 1
            else:
                out.conflicts.append(text(key))
        if not dry_run:
            await _index_leases(redis, keys.RunKeys(run))
            await redis.zadd(keys.RUN_INDEX, {run: 0})
        out.runs.append(run)
        out.keys_moved += moved
        progress(f"{run}: {moved} keys {'to move' if dry_run else 'moved'}")
    if not dry_run and legacy and not out.conflicts:
        await redis.delete(keys.LEGACY_RUNS_SET)
    return out
