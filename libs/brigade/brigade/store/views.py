"""What RunService, `brigade ctl` and the evaluator read: run state, leases, workers, adapters,
metrics, dead letters, events; and the evaluator's one write, its results beside the adapters."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError

from brigade import keys
from brigade.redis_clients import raise_if_cancelled
from brigade.store.learner import MAX_BLOCK_MS
from brigade.store.runs import Runs
from brigade.store.scripts import number, text
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import METRICS_KEPT, check_id, check_stream_id

LIST_LIMIT = 10_000           # inspection reads return at most this many rows


def event_from_fields(run: str, entry_id: str, fields: dict) -> pb.Event:
    attrs = {text(a): text(b) for a, b in fields.items()}
    typ = attrs.pop("type", "")
    return pb.Event(id=entry_id, run_id=run, type=typ, time_ms=int(entry_id.split("-")[0]), attrs=attrs)


class Views:
    def __init__(self, redis: aioredis.Redis, blocking: aioredis.Redis, runs: Runs):
        self.redis = redis
        self.blocking = blocking
        self.runs = runs

    async def run_state(self, run: str) -> pb.RunState:
        info = await self.runs.get(run)
        k = info.keys
        async with self.redis.pipeline(transaction=False) as p:
            p.get(k.cursor)
            p.xlen(k.work)
            p.xpending(k.work, keys.WORK_GROUP)
            p.xlen(k.rollouts)
            p.scard(k.consumed)
            p.hgetall(k.stats)
            p.get(k.adapter_latest)
            p.get(k.learner_step)
            p.xlen(k.deadletter)
            p.xlen(k.contributions)
            cursor, work_len, pending, rollouts_len, consumed, stats, latest, step, dead, contributions = await p.execute()
        stats = {text(a): number(b) for a, b in stats.items()}
        consumed += stats.get("consumed_compacted", 0)  # ids of finished epochs left the set (compact.lua)
        leased = int(pending["pending"]) if pending else 0
        cut = number(cursor)
        step_n = number(step)
        finished = (info.spec.max_steps > 0 and step_n >= info.spec.max_steps) or (
            info.total_batches > 0 and cut >= info.total_batches and work_len == 0 and rollouts_len == 0
            and contributions == 0)
        return pb.RunState(
            spec=info.spec, latest_version=number(latest), learner_step=step_n, batches_created=cut,
            queued=max(0, work_len - leased), leased=leased, completed=rollouts_len, consumed=consumed,
            rejected=stats.get("rejected", 0), revoked=stats.get("revoked", 0), expired=stats.get("expired", 0),
            deadlettered=max(dead, stats.get("deadlettered", 0)), stale_removed=stats.get("stale_removed", 0),
            duplicates=stats.get("duplicates", 0), created_ms=stats.get("created_ms", 0),
            num_prompts=info.num_prompts, finished=finished, contributions=contributions,
            lookahead=stats.get("lookahead", _initial_lookahead(info)),
            generation_s=stats.get("generation_ms", 0) / 1000, step_busy_s=stats.get("step_busy_ms", 0) / 1000,
        )

    async def list_leases(self, run: str) -> list[pb.LeaseInfo]:
        k = (await self.runs.get(run)).keys
        rows = await self.redis.xpending_range(k.work, keys.WORK_GROUP, "-", "+", LIST_LIMIT)
        if not rows:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for row in rows:
                p.hgetall(k.lease(text(row["message_id"])))
            hashes = await p.execute()
        out = []
        for row, h in zip(rows, hashes, strict=True):
            h = {text(a): text(b) for a, b in h.items()}
            out.append(pb.LeaseInfo(
                lease_id=text(row["message_id"]), batch_id=h.get("batch", ""),
                worker_id=h.get("worker") or text(row["consumer"]), adapter_version=number(h.get("version")),
                attempt=number(h.get("attempt")), deadline_ms=number(h.get("deadline_ms")), revoked="revoked" in h,
            ))
        return out

    async def list_workers(self, run: str) -> list[pb.WorkerInfo]:
        raw = await self.redis.hgetall((await self.runs.get(run)).keys.workers)
        workers: dict[str, pb.WorkerInfo] = {}
        for field, value in raw.items():
            kind, _, wid = text(field).partition(":")
            w = workers.setdefault(wid, pb.WorkerInfo(worker_id=wid))
            if kind == "info":
                try:
                    w.MergeFromString(value)
                except DecodeError:
                    pass
                w.worker_id = wid
            elif kind == "granted":
                w.leases_granted = number(value)
            elif kind == "completed":
                w.leases_completed = number(value)
            elif kind == "seen":
                w.last_seen_ms = number(value)
        return [workers[w] for w in sorted(workers)]

    async def list_adapters(self, run: str) -> list[pb.AdapterInfo]:
        k = (await self.runs.get(run)).keys
        async with self.redis.pipeline(transaction=False) as p:
            p.hgetall(k.adapters)
            p.hgetall(k.evals)
            adapters, evals = await p.execute()
        evals = {text(a): text(b) for a, b in evals.items()}
        out = []
        for version, raw in adapters.items():
            m = pb.AdapterManifest.FromString(raw)
            out.append(pb.AdapterInfo(version=m.version, step=m.step, uri=m.uri, created_ms=m.created_ms,
                                      payload=m.payload, eval_json=evals.get(text(version), "")))
        return sorted(out, key=lambda a: a.version)

    async def record_eval(self, run: str, version: int, result_json: str) -> None:
        """The evaluator's result for `version`, shown by ListAdapters (the latest write wins)."""
        await self.redis.hset((await self.runs.get(run)).keys.evals, str(version), result_json)

    async def metrics(self, run: str, last: int = 0) -> list[pb.StepMetrics]:
        k = (await self.runs.get(run)).keys
        if last > 0:
            rows = list(reversed(await self.redis.xrevrange(k.metrics, "+", "-", count=min(last, METRICS_KEPT))))
        else:  # the newest METRICS_KEPT (the stream's MAXLEN is approximate): a reply under 16 MB
            rows = list(reversed(await self.redis.xrevrange(k.metrics, "+", "-", count=METRICS_KEPT)))
        return [pb.StepMetrics(step=number(f.get(b"step")), metrics_json=text(f.get(b"json"))) for _, f in rows]

    async def dead_letters(self, run: str) -> list[pb.DeadLetter]:
        rows = await self.redis.xrange((await self.runs.get(run)).keys.deadletter, "-", "+", count=LIST_LIMIT)
        return [pb.DeadLetter(batch_id=text(f.get(b"batch")), reason=text(f.get(b"reason")),
                              last_worker=text(f.get(b"last_worker")), attempts=number(f.get(b"attempts")),
                              time_ms=number(f.get(b"time"))) for _, f in rows]

    async def events(self, run: str, after_id: str = "", from_start: bool = False,
                     block_ms: int = 5_000) -> AsyncIterator[pb.Event]:
        """Tail the run's events: from the beginning, after `after_id`, or only new ones."""
        check_id("run_id", run)
        if after_id:
            check_stream_id("after_id", after_id)
        k = (await self.runs.get(run)).keys
        if from_start:
            last = "0-0"
        elif after_id:
            last = after_id
        else:
            tail = await self.redis.xrevrange(k.events, "+", "-", count=1)
            last = text(tail[0][0]) if tail else "0-0"
        block = max(1, min(block_ms, MAX_BLOCK_MS))
        while True:
            res = await self.blocking.xread({k.events: last}, count=500, block=block)
            raise_if_cancelled()
            for _stream, entries in res or []:
                for entry_id, fields in entries:
                    last = text(entry_id)
                    yield event_from_fields(run, last, fields)

    async def read_events(self, run: str, after_id: str = "0-0", count: int = 1000) -> list[pb.Event]:
        start = "-" if after_id in ("", "0-0") else "(" + after_id
        rows = await self.redis.xrange(keys.RunKeys(run).events, start, "+", count=count)
        return [event_from_fields(run, text(i), f) for i, f in rows]


def _initial_lookahead(info) -> int:
    """What acquire.lua will choose before it has granted anything (then it records its choice)."""
    if info.spec.sync:
        return 0
    return 1 if info.lookahead in ("auto", "off") else int(info.lookahead)
