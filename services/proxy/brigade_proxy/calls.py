"""How the proxy serves every call: requests parsed off the wire with their size and field bounds
(a request that does not parse or is too big is refused, never raised into grpc), the methods that
take a slot before their body is read (CreateRun; WatchRun and PullRollouts hold theirs in the
handler), and the decorators that turn any exception of a handler into a deliberate status:
StoreError its own code, Redis down UNAVAILABLE, Redis full a transient RESOURCE_EXHAUSTED, anything
else INTERNAL (logged with its traceback) while the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from typing import Any

import grpc
import redis.exceptions
import structlog

from brigade.bucket import BucketError
from brigade.rpc import TRANSIENT_KEY
from brigade.store import StoreError
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import check_wire
from brigade_proxy import credentials
from brigade_proxy.bulk import BULK, bulk_deserializer
from brigade_proxy.limits import Limits

log = structlog.get_logger("brigade.proxy")

# ---------------------------------------------------------------- error mapping

REDIS_FULL = ("Redis is full: its used memory is over maxmemory, so it refuses writes (nothing was written); "
              "retry later, and give Redis more memory or let the learner and janitor drain it")


def _status(e: Exception) -> tuple[grpc.StatusCode, str, bool]:
    """(code, message, transient) for an exception of a handler."""
    if isinstance(e, StoreError):
        return grpc.StatusCode[e.code], str(e), False
    if isinstance(e, redis.exceptions.OutOfMemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, REDIS_FULL, True
    if isinstance(e, redis.exceptions.BusyLoadingError):  # a ConnectionError too: checked first, for its message
        return grpc.StatusCode.UNAVAILABLE, "Redis is loading its data after a restart; retry shortly", False
    if isinstance(e, redis.exceptions.ConnectionError | redis.exceptions.TimeoutError):
        return grpc.StatusCode.UNAVAILABLE, f"the proxy cannot reach Redis: {e}", False
    if isinstance(e, BucketError):
        return grpc.StatusCode.UNAVAILABLE, f"bucket error: {e}", False
    return grpc.StatusCode.INTERNAL, f"internal error in the proxy ({type(e).__name__}); see the proxy log", False


def _log_failure(method: str, e: Exception, code: grpc.StatusCode) -> None:
    if code == grpc.StatusCode.INTERNAL:
        log.error("rpc failed", method=method, error=repr(e), exc_info=e)
    elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        log.warning("rpc unavailable", method=method, code=code.name, error=str(e))


async def _abort(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str, transient: bool) -> None:
    await context.abort(code, message, trailing_metadata=((TRANSIENT_KEY, "1"),) if transient else ())


class Refused:
    """Stands in for a request refused before it is parsed: bytes that do not parse (INVALID_ARGUMENT;
    grpc itself would answer UNKNOWN) or more bytes than its method takes (RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        self.code = code
        self.message = message


def _safe_deserializer(cls: type, limit: int) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        if len(data) > limit:
            return Refused(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{cls.DESCRIPTOR.name} is {len(data)} bytes; the proxy takes at most {limit}")
        try:
            return check_wire(cls.FromString(data))  # every field within its declared bound
        except Exception as e:  # noqa: BLE001 - DecodeError and friends
            return Refused(grpc.StatusCode.INVALID_ARGUMENT, f"malformed {cls.DESCRIPTOR.name}: {e}")

    return deserialize


class Slots:
    """Calls of one kind in flight: at most `total`, and at most `per_client` from one client (its
    address, or with per="credential" its credential name)."""

    def __init__(self, what: str, total: int, per_client: int | None = None, per: str = "client"):
        self.what, self.total, self.per_client, self.per = what, total, per_client or total, per
        self.used = 0
        self.by_client: dict[str, int] = {}

    @contextlib.contextmanager
    def hold(self, client: str = ""):
        """One slot for the `with` block; a transient RESOURCE_EXHAUSTED (SlotsFull) when none is free."""
        mine = self.by_client.get(client, 0)
        if self.used >= self.total:
            raise SlotsFull(f"the proxy has {self.used} {self.what} in flight, its limit; retry later")
        if mine >= self.per_client:
            raise SlotsFull(f"this {self.per} ({client}) has {mine} {self.what} in flight, the limit per "
                            f"{self.per}; close some or retry later")
        self.used += 1
        self.by_client[client] = mine + 1
        try:
            yield
        finally:
            self.used -= 1
            left = self.by_client[client] - 1
            if left:
                self.by_client[client] = left
            else:
                del self.by_client[client]


class SlotsFull(Exception):
    pass


def client_address(context: grpc.aio.ServicerContext) -> str:
    """The peer's address without its port ("ipv4:10.0.0.7:51234" -> "ipv4:10.0.0.7")."""
    peer = context.peer() or ""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


def _gated(method_handler: grpc.RpcMethodHandler, slots: Slots) -> grpc.RpcMethodHandler:
    """A unary method served as request-streaming, so it takes a slot BEFORE its request is read: a
    call beyond the limit never has its body (up to max_message_bytes) buffered. Its bytes are parsed
    off the event loop (a million prompts take a second of C code that holds the GIL)."""
    behavior, deserialize = method_handler.unary_unary, method_handler.request_deserializer

    async def gated(request_iterator, context: grpc.aio.ServicerContext):
        try:
            with slots.hold(credentials.name_of(context)):  # "" without a tokens file: one credential
                data = await context.read()  # not the iterator: a suspended generator would hold the message
                if data is grpc.aio.EOF:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no request message")
                return await behavior(await asyncio.to_thread(deserialize, data), context)
        except SlotsFull as e:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), True)

    return grpc.stream_unary_rpc_method_handler(gated, response_serializer=method_handler.response_serializer)


def add_servicer(server: grpc.aio.Server, service: str, servicer: Any, limits: Limits,
                 gates: dict[str, Slots] | None = None) -> None:
    """What the generated add_*Servicer_to_server does, with request parsing that cannot escape,
    size limits per method, and the methods named in `gates` taking a slot before their request is read."""
    descriptor = pb.DESCRIPTOR.services_by_name[service]
    handlers = {}
    for method in descriptor.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        limit = limits.max_message_bytes if method.name in (gates or {}) else limits.max_request_bytes
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        deserializer = _safe_deserializer(request_cls, limit)
        if method.name in BULK:  # a million prompts: counted before parsing, parsed in pieces (bulk.py)
            field, bound = BULK[method.name]
            deserializer = bulk_deserializer(request_cls, limit, field, getattr(limits, bound), deserializer,
                                             Refused)
        handler = make(getattr(servicer, method.name), request_deserializer=deserializer,
                       response_serializer=response_cls.SerializeToString)
        if method.name in (gates or {}):
            handler = _gated(handler, gates[method.name])
        handlers[method.name] = handler
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))
    server.add_registered_method_handlers(descriptor.full_name, handlers)


def rpc(fn: Callable) -> Callable:
    """Unary handler: StoreError -> its status, Redis down -> UNAVAILABLE, Redis full -> RESOURCE_EXHAUSTED,
    anything else -> INTERNAL."""

    @functools.wraps(fn)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, Refused):
            await context.abort(request.code, request.message)
        try:
            return await fn(self, request, context)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except SlotsFull as e:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), True)
        except Exception as e:  # noqa: BLE001 - the point: no exception escapes to grpc
            code, message, transient = _status(e)
            _log_failure(fn.__name__, e, code)
            await _abort(context, code, message, transient)

    return handler


def rpc_stream(fn: Callable) -> Callable:
    """Server-streaming variant of `rpc`."""

    @functools.wraps(fn)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        if isinstance(request, Refused):
            await context.abort(request.code, request.message)
        try:
            async for item in fn(self, request, context):
                yield item
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except SlotsFull as e:
            await _abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), True)
        except Exception as e:  # noqa: BLE001
            code, message, transient = _status(e)
            _log_failure(fn.__name__, e, code)
            await _abort(context, code, message, transient)

    return handler
