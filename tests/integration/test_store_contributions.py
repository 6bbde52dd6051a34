"""topology local_sgd in brigade.store against a real redis-server: a trainer's round of leases is
completed at once by SubmitContribution (all or nothing, idempotent), the aggregator pulls the
contribution and acks it with the learner's ack script, and neither topology takes the other's calls."""

from __future__ import annotations

import pytest
import pytest_asyncio
from proxy_support import make_prompts, make_spec, new_run_id

from brigade import keys
from brigade.store import FailedPrecondition, InvalidArgument, Store
from brigade.v1 import brigade_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture
async def q(redis_url):
    store = Store(redis_url)
    yield store
    await store.close()


async def local_run(q: Store, **spec) -> str:
    run = new_run_id("ls")
    spec = {"topology": "local_sgd", "local_sgd": {"local_steps": 2}, **spec}
    assert await q.runs.create(make_spec(run, **spec), make_prompts(20)) is True
    return run


def contribution(run: str, trainer: str, grants, base: int = 0, **over) -> tuple[list[str], pb.ContributionManifest]:
    lease_ids = [g.lease.lease_id for g in grants]
    cid = keys.contribution_id(run, trainer, lease_ids)
    fields = dict(run_id=run, contribution_id=cid, trainer_id=trainer, base_version=base, local_steps=len(grants),
                  batch_ids=[g.lease.batch.batch_id for g in grants], uri=keys.contribution_key(run, base, cid),
                  sha256="0" * 64, num_samples=8, reward_mean=0.5)
    fields.update(over)
    return lease_ids, pb.ContributionManifest(**fields)


async def test_a_round_is_submitted_whole_pulled_and_acked(q):
    run = await local_run(q)
    # no admission cap in local_sgd: a trainer holds a round of leases (capacity would be 1 x 5 here)
    grants = [await q.leases.acquire(run, "t1") for _ in range(6)]
    assert all(g.granted for g in grants)
    lease_ids, m = contribution(run, "t1", grants[:2])
    done = await q.leases.submit(run, "t1", lease_ids, m)
    assert not done.duplicate and done.delivery_id
    assert (await q.leases.submit(run, "t1", lease_ids, m)).duplicate  # a retry after a lost answer
    state = await q.views.run_state(run)
    assert (state.leased, state.contributions) == (4, 1)

    pulled = await q.learner.pull_contributions(run, "agg", 10)
    assert [(d, c.contribution_id) for d, c in pulled.contributions] == [(done.delivery_id, m.contribution_id)]
    assert (await q.learner.pull_contributions(run, "agg", 10, include_pending=True)).contributions  # unacked
    await q.learner.ack(run, "agg", [done.delivery_id], list(m.batch_ids), [], step=1, metrics_json='{"step": 1}')
    state = await q.views.run_state(run)
    assert (state.contributions, state.consumed, state.learner_step) == (0, 2, 1)
    assert not (await q.learner.pull_contributions(run, "agg", 10, include_pending=True)).contributions


async def test_a_round_with_one_lease_gone_is_refused_whole(q):
    run = await local_run(q)
    grants = [await q.leases.acquire(run, "t1") for _ in range(2)]
    await q.leases.fail(run, grants[1].lease.lease_id, "t1", pb.FailLeaseRequest.PREEMPTED)
    lease_ids, m = contribution(run, "t1", grants)
    with pytest.raises(FailedPrecondition, match="gone"):
        await q.leases.submit(run, "t1", lease_ids, m)
    state = await q.views.run_state(run)
    assert (state.leased, state.contributions, state.completed) == (1, 0, 0)  # nothing changed
    other = await q.leases.acquire(run, "t2")  # the handed-back batch
    lease_ids, m = contribution(run, "t1", [grants[0], other])
    with pytest.raises(FailedPrecondition, match="another worker"):
        await q.leases.submit(run, "t1", lease_ids, m)


async def test_contribution_manifests_are_checked(q):
    run = await local_run(q)
    grants = [await q.leases.acquire(run, "t1") for _ in range(2)]
    lease_ids, good = contribution(run, "t1", grants)
    for over, needle in ((dict(contribution_id="f" * 32), "contribution_id"),
                         (dict(uri=f"runs/{run}/adapters/v00000001/x"), "uri"),
                         (dict(batch_ids=[grants[1].lease.batch.batch_id, grants[0].lease.batch.batch_id]),
                          "is not the batch of lease"),
                         (dict(batch_ids=[grants[0].lease.batch.batch_id]), "one per lease"),
                         (dict(empty_batch_ids=[f"{run}:9:9"]), "empty_batch_ids"),
                         (dict(trainer_id="t2"), "trainer_id"),
                         (dict(reward_mean=float("nan")), "finite")):
        _, m = contribution(run, "t1", grants, **over)
        with pytest.raises((InvalidArgument,), match=needle):
            await q.leases.submit(run, "t1", lease_ids, m)
    assert not (await q.leases.submit(run, "t1", lease_ids, good)).duplicate


async def test_each_topology_refuses_the_others_calls(q):
    central = new_run_id("c")
    await q.runs.create(make_spec(central), make_prompts(4))
    g = await q.leases.acquire(central, "t1")
    lease_ids, m = contribution(central, "t1", [g])
    with pytest.raises(FailedPrecondition, match="topology central; SubmitContribution belongs to topology local_sgd"):
        await q.leases.submit(central, "t1", lease_ids, m)
    with pytest.raises(FailedPrecondition, match="PullContributions"):
        await q.learner.pull_contributions(central, "agg", 1)
    run = await local_run(q)
    g = await q.leases.acquire(run, "w")
    rollout = pb.RolloutManifest(run_id=run, batch_id=g.lease.batch.batch_id, attempt=1, worker_id="w",
                                 uri=keys.rollout_key(run, g.lease.batch.batch_id, 1), sha256="0" * 64, num_samples=1)
    with pytest.raises(FailedPrecondition, match="CompleteLease belongs to topology central"):
        await q.leases.complete(run, g.lease.lease_id, "w", rollout)
