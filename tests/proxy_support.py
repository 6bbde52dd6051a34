"""Helpers shared by the store / proxy / janitor / ctl tests (not a test module itself).

`BackgroundProxy` runs a real grpc.aio proxy in its own thread and event loop, so synchronous
tests (hypothesis, typer's CliRunner) can call it with plain blocking stubs and can still run
coroutines (janitor sweeps, store reads) on the proxy's loop with `call()`.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Coroutine
from typing import Any

import grpc

from brigade import keys
from brigade.rpc import CHANNEL_OPTIONS
from brigade.spec_file import build_spec
from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade_proxy.server import ProxyServer, start_server

PROXY_TOKEN = "test-proxy-token"  # what the shared token_proxy fixture demands
# the deliberate answers to a request the proxy refuses (anything else, UNKNOWN or INTERNAL, is a bug)
REFUSALS = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
            grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS}
WAITING = {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}  # a long poll or a stream that parsed


def status_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status a blocking call ends with; a stream is read for one message (or its error)."""
    try:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            try:
                next(result)
            finally:
                result.cancel()
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()


def new_run_id(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def make_spec(run: str, **overrides: Any) -> pb.RunSpec:
    """A run spec for the store's and proxy's tests. These cut batches without a learner publishing
    versions, so workers may run as far ahead as the staleness cap allows (fixed lookahead = the cap);
    a test of automatic lookahead asks for `lookahead: 0`."""
    staleness = {"max_staleness": 2, "lease_seconds": 30, "max_attempts": 3} | overrides.pop("staleness", {})
    staleness.setdefault("lookahead", staleness["max_staleness"])
    data = {"run_id": run, "prompts_per_batch": 2, "batches_per_step": 1, "staleness": staleness} | overrides
    return build_spec(data)


def make_prompts(n: int) -> list[pb.Prompt]:
    return [pb.Prompt(id=f"p{i}", text=f"{i} + {i} =", columns={"answer": str(2 * i)}) for i in range(n)]


def manifest_for(run: str, lease: pb.Lease, worker: str, **overrides: Any) -> pb.RolloutManifest:
    b = lease.batch.batch_id
    fields = dict(run_id=run, batch_id=b, attempt=lease.attempt, worker_id=worker,
                  policy_version=lease.adapter_version, uri=keys.rollout_key(run, b, lease.attempt),
                  sha256="ab" * 32, size_bytes=10, num_samples=4, num_tokens=40, reward_mean=0.5,
                  compute_seconds=1.0, price_per_hour=0.5, capacity_class="spot")
    fields.update(overrides)
    return pb.RolloutManifest(**fields)


def adapter_manifest(run: str, version: int, step: int | None = None) -> pb.AdapterManifest:
    return pb.AdapterManifest(run_id=run, version=version, step=version if step is None else step,
                              uri=keys.adapter_prefix(run, version), payload="bf16", created_ms=1)


class SyncClient:
    """Blocking stubs of the three services (and health) on one channel."""

    def __init__(self, target: str, token: str = ""):
        self.channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.lease = pbg.LeaseServiceStub(self.channel)
        self.learner = pbg.LearnerServiceStub(self.channel)
        self.runs = pbg.RunServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()


class BackgroundProxy:
    """A proxy server on its own thread + event loop."""

    def __init__(self, redis_url: str, **server_kwargs: Any):
        self.redis_url = redis_url
        self.server_kwargs = server_kwargs
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="background-proxy", daemon=True)
        self.thread.start()
        self.server: ProxyServer = self.call(self._start())

    async def _start(self) -> ProxyServer:
        return await start_server(self.redis_url, "127.0.0.1:0", monitor_redis=False, **self.server_kwargs)

    def call(self, coro: Coroutine, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def target(self) -> str:
        return self.server.target

    @property
    def store(self):
        return self.server.proxy.store

    def restart(self) -> None:
        """A new server object (new port, new Store, empty caches) on the same Redis."""
        self.call(self.server.stop(0))
        self.server = self.call(self._start())

    def close(self) -> None:
        try:
            self.call(self.server.stop(0))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()
