"""The rollout worker's failure policy: which errors it retries (each try bounded, with backoff and
full jitter, for as long as the process lives), which end the process (FatalError: a bad token or
request, which retrying cannot fix), and which end one batch (LeaseGone, KeyTaken, BatchError).
The worker module's doc says what it does with each."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
import structlog

from brigade.adapters import InvalidAdapter
from brigade.bucket import CorruptObject, ObjectExists, ObjectNotFound
from brigade.retry import Backoff, retry
from brigade.rpc import describe_rpc_error

T = TypeVar("T")
log = structlog.get_logger()

RPC_TIMEOUT_S = 15.0       # one try of a unary call
BUCKET_TIMEOUT_S = 120.0   # one try of a bucket operation
BACKOFF = Backoff(base_s=0.2, cap_s=15.0)  # full jitter, so restarting workers spread out
FATAL_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
               grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.UNIMPLEMENTED}
RETRY_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
               grpc.StatusCode.ABORTED, grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}


class FatalError(Exception):
    """A configuration problem retrying cannot fix (bad token, bad request): the worker exits."""


class LeaseGone(Exception):
    """The proxy took the lease back (expired or revoked) before the rollout was completed."""


class KeyTaken(Exception):
    """The attempt's rollout key holds bytes that are not this lease's rollout."""


class BatchError(Exception):
    """This batch cannot be done here; FailLease(ERROR) and move on."""


def rpc_retryable(e: BaseException) -> bool:
    if isinstance(e, grpc.aio.AioRpcError):
        if e.code() in FATAL_CODES:
            raise FatalError(describe_rpc_error(e)) from e
        return e.code() in RETRY_CODES or e.code() == grpc.StatusCode.NOT_FOUND
    return isinstance(e, (TimeoutError, ConnectionError))


def bucket_retryable(e: BaseException) -> bool:
    # missing, corrupt and create-only conflicts are answers, not outages
    return not isinstance(e, (ObjectExists, CorruptObject, ObjectNotFound, InvalidAdapter, ValueError, TypeError))


async def with_retries(what: str, fn: Callable[[], Awaitable[T]], retryable: Callable[[BaseException], bool],
                       timeout_s: float) -> T:
    """The worker's policy: each try bounded by `timeout_s`, for as long as the process lives."""
    def log_retry(attempt: int, delay: float, e: BaseException) -> None:
        msg = describe_rpc_error(e) if isinstance(e, grpc.aio.AioRpcError) else f"{type(e).__name__}: {e}"
        log.warning(f"{what} failed; retrying", attempt=attempt, retry_in_s=round(delay, 2), error=msg)

    return await retry(fn, retryable=retryable, backoff=BACKOFF, timeout_s=timeout_s, on_retry=log_retry)
