"""Two proxy replicas (separate threads, event loops and Redis connections) serving one run to 64
concurrent clients: no batch is ever granted twice, admission is never exceeded, nothing is lost."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest
from proxy_support import BackgroundProxy, make_prompts, make_spec, manifest_for, new_run_id

from brigade.rpc import ProxyClient
from brigade.v1 import brigade_pb2 as pb

pytestmark = pytest.mark.asyncio(loop_scope="session")
CLIENTS = 64


@pytest.fixture(scope="module")
def replicas(redis_url):
    a, b = BackgroundProxy(redis_url), BackgroundProxy(redis_url)
    yield a, b
    a.close()
    b.close()


async def test_no_batch_granted_twice(replicas):
    a, b = replicas
    run = new_run_id("c")
    batches = 300
    async with ProxyClient.connect(a.target) as ca, ProxyClient.connect(b.target) as cb:
        await ca.runs.CreateRun(pb.CreateRunRequest(
            spec=make_spec(run, prompts_per_batch=1, epochs=1, staleness={"max_staleness": 10_000, "max_attempts": 50}),
            prompts=make_prompts(batches)))
        grants: list[tuple[str, int]] = []
        completed: list[str] = []
        in_flight: dict[str, str] = {}  # batch -> lease id, while held
        rng = random.Random(7)

        async def worker(i: int) -> None:
            client = (ca, cb)[i % 2]
            name = f"w{i}"
            while True:
                resp = await client.lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=name), timeout=30)
                if not resp.granted:
                    if resp.reason == "finished":
                        return
                    await asyncio.sleep(0.01)
                    continue
                lease = resp.lease
                batch = lease.batch.batch_id
                assert batch not in in_flight, f"{batch} granted while {in_flight[batch]} still holds it"
                in_flight[batch] = lease.lease_id
                grants.append((batch, lease.attempt))
                await asyncio.sleep(rng.random() * 0.002)  # "generating"
                other = (cb, ca)[i % 2] if rng.random() < 0.5 else client  # finish on either replica
                if rng.random() < 0.1:
                    del in_flight[batch]  # once failed, it may be granted again at once
                    await other.lease.FailLease(pb.FailLeaseRequest(run_id=run, lease_id=lease.lease_id,
                                                                    worker_id=name,
                                                                    reason=pb.FailLeaseRequest.PREEMPTED))
                    continue
                done = await other.lease.CompleteLease(pb.CompleteLeaseRequest(
                    run_id=run, lease_id=lease.lease_id, worker_id=name, manifest=manifest_for(run, lease, name)))
                assert not done.duplicate
                del in_flight[batch]
                completed.append(batch)

        await asyncio.wait_for(asyncio.gather(*(worker(i) for i in range(CLIENTS))), 120)
        assert len(grants) == len(set(grants))  # each (batch, attempt) granted once
        first_attempts = collections.Counter(b for b, attempt in grants if attempt == 1)
        assert len(first_attempts) == batches and set(first_attempts.values()) == {1}
        assert sorted(completed) == sorted(set(completed)) and len(completed) == batches
        state = await ca.runs.GetRun(pb.RunRef(run_id=run))
        assert (state.batches_created, state.completed, state.leased, state.queued) == (batches, batches, 0, 0)
        assert state.finished is False  # the learner has not consumed them yet


async def test_admission_is_never_exceeded_under_contention(replicas):
    a, b = replicas
    run = new_run_id("c")
    async with ProxyClient.connect(a.target) as ca, ProxyClient.connect(b.target) as cb:
        await ca.runs.CreateRun(pb.CreateRunRequest(
            spec=make_spec(run, batches_per_step=3, staleness={"max_staleness": 1}), prompts=make_prompts(100)))

        async def grab(i: int) -> pb.AcquireLeaseResponse:
            return await (ca, cb)[i % 2].lease.AcquireLease(pb.AcquireLeaseRequest(run_id=run, worker_id=f"w{i}"))

        answers = await asyncio.gather(*(grab(i) for i in range(CLIENTS)))
        granted = [r.lease.batch.batch_id for r in answers if r.granted]
        assert len(granted) == 6 == len(set(granted))  # capacity = 3 * (1 + 1)
        assert {r.reason for r in answers if not r.granted} == {"admission"}
