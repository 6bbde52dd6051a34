"""FillingSha256: the digest of a buffer hashed by a worker thread while the event loop fills it
from the front, equal to hashlib's; a read that fails frees its thread; the caller owns the buffer
once the digest is out."""

from __future__ import annotations

import asyncio
import hashlib
import random

from brigade.bucket.base import HASH_POOL, FillingSha256

POOL_THREADS = HASH_POOL._max_workers  # noqa: SLF001 - the point is to exceed it


def chunks_of(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i < len(data):
        n = random.choice((0, 1, 7, 4096, 65_536, 262_144))
        out.append(data[i:i + n])
        i += n
    return out


async def fill(buffer: bytearray, hasher: FillingSha256, chunks: list[bytes]) -> None:
    """What S3Bucket._get_once does: write each chunk after the last, then tell the hasher."""
    size = 0
    for i, chunk in enumerate(chunks):
        buffer[size:size + len(chunk)] = chunk
        size += len(chunk)
        hasher.update(chunk)
        if i % 3 == 0:
            await asyncio.sleep(0)  # let the thread catch up part way, as a network read would


async def test_concurrent_fills_beyond_the_pool_get_their_own_digests():
    bodies = [random.randbytes(random.randint(0, 3_000_000)) for _ in range(POOL_THREADS * 2)]
    buffers = [bytearray(len(b)) for b in bodies]
    hashers = [FillingSha256(buf) for buf in buffers]
    await asyncio.gather(*(fill(buf, h, chunks_of(b)) for buf, h, b in zip(buffers, hashers, bodies, strict=True)))
    digests = await asyncio.wait_for(asyncio.gather(*(h.hexdigest() for h in hashers)), 60)
    assert digests == [hashlib.sha256(b).hexdigest() for b in bodies]
    for buf in buffers:
        buf.extend(b"x")  # no view of it is left exported: a BufferError here would say otherwise


async def test_a_failed_read_frees_its_thread_and_its_buffer():
    buffers = [bytearray(1 << 20) for _ in range(POOL_THREADS * 2)]
    for buf in buffers:
        hasher = FillingSha256(buf)
        buf[:5] = b"half "
        hasher.update(b"half ")
        hasher.close()  # what a torn read does; twice is fine
        hasher.close()
        await asyncio.wait_for(hasher.hexdigest(), 10)
        buf.clear()  # the thread let go of its view
    late = bytearray(3)
    hasher = FillingSha256(late)
    late[:] = b"abc"
    hasher.update(b"abc")
    assert await asyncio.wait_for(hasher.hexdigest(), 10) == hashlib.sha256(b"abc").hexdigest()


async def test_the_digest_covers_only_what_was_filled():
    buf = bytearray(b"abcdef")  # the tail was never reported as written: it is not hashed
    hasher = FillingSha256(buf)
    hasher.update(b"abc")
    assert await hasher.hexdigest() == hashlib.sha256(b"abc").hexdigest()
