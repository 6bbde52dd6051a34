"""What the learner does: pull completed manifests, ack what a checkpoint covers, publish adapters; and
the aggregator, local_sgd's learner: pull contributions, ack them with the same script, publish."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError, Message
from redis.exceptions import RedisError

from brigade import keys
from brigade.store.runs import Runs, require_topology
from brigade.store.scripts import Scripts, number, text
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import (
    MAX_CONTRIBUTION_BYTES,
    MAX_MANIFEST_BYTES,
    METRICS_KEPT,
    check_ack_ids,
    check_adapter_manifest,
    check_id,
    check_metrics_json,
    check_short,
    check_within,
    require_manifest,
)

MAX_BLOCK_MS = 30_000         # long polls (PullRollouts, WatchRun) block at most this long per call
MAX_PULL = 1_000
MAX_PULL_CONTRIBUTIONS = 32
LOST_COMMITS = 16             # a Redis crash loses at most this many learner commits (a second or two of
                              # writes): what ack.lua lets an ack recover of the batch cuts it lost
PULL_REPLY_BYTES = 8 << 20    # a PullRollouts reply is at most MAX_PULL manifests of MAX_MANIFEST_BYTES each
assert MAX_PULL * (MAX_MANIFEST_BYTES + 64) <= PULL_REPLY_BYTES
assert MAX_PULL_CONTRIBUTIONS * (MAX_CONTRIBUTION_BYTES + 64) <= PULL_REPLY_BYTES


@dataclass
class Pulled:
    rollouts: list[tuple[str, pb.RolloutManifest]]
    latest_version: int


@dataclass
class PulledContributions:
    contributions: list[tuple[str, pb.ContributionManifest]]
    latest_version: int


@dataclass(frozen=True)
class _Feed:
    """A stream the learner role reads with its group: the rollouts (central), or the contributions
    (local_sgd, read by the aggregator)."""

    cls: type[Message]
    max_bytes: int
    max_pull: int


ROLLOUTS = _Feed(pb.RolloutManifest, MAX_MANIFEST_BYTES, MAX_PULL)
CONTRIBUTIONS = _Feed(pb.ContributionManifest, MAX_CONTRIBUTION_BYTES, MAX_PULL_CONTRIBUTIONS)


class Learner:
    """`blocking` (a separate pool) serves the long polls, so waiting learners never starve leases."""

    def __init__(self, redis: aioredis.Redis, blocking: aioredis.Redis, runs: Runs, scripts: Scripts):
        self.redis = redis
        self.blocking = blocking
        self.runs = runs
        self.scripts = scripts

    async def pull(self, run: str, learner: str, max_manifests: int, wait_ms: int = 0,
                   include_pending: bool = False) -> Pulled:
        """Completed rollouts for the learner (central)."""
        check_id("run_id", run)
        check_id("learner_id", learner)
        k = (await self.runs.get(run)).keys
        return Pulled(*await self._pull(k, k.rollouts, ROLLOUTS, learner, max_manifests, wait_ms, include_pending))

    async def pull_contributions(self, run: str, aggregator: str, max_contributions: int, wait_ms: int = 0,
                                 include_pending: bool = False) -> PulledContributions:
        """Submitted contributions for the aggregator (local_sgd): the same long poll as `pull`."""
        check_id("run_id", run)
        check_id("aggregator_id", aggregator)
        ri = await self.runs.get(run)
        require_topology(ri, "local_sgd", "PullContributions")
        k = ri.keys
        return PulledContributions(*await self._pull(k, k.contributions, CONTRIBUTIONS, aggregator, max_contributions,
                                                     wait_ms, include_pending))

    async def _pull(self, k: keys.RunKeys, stream: str, feed: _Feed, learner: str, max_entries: int, wait_ms: int,
                    include_pending: bool) -> tuple[list[tuple[str, Message]], int]:
        """Everything the reply needs is read BEFORE the delivering read (XREADGROUP '>'): once Redis
        has handed entries to this learner's pending list, no call that can fail (a connection a Redis
        restart left stale) stands between that read and the reply. A reply lost anyway (the proxy
        dies, the network drops it) leaves them pending; the learner reads its pending entries
        again (include_pending) after any failed pull."""
        count = max(1, min(max_entries or 1, feed.max_pull))
        latest = number(await self.redis.get(k.adapter_latest))  # may lag a long poll's wait: a hint
        out: list[tuple[str, Message]] = []
        if include_pending:
            res = await self.redis.xreadgroup(keys.LEARNER_GROUP, learner, {stream: "0"}, count=count)
            out, gone = self._decode(res, feed)
            await self._ack_gone(stream, gone)
        if not out:
            wait = max(0, min(wait_ms, MAX_BLOCK_MS))
            res = await self._deliver(stream, learner, count, wait)
            out, gone = self._decode(res, feed)
            try:
                await self._ack_gone(stream, gone)
            except RedisError:  # housekeeping: they stay pending, empty, until a pending read acks them
                pass
        return out, latest

    async def _deliver(self, stream: str, learner: str, count: int, wait_ms: int):
        """The delivering read: new entries become this learner's pending ones."""
        client = self.blocking if wait_ms else self.redis
        return await client.xreadgroup(keys.LEARNER_GROUP, learner, {stream: ">"}, count=count,
                                       block=wait_ms or None)

    @staticmethod
    def _decode(res, feed: _Feed) -> tuple[list[tuple[str, Message]], list[bytes]]:
        """(delivery id, manifest) of each entry, and the ids of entries deleted after delivery."""
        out, gone = [], []
        for _stream, entries in res or []:
            for entry_id, fields in entries:
                # deleted after delivery (stale removal), or stored before manifests had a size bound
                if not fields or len(fields.get(b"m", b"")) not in range(1, feed.max_bytes + 1):
                    gone.append(entry_id)
                    continue
                try:  # nothing between the delivering read and the reply may raise: undecodable is gone
                    out.append((text(entry_id), feed.cls.FromString(fields[b"m"])))
                except DecodeError:
                    gone.append(entry_id)
        return out, gone

    async def _ack_gone(self, stream: str, gone: list[bytes]) -> None:
        if gone:
            await self.redis.xack(stream, keys.LEARNER_GROUP, *gone)
            await self.redis.xdel(stream, *gone)  # an oversized one would count as outstanding for ever

    async def ack(self, run: str, learner: str, delivery_ids: Sequence[str], consumed: Sequence[str],
                  rejected: Sequence[str], step: int, metrics_json: str = "") -> int:
        check_id("run_id", run)
        check_short("learner_id", learner)
        check_metrics_json(metrics_json)
        check_within("step", step)
        ri = await self.runs.get(run)
        check_ack_ids(run, delivery_ids, consumed, rejected)
        # local_sgd: the aggregator acks contributions; their batches take the fates rollouts take
        stream = ri.keys.contributions if ri.spec.topology == "local_sgd" else ri.keys.rollouts
        per_step, per_commit = max(1, ri.spec.batches_per_step), max(1, ri.spec.checkpoint_every)
        acked, _consumed, _rejected = await self.scripts.ack(
            ri.keys, rollouts=stream, step=step, metrics_json=metrics_json, n_deliveries=len(delivery_ids), n_consumed=len(consumed),
            learner=learner, batches_per_step=per_step, max_advance=per_commit, max_steps=ri.spec.max_steps,
            metrics_maxlen=METRICS_KEPT, run=run, batches_per_epoch=ri.batches_per_epoch, total_batches=ri.total_batches,
            lost_cuts=ri.capacity + LOST_COMMITS * per_step * per_commit, ids=[*delivery_ids, *consumed, *rejected])
        return int(acked)

    async def publish(self, run: str, manifest: pb.AdapterManifest | None, step_busy_s: float = 0.0) -> int:
        check_id("run_id", run)
        require_manifest(manifest)
        k = (await self.runs.get(run)).keys
        check_adapter_manifest(run, manifest)
        (latest,) = await self.scripts.publish(
            k, version=manifest.version, manifest=manifest.SerializeToString(deterministic=True), uri=manifest.uri,
            step=manifest.step, step_busy_ms=_busy_ms(step_busy_s))
        return int(latest)


def _busy_ms(seconds: float) -> int:
    """The learner's figure as whole ms; what is not a sane duration (NaN, negative, over a day) is 0,
    "not measured", and moves no average."""
    if not math.isfinite(seconds) or not 0 < seconds < 86_400:
        return 0
    return max(1, round(seconds * 1000))
