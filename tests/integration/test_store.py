"""brigade.store against a real redis-server: every operation's happy path and refusals. The tests
on the `q` fixture run twice: on one redis-server and on a three-master Redis Cluster."""

from __future__ import annotations

import asyncio
import gc

import pytest
import pytest_asyncio
from proxy_support import adapter_manifest, make_prompts, make_spec, new_run_id

from brigade import keys
from brigade.store import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RunInfo,
    Store,
)
from brigade.store.sweeps import SweepResult
from brigade.v1 import brigade_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture
async def q(any_redis_url):
    store = Store(any_redis_url)
    yield store
    await store.close()


async def new_run(q: Store, n_prompts: int = 10, **spec) -> str:
    run = new_run_id("q")
    assert await q.runs.create(make_spec(run, **spec), make_prompts(n_prompts)) is True
    return run


def manifest(run: str, g, worker: str = "w", **over) -> pb.RolloutManifest:
    lease = g.lease
    fields = dict(run_id=run, batch_id=lease.batch.batch_id, attempt=lease.attempt, worker_id=worker,
                  policy_version=lease.adapter_version, uri=keys.rollout_key(run, lease.batch.batch_id, lease.attempt),
                  sha256="0" * 64, num_samples=2)
    fields.update(over)
    return pb.RolloutManifest(**fields)


async def force_idle(q: Store, run: str, lease_id: str, worker: str) -> None:
    """Make a lease look silent for a long time (as if its worker died): its deadline long past."""
    await q.redis.xclaim(keys.RunKeys(run).work, keys.WORK_GROUP, worker, 0, [lease_id], idle=10**9, justid=True)
    await q.redis.zadd(keys.RunKeys(run).lease_deadlines, {lease_id: 0})


# ---------------------------------------------------------------- runs

async def test_create_run_idempotence_and_conflicts(q):
    run = new_run_id("q")
    spec = make_spec(run)
    assert await q.runs.create(spec, make_prompts(4)) is True
    assert await q.runs.create(spec, make_prompts(4), exist_ok=True) is False
    with pytest.raises(AlreadyExists, match="already exists"):
        await q.runs.create(spec, make_prompts(4))
    with pytest.raises(AlreadyExists, match="different spec"):
        await q.runs.create(make_spec(run, seed=7), make_prompts(4), exist_ok=True)
    assert run in await q.runs.ids()
    info = await q.runs.get(run)
    assert info.num_prompts == 4 and info.spec == spec
    loaded = await q.runs.load_prompts(info)
    # kept as bytes: a parsed message per prompt would be one more object for every full garbage
    # collection (a pause of the whole proxy) to walk, a million of them for a big run
    assert len(loaded) == 4 and not any(gc.is_tracked(p) for p in loaded)
    batch = info.batch(keys.batch_id(run, 0, 0)).prompts
    assert len(batch) == 2 and all(p in make_prompts(4) for p in batch)  # whole prompts, columns too


async def test_create_run_validates(q):
    bad = make_spec(new_run_id("q"))
    bad.sampling.group_size = 1
    with pytest.raises(InvalidArgument, match="sampling.group_size"):
        await q.runs.create(bad, make_prompts(2))
    with pytest.raises(InvalidArgument, match="at least one prompt"):
        await q.runs.create(make_spec(new_run_id("q")), [])


async def test_unknown_run_lists_known(q):
    await new_run(q)
    with pytest.raises(NotFound, match=r"no run 'nope' \(known: ") as err:
        await q.leases.acquire("nope", "w")
    # the message names the first known runs (sorted), however many earlier tests made
    assert all(r in str(err.value) for r in (await q.runs.ids())[:8])
    run = await new_run(q)
    with pytest.raises(NotFound, match=f"did you mean {run}"):  # a typo names the run meant
        await q.leases.acquire(run[:-1], "w")


# ---------------------------------------------------------------- batches

async def test_batches_are_deterministic_and_cover_each_epoch():
    spec = make_spec("det", prompts_per_batch=3, seed=11)
    prompts = make_prompts(10)
    encoded = [p.SerializeToString(deterministic=True) for p in prompts]
    a, b = RunInfo(spec, b"", encoded), RunInfo(spec, b"", encoded)
    assert a.batches_per_epoch == 4
    for epoch in range(3):
        seen = []
        for index in range(4):
            batch = a.batch(keys.batch_id("det", epoch, index))
            assert batch == b.batch(keys.batch_id("det", epoch, index))
            assert (batch.epoch, batch.index) == (epoch, index)
            seen += [p.id for p in batch.prompts]
        assert sorted(seen) == sorted(p.id for p in prompts)  # every prompt once per epoch
    assert a.permutation(0) != a.permutation(1)
    other = RunInfo(make_spec("det", prompts_per_batch=3, seed=12), b"", encoded)
    assert other.permutation(0) != a.permutation(0)


async def test_cut_order_and_epochs_bound(q):
    run = await new_run(q, n_prompts=3, prompts_per_batch=2, epochs=2, staleness={"max_staleness": 100})
    grants = [await q.leases.acquire(run, f"w{i}") for i in range(4)]
    assert [g.lease.batch.batch_id for g in grants] == [f"{run}:0:0", f"{run}:0:1", f"{run}:1:0", f"{run}:1:1"]
    assert all(g.granted and g.lease.attempt == 1 and g.lease.adapter_version == 0 for g in grants)
    g = await q.leases.acquire(run, "w9")
    assert not g.granted and g.reason == "admission"  # all cut, but leases may still come back
    for i, lease in enumerate(grants):
        await q.leases.complete(run, lease.lease.lease_id, f"w{i}", manifest(run, lease, f"w{i}"))
    g = await q.leases.acquire(run, "w9")
    assert not g.granted and g.reason == "finished" and g.retry_after_ms > 0


async def test_admission_cap(q):
    run = await new_run(q, n_prompts=50, batches_per_step=2, staleness={"max_staleness": 1})
    grants = [await q.leases.acquire(run, f"w{i}") for i in range(4)]  # cap = 2 * (1 + 1)
    assert all(g.granted for g in grants)
    denied = await q.leases.acquire(run, "w5")
    assert not denied.granted and denied.reason == "admission" and 200 <= denied.retry_after_ms <= 1200
    await q.leases.complete(run, grants[0].lease.lease_id, "w0", manifest(run, grants[0], "w0"))
    assert not (await q.leases.acquire(run, "w5")).granted  # completed-but-unconsumed still counts
    pulled = await q.learner.pull(run, "L", 10)
    # step 0: one batch of a two-batch step makes no step yet
    await q.learner.ack(run, "L", [pulled.rollouts[0][0]], [grants[0].lease.batch.batch_id], [], step=0)
    assert (await q.leases.acquire(run, "w5")).granted


async def test_sync_barrier(q):
    run = await new_run(q, n_prompts=50, sync=True, batches_per_step=1, staleness={"max_staleness": 5})
    g0 = await q.leases.acquire(run, "w")
    assert g0.granted and g0.lease.batch.batch_id == f"{run}:0:0"
    g1 = await q.leases.acquire(run, "w")
    assert not g1.granted and g1.reason == "sync_barrier"
    await q.learner.publish(run, adapter_manifest(run, 1))
    g1 = await q.leases.acquire(run, "w")
    assert g1.granted and g1.lease.adapter_version == 1


async def test_automatic_lookahead_follows_generation_against_training(q):
    """lookahead 0 = automatic: one version ahead (the batch in training and one more) until both
    times are measured; then ceil(generation / learner busy x slack) versions, at most
    max_staleness, and back down when the learner turns out slower than generation. The choice and
    both averages are in the run's state."""
    run = await new_run(q, n_prompts=50, staleness={"max_staleness": 4, "lookahead": 0})
    grants = [await q.leases.acquire(run, "w") for _ in range(2)]
    assert all(g.granted for g in grants)
    refused = await q.leases.acquire(run, "w")
    assert not refused.granted and refused.reason == "lookahead" and 250 <= refused.retry_after_ms <= 500
    state = await q.views.run_state(run)
    assert (state.lookahead, state.generation_s, state.step_busy_s) == (1, 0, 0)

    await asyncio.sleep(0.05)  # a batch takes 50 ms to generate; the learner says a step takes 1 ms
    for step, g in enumerate(grants, 1):  # both trained on: nothing outstanding
        await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
        delivered = [d for d, _ in (await q.learner.pull(run, "L", 1)).rollouts]
        await q.learner.ack(run, "L", delivered, [g.lease.batch.batch_id], [], step=step)
    await q.learner.publish(run, adapter_manifest(run, 1), step_busy_s=0.001)
    more = [await q.leases.acquire(run, "w") for _ in range(5)]
    # four versions ahead would be 5 batches; the cap's capacity is 5 too: lookahead 4, the cap
    assert [g.granted for g in more] == [True] * 5
    state = await q.views.run_state(run)
    assert state.lookahead == 4 and state.generation_s >= 0.05 and state.step_busy_s == 0.001

    for version in range(2, 12):  # steps of 10 s: generation is much faster, one version ahead will do
        await q.learner.publish(run, adapter_manifest(run, version), step_busy_s=10.0)
    refused = await q.leases.acquire(run, "w")
    assert not refused.granted and refused.reason == "admission"  # the cap's capacity holds first
    g = more[0]
    await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
    delivered = [d for d, _ in (await q.learner.pull(run, "L", 1)).rollouts]
    await q.learner.ack(run, "L", delivered, [g.lease.batch.batch_id], [], step=3)
    refused = await q.leases.acquire(run, "w")  # 4 outstanding: room for 2 at lookahead 1
    assert not refused.granted and refused.reason == "lookahead"
    state = await q.views.run_state(run)
    assert state.lookahead == 1 and 9.0 < state.step_busy_s <= 10.0


async def test_a_rejected_batch_frees_its_room_under_lookahead(q):
    """Lookahead counts outstanding batches, not batch indexes: a batch the learner rejects (bad
    rewards, too stale) makes room for its replacement, though no version was published."""
    run = await new_run(q, n_prompts=50, staleness={"max_staleness": 4, "lookahead": 1})
    grants = [await q.leases.acquire(run, "w") for _ in range(3)]
    assert [g.granted for g in grants] == [True, True, False] and grants[2].reason == "lookahead"
    g = grants[0]
    await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
    delivered = [d for d, _ in (await q.learner.pull(run, "L", 1)).rollouts]
    await q.learner.ack(run, "L", delivered, [], [g.lease.batch.batch_id], step=0)  # rejected
    assert (await q.leases.acquire(run, "w")).granted


async def test_lookahead_counts_versions_with_publish_every(q):
    """With publish_every 2, one version ahead is two steps' batches beyond the one in training."""
    run = await new_run(q, n_prompts=50, publish_every=2, staleness={"max_staleness": 4, "lookahead": 1})
    grants = [await q.leases.acquire(run, "w") for _ in range(4)]
    assert [g.granted for g in grants] == [True, True, True, False] and grants[-1].reason == "lookahead"


async def test_max_steps_finishes(q):
    run = await new_run(q, max_steps=1)
    g = await q.leases.acquire(run, "w")
    await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
    pulled = await q.learner.pull(run, "L", 5)
    await q.learner.ack(run, "L", [d for d, _ in pulled.rollouts], [g.lease.batch.batch_id], [], step=1)
    g = await q.leases.acquire(run, "w")
    assert not g.granted and g.reason == "finished"
    assert (await q.views.run_state(run)).finished


# ---------------------------------------------------------------- heartbeat / complete / fail

async def test_heartbeat(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    beat = await q.leases.heartbeat(run, g.lease.lease_id, "w1")
    assert beat.status == "ok" and beat.deadline_ms >= g.lease.deadline_ms and beat.latest_version == 0
    foreign = await q.leases.heartbeat(run, g.lease.lease_id, "w2")
    assert foreign.status == "lost" and "another worker" in foreign.message
    unknown = await q.leases.heartbeat(run, "1-1", "w1")
    assert unknown.status == "lost" and "unknown lease" in unknown.message


async def test_heartbeat_keeps_lease_from_expiring(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    await force_idle(q, run, g.lease.lease_id, "w1")
    assert (await q.leases.heartbeat(run, g.lease.lease_id, "w1")).status == "ok"  # resets the idle time
    assert (await q.sweeps.expire_leases(run)).expired == 0
    await force_idle(q, run, g.lease.lease_id, "w1")
    assert (await q.sweeps.expire_leases(run)).expired == 1
    lost = await q.leases.heartbeat(run, g.lease.lease_id, "w1")
    assert lost.status == "lost" and "expired" in lost.message


async def test_complete_and_duplicates(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    c = await q.leases.complete(run, g.lease.lease_id, "w1", manifest(run, g, "w1"))
    assert not c.duplicate and c.delivery_id
    again = await q.leases.complete(run, g.lease.lease_id, "w1", manifest(run, g, "w1"))
    assert again.duplicate
    state = await q.views.run_state(run)
    assert state.completed == 1 and state.duplicates == 1 and state.leased == 0
    assert len((await q.learner.pull(run, "L", 10)).rollouts) == 1  # one manifest, not two


async def test_complete_refusals(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    good = manifest(run, g, "w1")
    cases = [
        (dict(run_id="other"), "run_id"),
        (dict(batch_id=f"{run}:5:5", uri=keys.rollout_key(run, f"{run}:5:5", 1)), "does not match the leased batch"),
        (dict(attempt=2, uri=keys.rollout_key(run, g.lease.batch.batch_id, 2)), "attempt"),
        (dict(policy_version=3), "policy_version"),
        (dict(uri="runs/other/rollouts/x/attempt-1.safetensors"), "uri"),
        (dict(uri=keys.rollout_key(run, g.lease.batch.batch_id, 1) + "/../../x"), "uri"),
        (dict(text_uri="runs/other/x.json"), "text_uri"),
        (dict(sha256="ABC"), "sha256"),
        (dict(num_samples=0), "num_samples"),
        (dict(reward_mean=float("nan")), "reward_mean"),
        (dict(compute_seconds=float("inf")), "compute_seconds"),
    ]
    for over, needle in cases:
        bad = pb.RolloutManifest()
        bad.CopyFrom(good)
        for k, v in over.items():
            setattr(bad, k, v)
        with pytest.raises(InvalidArgument, match=needle):
            await q.leases.complete(run, g.lease.lease_id, "w1", bad)
    with pytest.raises(FailedPrecondition, match="another worker"):
        await q.leases.complete(run, g.lease.lease_id, "w2", good)
    with pytest.raises(NotFound, match="unknown lease"):
        await q.leases.complete(run, "1-1", "w1", good)
    assert not (await q.leases.complete(run, g.lease.lease_id, "w1", good)).duplicate  # still completable


async def test_complete_after_expiry_is_refused(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    await force_idle(q, run, g.lease.lease_id, "w1")
    await q.sweeps.expire_leases(run)
    with pytest.raises(FailedPrecondition, match="expired"):
        await q.leases.complete(run, g.lease.lease_id, "w1", manifest(run, g, "w1"))
    g2 = await q.leases.acquire(run, "w2")  # the requeued attempt comes first
    assert g2.lease.batch.batch_id == g.lease.batch.batch_id and g2.lease.attempt == 2
    await q.leases.complete(run, g2.lease.lease_id, "w2", manifest(run, g2, "w2"))
    # the late first worker now hears "duplicate": its work is simply dropped
    assert (await q.leases.complete(run, g.lease.lease_id, "w1", manifest(run, g, "w1"))).duplicate


async def test_fail_requeues_then_deadletters(q):
    run = await new_run(q, staleness={"max_attempts": 2})
    g = await q.leases.acquire(run, "w1")
    f = await q.leases.fail(run, g.lease.lease_id, "w1", pb.FailLeaseRequest.ERROR, message="CUDA OOM")
    assert f.requeued and not f.deadlettered and f.next_attempt == 2
    g2 = await q.leases.acquire(run, "w2")
    assert g2.lease.batch.batch_id == g.lease.batch.batch_id and g2.lease.attempt == 2
    f2 = await q.leases.fail(run, g2.lease.lease_id, "w2", pb.FailLeaseRequest.ERROR, message="again")
    assert f2.deadlettered and not f2.requeued
    (dead,) = await q.views.dead_letters(run)
    assert dead.batch_id == g.lease.batch.batch_id and dead.attempts == 2 and dead.last_worker == "w2"
    assert "again" in dead.reason
    with pytest.raises(NotFound):
        await q.leases.fail(run, g2.lease.lease_id, "w2", pb.FailLeaseRequest.ERROR)


async def test_preemption_does_not_count(q):
    run = await new_run(q, staleness={"max_attempts": 1})
    g = await q.leases.acquire(run, "w1")
    for attempt in range(2, 6):
        f = await q.leases.fail(run, g.lease.lease_id, "w1", pb.FailLeaseRequest.PREEMPTED)
        assert f.requeued and f.next_attempt == attempt
        g = await q.leases.acquire(run, "w1")
        assert g.lease.attempt == attempt
    assert (await q.leases.fail(run, g.lease.lease_id, "w1", pb.FailLeaseRequest.ERROR)).deadlettered


async def test_fail_refusals(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1")
    with pytest.raises(FailedPrecondition, match="another worker"):
        await q.leases.fail(run, g.lease.lease_id, "w2", pb.FailLeaseRequest.ERROR)
    with pytest.raises(NotFound):
        await q.leases.fail(run, "9-9", "w1", pb.FailLeaseRequest.ERROR)


# ---------------------------------------------------------------- learner

async def test_pull_ack_and_redelivery(q):
    run = await new_run(q, staleness={"max_staleness": 10})
    grants = [await q.leases.acquire(run, "w") for _ in range(3)]
    for g in grants:
        await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
    first = await q.learner.pull(run, "L", 2)
    assert [m.batch_id for _, m in first.rollouts] == [g.lease.batch.batch_id for g in grants[:2]]
    # a restarted learner sees what it pulled but never acked
    again = await q.learner.pull(run, "L", 10, include_pending=True)
    assert [d for d, _ in again.rollouts] == [d for d, _ in first.rollouts]
    b0, b1 = grants[0].lease.batch.batch_id, grants[1].lease.batch.batch_id
    acked = await q.learner.ack(run, "L", [d for d, _ in first.rollouts], [b0], [b1], step=1,
                                metrics_json='{"loss": 0.5}')
    assert acked == 2
    # idempotent: the same ack again changes nothing
    assert await q.learner.ack(run, "L", [d for d, _ in first.rollouts], [b0], [b1], step=1,
                               metrics_json='{"loss": 0.5}') == 0
    state = await q.views.run_state(run)
    assert (state.consumed, state.rejected, state.learner_step, state.completed) == (1, 1, 1, 1)
    assert [m.step for m in await q.views.metrics(run)] == [1]
    rest = await q.learner.pull(run, "L", 10, wait_ms=50)
    assert [m.batch_id for _, m in rest.rollouts] == [grants[2].lease.batch.batch_id]
    empty = await q.learner.pull(run, "L", 10, wait_ms=50)
    assert empty.rollouts == []
    # step never goes back
    await q.learner.ack(run, "L", [], [], [], step=0)
    assert (await q.views.run_state(run)).learner_step == 1


async def test_ack_refusals(q):
    run = await new_run(q)
    with pytest.raises(InvalidArgument, match="never completed"):  # no batch of this run (5 a epoch)
        await q.learner.ack(run, "L", [], [f"{run}:0:5"], [], step=1)
    with pytest.raises(InvalidArgument, match="never completed"):  # past what a lost cut can be
        await q.learner.ack(run, "L", [], [f"{run}:999:0"], [], step=1)
    with pytest.raises(InvalidArgument, match="never completed"):  # a lost cut is a consumed batch's
        await q.learner.ack(run, "L", [], [], [f"{run}:0:0"], step=1)
    with pytest.raises(InvalidArgument, match="another run"):
        await q.learner.ack(run, "L", [], ["other:0:0"], [], step=1)
    with pytest.raises(InvalidArgument, match="stream entry id"):
        await q.learner.ack(run, "L", ["nope"], [], [], step=1)


async def test_a_trained_batch_whose_completion_redis_lost_is_recovered_by_the_ack(q):
    """A Redis crash lost a completion after the learner trained on the batch: Redis holds the batch as
    outstanding work again (leased, or queued as its next attempt). The learner's ack of it as consumed
    is the record: completed and consumed, its work taken back (never generated again, never
    dead-lettered), the late completion a duplicate. Ids Redis does not hold are still refused."""
    run = await new_run(q)
    k = keys.RunKeys(run)
    leased, queued = await q.leases.acquire(run, "w"), await q.leases.acquire(run, "w2")
    await q.sweeps.expire_leases(run, min_idle_ms=0)  # both taken back: attempt 2 of each is queued
    relet = await q.leases.acquire(run, "w3")         # one of them leased again
    b_leased, b_queued = relet.lease.batch.batch_id, ({leased.lease.batch.batch_id, queued.lease.batch.batch_id}
                                                      - {relet.lease.batch.batch_id}).pop()
    with pytest.raises(InvalidArgument, match="never completed"):  # a rejected id is not recovered
        await q.learner.ack(run, "L", [], [], [b_queued], step=0)
    with pytest.raises(InvalidArgument, match="never completed"):  # nor one Redis does not hold at all
        await q.learner.ack(run, "L", [], [b_leased, f"{run}:999:0"], [], step=1)
    assert await q.redis.xlen(k.work) == 2 and await q.redis.scard(k.consumed) == 0  # a refusal changes nothing

    await q.learner.ack(run, "L", [], [b_leased, b_queued], [], step=1)
    state = await q.views.run_state(run)
    assert (state.consumed, state.learner_step) == (2, 1)
    assert await q.redis.smembers(k.completed) == {b_leased.encode(), b_queued.encode()}
    assert await q.redis.xlen(k.work) == 0 and (await q.redis.xpending(k.work, keys.WORK_GROUP))["pending"] == 0
    recovered = [e.attrs["batch"] for e in await q.views.read_events(run) if e.type == "BatchRecovered"]
    assert sorted(recovered) == sorted([b_leased, b_queued])
    assert (await q.leases.complete(run, relet.lease.lease_id, "w3", manifest(run, relet, worker="w3"))).duplicate
    assert await q.sweeps.expire_leases(run, min_idle_ms=0) == SweepResult()  # nothing left to requeue
    nxt = await q.leases.acquire(run, "w")
    assert nxt.lease.batch.batch_id not in (b_leased, b_queued) and nxt.lease.attempt == 1


async def test_a_trained_batch_whose_cut_redis_lost_is_recovered_and_never_cut_again(q):
    """A Redis crash lost the cuts of batches the learner then trained (cut, generated and delivered
    within the lost second): Redis's cursor is behind them. The learner's ack of them as consumed is
    the record: completed and consumed, and the cursor passes over them instead of cutting them
    again. Below the cursor, a batch Redis does not hold had another fate: still refused."""
    run = await new_run(q, staleness={"max_attempts": 1})
    k = keys.RunKeys(run)
    first = await q.leases.acquire(run, "w")
    assert first.lease.batch.batch_id == f"{run}:0:0"
    await q.learner.ack(run, "L", [], [f"{run}:0:1", f"{run}:0:2"], [], step=2)
    state = await q.views.run_state(run)
    assert (state.consumed, state.learner_step) == (2, 2)
    assert await q.redis.smembers(k.completed) == {f"{run}:0:1".encode(), f"{run}:0:2".encode()}
    recovered = {e.attrs["batch"]: e.attrs["lost"] for e in await q.views.read_events(run) if e.type == "BatchRecovered"}
    assert recovered == {f"{run}:0:1": "cut", f"{run}:0:2": "cut"}
    for version in (1, 2):  # what the learner published for those two steps
        await q.learner.publish(run, adapter_manifest(run, version))
    nxt = await q.leases.acquire(run, "w2")
    assert nxt.lease.batch.batch_id == f"{run}:0:3" and int(await q.redis.get(k.cursor)) == 4
    # both leases expire on their one attempt: below the cursor and held nowhere, their fate is known
    await q.sweeps.expire_leases(run, min_idle_ms=0)
    assert (await q.views.run_state(run)).deadlettered == 2
    with pytest.raises(InvalidArgument, match="never completed"):
        await q.learner.ack(run, "L", [], [f"{run}:0:0"], [], step=3)


async def test_metrics_last(q):
    run = await new_run(q)
    for step in range(1, 6):
        g = await q.leases.acquire(run, "w")
        await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
        delivered = [d for d, _ in (await q.learner.pull(run, "L", 1)).rollouts]
        await q.learner.ack(run, "L", delivered, [g.lease.batch.batch_id], [], step=step,
                            metrics_json=f'{{"step": {step}}}')
        await q.learner.publish(run, adapter_manifest(run, step))
    assert [m.step for m in await q.views.metrics(run, last=2)] == [4, 5]
    assert len(await q.views.metrics(run)) == 5


async def test_publish_versions_never_go_back(q):
    run = await new_run(q)
    assert await q.learner.publish(run, adapter_manifest(run, 1)) == 1
    assert await q.learner.publish(run, adapter_manifest(run, 2)) == 2
    assert await q.learner.publish(run, adapter_manifest(run, 1)) == 2
    assert await q.learner.publish(run, adapter_manifest(run, 2)) == 2  # identical retry is fine
    with pytest.raises(AlreadyExists, match="different manifest"):
        await q.learner.publish(run, adapter_manifest(run, 2, step=9))
    for bad, needle in [
        (pb.AdapterManifest(run_id=run, version=0, uri=keys.adapter_prefix(run, 0)), "version"),
        (pb.AdapterManifest(run_id="x", version=3, uri=keys.adapter_prefix(run, 3)), "run_id"),
        (pb.AdapterManifest(run_id=run, version=3, uri="runs/other/adapters/v00000003/"), "uri"),
        (pb.AdapterManifest(run_id=run, version=3, uri=keys.adapter_prefix(run, 4)), "uri"),
    ]:
        with pytest.raises(InvalidArgument, match=needle):
            await q.learner.publish(run, bad)
    full = pb.AdapterManifest(run_id=run, version=3, step=3, uri="s3://b/pre/" + keys.adapter_prefix(run, 3))
    assert await q.learner.publish(run, full) == 3
    assert [a.version for a in await q.views.list_adapters(run)] == [1, 2, 3]


async def test_only_the_newest_adapter_versions_stay_in_redis(q):
    from brigade.store.scripts import ADAPTERS_KEPT

    run = await new_run(q)
    k = keys.RunKeys(run)
    old = adapter_manifest(run, 6).SerializeToString(deterministic=True)
    await q.redis.hset(k.adapters, mapping={"5": old, "6": old})   # as if published long ago
    await q.redis.hset(k.evals, mapping={"5": "{}", "6": "{}"})
    await q.redis.set(k.adapter_latest, ADAPTERS_KEPT + 5)
    assert await q.learner.publish(run, adapter_manifest(run, ADAPTERS_KEPT + 6)) == ADAPTERS_KEPT + 6
    assert sorted(int(v) for v in await q.redis.hkeys(k.adapters)) == [5, ADAPTERS_KEPT + 6]
    assert [int(v) for v in await q.redis.hkeys(k.evals)] == [5]


# ---------------------------------------------------------------- janitor sweeps

async def test_expiry_requeues_with_next_attempt_then_deadletters(q):
    run = await new_run(q, staleness={"max_attempts": 2})
    g = await q.leases.acquire(run, "w1")
    await force_idle(q, run, g.lease.lease_id, "w1")
    r = await q.sweeps.expire_leases(run)
    assert (r.expired, r.deadlettered) == (1, 0)
    g2 = await q.leases.acquire(run, "w2")
    assert g2.lease.batch.batch_id == g.lease.batch.batch_id and g2.lease.attempt == 2
    assert g2.lease.lease_id != g.lease.lease_id
    await force_idle(q, run, g2.lease.lease_id, "w2")
    r = await q.sweeps.expire_leases(run)
    assert (r.expired, r.deadlettered) == (1, 1)
    (dead,) = await q.views.dead_letters(run)
    assert (dead.batch_id, dead.reason, dead.last_worker, dead.attempts) == (
        g.lease.batch.batch_id, "lease expired", "w2", 2)
    state = await q.views.run_state(run)
    assert (state.expired, state.deadlettered, state.queued, state.leased) == (2, 1, 0, 0)


async def test_revoke_stale_leases(q):
    run = await new_run(q, staleness={"max_staleness": 1, "max_attempts": 5})
    old = await q.leases.acquire(run, "w1")
    await q.learner.publish(run, adapter_manifest(run, 1))
    fresh = await q.leases.acquire(run, "w2")
    assert (await q.sweeps.revoke_stale(run)).revoked == 0  # 1 - 0 is within max_staleness
    await q.learner.publish(run, adapter_manifest(run, 2))
    r = await q.sweeps.revoke_stale(run)
    assert r.revoked == 1
    beat = await q.leases.heartbeat(run, old.lease.lease_id, "w1")
    assert beat.status == "revoked" and beat.latest_version == 2
    assert (await q.leases.heartbeat(run, fresh.lease.lease_id, "w2")).status == "ok"
    with pytest.raises(FailedPrecondition, match="revoked"):
        await q.leases.complete(run, old.lease.lease_id, "w1", manifest(run, old, "w1"))
    again = await q.leases.acquire(run, "w3")
    assert again.lease.batch.batch_id == old.lease.batch.batch_id
    assert again.lease.attempt == 2 and again.lease.adapter_version == 2
    assert (await q.views.run_state(run)).revoked == 1


async def test_remove_stale_manifests_only_undelivered(q):
    run = await new_run(q, staleness={"max_staleness": 1})
    a = await q.leases.acquire(run, "w")
    b = await q.leases.acquire(run, "w")
    await q.leases.complete(run, a.lease.lease_id, "w", manifest(run, a))
    pulled = await q.learner.pull(run, "L", 1)  # the learner holds a
    await q.leases.complete(run, b.lease.lease_id, "w", manifest(run, b))
    await q.learner.publish(run, adapter_manifest(run, 1))
    await q.learner.publish(run, adapter_manifest(run, 2))
    r = await q.sweeps.remove_stale_manifests(run)
    assert r.stale_removed == 1  # b; a is the learner's to judge
    state = await q.views.run_state(run)
    assert state.stale_removed == 1 and state.completed == 1
    rejected = await q.redis.hgetall(keys.RunKeys(run).rejected)
    assert rejected == {b.lease.batch.batch_id.encode(): b"stale (janitor)"}
    await q.learner.ack(run, "L", [pulled.rollouts[0][0]], [], [a.lease.batch.batch_id], step=0)
    assert (await q.learner.pull(run, "L", 10)).rollouts == []


# ---------------------------------------------------------------- inspection

async def test_inspection_reads(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "w1", pb.WorkerInfo(capacity_class="spot", price_per_hour=0.7))
    (lease,) = await q.views.list_leases(run)
    assert (lease.lease_id, lease.batch_id, lease.worker_id, lease.attempt) == (
        g.lease.lease_id, g.lease.batch.batch_id, "w1", 1)
    (worker,) = await q.views.list_workers(run)
    assert (worker.worker_id, worker.capacity_class, worker.leases_granted) == ("w1", "spot", 1)
    assert worker.last_seen_ms > 0
    events = await q.views.read_events(run)
    assert [e.type for e in events] == ["RunCreated", "WorkerSeen", "LeaseGranted"]
    assert events[2].attrs["batch"] == g.lease.batch.batch_id and events[2].time_ms > 0
    state = await q.views.run_state(run)
    assert (state.batches_created, state.leased, state.queued, state.num_prompts) == (1, 1, 0, 10)
    assert state.created_ms > 0 and not state.finished


async def test_events_tail(q):
    run = await new_run(q)
    seen = []

    async def tail():
        async for event in q.views.events(run, from_start=True, block_ms=100):
            seen.append(event.type)
            if len(seen) == 3:
                return


    task = asyncio.create_task(tail())
    await asyncio.sleep(0.05)
    await q.leases.acquire(run, "w1")
    await asyncio.wait_for(task, 5)
    assert seen == ["RunCreated", "WorkerSeen", "LeaseGranted"]


async def test_redis_py_fallback_path(any_redis_url):
    """Without the pipelined connection the scripts run through redis-py (its cluster client on a
    cluster, which loads them on every master) with the same results."""
    q = Store(any_redis_url, pipelined=False)
    try:
        assert q.fast is None
        run = await new_run(q)
        g = await q.leases.acquire(run, "w")
        assert g.granted
        assert not (await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))).duplicate
    finally:
        await q.close()


async def test_prune_consumers_keeps_lease_holders(q):
    run = await new_run(q)
    g = await q.leases.acquire(run, "holder")
    done = await q.leases.acquire(run, "finished-worker")
    await q.leases.complete(run, done.lease.lease_id, "finished-worker", manifest(run, done, "finished-worker"))
    await q.learner.pull(run, "old-learner", 1)
    await asyncio.sleep(0.05)
    removed = await q.sweeps.prune_consumers(run, min_idle_ms=10)
    assert removed == 1  # finished-worker; "holder" holds a lease, "old-learner" holds a delivery
    names = {c["name"] for c in await q.redis.xinfo_consumers(keys.RunKeys(run).work, keys.WORK_GROUP)}
    assert names == {b"holder"}
    assert (await q.leases.heartbeat(run, g.lease.lease_id, "holder")).status == "ok"


async def test_finished_epochs_are_compacted_and_keep_their_fates(q):
    """The ids of an epoch whose batches all had their fate leave completed / consumed / rejected
    (here whatever the set holds: keep=0); counts stay, a late duplicate completion or ack of such a batch changes nothing, and an epoch with
    a batch in flight is left alone."""
    run = await new_run(q, n_prompts=4, staleness={"max_staleness": 10})   # 2 batches an epoch
    k = keys.RunKeys(run)
    grants = [await q.leases.acquire(run, "w") for _ in range(3)]           # epoch 0 whole, then 1:0
    assert [g.lease.batch.batch_id for g in grants] == [f"{run}:0:0", f"{run}:0:1", f"{run}:1:0"]
    for g in grants[:2]:
        await q.leases.complete(run, g.lease.lease_id, "w", manifest(run, g))
    pulled = await q.learner.pull(run, "L", 10)
    assert await q.sweeps.compact_epochs(run, keep=0) == 0   # delivered, not acked: still in flight
    b0, b1 = (g.lease.batch.batch_id for g in grants[:2])
    await q.learner.ack(run, "L", [d for d, _ in pulled.rollouts], [b0], [b1], step=1)
    before = await q.views.run_state(run)
    assert await q.sweeps.compact_epochs(run) == 0   # the default keeps the newest 10,000 ids
    assert await q.sweeps.compact_epochs(run, keep=0) == 2   # both ids of epoch 0
    assert await q.redis.scard(k.completed) == 0 and await q.redis.scard(k.consumed) == 0
    assert await q.redis.hlen(k.rejected) == 0
    assert await q.views.run_state(run) == before and before.consumed == 1 and before.rejected == 1
    # the fates hold: an old completion is a duplicate, an old ack adds nothing, a new id is still checked
    late = await q.leases.complete(run, grants[0].lease.lease_id, "w", manifest(run, grants[0]))
    assert late.duplicate
    await q.learner.ack(run, "L", [], [b0, b1], [], step=1)
    assert (await q.views.run_state(run)).consumed == 1
    with pytest.raises(InvalidArgument, match="never completed"):  # (beyond what a lost cut can be)
        await q.learner.ack(run, "L", [], [f"{run}:99:1"], [], step=1)
    # epoch 1 is cut whole, but 1:0 is still leased: not compacted
    await q.leases.acquire(run, "w")
    assert await q.sweeps.compact_epochs(run, keep=0) == 0
    assert (await q.redis.hget(k.stats, "epochs_done")) == b"1"
