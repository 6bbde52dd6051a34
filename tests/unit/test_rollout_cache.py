"""The adapter cache: sha256-checked fetches through the bucket, joined in-flight fetches, an LRU
of decoded versions, and never a version other than the one asked for."""

from __future__ import annotations

import asyncio

import pytest
import torch

from brigade import adapters, keys
from brigade.bucket import CorruptObject, ObjectNotFound, open_bucket
from brigade_rollout.adapter_cache import AdapterCache

pytestmark = pytest.mark.asyncio(loop_scope="session")

RUN = "cache-run"


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"base_model.model.layers.{i}.q_proj.lora_A.weight": torch.randn(4, 16, generator=g) for i in range(2)}


async def publish(bucket, version: int, payload: str = "bf16") -> dict[str, torch.Tensor]:
    files, err = adapters.encode(state(version), b'{"r": 4}', payload)
    await adapters.write_version(bucket, RUN, version, version, files, payload, err)
    return adapters.decode(files)


@pytest.fixture
async def bucket(file_bucket_url):
    b = open_bucket(file_bucket_url)
    await b.ensure()
    yield b
    await b.close()


async def test_fetch_prefetch_and_lru(bucket):
    expected = {v: await publish(bucket, v, "int8" if v == 3 else "bf16") for v in (1, 2, 3)}
    cache = AdapterCache(bucket, RUN, capacity=2)

    v0 = await cache.get(0)
    assert v0.version == 0 and v0.state is None and cache.fetches == 0

    got = await cache.get(1)
    assert got.version == 1 and got.payload == "bf16"
    assert all(got.state[k].dtype == torch.bfloat16 for k in expected[1])   # as sent; the engine converts
    assert all(torch.equal(got.state[k].float(), expected[1][k]) for k in expected[1])

    cache.prefetch(2)                      # as on AdapterPublished
    a, b = await asyncio.gather(cache.get(2), cache.get(2))
    assert a is b and cache.fetches == 2   # the lease joined the prefetch; one read
    assert 2 in cache

    got = await cache.get(3)
    assert got.payload == "int8" and got.version == 3
    assert 1 not in cache                  # least recently used went out
    await cache.get(2)
    assert cache.fetches == 3
    await cache.get(1)
    assert cache.fetches == 4
    await cache.close()


async def test_corrupt_missing_and_mislabelled_versions(bucket):
    await publish(bucket, 1)
    await publish(bucket, 2)
    cache = AdapterCache(bucket, RUN)

    # bytes changed after publication: the sha256 from the manifest catches it
    await bucket.put(keys.adapter_prefix(RUN, 1) + adapters.WEIGHTS, b"not what the manifest says")
    with pytest.raises(CorruptObject):
        await cache.get(1)
    assert 1 not in cache

    with pytest.raises(ObjectNotFound):
        await cache.get(7)

    # a manifest that claims another version is refused: the cache never serves a different version
    manifest = await bucket.get(keys.adapter_manifest_key(RUN, 2))
    await bucket.put_new(keys.adapter_manifest_key(RUN, 5), manifest)
    with pytest.raises(adapters.InvalidAdapter, match="version 2"):
        await cache.get(5)

    cache.prefetch(9)                      # a failed prefetch is logged, not raised, and not cached
    await asyncio.sleep(0.1)
    assert 9 not in cache
    assert (await cache.get(2)).version == 2
    await cache.close()
