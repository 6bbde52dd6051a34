"""From manifests to trainable rollouts: check, fetch (sha256-verified), parse, filter, prefetch.

Everything a manifest points at came from another process, possibly a broken or hostile one, so a
rollout is trusted only after: its key is exactly where this run's rollouts live, its bytes match
the manifest's sha256, it parses as a brigade rollout (safetensors only: nothing is unpickled), its
metadata agrees with the manifest, and its samples are finite. Anything else is rejected with a
reason that is logged, counted and sent to the proxy; a rejected batch is never trained on.

The `Prefetcher` keeps the next step's rollouts downloading and parsing while the current step
computes; staleness is decided only when a step takes them, against the version it trains at.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog
import torch

from brigade.bucket import Bucket, BucketError, CorruptObject, ObjectNotFound
from brigade.errors import InvalidArgument
from brigade.retry import Backoff, retry
from brigade.rollout_format import InvalidRollout, Limits, Rollout, from_bytes
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import check_rollout_manifest

log = structlog.get_logger()

# Rejection reasons (metrics keys `rejected/<reason>`).
STALE = "stale"                # policy_version too far behind the learner
FUTURE = "future_version"      # claims a version the learner never published
FOREIGN_URI = "foreign_uri"    # uri is not keys.rollout_key(run, batch, attempt)
CORRUPT = "corrupt"            # bytes do not match the manifest's sha256 (or size)
MISSING = "missing"            # no object at the uri
INVALID = "invalid"            # not a brigade rollout: not safetensors, wrong dtypes, shapes beyond the spec, ids
                               # outside vocab, masks not 0/1, positive log-probs, metadata of the wrong types
MISMATCH = "mismatch"          # valid rollout, but its metadata is not what the manifest says
EMPTY = "empty"                # every sample was dropped as non-finite
DUPLICATE = "duplicate"        # the batch was already trained on (not a rejection: acked, not counted)

# Sample-level drops (metrics keys `dropped/<reason>`).
NONFINITE_REWARD = "nonfinite_reward"
NONFINITE_LOGPROB = "nonfinite_logprob"


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class Accepted:
    """One rollout object that passed every check, with its non-finite samples already removed."""

    delivery_id: str
    manifest: pb.RolloutManifest
    rollout: Rollout
    dropped: Counter = field(default_factory=Counter)

    @property
    def batch_id(self) -> str:
        return self.manifest.batch_id


def check_manifest(run: str, m: pb.RolloutManifest) -> None:
    """The manifest alone: it must belong to this run and point exactly where its rollout lives
    (the proxy's own check, again). A uri anywhere else (another run's prefix, an adapter, a
    checkpoint) is never read."""
    try:
        check_rollout_manifest(run, m)
    except InvalidArgument as e:
        raise Rejected(FOREIGN_URI, str(e)) from None


def check_rollout(r: Rollout, m: pb.RolloutManifest) -> None:
    """Metadata inside the object must repeat the manifest: a rollout copied from another batch,
    attempt or version (or run) would otherwise be trained on under the wrong staleness."""
    got = (r.run_id, r.batch_id, r.attempt, r.policy_version)
    want = (m.run_id, m.batch_id, m.attempt, m.policy_version)
    if got != want:
        raise Rejected(MISMATCH, f"object says (run, batch, attempt, version) = {got}, manifest says {want}")
    if m.num_samples and m.num_samples != r.num_samples:
        raise Rejected(MISMATCH, f"object holds {r.num_samples} samples, manifest says {m.num_samples}")
    if r.reward_parts.shape[1] != len(r.reward_names) and r.reward_names:
        raise Rejected(MISMATCH, f"{r.reward_parts.shape[1]} reward columns but {len(r.reward_names)} reward names")


def drop_nonfinite(r: Rollout) -> tuple[Rollout, Counter]:
    """Remove samples whose reward or any behaviour log-prob is NaN or infinite. A NaN reward means a
    reward function gave up on the sample; a NaN log-prob would turn the whole loss into NaN (even on
    padding: 0 * NaN is NaN). Groups are recomputed from what is left, so nothing else changes."""
    bad_reward = ~torch.isfinite(r.rewards)
    bad_logp = ~torch.isfinite(r.logprobs).all(dim=1) & ~bad_reward
    dropped = Counter({NONFINITE_REWARD: int(bad_reward.sum()), NONFINITE_LOGPROB: int(bad_logp.sum())})
    dropped = +dropped  # drop zero counts
    if not dropped:
        return r, dropped
    keep = ~(bad_reward | bad_logp)
    rows = {name: getattr(r, name)[keep] for name in (
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs", "rewards", "reward_parts",
        "group")}
    return Rollout(run_id=r.run_id, batch_id=r.batch_id, attempt=r.attempt, policy_version=r.policy_version,
                   reward_names=r.reward_names, reward_metrics=r.reward_metrics,
                   env_mask=None if r.env_mask is None else r.env_mask[keep], **rows), dropped


async def fetch(bucket: Bucket, pulled: pb.PulledRollout, run: str, vocab_size: int,
                limits: Limits | None = None) -> Accepted:
    """The learner's whole data path for one manifest; raises Rejected with the reason. Only the
    bucket's own errors (BucketError, OSError: transient, retried by the caller) get out otherwise."""
    m = pulled.manifest
    check_manifest(run, m)
    try:
        data = await bucket.get(m.uri, sha256=m.sha256)
    except CorruptObject as e:
        raise Rejected(CORRUPT, str(e)) from None
    except ObjectNotFound as e:
        raise Rejected(MISSING, str(e)) from None
    if m.size_bytes and len(data) != m.size_bytes:
        raise Rejected(CORRUPT, f"object is {len(data)} bytes, manifest says {m.size_bytes}")
    try:
        rollout = from_bytes(data, vocab_size, limits)
        check_rollout(rollout, m)
        rollout, dropped = drop_nonfinite(rollout)
    except Rejected:
        raise
    except InvalidRollout as e:
        raise Rejected(INVALID, str(e)) from None
    except Exception as e:  # noqa: BLE001 - whatever one object does to the parser costs only that object
        raise Rejected(INVALID, f"unreadable rollout object ({type(e).__name__}: {str(e)[:200]})") from None
    if rollout.num_samples == 0:
        raise Rejected(EMPTY, f"all {sum(dropped.values())} samples had non-finite rewards or log-probs")
    return Accepted(pulled.delivery_id, m, rollout, dropped)


# ---------------------------------------------------------------- prefetch

# pull(max_manifests, include_pending) -> (deliveries, failed): failed when an attempt failed before
# the one that answered (its delivering read may have handed over entries no reply brought back)
PullFn = Callable[[int, bool], Awaitable[tuple[list[pb.PulledRollout], bool]]]
# ack(delivery_ids, consumed_batch_ids, rejected_batch_ids): deliveries that will never be trained on
AckFn = Callable[[list[str], list[str], list[str]], Awaitable[None]]


@dataclass
class StepData:
    accepted: list[Accepted]
    rejected: Counter              # batch-level rejections by reason since the previous step
    dropped: Counter               # sample-level drops by reason, over the accepted batches
    staleness: Counter             # staleness -> number of accepted batches
    duplicates: int
    wait_s: float                  # time the step sat waiting for data


MAX_PENDING_PULL = 1000  # the proxy's cap on one PullRollouts
FETCH_ATTEMPTS = 4       # transient bucket errors are retried with backoff, then the learner stops
READ_BACKOFF = Backoff(base_s=0.5, cap_s=5.0)  # a rollout's, and a checkpoint file's (checkpoint.py)


class Prefetcher:
    """Keeps up to `want` verified rollouts ready ahead of the step that will use them.

    One background task pulls manifests and fetches their objects concurrently; rejections and
    duplicates are acknowledged at once (they are terminal, and an unacked one would count as
    outstanding work at the proxy's admission). `take` hands a step its batches, judging staleness
    against the version the step trains at.

    After a failed pull (or `repull()`: Redis lost writes) it reads this learner's pending entries
    again: a delivery whose reply was lost is only reachable that way. Deliveries it already holds
    (fetching, ready, or trained and waiting for their commit's ack: `settled` ends that) are
    dropped from such a re-read; any other pending one is new to it.
    """

    def __init__(self, pull: PullFn, ack: AckFn, bucket: Bucket, run: str, vocab_size: int, want: int,
                 consumed: set[str], max_staleness: int, limits: Limits | None = None):
        self._pull, self._ack, self._bucket = pull, ack, bucket
        self.run, self.vocab_size, self.want, self.limits = run, vocab_size, want, limits
        self.consumed = consumed          # shared with the learner: batch ids already trained on
        self.max_staleness = max_staleness
        self._ready: asyncio.Queue[Accepted | None] = asyncio.Queue()
        self._ahead = 0                   # pulled and not yet taken by a step (fetching or ready)
        self._room = asyncio.Condition()
        self._rejected: Counter = Counter()
        self._duplicates = 0
        self._task: asyncio.Task | None = None
        self._error: BaseException | None = None
        self._held: set[str] = set()      # delivery ids pulled and not yet acked
        self._repull = False

    def repull(self) -> None:
        """Read the pending entries again before the next new ones (Redis may have lost acks)."""
        self._repull = True

    def settled(self, delivery_ids: list[str]) -> None:
        """These deliveries were acked by the learner's commit."""
        self._held.difference_update(delivery_ids)

    def _unheld(self, pulled: list[pb.PulledRollout]) -> list[pb.PulledRollout]:
        fresh = []
        for p in pulled:
            if p.delivery_id not in self._held:
                self._held.add(p.delivery_id)
                fresh.append(p)
        return fresh

    def start(self) -> None:
        self._task = asyncio.create_task(self._pump(), name="learner-prefetch")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _release(self, n: int = 1) -> None:
        async with self._room:
            self._ahead -= n
            self._room.notify_all()

    async def _pump(self) -> None:
        try:
            pulled = await self._pull_pending()
            while True:
                pulled = self._unheld(pulled)
                if pulled:
                    self._ahead += len(pulled)
                    for item in await asyncio.gather(*(self._fetch_one(p) for p in pulled)):
                        if item is None:
                            await self._release()
                        else:
                            self._ready.put_nowait(item)
                async with self._room:
                    await self._room.wait_for(lambda: self._ahead < self.want)
                    free = self.want - self._ahead
                pulled, failed = await self._pull(free, False)
                if failed or self._repull:
                    self._repull = False
                    pulled += await self._pull_pending()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # surfaced to the step loop by take()
            self._error = e
            self._ready.put_nowait(None)
            raise

    async def _pull_pending(self) -> list[pb.PulledRollout]:
        """Everything this learner pulled but never acked (at a start, and after a failed pull). A
        pending read always starts from the oldest pending entry, so ask for more until a reply comes
        back short (then it held all of them; with nothing pending it holds at most `want` new ones)."""
        n, seen = self.want, {}
        while True:
            pulled, _failed = await self._pull(n, True)  # a failed try was retried as this same read
            for p in pulled:
                seen.setdefault(p.delivery_id, p)
            if len(pulled) < n or n >= MAX_PENDING_PULL:
                return list(seen.values())
            n = min(2 * n, MAX_PENDING_PULL)

    async def _fetch_one(self, p: pb.PulledRollout) -> Accepted | None:
        m = p.manifest
        if m.batch_id in self.consumed:
            await self._skip_duplicate(p)
            return None
        def log_retry(attempt: int, delay: float, e: BaseException) -> None:
            log.warning("rollout_fetch_retry", batch=m.batch_id, attempt=attempt, error=str(e)[:300])

        try:
            # the store hiccuped (not the object's fault): read again; a Rejected is an answer
            return await retry(lambda: fetch(self._bucket, p, self.run, self.vocab_size, self.limits),
                               retryable=lambda e: isinstance(e, (BucketError, OSError)), backoff=READ_BACKOFF,
                               attempts=FETCH_ATTEMPTS, on_retry=log_retry)
        except Rejected as e:
            await self._reject(p, e)
            return None

    async def _reject(self, p: pb.PulledRollout, e: Rejected) -> None:
        m = p.manifest
        log.warning("rollout_rejected", batch=m.batch_id[:200], attempt=m.attempt, worker=m.worker_id[:200],
                    reason=e.reason, detail=e.detail[:500])
        self._rejected[e.reason] += 1
        # the proxy only accepts batch ids of this run; a foreign one is just acked off the stream
        ours = e.reason != FOREIGN_URI or m.batch_id.startswith(self.run + ":")
        await self._ack([p.delivery_id], [], [m.batch_id] if ours and m.run_id == self.run else [])
        self._held.discard(p.delivery_id)

    async def _skip_duplicate(self, p: pb.PulledRollout) -> None:
        """A batch already trained on (a regenerated copy, or a delivery whose ack Redis lost): acked
        as consumed, so Redis records its fate even when it lost the first ack."""
        log.info("rollout_duplicate", batch=p.manifest.batch_id, attempt=p.manifest.attempt)
        self._duplicates += 1
        await self._ack([p.delivery_id], [p.manifest.batch_id], [])
        self._held.discard(p.delivery_id)

    async def take(self, version: int) -> StepData:
        """Wait for `want` rollouts the learner at `version` may train on."""
        t0 = time.monotonic()
        accepted: list[Accepted] = []
        staleness: Counter = Counter()
        while len(accepted) < self.want:
            item = await self._ready.get()
            if item is None:
                raise RuntimeError(f"fetching rollouts failed: {self._error!r}") from self._error
            await self._release()
            m = item.manifest
            if m.batch_id in self.consumed or any(a.batch_id == m.batch_id for a in accepted):
                await self._skip_duplicate(pb.PulledRollout(delivery_id=item.delivery_id, manifest=m))
                continue
            lag = version - m.policy_version
            if lag > self.max_staleness:
                await self._reject(pb.PulledRollout(delivery_id=item.delivery_id, manifest=m), Rejected(
                    STALE, f"policy version {m.policy_version} is {lag} behind {version} (max {self.max_staleness})"))
                continue
            if lag < 0:
                await self._reject(pb.PulledRollout(delivery_id=item.delivery_id, manifest=m), Rejected(
                    FUTURE, f"policy version {m.policy_version} is newer than the learner's {version}"))
                continue
            staleness[lag] += 1
            accepted.append(item)
        dropped: Counter = sum((a.dropped for a in accepted), Counter())
        rejected, self._rejected = self._rejected, Counter()
        duplicates, self._duplicates = self._duplicates, 0
        return StepData(accepted, rejected, dropped, staleness, duplicates, time.monotonic() - t0)


def manifest_dollars(m: pb.RolloutManifest) -> float:
    """What generating this batch cost, from the worker's own report."""
    value = m.compute_seconds * m.price_per_hour / 3600.0
    return value if math.isfinite(value) and value >= 0 else 0.0
