"""What an S3-compatible store's answers mean, and two things the S3 backend (s3.py) needs around
botocore and moto: the payload digest SigV4 already computed for a PutObject, and per-key locks that
make create-only writes exact within one process where the store does not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any

from botocore.exceptions import ClientError

NOT_FOUND_CODES = {"NoSuchKey", "NotFound", "404", "NoSuchBucket"}
NO_BUCKET_CODES = {"NoSuchBucket"}
# 412: the key exists. 409 ConditionalRequestConflict: another conditional write of the same key
# is in flight right now; AWS says to retry, and the retry then tells us who won.
_PRECONDITION_CODES = {"PreconditionFailed", "412"}
_CONFLICT_CODES = {"ConditionalRequestConflict", "409"}
CONFLICT_RETRIES = 4


def error_code(e: ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def http_status(e: ClientError) -> int | None:
    return e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def was_retried(e: ClientError) -> bool:
    return bool(e.response.get("ResponseMetadata", {}).get("RetryAttempts", 0))


def is_not_found(e: ClientError) -> bool:
    return error_code(e) in NOT_FOUND_CODES or http_status(e) == 404


def is_precondition(e: ClientError) -> bool:
    return error_code(e) in _PRECONDITION_CODES or http_status(e) == 412


def is_conflict(e: ClientError) -> bool:
    return error_code(e) in _CONFLICT_CODES


# Where capture_payload_sha256 drops the digest for the PutObject in flight in this task.
signed_payload: ContextVar[list[str] | None] = ContextVar("brigade_signed_payload", default=None)


def capture_payload_sha256(request: Any, **_: Any) -> None:
    """botocore hook, just before a PutObject goes on the wire (after signing).

    With our checksum settings botocore signs the payload of every PutObject (no Content-MD5
    or CRC header, so even over TLS it falls back to a signed body): X-Amz-Content-SHA256 then
    holds the sha256 hex of the exact bytes sent, which is the digest `put` must return.
    Returns None, as a before-send handler must (anything else replaces the HTTP response).
    """
    slot = signed_payload.get()
    if slot is None:
        return
    value = request.headers.get("X-Amz-Content-SHA256")
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace")
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        slot.append(value)  # not "UNSIGNED-PAYLOAD" / "STREAMING-..." placeholders


class KeyLocks:
    """Process-wide asyncio locks per (endpoint, bucket, key), dropped when unused.

    Why it exists: S3 makes `If-None-Match: *` atomic, but moto (5.2.5, used in tests and the
    bench) checks it and then writes without a lock in a threaded server, so two concurrent
    create-only writes of one key can both succeed (reliably so for multipart uploads). Within
    one process we can make it exact, and it also saves the loser a wasted upload.
    """

    def __init__(self) -> None:
        self._locks: dict[tuple[Any, ...], tuple[asyncio.Lock, int]] = {}

    @asynccontextmanager
    async def hold(self, name: tuple[Any, ...]) -> AsyncIterator[None]:
        # Locks belong to one event loop; key by loop so separate loops never share one.
        full = (id(asyncio.get_running_loop()), *name)
        lock, users = self._locks.get(full, (None, 0))
        if lock is None:
            lock = asyncio.Lock()
        self._locks[full] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[full]
            if users <= 1:
                del self._locks[full]
            else:
                self._locks[full] = (lock, users - 1)


put_new_locks = KeyLocks()
