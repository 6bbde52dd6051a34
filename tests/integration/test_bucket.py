"""Conformance suite for brigade.bucket: the same tests against a real S3 API (moto server) and
a local folder. No mocks: every byte goes through the backend under test."""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from aiobotocore.session import get_session

from brigade.bucket import (
    Bucket,
    BucketError,
    CorruptObject,
    ObjectExists,
    ObjectNotFound,
    open_bucket,
    sha256_hex,
)
from brigade.bucket.base import TEMP_MARKER
from brigade.bucket.local import LocalBucket
from brigade.bucket.s3 import S3Bucket

# The S3 client lives on the loop it was created in: run fixtures and tests on one loop.
pytestmark = pytest.mark.asyncio(loop_scope="session")

MiB = 1 << 20

# Small pages and a low multipart threshold so that a 25-key listing paginates and a 34 MiB
# object goes up as a multipart upload (5 parts), as it would in production for bigger files.
S3_OPTIONS = {"page_size": 10, "multipart_threshold": 16 * MiB, "part_size": 8 * MiB}


@dataclass
class Env:
    kind: str
    url: str
    bucket: Bucket
    opened: list[Bucket]

    def open(self, url: str | None = None) -> Bucket:
        """Another Bucket on the same (or a sibling) URL: a second client, as another process."""
        b = open_bucket(url or self.url, **S3_OPTIONS)
        self.opened.append(b)
        return b


@pytest.fixture(params=["s3", "file"])
async def env(request: pytest.FixtureRequest) -> AsyncIterator[Env]:
    url = request.getfixturevalue("s3_bucket_url" if request.param == "s3" else "file_bucket_url")
    e = Env(request.param, url, open_bucket(url, **S3_OPTIONS), [])
    await e.bucket.ensure()
    yield e
    for b in (e.bucket, *e.opened):
        await b.close()


async def raw_overwrite(env: Env, key: str, data: bytes) -> None:
    """Change stored bytes behind the library's back (bit rot, a buggy writer)."""
    uri = env.bucket.url(key)
    if env.kind == "file":
        Path(unquote(urlsplit(uri).path)).write_bytes(data)
        return
    name, _, full = uri.removeprefix("s3://").partition("/")
    async with get_session().create_client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"]) as s3:
        await s3.put_object(Bucket=name, Key=full, Body=data)


# -- round trips ------------------------------------------------------------------------


async def test_small_round_trip(env: Env) -> None:
    b = env.bucket
    data = b"hello, brigade\n"
    digest = await b.put("runs/r1/run.pb", data)
    assert digest == sha256_hex(data)
    assert await b.get("runs/r1/run.pb") == data
    assert await b.get("runs/r1/run.pb", sha256=digest) == data
    assert await b.get("runs/r1/run.pb", sha256=digest.upper()) == data
    assert await b.exists("runs/r1/run.pb")
    assert await b.list() == ["runs/r1/run.pb"]
    assert await b.put("empty", b"") == sha256_hex(b"")
    assert await b.get("empty", sha256=sha256_hex(b"")) == b""
    assert [c async for c in b.stream("empty")] == []


async def test_url_names_the_key(env: Env) -> None:
    uri = env.bucket.url("adapters/v00000001/manifest.pb")
    assert uri == env.url.rstrip("/") + "/adapters/v00000001/manifest.pb"


async def test_large_round_trip_34mib(env: Env) -> None:
    data = random.randbytes(34 * MiB)
    digest = await env.bucket.put_new("adapters/v00000001/adapter_model.safetensors", data)
    assert digest == sha256_hex(data)
    got = await env.bucket.get("adapters/v00000001/adapter_model.safetensors", sha256=digest)
    assert got == data
    streamed = [c async for c in env.bucket.stream("adapters/v00000001/adapter_model.safetensors")]
    assert all(len(c) <= MiB for c in streamed)
    assert b"".join(streamed) == data
    if isinstance(env.bucket, S3Bucket):
        # A multipart object's ETag is "<md5 of part md5s>-<part count>": 34 MiB / 8 MiB = 5.
        s3 = await env.bucket._s3()
        head = await s3.head_object(Bucket=env.bucket.name, Key=env.bucket._full("adapters/v00000001/adapter_model.safetensors"))
        assert head["ETag"].strip('"').endswith("-5")
        assert (await s3.list_multipart_uploads(Bucket=env.bucket.name)).get("Uploads") is None


async def test_stream_equals_get(env: Env) -> None:
    data = random.randbytes(3 * MiB + 12345)
    await env.bucket.put("rollouts/b1/attempt-0.safetensors", data)
    chunks = [c async for c in env.bucket.stream("rollouts/b1/attempt-0.safetensors", chunk_size=64 * 1024)]
    assert all(0 < len(c) <= 64 * 1024 for c in chunks)
    assert b"".join(chunks) == await env.bucket.get("rollouts/b1/attempt-0.safetensors") == data


@pytest.mark.parametrize("size", [0, 1000, 3 * MiB + 12345])  # from 1 MiB on, S3 fills one buffer as bytes arrive
async def test_get_buffer_is_get_in_a_bytearray(env: Env, size: int) -> None:
    key = "adapters/v00000004/adapter_model.safetensors"
    data = random.randbytes(size)
    digest = await env.bucket.put_new(key, data)
    got = await env.bucket.get_buffer(key, sha256=digest)
    assert type(got) is bytearray and got == data
    assert await env.bucket.get_buffer(key) == data
    with pytest.raises(CorruptObject):
        await env.bucket.get_buffer(key, sha256="0" * 64)
    if size:
        flipped = bytearray(data)
        flipped[-1] ^= 0x01
        await raw_overwrite(env, key, bytes(flipped))
        with pytest.raises(CorruptObject):
            await env.bucket.get_buffer(key, sha256=digest)
        assert await env.bucket.get_buffer(key) == flipped
    with pytest.raises(ObjectNotFound):
        await env.bucket.get_buffer("adapters/v00000009/manifest.pb", sha256=digest)


# -- create-only writes -----------------------------------------------------------------


async def test_put_overwrites_put_new_refuses(env: Env) -> None:
    b = env.bucket
    await b.put("evals/v00000001.json", b"first")
    await b.put("evals/v00000001.json", b"second")
    assert await b.get("evals/v00000001.json") == b"second"
    with pytest.raises(ObjectExists) as info:
        await b.put_new("evals/v00000001.json", b"third")
    assert "evals/v00000001.json" in str(info.value) and b.url("evals/v00000001.json") in str(info.value)
    assert info.value.key == "evals/v00000001.json"
    assert await b.get("evals/v00000001.json") == b"second"
    assert await b.put_new("evals/v00000002.json", b"new") == sha256_hex(b"new")


async def test_put_new_refuses_large_objects_too(env: Env) -> None:
    first, second = random.randbytes(17 * MiB), random.randbytes(17 * MiB)
    digest = await env.bucket.put_new("checkpoints/step-00000001/optimizer.pt", first)
    with pytest.raises(ObjectExists):
        await env.bucket.put_new("checkpoints/step-00000001/optimizer.pt", second)
    assert await env.bucket.get("checkpoints/step-00000001/optimizer.pt", sha256=digest) == first


@pytest.mark.parametrize("size", [100, 2 * MiB, 17 * MiB])
async def test_concurrent_put_new_exactly_one_wins(env: Env, size: int) -> None:
    # Two writers with separate clients race for the same versioned key, several times.
    a, b = env.bucket, env.open()
    rounds = 2 if size > MiB else 6
    for i in range(rounds):
        key = f"adapters/v{i:08d}/adapter_model.safetensors"
        da, db = random.randbytes(size), random.randbytes(size)
        results = await asyncio.gather(a.put_new(key, da), b.put_new(key, db), return_exceptions=True)
        winners = [r for r in results if isinstance(r, str)]
        losers = [r for r in results if isinstance(r, ObjectExists)]
        assert len(winners) == 1 and len(losers) == 1, results
        stored = await a.get(key, sha256=winners[0])
        assert stored == (da if results[0] == winners[0] else db)
    assert len(await a.list("adapters/")) == rounds


# -- listing ----------------------------------------------------------------------------


async def test_list_order_prefix_and_pagination(env: Env) -> None:
    b = env.bucket
    keys = [f"rollouts/b{i:02d}/attempt-0.safetensors" for i in range(25)]
    keys += ["rollouts/b03/attempt-1.safetensors", "rollouts-old/x", "run.pb", "adapters/v00000001/manifest.pb"]
    shuffled = keys[:]
    random.shuffle(shuffled)
    await asyncio.gather(*(b.put(k, k.encode()) for k in shuffled))
    # A sibling prefix that shares the first characters of ours must stay invisible.
    sibling = env.open(env.url + "-sibling")
    await sibling.put("rollouts/b99/attempt-0.safetensors", b"not ours")

    assert await b.list() == sorted(keys)
    assert len(await b.list()) == 29  # three pages of 10 on S3
    assert await b.list("rollouts/") == sorted(k for k in keys if k.startswith("rollouts/"))
    assert await b.list("rollouts") == sorted(k for k in keys if k.startswith("rollouts"))
    assert await b.list("rollouts/b0") == sorted(k for k in keys if k.startswith("rollouts/b0"))
    assert await b.list("rollouts/b03/") == ["rollouts/b03/attempt-0.safetensors", "rollouts/b03/attempt-1.safetensors"]
    assert await b.list("nothing/") == []
    assert await b.list("run.pb") == ["run.pb"]
    assert await sibling.list() == ["rollouts/b99/attempt-0.safetensors"]


# -- missing keys -----------------------------------------------------------------------


async def test_missing_keys(env: Env) -> None:
    b = env.bucket
    with pytest.raises(ObjectNotFound) as info:
        await b.get("adapters/v00000009/manifest.pb")
    assert b.url("adapters/v00000009/manifest.pb") in str(info.value)
    with pytest.raises(ObjectNotFound):
        await b.get("adapters/v00000009/manifest.pb", sha256=sha256_hex(b""))
    with pytest.raises(ObjectNotFound):
        async for _ in b.stream("adapters/v00000009/manifest.pb"):
            pass
    assert not await b.exists("adapters/v00000009/manifest.pb")
    await b.delete("adapters/v00000009/manifest.pb")  # not an error

    await b.put("metrics/step-00000001.json", b"{}")
    assert await b.exists("metrics/step-00000001.json")
    await b.delete("metrics/step-00000001.json")
    assert not await b.exists("metrics/step-00000001.json")
    assert await b.list("metrics/") == []
    # A key that is only a "folder" of other keys is not an object.
    await b.put("metrics/step-00000002.json", b"{}")
    assert not await b.exists("metrics")
    with pytest.raises(ObjectNotFound):
        await b.get("metrics")
    await b.delete("metrics")  # not an object: nothing to delete, and its keys survive
    assert await b.list("metrics/") == ["metrics/step-00000002.json"]


async def test_deleting_the_last_keys_of_a_prefix_leaves_nothing_behind(env: Env) -> None:
    b = env.bucket
    for key in ("ck/step-1/a.bin", "ck/step-1/deep/b.bin", "ck/step-2/a.bin"):
        await b.put(key, b"x")
    for key in ("ck/step-1/deep/b.bin", "ck/step-1/a.bin"):
        await b.delete(key)
    assert await b.list("ck/") == ["ck/step-2/a.bin"]
    if env.kind == "file":  # no empty folders piling up on disk either (S3 has none to begin with)
        root = Path(b.root)
        assert not (root / "ck" / "step-1").exists() and (root / "ck" / "step-2").is_dir()
    await b.put_new("ck/step-1/a.bin", b"again")   # the prefix can be written again
    assert await b.get("ck/step-1/a.bin") == b"again"


# -- corruption -------------------------------------------------------------------------


async def test_wrong_digest_is_corrupt(env: Env) -> None:
    digest = await env.bucket.put("rollouts/b1/attempt-0.safetensors", b"tokens")
    with pytest.raises(CorruptObject) as info:
        await env.bucket.get("rollouts/b1/attempt-0.safetensors", sha256="0" * 64)
    assert "rollouts/b1/attempt-0.safetensors" in str(info.value)
    assert isinstance(info.value, BucketError)
    assert await env.bucket.get("rollouts/b1/attempt-0.safetensors", sha256=digest) == b"tokens"


@pytest.mark.parametrize("size", [1000, 5 * MiB])
async def test_bytes_changed_out_of_band_are_corrupt(env: Env, size: int) -> None:
    data = random.randbytes(size)
    digest = await env.bucket.put_new("adapters/v00000003/adapter_model.safetensors", data)
    flipped = bytearray(data)
    flipped[size // 2] ^= 0x01  # one bit, same length
    await raw_overwrite(env, "adapters/v00000003/adapter_model.safetensors", bytes(flipped))
    with pytest.raises(CorruptObject):
        await env.bucket.get("adapters/v00000003/adapter_model.safetensors", sha256=digest)
    # Without an expected digest the bytes come back as stored.
    assert await env.bucket.get("adapters/v00000003/adapter_model.safetensors") == bytes(flipped)


# -- hostile keys -----------------------------------------------------------------------

HOSTILE = ["", "/etc/passwd", "../x", "a/../../x", "a/..", "..", "a\\..\\b", "a//b", "./a", "a/./b", "a/", "x\x00y", f"a/{TEMP_MARKER}1"]


async def test_hostile_keys_rejected(env: Env) -> None:
    b = env.bucket
    for key in HOSTILE:
        with pytest.raises(ValueError):
            await b.put(key, b"x")
        with pytest.raises(ValueError):
            await b.put_new(key, b"x")
        with pytest.raises(ValueError):
            await b.get(key)
        with pytest.raises(ValueError):
            async for _ in b.stream(key):
                pass
        with pytest.raises(ValueError):
            await b.exists(key)
        with pytest.raises(ValueError):
            await b.delete(key)
        with pytest.raises(ValueError):
            b.url(key)
    for prefix in ["../", "/abs", "a/../", "a\\b"]:
        with pytest.raises(ValueError):
            await b.list(prefix)
    assert await b.list() == []


# -- local backend specifics ----------------------------------------------------------


async def test_local_ignores_temp_files_and_escapes_nothing(file_bucket_url: str, tmp_path: Path) -> None:
    async with open_bucket(file_bucket_url) as b:
        assert isinstance(b, LocalBucket)
        await b.put("a/b.bin", b"1")
        # A crashed writer leaves a temp file behind: never listed, never a key.
        (b.root / "a" / f"{TEMP_MARKER}dead-b.bin").write_bytes(b"partial")
        assert await b.list() == ["a/b.bin"]
        with pytest.raises(ValueError):
            await b.put("../escaped", b"x")
    assert not (tmp_path / "escaped").exists()


async def test_local_many_concurrent_writers(file_bucket_url: str) -> None:
    # link(2) arbitrates: with 8 writers in 8 threads, exactly one name is created.
    buckets = [open_bucket(file_bucket_url) for _ in range(8)]
    payloads = [bytes([i]) * 100_000 for i in range(8)]
    results = await asyncio.gather(
        *(b.put_new("adapters/v00000001/x", p) for b, p in zip(buckets, payloads, strict=True)),
        return_exceptions=True,
    )
    winners = [i for i, r in enumerate(results) if isinstance(r, str)]
    assert len(winners) == 1
    assert all(isinstance(r, ObjectExists) for i, r in enumerate(results) if i != winners[0])
    assert await buckets[0].get("adapters/v00000001/x") == payloads[winners[0]]
    assert await buckets[0].list() == ["adapters/v00000001/x"]


# -- S3 backend specifics ---------------------------------------------------------------


async def test_s3_bucket_created_lazily(s3_bucket_url: str) -> None:
    async with open_bucket(s3_bucket_url) as b:
        assert await b.list() == []  # no bucket yet: nothing listed, no error
        assert not await b.exists("x")
        with pytest.raises(ObjectNotFound):
            await b.get("x")
        assert await b.put_new("x", b"1") == sha256_hex(b"1")  # creates the bucket
        assert await b.get("x") == b"1"
        await b.ensure()  # idempotent on an existing bucket
    async with open_bucket(s3_bucket_url.replace("brigade-test-", "brigade-test2-")) as b:
        await b.put("big", random.randbytes(20 * MiB))  # lazily created by the multipart path
        assert await b.exists("big")


async def test_s3_errors_are_bucket_errors(s3_endpoint: str) -> None:
    # A bucket name the store refuses (moto: under 3 characters): the failure surfaces as a
    # BucketError naming the URI, not as a botocore exception.
    async with open_bucket("s3://ab/p") as b:
        with pytest.raises(BucketError) as info:
            await b.put("k", b"x")
        assert "s3://ab/p" in str(info.value) and "InvalidBucketName" in str(info.value)
        assert not isinstance(info.value, ObjectNotFound)


# -- opening ----------------------------------------------------------------------------


async def test_open_bucket_urls(tmp_path: Path) -> None:
    s3 = open_bucket("s3://name/some/prefix/")
    assert isinstance(s3, S3Bucket)
    assert (s3.name, s3.prefix) == ("name", "some/prefix")
    assert s3.url("k/v") == "s3://name/some/prefix/k/v"
    assert open_bucket("s3://name").url("k") == "s3://name/k"

    local = open_bucket(f"file://{tmp_path}/b", page_size=10)  # S3 options are ignored
    assert isinstance(local, LocalBucket) and local.root == tmp_path / "b"
    assert local.url("k") == f"file://{tmp_path}/b/k"
    plain = open_bucket(tmp_path / "c")
    assert isinstance(plain, LocalBucket) and plain.root == tmp_path / "c"

    for bad in ["gs://x/y", "file://host/path", "s3:///nobucket", "s3://name/../up"]:
        with pytest.raises(ValueError):
            open_bucket(bad)


async def test_context_manager_closes(s3_bucket_url: str) -> None:
    async with open_bucket(s3_bucket_url) as b:
        await b.put("k", b"v")
        assert isinstance(b, S3Bucket) and b._client is not None
    assert b._client is None


async def test_the_default_file_url_is_relative_to_the_working_directory(tmp_path, monkeypatch) -> None:
    """`file://./brigade-runs/bucket`, every service's default --bucket, is a folder under the working
    directory (it was refused as a URL with a host, so `brigade proxy` without --bucket stopped)."""
    monkeypatch.chdir(tmp_path)
    async with open_bucket("file://./brigade-runs/bucket") as b:
        await b.put_new("k", b"v")
    assert (tmp_path / "brigade-runs" / "bucket" / "k").read_bytes() == b"v"
    with pytest.raises(ValueError, match="local absolute path"):
        open_bucket("file://elsewhere/x")
