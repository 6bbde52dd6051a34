"""gRPC plumbing shared by the proxy and its clients: channel options, bearer-token auth on both
sides, TLS, and one-line descriptions of RPC errors for people."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from brigade.v1 import brigade_pb2_grpc as pbg

# Manifests and prompt batches are small; the one large message is CreateRun with its prompt set.
MAX_MESSAGE_BYTES = 32 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # gRPC's reconnect backoff grows to 120 s by default: after a long proxy outage a client would
    # sit idle up to two minutes after the proxy is back. Cap it; callers add their own jittered retries.
    ("grpc.max_reconnect_backoff_ms", 5_000),
    # a name that resolves to several proxies (a headless Kubernetes Service) gets a connection to
    # each and calls spread over them, not one HTTP/2 connection pinned to the first address
    ("grpc.lb_policy_name", "round_robin"),
]
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


def open_channel(target: str, token: str = "", tls_ca: str = "") -> grpc.aio.Channel:
    """An aio channel to the proxy; TLS when a CA file is given (or target starts with https://)."""
    interceptors = [_BearerTokenUnary(token), _BearerTokenStream(token)] if token else None
    if target.startswith("https://"):
        target, tls = target.removeprefix("https://"), True
    else:
        target, tls = target.removeprefix("http://"), bool(tls_ca)
    if tls:
        creds = grpc.ssl_channel_credentials(root_certificates=_read(tls_ca) if tls_ca else None)
        return grpc.aio.secure_channel(target, creds, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS, interceptors=interceptors)


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
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"the proxy{where} did not answer in time"
    return f"{code.name}: {details}"


# ---------------------------------------------------------------- server side

class BearerAuthInterceptor(grpc.aio.ServerInterceptor):
    """Rejects calls without `authorization: Bearer <token>`, except health and reflection."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}"

        async def deny(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        async def deny_stream(request, context: grpc.aio.ServicerContext):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            yield  # pragma: no cover - makes this an async generator for server-streaming methods

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny_stream)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        if method.startswith(OPEN_METHOD_PREFIXES):
            return await continuation(handler_call_details)
        metadata = dict(handler_call_details.invocation_metadata or ())
        given = metadata.get("authorization", "")
        # constant-time comparison: response timing must not leak how much of a guess was right
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._expected.encode()):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is not None and handler.response_streaming:
            return self._deny_stream
        return self._deny_unary


def server_credentials(cert: str, key: str) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(_read(key), _read(cert))])
