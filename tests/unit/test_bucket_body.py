"""How an S3 GET assembles a body (brigade.bucket.s3_body.Body): a bytes join for `get`, one buffer
filled on arrival for `get_buffer`, and a server that sends more or other than it promised."""

from __future__ import annotations

import hashlib
import random

import pytest

from brigade.bucket import s3_body


def fill(body: s3_body.Body, chunks: list[bytes]) -> bytes | bytearray:
    for c in chunks:
        body.add(c)
    return body.result()


CHUNKS = [b"ab", b"", b"cde", b"f"]


def test_get_joins_bytes_and_get_buffer_fills_one_bytearray() -> None:
    assert fill(s3_body.Body(6, into_buffer=False), CHUNKS) == b"abcdef"
    assert type(fill(s3_body.Body(6, into_buffer=False), CHUNKS)) is bytes
    for length in (6, None):  # a known length is filled in place; an unknown one is joined
        got = fill(s3_body.Body(length, into_buffer=True), CHUNKS)
        assert type(got) is bytearray and got == b"abcdef"
    got.extend(b"g")  # the caller owns it: no view of it is left exported


def test_more_bytes_than_promised_is_a_torn_read() -> None:
    body = s3_body.Body(4, into_buffer=True)
    body.add(b"abc")
    with pytest.raises(s3_body.TornRead, match="more than the 4 bytes promised"):
        body.add(b"de")
    # fewer bytes than promised: `size` says so, and _get_once reads again
    assert s3_body.Body(4, into_buffer=True).size == 0


def test_an_absurd_promised_length_is_not_allocated() -> None:
    body = s3_body.Body(1 << 40, into_buffer=True)  # a terabyte claimed: only what arrives is kept
    assert fill(body, CHUNKS) == b"abcdef" and body.size == 6


@pytest.mark.parametrize("into_buffer", [False, True])
@pytest.mark.parametrize("size", [6, 3 << 20])  # on the loop; by a thread (from the buffer, for get_buffer)
async def test_a_verified_body_hashes_what_it_took_in(into_buffer: bool, size: int) -> None:
    data = random.randbytes(size)
    body = s3_body.Body(size, into_buffer=into_buffer, verify=True)
    for i in range(0, size, 256 << 10):
        body.add(data[i:i + (256 << 10)])
    body.close()
    assert body.result() == data
    assert await body.hexdigest() == hashlib.sha256(data).hexdigest()
