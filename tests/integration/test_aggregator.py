"""The aggregator (topology local_sgd) against a real proxy, Redis and bucket, with contributions
made by hand: a round merges what passes and rejects the rest with its reason (stale beyond the cap,
a version from the future, missing, corrupt, invalid, empty), weights late contributions down,
closes at its deadline with fewer than M, and a restart replays its newest record: the same bytes,
and nothing merged twice."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
import torch
from proxy_support import PROXY_TOKEN, make_prompts, make_spec, new_run_id
from safetensors.torch import save as st_save

from brigade import adapters, keys
from brigade.bucket import open_bucket, sha256_hex
from brigade.rpc import ProxyClient
from brigade.store import Store
from brigade.v1 import brigade_pb2 as pb
from brigade_aggregator import rounds
from brigade_aggregator.aggregator import Aggregator
from brigade_aggregator.config import AggregatorConfig

pytestmark = pytest.mark.asyncio(loop_scope="session")
A = "base_model.model.layers.0.q_proj.lora_A.weight"
B = "base_model.model.layers.0.q_proj.lora_B.weight"
LAST: list[pb.ContributionManifest] = []


@pytest_asyncio.fixture
async def env(redis_url, token_proxy, tmp_path):
    store, bucket = Store(redis_url), open_bucket(f"file://{tmp_path / 'bucket'}")
    client = ProxyClient.connect(token_proxy.target, PROXY_TOKEN)
    yield store, bucket, client
    await client.close()
    await bucket.close()
    await store.close()


async def start(store, bucket, **local_sgd):
    run = new_run_id("agg")
    spec = make_spec(run, topology="local_sgd", staleness={"max_staleness": 1},
                     local_sgd={"local_steps": 1, "min_contributions": 2, "round_timeout_s": 60, **local_sgd})
    await store.runs.create(spec, make_prompts(40))
    v0 = {A: torch.randn(2, 6, generator=torch.Generator().manual_seed(0)), B: torch.zeros(4, 2)}
    await bucket.put_new(keys.base_adapter_key(run), st_save(v0, metadata={"adapter_config": '{"r": 2}'}))
    return run, spec, v0


async def contribute(store, bucket, run: str, trainer: str, base: int, b: torch.Tensor, samples: int = 16,
                     tensors: dict | None = None, sha: str = "", put: bool = True) -> str:
    """A trainer's round of one lease, uploaded and submitted; its batch id (its manifest in LAST)."""
    g = await store.leases.acquire(run, trainer)
    lease_ids = [g.lease.lease_id]
    cid = keys.contribution_id(run, trainer, lease_ids)
    key = keys.contribution_key(run, base, cid)
    data = st_save(tensors if tensors is not None else {B: b})
    if put:
        await bucket.put_new(key, data)
    m = pb.ContributionManifest(run_id=run, contribution_id=cid, trainer_id=trainer, base_version=base, local_steps=1,
                                batch_ids=[g.lease.batch.batch_id], uri=key, sha256=sha or sha256_hex(data),
                                size_bytes=len(data), num_samples=samples, reward_mean=0.5)
    await store.leases.submit(run, trainer, lease_ids, m)
    LAST[:] = [m]
    return g.lease.batch.batch_id


def aggregator(run, spec, bucket, client, token_proxy, tmp_path) -> Aggregator:
    cfg = AggregatorConfig(proxy=token_proxy.target, bucket=f"file://{tmp_path / 'bucket'}", run=run,
                           token=PROXY_TOKEN, pull_wait_ms=200, keep_rounds=0)
    return Aggregator(cfg, spec, bucket, client)


async def test_rounds_merge_reject_and_replay(env, token_proxy, tmp_path):
    store, bucket, client = env
    run, spec, v0 = await start(store, bucket)
    agg = aggregator(run, spec, bucket, client, token_proxy, tmp_path)
    await agg.resume()
    d1, d2 = torch.full((4, 2), 1.0), torch.full((4, 2), 4.0)
    good = [await contribute(store, bucket, run, "t1", 0, d1, samples=30),
            await contribute(store, bucket, run, "t2", 0, d2, samples=10)]
    await agg.round()
    s = agg.state
    assert s.version == 1 and torch.allclose(s.master[B], torch.full((4, 2), 0.75 * 1 + 0.25 * 4))
    assert torch.equal(s.master[A], v0[A]) and s.metrics["averaging_error"] < 1e-7
    _, files = await adapters.read_version(bucket, run, 1)
    assert torch.allclose(adapters.decode(files)[B], s.master[B].bfloat16().float())
    state = await store.views.run_state(run)
    assert (state.latest_version, state.learner_step, state.consumed, state.contributions) == (1, 1, 2, 0)

    # round 2: one late (base 0, weight x 0.5), one fresh, and six that must be refused
    late = await contribute(store, bucket, run, "t1", 0, torch.full((4, 2), 2.0))
    fresh = await contribute(store, bucket, run, "t2", 1, s.master[B].bfloat16().float() + 1.0)
    refused = {
        "future_version": await contribute(store, bucket, run, "t3", 5, d1),
        "missing": await contribute(store, bucket, run, "t3", 1, d1, put=False),
        "corrupt": await contribute(store, bucket, run, "t3", 1, d1, sha="0" * 64),
        "invalid": await contribute(store, bucket, run, "t3", 1, d1, tensors={B: torch.ones(3, 3)}),
        "empty": await contribute(store, bucket, run, "t3", 1, d1, samples=0),
    }
    await agg.round()
    s = agg.state
    assert s.version == 2 and s.metrics["contributions"] == 2 and s.metrics["staleness/1"] == 1
    # weights 16 x 0.5 (late) and 16 (fresh), deltas 2 (from v0) and 1 (from v1), on v1's master 1.75
    assert torch.allclose(s.master[B], torch.full((4, 2), 1.75 + (1 / 3) * 2.0 + (2 / 3) * 1.0))
    assert {k.split("/")[1] for k in s.metrics if k.startswith("rejected/")} == set(refused)
    rejected = {b.decode(): v.decode() for b, v in (await store.redis.hgetall(keys.RunKeys(run).rejected)).items()}
    assert set(rejected) == set(refused.values())
    assert set(s.ack.consumed) == {late, fresh} and not set(good) & set(s.ack.consumed)

    # a contribution left beyond the cap while it waits is dropped as stale; the deadline closes a round of one
    await contribute(store, bucket, run, "t1", 1, torch.zeros(4, 2))
    spec.local_sgd.round_timeout_s = 0.5
    await agg.round()
    stale = await contribute(store, bucket, run, "t2", 1, torch.zeros(4, 2))
    await contribute(store, bucket, run, "t2", 3, agg.state.master[B].bfloat16().float())
    await agg.round()
    assert agg.state.metrics["closed_by"] == "deadline" and agg.state.metrics["rejected/stale"] == 1
    assert (await store.redis.hget(keys.RunKeys(run).rejected, stale)) is not None

    # a crash after the record, before publish and ack: the restart replays it, and merges nothing twice
    await contribute(store, bucket, run, "t1", 4, torch.zeros(4, 2))
    await contribute(store, bucket, run, "t2", 4, torch.zeros(4, 2))

    async def crash(_state):
        raise RuntimeError("killed after the record")

    agg._publish_and_ack = crash
    with pytest.raises(RuntimeError):
        await agg.round()
    record = await bucket.get(keys.round_key(run, 5))
    again = aggregator(run, spec, bucket, client, token_proxy, tmp_path)
    await again.resume()
    assert again.state.version == 5 and rounds.encode(run, again.state) == record
    manifest, files = await adapters.read_version(bucket, run, 5)
    assert files == adapters.encode(again.state.master, again.state.config_json, spec.adapter_payload)[0]
    state = await store.views.run_state(run)
    assert (state.latest_version, state.learner_step, state.contributions) == (5, 5, 0)
    metrics = json.loads((await store.views.metrics(run, 1))[0].metrics_json)
    assert metrics["step"] == 5 and metrics["contributions"] == 2
    # delivered again (Redis lost the ack): acked as consumed, never merged a second time
    assert LAST[0].contribution_id in again.state.merged
    await again._admit(pb.PulledContribution(delivery_id="1-1", manifest=LAST[0]))
    assert not again.waiting


async def test_nesterov_momentum_survives_a_restart(env, token_proxy, tmp_path):
    """DiLoCo's outer optimizer: its buffer is in every round record, so a restarted aggregator steps
    exactly as one that never stopped."""
    from brigade_aggregator import averaging

    store, bucket, client = env
    run, spec, _ = await start(store, bucket, outer_optimizer="nesterov", outer_lr=0.7, outer_momentum=0.9)
    agg = aggregator(run, spec, bucket, client, token_proxy, tmp_path)
    await agg.resume()
    for v in range(2):
        base = agg.state.master[B].bfloat16().float() if v else torch.zeros(4, 2)
        await contribute(store, bucket, run, "t1", v, base + 1.0)
        await contribute(store, bucket, run, "t2", v, base + 3.0)
        await agg.round()
    assert agg.state.momentum and torch.allclose(agg.state.momentum[B], torch.full((4, 2), -2.0 * 0.9 - 2.0))
    again = aggregator(run, spec, bucket, client, token_proxy, tmp_path)
    await again.resume()
    assert torch.equal(again.state.momentum[B], agg.state.momentum[B])
    want = averaging.outer_step(agg.state.master, agg.state.momentum, {B: torch.full((4, 2), 2.0)}, "nesterov",
                                0.7, 0.9).master[B]
    base = again.state.master[B].bfloat16().float()
    await contribute(store, bucket, run, "t1", 2, base + 2.0)
    await contribute(store, bucket, run, "t2", 2, base + 2.0)
    await again.round()
    assert torch.allclose(again.state.master[B], want, atol=1e-6)
