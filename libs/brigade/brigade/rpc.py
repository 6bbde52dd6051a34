"""gRPC plumbing shared by the proxy and its clients: channel options, the clients' bearer token
and the refusals the proxy's auth answers with (its check: brigade_proxy.credentials), TLS, and
one-line descriptions of RPC errors for people."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
import structlog

from brigade.retry import Backoff, retry
from brigade.v1 import brigade_pb2_grpc as pbg

log = structlog.get_logger()
T = TypeVar("T")

# Manifests and prompt batches are small; the one large message is CreateRun with its prompt set.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024

# Keepalive, both sides in one place. Clients ping every KEEPALIVE_MS, with or without calls, so a
# dead proxy (or a NAT that dropped the connection) is noticed within KEEPALIVE_MS + 20 s. grpc-core's
# server default counts a ping received less than 5 minutes after the last one, or with no call open,
# as a "strike" and sends GOAWAY too_many_pings after two: it must accept what the clients send, so it
# permits pings without calls and any ping interval down to half the clients' (a safety factor for
# timer jitter); a peer pinging faster than that still gets GOAWAY, as grpc-core intends.
KEEPALIVE_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 20_000
SERVER_KEEPALIVE_MS = 60_000  # the proxy pings idle clients too: a vanished watcher frees its stream


def channel_options(keepalive_ms: int = KEEPALIVE_MS) -> list[tuple[str, int | str]]:
    """Client channel options; `keepalive_ms` is the ping interval (tests shorten it)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging a quiet stream (WatchRun on an idle run)
        # gRPC's reconnect backoff grows to 120 s by default: after a long proxy outage a client would
        # sit idle up to two minutes after the proxy is back. Cap it; callers add their own jittered retries.
        ("grpc.max_reconnect_backoff_ms", 5_000),
        # a name that resolves to several proxies (a headless Kubernetes Service) gets a connection to
        # each and calls spread over them, not one HTTP/2 connection pinned to the first address
        ("grpc.lb_policy_name", "round_robin"),
    ]


CHANNEL_OPTIONS = channel_options()


def server_options(max_receive_bytes: int = MAX_MESSAGE_BYTES,
                   min_ping_interval_ms: int = KEEPALIVE_MS // 2, reuse_port: bool = False) -> list[tuple[str, int]]:
    """The proxy's server options: the keepalive policy above and gRPC's receive limit. `reuse_port`:
    several processes listen on one port and the kernel spreads connections over them (otherwise a
    second proxy on a taken port is an error, not a silent half of the traffic)."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", max_receive_bytes),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_MS),
        ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", 1),
        # (the server side's minimum interval of RECEIVED pings, whatever the name suggests)
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_interval_ms),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.so_reuseport", int(reuse_port)),
    ]


# A RESOURCE_EXHAUSTED that goes away by itself (Redis is full, a concurrency limit of the proxy) carries
# this trailing metadata key; one that does not (a message over the size limit) does not carry it.
TRANSIENT_KEY = "brigade-transient"
# grpc's own refusal beyond the server's maximum_concurrent_rpcs (it sets no metadata)
_GRPC_CONCURRENCY_DETAILS = "Concurrent RPC limit exceeded"


def is_transient(err: BaseException) -> bool:
    """An RPC error that calling again later may heal: the proxy unreachable or slow, Redis full, a limit."""
    if not isinstance(err, grpc.RpcError):
        return False
    code = err.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return True
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = err.trailing_metadata() or ()
    return any(k == TRANSIENT_KEY for k, _ in trailing) or (err.details() or "").startswith(_GRPC_CONCURRENCY_DETAILS)


# Health checking and reflection stay open so load balancers and grpcurl work without a token.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


# ---------------------------------------------------------------- client side

class _BearerToken:
    def __init__(self, token: str):
        self._metadata = ("authorization", f"Bearer {token}")

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = grpc.aio.Metadata(*(details.metadata or ()), self._metadata)
        return grpc.aio.ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                          details.wait_for_ready)


# grpc.aio files each interceptor under ONE call type (an if/elif on its base classes), so a class
# deriving from both would never see server-streaming calls (WatchRun): one class per call type.
class _BearerTokenUnary(_BearerToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


class _BearerTokenStream(_BearerToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


def open_channel(target: str, token: str = "", tls_ca: str = "", keepalive_ms: int = KEEPALIVE_MS) -> grpc.aio.Channel:
    """An aio channel to the proxy; TLS when a CA file is given (or target starts with https://)."""
    options = channel_options(keepalive_ms)
    interceptors = [_BearerTokenUnary(token), _BearerTokenStream(token)] if token else None
    if target.startswith("https://"):
        target, tls = target.removeprefix("https://"), True
    else:
        target, tls = target.removeprefix("http://"), bool(tls_ca)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca) if tls_ca else None)
        return grpc.aio.secure_channel(target, creds, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)


@dataclass
class ProxyClient:
    """The three services of the proxy on one channel."""

    channel: grpc.aio.Channel

    def __post_init__(self) -> None:
        self.lease = pbg.LeaseServiceStub(self.channel)
        self.learner = pbg.LearnerServiceStub(self.channel)
        self.runs = pbg.RunServiceStub(self.channel)

    @classmethod
    def connect(cls, target: str, token: str = "", tls_ca: str = "") -> ProxyClient:
        return cls(open_channel(target, token, tls_ca))

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> ProxyClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def describe_rpc_error(err: grpc.aio.AioRpcError | grpc.RpcError, target: str = "") -> str:
    """One line for a person: what failed and what to check."""
    code = err.code()
    details = err.details() or ""
    where = f" at {target}" if target else ""
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"cannot reach the proxy{where}: {details} (is `brigade proxy` running? check BRIGADE_PROXY)"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return f"the proxy{where} refused the token: {details} (set BRIGADE_TOKEN to the proxy's token)"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return (f"the proxy{where} refused this call to the token's credential: {details} (ask for a token "
                f"with that role in the proxy's tokens file)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the proxy{where} did not answer in time"
    return f"{code.name}: {details}"


PROXY_BACKOFF = Backoff(base_s=0.2, cap_s=5.0)


async def retry_unavailable(what: str, fn: Callable[[], Awaitable[T]], target: str,
                            on_failure: Callable[[], None] = lambda: None) -> T:
    """A proxy restart or a network blip must not kill a steady service (the learner, the
    aggregator): wait and call again, forever. `on_failure` runs before each wait."""
    def log_retry(attempt: int, delay: float, e: BaseException) -> None:
        on_failure()
        log.warning("proxy_unreachable", call=what, error=describe_rpc_error(e, target), retry_s=round(delay, 2))

    # is_transient: UNAVAILABLE, DEADLINE_EXCEEDED, and a RESOURCE_EXHAUSTED that heals (Redis full, a
    # proxy limit); an oversized message stays fatal
    return await retry(fn, retryable=is_transient, backoff=PROXY_BACKOFF, on_retry=log_retry)


# ---------------------------------------------------------------- server side

def refusal(code: grpc.StatusCode, message: str, *, transient: bool = False,
            streaming: bool = False) -> grpc.RpcMethodHandler:
    """A handler that answers `code` WITHOUT reading the request: it is declared request-streaming, so
    grpc.aio calls it before any message arrives and the body (up to the receive limit) is never
    buffered; the caller sees the same status whatever its method's type."""
    trailing = ((TRANSIENT_KEY, "1"),) if transient else ()

    async def refuse(request_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message, trailing_metadata=trailing)

    async def refuse_stream(request_iterator, context: grpc.aio.ServicerContext):
        await context.abort(code, message, trailing_metadata=trailing)
        yield  # pragma: no cover - makes this an async generator for server-streaming methods

    if streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream)
    return grpc.stream_unary_rpc_method_handler(refuse)


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(key), _read(cert))])
