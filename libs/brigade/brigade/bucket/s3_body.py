"""How an S3 GET's body is taken in (S3Bucket.get and get_buffer): where its chunks go, how they are
hashed on the way, and what counts as a body cut short."""

from __future__ import annotations

from brigade.bucket.base import FillingSha256, StreamingSha256

STREAM_HASH_BYTES = 1 << 20  # bodies at least this big are hashed by a thread as they arrive
# get_buffer allocates the promised length up front up to this; a bigger claim is taken on trust
# only as far as the bytes that actually arrive
PREALLOCATE_MAX = 1 << 30


class TornRead(Exception):
    """A GET whose body arrived incomplete; `get` reads again, then raises BucketError."""


class Body:
    """Where a GET's chunks go. For `get`, a list joined into bytes after the last one. For
    `get_buffer` with a known length, one bytearray each chunk is copied into on arrival, so the
    chunk is freed at once: aiohttp's next receive buffers reuse its memory, still in cache, where
    the list grows the heap by the whole object (one page fault per 4 KiB) before a join copies it
    all again. Measured with 4 concurrent 32 MiB reads against moto: 8,200 page faults a read into
    the bytearray against 11,000 through the list, and 20-57 ms less CPU and 29-62 ms less time a
    round (bench/results/2026-12-diary.md, Adapter sync).

    With `verify`, the chunks are hashed as they arrive: a big body by a thread (from the buffer it
    fills, when there is one: FillingSha256), a small one on the loop. `close()` stops that thread
    (always call it, a failed read included); `hexdigest()` is the digest once the body is in."""

    def __init__(self, length: int | None, into_buffer: bool, verify: bool = False) -> None:
        self.size = 0
        self._into_buffer = into_buffer
        self._chunks: list[bytes] = []
        self._buffer: bytearray | None = None
        if into_buffer and length is not None and length <= PREALLOCATE_MAX:
            self._buffer = bytearray(length)
            self._view = memoryview(self._buffer)
        self._hasher: StreamingSha256 | FillingSha256 | None = None
        if verify:
            big = (length or 0) >= STREAM_HASH_BYTES
            self._hasher = (FillingSha256(self._buffer) if big and self._buffer is not None
                            else StreamingSha256(threaded=big))

    def add(self, chunk: bytes) -> None:
        end = self.size + len(chunk)
        if self._buffer is None:
            self._chunks.append(chunk)
        elif end > len(self._buffer):
            raise TornRead(f"GetObject: more than the {len(self._buffer)} bytes promised")
        else:
            self._view[self.size:end] = chunk
        self.size = end
        if self._hasher is not None:  # after the copy: a FillingSha256 hashes what the buffer holds
            self._hasher.update(chunk)

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.close()

    def result(self) -> bytes | bytearray:
        if self._buffer is not None:
            self._view.release()  # a bytearray with a view exported cannot be resized by its owner
            return self._buffer
        if self._into_buffer:
            return bytearray().join(self._chunks)
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    async def hexdigest(self) -> str:
        if self._hasher is None:
            raise RuntimeError("a Body made without verify has no digest")
        return await self._hasher.hexdigest()
