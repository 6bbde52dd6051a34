"""A stateful property test of the whole lease protocol: hypothesis drives random sequences of
acquire, heartbeat, complete (and duplicate completes), fail, lease expiry, janitor sweeps, learner
pull/ack, adapter publishes, proxy restarts and janitor restarts against a real proxy and Redis,
and checks after every step that no batch is lost or doubled:

- every batch ever cut is in exactly one of: queued/leased (work stream), completed and waiting
  (rollouts stream), consumed, rejected, dead-lettered;
- no batch is completed twice and the learner never gets two manifests for one batch;
- outstanding work (work + rollouts) never exceeds the admission cap;
- the adapter version never goes back.
"""

from __future__ import annotations

import collections

import grpc
import pytest
import redis
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from proxy_support import (
    BackgroundProxy,
    SyncClient,
    adapter_manifest,
    make_prompts,
    make_spec,
    manifest_for,
    new_run_id,
)

from brigade import keys
from brigade.store import Store
from brigade.v1 import brigade_pb2 as pb
from brigade_janitor.janitor import Janitor

WORKERS = ["w1", "w2", "w3"]
PROMPTS, PER_BATCH, PER_STEP, MAX_STALENESS, MAX_ATTEMPTS = 7, 2, 2, 1, 2
CAPACITY = PER_STEP * (MAX_STALENESS + 1)
BATCHES_PER_EPOCH = -(-PROMPTS // PER_BATCH)
SEEN: collections.Counter[str] = collections.Counter()  # what the runs exercised, checked at the end


class LeaseProtocol(RuleBasedStateMachine):
    bg: BackgroundProxy
    redis_url: str

    def __init__(self) -> None:
        super().__init__()
        self.run = new_run_id("sm")
        self.k = keys.RunKeys(self.run)
        self.r = redis.Redis.from_url(self.redis_url)
        self.client = SyncClient(self.bg.target)
        spec = make_spec(self.run, prompts_per_batch=PER_BATCH, batches_per_step=PER_STEP,
                         staleness={"max_staleness": MAX_STALENESS, "max_attempts": MAX_ATTEMPTS,
                                    "lease_seconds": 30})
        self.client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=make_prompts(PROMPTS)))
        self.janitor = self._new_janitor()
        SEEN["machines"] += 1
        self.held: dict[str, tuple[str, pb.Lease]] = {}         # lease id -> (worker, lease) we think we hold
        self.done: list[tuple[str, pb.Lease, pb.RolloutManifest]] = []  # completed leases, for duplicates
        self.completed_batches: set[str] = set()
        self.pulled: dict[str, str] = {}                         # delivery id -> batch, not yet acked
        self.delivery_of: dict[str, str] = {}                    # batch -> the one delivery id it ever had
        self.step = 0
        self.consumed_total = 0
        self.max_version = 0

    def _new_janitor(self) -> Janitor:
        return Janitor(Store(self.redis_url), runs=[self.run], janitor_id=new_run_id("janitor"))

    def teardown(self) -> None:
        try:
            # the learner drains what is waiting (alternately training and rejecting), then the
            # books must still balance
            for _ in range(10):
                self.pull(include_pending=True)
                self.pull(include_pending=False)
                if not self.pulled:
                    break
                self.ack([i % 2 == 0 for i in range(len(self.pulled))])
            self.every_batch_in_exactly_one_place()
            assert self.r.xlen(self.k.rollouts) == 0
        finally:
            self._close()

    def _close(self) -> None:
        self.bg.call(self.janitor.store.close())
        self.client.close()
        self.r.close()

    # -------------------------------------------------------------- workers

    @initialize()
    def start_workers(self) -> None:
        for worker in WORKERS:
            self.acquire(worker)

    @rule(worker=st.sampled_from(WORKERS))
    def acquire(self, worker: str) -> None:
        resp = self.client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=self.run, worker_id=worker), timeout=10)
        if not resp.granted:
            assert resp.reason in ("admission", "sync_barrier", "lookahead", "finished") and resp.retry_after_ms > 0
            SEEN["denied: " + resp.reason] += 1
            return
        lease = resp.lease
        SEEN["granted" if lease.attempt == 1 else "granted a retry"] += 1
        assert lease.batch.batch_id not in self.completed_batches, "a completed batch was leased again"
        assert all(held.batch.batch_id != lease.batch.batch_id for _, held in self.held.values()
                   if self._pending(held.lease_id)), "one batch leased twice at once"
        self.held[lease.lease_id] = (worker, lease)

    def _pending(self, lease_id: str) -> bool:
        return bool(self.r.xpending_range(self.k.work, keys.WORK_GROUP, lease_id, lease_id, 1))

    def _pick(self, i: int) -> tuple[str, pb.Lease]:
        ids = sorted(self.held)
        return self.held[ids[i % len(ids)]]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), foreign=st.booleans())
    def heartbeat(self, i: int, foreign: bool) -> None:
        worker, lease = self._pick(i)
        who = "intruder" if foreign else worker
        resp = self.client.lease.Heartbeat(pb.HeartbeatRequest(run_id=self.run, lease_id=lease.lease_id,
                                                               worker_id=who), timeout=10)
        if foreign:
            assert resp.status == pb.HeartbeatResponse.LOST
        elif resp.status == pb.HeartbeatResponse.OK:
            assert self._pending(lease.lease_id)
            assert resp.latest_adapter_version == self.max_version
        else:
            del self.held[lease.lease_id]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def complete(self, i: int) -> None:
        worker, lease = self._pick(i)
        m = manifest_for(self.run, lease, worker)
        try:
            resp = self.client.lease.CompleteLease(pb.CompleteLeaseRequest(
                run_id=self.run, lease_id=lease.lease_id, worker_id=worker, manifest=m), timeout=10)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), e
            SEEN["late completion refused"] += 1
            del self.held[lease.lease_id]
            return
        del self.held[lease.lease_id]
        SEEN["duplicate" if resp.duplicate else "completed"] += 1
        if not resp.duplicate:
            assert lease.batch.batch_id not in self.completed_batches, "completed twice"
            self.completed_batches.add(lease.batch.batch_id)
            self.done.append((worker, lease, m))

    @rule(worker=st.sampled_from(WORKERS))
    def work(self, worker: str) -> None:
        """The common case: a worker leases a batch and completes it."""
        before = set(self.held)
        self.acquire(worker)
        new = sorted(set(self.held) - before)
        if new:
            self.complete(sorted(self.held).index(new[0]))

    @precondition(lambda self: self.done)
    @rule(i=st.integers(0, 100))
    def duplicate_complete(self, i: int) -> None:
        worker, lease, m = self.done[i % len(self.done)]
        resp = self.client.lease.CompleteLease(pb.CompleteLeaseRequest(
            run_id=self.run, lease_id=lease.lease_id, worker_id=worker, manifest=m), timeout=10)
        assert resp.duplicate
        SEEN["duplicate"] += 1

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100), preempted=st.booleans())
    def fail(self, i: int, preempted: bool) -> None:
        worker, lease = self._pick(i)
        reason = pb.FailLeaseRequest.PREEMPTED if preempted else pb.FailLeaseRequest.ERROR
        try:
            resp = self.client.lease.FailLease(pb.FailLeaseRequest(run_id=self.run, lease_id=lease.lease_id,
                                                                   worker_id=worker, reason=reason), timeout=10)
            assert resp.requeued != resp.deadlettered
            SEEN["failed, dead-lettered" if resp.deadlettered else "failed, requeued"] += 1
            if resp.requeued:
                assert resp.next_attempt == lease.attempt + 1
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND), e
        del self.held[lease.lease_id]

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def worker_goes_silent(self, i: int) -> None:
        """The worker stops heartbeating: its lease looks idle for ages; the janitor takes it back."""
        worker, lease = self._pick(i)
        if self._pending(lease.lease_id):
            self.r.xclaim(self.k.work, keys.WORK_GROUP, worker, 0, [lease.lease_id], idle=10**9, justid=True)
            self.r.zadd(self.k.lease_deadlines, {lease.lease_id: 0})  # its deadline long past
        result = self.bg.call(self.janitor.sweep_run(self.run))
        SEEN["expired"] += result.expired
        SEEN["revoked"] += result.revoked

    # -------------------------------------------------------------- janitor and proxy lifecycle

    @rule()
    def janitor_sweep(self) -> None:
        result = self.bg.call(self.janitor.sweep_run(self.run))
        SEEN["revoked"] += result.revoked
        SEEN["stale removed"] += result.stale_removed

    @rule()
    def restart_janitor(self) -> None:
        self.bg.call(self.janitor.store.close())
        self.janitor = self._new_janitor()

    @rule()
    def restart_proxy(self) -> None:
        self.client.close()
        self.bg.restart()
        self.client = SyncClient(self.bg.target)

    # -------------------------------------------------------------- learner

    @rule(include_pending=st.booleans())
    def pull(self, include_pending: bool) -> None:
        resp = self.client.learner.PullRollouts(pb.PullRolloutsRequest(
            run_id=self.run, learner_id="learner", max_manifests=3, include_pending=include_pending), timeout=10)
        for r in resp.rollouts:
            batch = r.manifest.batch_id
            assert self.delivery_of.setdefault(batch, r.delivery_id) == r.delivery_id, "a second manifest"
            self.pulled[r.delivery_id] = batch
        assert resp.latest_adapter_version == self.max_version

    @precondition(lambda self: self.pulled)
    @rule(consume=st.lists(st.booleans(), min_size=1, max_size=4))
    def ack(self, consume: list[bool]) -> None:
        consume = consume + [True] * (len(self.pulled) - len(consume))
        ids = sorted(self.pulled)[:len(consume)]
        consume = consume[:len(ids)]
        batches = [self.pulled[d] for d in ids]
        # a step is what the consumed batches make: the proxy refuses one beyond that
        self.consumed_total += sum(consume)
        self.step = self.consumed_total // PER_STEP
        resp = self.client.learner.AckRollouts(pb.AckRolloutsRequest(
            run_id=self.run, learner_id="learner", delivery_ids=ids, step=self.step,
            consumed_batch_ids=[b for b, c in zip(batches, consume, strict=False) if c],
            rejected_batch_ids=[b for b, c in zip(batches, consume, strict=False) if not c]), timeout=10)
        assert resp.acked == len(ids)
        SEEN["consumed"] += sum(consume)
        SEEN["rejected"] += len(ids) - sum(consume)
        for d in ids:
            del self.pulled[d]

    @rule(consume=st.lists(st.booleans(), min_size=4, max_size=4), publish=st.booleans())
    def learner_step(self, consume: list[bool], publish: bool) -> None:
        """What the learner does each step: pull, train on some, reject others, maybe publish."""
        self.pull(include_pending=False)
        if self.pulled:
            self.ack(consume)
        if publish:
            self.publish(back=False)

    @rule(back=st.booleans())
    def publish(self, back: bool) -> None:
        version = max(1, self.max_version - 1) if back else self.max_version + 1
        resp = self.client.learner.PublishAdapter(pb.PublishAdapterRequest(
            run_id=self.run, manifest=adapter_manifest(self.run, version)), timeout=10)
        assert resp.latest_version >= self.max_version
        self.max_version = resp.latest_version

    # -------------------------------------------------------------- invariants

    @invariant()
    def every_batch_in_exactly_one_place(self) -> None:
        r, k = self.r, self.k
        cut = int(r.get(k.cursor) or 0)
        expected = {keys.batch_id(self.run, n // BATCHES_PER_EPOCH, n % BATCHES_PER_EPOCH) for n in range(cut)}
        places = {
            "work": [f[b"batch"].decode() for _, f in r.xrange(k.work)],
            "rollouts": [f[b"batch"].decode() for _, f in r.xrange(k.rollouts)],
            "consumed": [b.decode() for b in r.smembers(k.consumed)],
            "rejected": [b.decode() for b in r.hkeys(k.rejected)],
            "deadletter": [f[b"batch"].decode() for _, f in r.xrange(k.deadletter)],
        }
        seen = collections.Counter(b for batches in places.values() for b in batches)
        doubled = {b: [p for p, bs in places.items() if b in bs] for b, n in seen.items() if n > 1}
        assert not doubled, f"batches in two places: {doubled}"
        assert set(seen) == expected, f"lost: {expected - set(seen)}, unknown: {set(seen) - expected}"
        assert set(places["consumed"]) | set(places["rejected"]) | set(places["rollouts"]) <= self.completed_batches

    @invariant()
    def admission_cap_holds(self) -> None:
        SEEN["steps"] += 1
        assert self.r.xlen(self.k.work) + self.r.xlen(self.k.rollouts) <= CAPACITY

    @invariant()
    def version_never_goes_back(self) -> None:
        latest = int(self.r.get(self.k.adapter_latest) or 0)
        assert latest == self.max_version


@pytest.fixture(scope="module")
def bg(redis_url):
    proxy = BackgroundProxy(redis_url)
    yield proxy
    proxy.close()


def test_lease_protocol_state_machine(bg, redis_url):
    LeaseProtocol.bg = bg
    LeaseProtocol.redis_url = redis_url
    run_state_machine_as_test(LeaseProtocol, settings=settings(
        max_examples=25, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]))
    # the sequences did reach every path, not just the easy ones
    for what in ("granted", "granted a retry", "completed", "duplicate", "expired", "failed, requeued",
                 "consumed", "rejected"):
        assert SEEN[what] > 0, f"{what}: {dict(SEEN)}"
    assert SEEN["revoked"] + SEEN["stale removed"] + SEEN["denied: admission"] > 0, dict(SEEN)
    print(dict(SEEN))
