"""The bucket interface shared by both backends, its errors, and key validation.

Every byte the services exchange (adapters, rollouts, checkpoints) goes through a `Bucket`.
Keys are "/"-separated and relative to the bucket URL's prefix; they often come from
manifests written by other processes, so they are validated before they touch a path or a
request: a hostile key must not escape the prefix.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import TracebackType

# Reads are handed out (and hashed) in pieces of this size: big enough that per-chunk
# overhead (a thread hop for hashing, an await) is negligible, small enough to bound memory
# for streaming consumers.
CHUNK_SIZE = 1 << 20

# Below this, hashing inline costs less than the hop to a worker thread.
_INLINE_HASH_BYTES = 256 << 10


class BucketError(Exception):
    """Base of every bucket failure; names the key and its full URI."""

    def __init__(self, message: str, *, key: str | None = None, uri: str | None = None) -> None:
        self.key = key
        self.uri = uri
        where = f" (key {key!r}, {uri})" if key is not None else (f" ({uri})" if uri else "")
        super().__init__(f"{message}{where}")


class ObjectExists(BucketError):
    """A create-only put found the key already written."""


class ObjectNotFound(BucketError):
    """The key (or the bucket itself) does not exist."""


class CorruptObject(BucketError):
    """The bytes read do not match the expected sha256."""


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


async def sha256_hex_async(data: bytes | bytearray | memoryview) -> str:
    """sha256 of a large buffer off the event loop (hashlib releases the GIL on big inputs,
    so this overlaps with network IO instead of stalling it)."""
    if len(data) < _INLINE_HASH_BYTES:
        return sha256_hex(data)
    return await start_sha256(data)


def start_sha256(data: bytes | bytearray | memoryview) -> asyncio.Future[str]:
    """Submit the hash to a worker thread *now* (not at the next loop turn, as a coroutine
    would), so it runs alongside whatever the caller does next (e.g. botocore serialising and
    sending the same bytes)."""
    return asyncio.get_running_loop().run_in_executor(None, sha256_hex, data)


# The threads of StreamingSha256 and FillingSha256, their own: a drain holds one for the whole read,
# and must not keep asyncio.to_thread callers (or aiohttp's DNS lookups) waiting behind a batch of
# concurrent downloads
HASH_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="brigade-sha256")


class StreamingSha256:
    """sha256 of bytes that arrive in chunks. With `threaded`, a worker thread hashes them while the
    next chunks are still on the wire: `update` only queues the chunk (a microsecond on the event
    loop) and hashlib releases the GIL while it hashes, so the digest costs the loop nothing and is
    ready about one chunk after the last byte (hashing on the loop put 34 MiB of sha256, ~24 ms at
    1.4 GB/s, in series with reading the body). Without it, each chunk is hashed on the spot: for a
    small body a thread hop would cost more than the hash. `hexdigest()` must be awaited once;
    `close()` (idempotent) stops the thread when the read fails."""

    _END = None

    def __init__(self, threaded: bool = True) -> None:
        self._hasher = hashlib.sha256()
        self._queue: queue.SimpleQueue[bytes | None] | None = None
        self._done: asyncio.Future[str] | None = None
        if threaded:
            self._queue = queue.SimpleQueue()
            self._done = asyncio.get_running_loop().run_in_executor(HASH_POOL, self._drain)
        self._closed = False

    def _drain(self) -> str:
        while (chunk := self._queue.get()) is not self._END:
            self._hasher.update(chunk)
        return self._hasher.hexdigest()

    def update(self, chunk: bytes) -> None:
        if self._queue is None:
            self._hasher.update(chunk)
        else:
            self._queue.put(chunk)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._queue is not None:
                self._queue.put(self._END)

    async def hexdigest(self) -> str:
        self.close()
        return self._hasher.hexdigest() if self._done is None else await self._done


class FillingSha256:
    """sha256 of a buffer while it is filled from the front (S3Bucket.get_buffer): `update(chunk)`
    says the chunk was just written after the bytes before it, and a worker thread hashes all that
    was written since its last pass in one hashlib call. StreamingSha256 makes one call a chunk (a
    256 KiB chunk from aiohttp), and every call is a round trip between the thread and a busy event
    loop: on a 34 MiB GET from moto it cost 12-15 ms more CPU and 6-13 % more time than one call a
    pass (bench/results/2026-12-diary.md, Verified GET). The filled part of the buffer is never written again, so the thread
    reads it while the loop writes further on. Same interface and pool as StreamingSha256; its view of the
    buffer is released before the digest is handed out, so the caller may resize the buffer."""

    def __init__(self, buffer: bytearray) -> None:
        self._view = memoryview(buffer)
        self._hasher = hashlib.sha256()
        self._filled = 0
        self._closed = False
        self._waiting = False
        self._changed = threading.Condition()
        self._done = asyncio.get_running_loop().run_in_executor(HASH_POOL, self._drain)

    def _drain(self) -> str:
        hashed = 0
        try:
            while True:
                with self._changed:
                    while self._filled == hashed and not self._closed:
                        self._waiting = True
                        self._changed.wait()
                        self._waiting = False
                    filled, closed = self._filled, self._closed
                if filled > hashed:
                    with self._view[hashed:filled] as span:
                        self._hasher.update(span)
                    hashed = filled
                elif closed:
                    return self._hasher.hexdigest()
        finally:
            self._view.release()

    def _set(self, filled: int | None = None, closed: bool = False) -> None:
        with self._changed:
            if filled is not None:
                self._filled = filled
            self._closed = self._closed or closed
            if self._waiting:  # the loop pays for a wakeup only when the thread sleeps
                self._changed.notify()

    def update(self, chunk: bytes) -> None:
        self._set(filled=self._filled + len(chunk))

    def close(self) -> None:
        self._set(closed=True)

    async def hexdigest(self) -> str:
        self.close()
        return await self._done


# Names the local backend uses for in-progress writes; keys may not collide with them.
TEMP_MARKER = ".brigade-tmp-"


def check_key(key: str) -> str:
    """Return `key` if it is a safe relative key, else raise ValueError.

    Rejected: empty, absolute ("/x"), backslashes (a Windows path separator on some stores and
    tools), empty / "." / ".." segments (path traversal or aliasing of the same object under two
    keys), NUL, and names reserved for the local backend's temporary files.
    """
    if not isinstance(key, str) or not key:
        raise ValueError(f"bucket key must be a non-empty string, got {key!r}")
    _check_parts(key, allow_trailing_slash=False)
    return key


def check_prefix(prefix: str) -> str:
    """Like check_key, but "" (everything) and a trailing "/" (a folder) are allowed."""
    if not isinstance(prefix, str):
        raise ValueError(f"bucket prefix must be a string, got {prefix!r}")
    if prefix:
        _check_parts(prefix, allow_trailing_slash=True)
    return prefix


def _check_parts(key: str, *, allow_trailing_slash: bool) -> None:
    if key.startswith("/"):
        raise ValueError(f"bucket key must be relative, got {key!r}")
    if "\\" in key or "\x00" in key:
        raise ValueError(f"bucket key must not contain backslashes or NUL, got {key!r}")
    parts = key.split("/")
    if allow_trailing_slash and parts[-1] == "":
        parts = parts[:-1]
    for part in parts:
        if part in ("", ".", ".."):
            raise ValueError(f"bucket key has an empty, '.' or '..' segment: {key!r}")
        if part.startswith(TEMP_MARKER):
            raise ValueError(f"bucket key uses the reserved name {TEMP_MARKER!r}: {key!r}")


class Bucket(abc.ABC):
    """An object store rooted at a URL prefix. Async, safe to share between tasks."""

    @abc.abstractmethod
    def url(self, key: str) -> str:
        """The full URI of `key`, e.g. "s3://name/prefix/key" or "file:///root/key"."""

    def describe(self) -> str:
        """Which store this is, for messages: its URL root (and, for S3, the endpoint)."""
        return repr(self)

    @abc.abstractmethod
    async def ensure(self) -> None:
        """Create the bucket / folder if it is missing (idempotent)."""

    @abc.abstractmethod
    async def put(self, key: str, data: bytes) -> str:
        """Write `data` at `key`, replacing what is there. Returns its sha256 hex."""

    @abc.abstractmethod
    async def put_new(self, key: str, data: bytes) -> str:
        """Write `data` at `key` only if nothing is there (ObjectExists otherwise)."""

    @abc.abstractmethod
    async def get(self, key: str, sha256: str | None = None) -> bytes:
        """Read `key`; with `sha256`, raise CorruptObject unless the bytes match it."""

    @abc.abstractmethod
    async def get_buffer(self, key: str, sha256: str | None = None) -> bytearray:
        """`get` into a bytearray, for readers that take any buffer (torch.frombuffer: the adapter
        files): a big object's bytes are copied into it as they arrive, and each received chunk is
        freed at once. `get` must keep every chunk until the last and then join them into a bytes
        object, which is one more pass over the whole object, on the path to using it, and twice its
        size in memory at the peak."""

    @abc.abstractmethod
    def stream(self, key: str, chunk_size: int = CHUNK_SIZE) -> AsyncIterator[bytes]:
        """Read `key` in chunks of at most `chunk_size` bytes (ObjectNotFound if missing)."""

    @abc.abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    async def list(self, prefix: str = "") -> list[str]:
        """All keys starting with `prefix` (relative to the bucket's prefix), sorted."""

    @abc.abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; a missing key is not an error."""

    async def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections; the bucket may not be used afterwards."""

    async def __aenter__(self) -> Bucket:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    def _check_digest(self, key: str, expected: str | None, actual: str) -> None:
        if expected is not None and expected.lower() != actual:
            raise CorruptObject(
                f"sha256 mismatch: expected {expected}, read {actual}", key=key, uri=self.url(key)
            )
