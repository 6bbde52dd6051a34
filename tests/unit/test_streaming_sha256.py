"""StreamingSha256: the digest of chunks hashed by a worker thread as they are fed, equal to hashlib's,
with more reads in flight than the hashing pool has threads (no read may wait on another's hash)."""

from __future__ import annotations

import asyncio
import hashlib
import random

from brigade.bucket.base import HASH_POOL, StreamingSha256


async def test_interleaved_reads_beyond_the_pool_get_their_own_digests():
    n = HASH_POOL._max_workers * 3  # noqa: SLF001 - the point is to exceed it
    bodies = [[random.randbytes(random.randint(0, 300_000)) for _ in range(20)] for _ in range(n)]
    hashers = [StreamingSha256() for _ in range(n)]
    for step in range(20):  # every read gets a chunk in turn, as concurrent downloads would
        for hasher, chunks in zip(hashers, bodies, strict=True):
            hasher.update(chunks[step])
        await asyncio.sleep(0)
    digests = await asyncio.wait_for(asyncio.gather(*(h.hexdigest() for h in hashers)), 30)
    assert digests == [hashlib.sha256(b"".join(chunks)).hexdigest() for chunks in bodies]


async def test_a_failed_read_frees_its_thread():
    hashers = [StreamingSha256() for _ in range(HASH_POOL._max_workers * 2)]  # noqa: SLF001
    for hasher in hashers:
        hasher.update(b"half a body")
        hasher.close()  # what a torn read does; twice is fine
        hasher.close()
    # every drain ended, so a new read still gets a thread and its digest
    late = StreamingSha256()
    late.update(b"abc")
    assert await asyncio.wait_for(late.hexdigest(), 10) == hashlib.sha256(b"abc").hexdigest()


async def test_a_small_body_is_hashed_on_the_spot_to_the_same_digest():
    inline = StreamingSha256(threaded=False)
    for chunk in (b"ab", b"", b"c" * 5000):
        inline.update(chunk)
    inline.close()
    assert await inline.hexdigest() == hashlib.sha256(b"ab" + b"c" * 5000).hexdigest()
