"""The lease proxy: LeaseService, LearnerService and RunService over grpc.aio, thin over
`brigade.store` (all state lives in Redis, so any number of replicas may serve one run).

Every handler calls one store operation (which checks the request) and maps refusals to status codes;
anything unexpected becomes INTERNAL (logged with its traceback) and the server keeps serving.
Health checking and reflection (v1 and v1alpha) are registered so `grpcurl` and load balancers
work; they stay open when a bearer token is required. With a tokens file (credentials.py) each
caller's credential may call only its roles' methods. The limits of limits.py are enforced here:
request sizes per method, CreateRun calls, WatchRun streams and PullRollouts in flight, and with a
tokens file the quotas of each credential (CreateRun calls in flight, runs created, worker ids per run).
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from brigade import keys
from brigade.code_policy import CodePolicy, check_spec
from brigade.errors import LegacyKeys
from brigade.prom import listen_host
from brigade.rpc import KEEPALIVE_MS, server_credentials, server_options
from brigade.spec import fill_defaults
from brigade.store import AlreadyExists, InvalidArgument, NotFound, Store
from brigade.store.runs import BREATHE_EVERY, BULK_WORK, breathe, prompt_bundle
from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade.wire import check_manifest_worker, check_run_spec
from brigade_proxy import credentials, reflection
from brigade_proxy.calls import Slots, add_servicer, client_address, rpc, rpc_stream
from brigade_proxy.limits import Limits
from brigade_proxy.metrics import RpcMetrics, start_metrics

log = structlog.get_logger("brigade.proxy")

SERVICE_NAMES = (
    pb.DESCRIPTOR.services_by_name["LeaseService"].full_name,
    pb.DESCRIPTOR.services_by_name["LearnerService"].full_name,
    pb.DESCRIPTOR.services_by_name["RunService"].full_name,
)


# ---------------------------------------------------------------- the proxy

class Proxy:
    """What the three servicers share: the store and (optionally) the bucket."""

    def __init__(self, store: Store, bucket: Any = None, bucket_url: str = "", owns_bucket: bool = True,
                 limits: Limits | None = None, tokens: credentials.TokenTable | None = None):
        self.store = store
        self.limits = limits = limits or Limits()
        self.tokens = tokens  # None: one credential (one-token mode, no auth), no per-credential quotas
        # keyed by credential name (credentials.name_of): with one credential, the total is the only bound
        self.create_runs = Slots("CreateRun calls", limits.max_create_runs,
                                 limits.max_create_runs_per_credential if tokens else None, per="credential")
        self.streams = Slots("WatchRun streams", limits.max_streams, limits.max_streams_per_client)
        self.pulls = Slots("PullRollouts calls", limits.max_pulls, limits.max_pulls_per_client)
        self.bucket = bucket
        self.bucket_url = bucket_url
        self.owns_bucket = owns_bucket
        self._ensured = False

    async def store_run(self, run: str, spec_bytes: bytes, prompts_bytes: bytes) -> None:
        """run.pb and the prompt set, create-only; an identical object already there is fine."""
        if self.bucket is None:
            return
        from brigade.bucket import ObjectExists

        if not self._ensured:
            try:
                await self.bucket.ensure()
                self._ensured = True
            except Exception as e:  # noqa: BLE001 - no right to create it? the put says what is wrong
                log.warning("cannot ensure the bucket exists", bucket=self.bucket_url, error=str(e))

        for key, data in ((keys.run_spec_key(run), spec_bytes), (keys.prompts_key(run), prompts_bytes)):
            try:
                await self.bucket.put_new(key, data)
            except ObjectExists:
                if await self.bucket.get(key) != data:
                    raise AlreadyExists(f"the bucket already holds a different {key} (from an earlier run with "
                                        f"this id?); pick a new run_id") from None

    def worker_quota(self, context: grpc.aio.ServicerContext) -> dict[str, Any]:
        """The store's per-credential worker-id arguments for the caller (acquire.lua)."""
        return dict(credential=credentials.name_of(context),
                    max_credential_workers=self.limits.max_worker_ids_per_credential)

    async def claim_run(self, context: grpc.aio.ServicerContext, run: str) -> None:
        """Runs per credential: a new run counts against its creator's quota (with a tokens file)."""
        if name := credentials.name_of(context):
            await self.store.runs.claim(run, name, self.limits.max_runs_per_credential)

    async def close(self) -> None:
        await self.store.close()
        if self.bucket is not None and self.owns_bucket:
            await self.bucket.close()


class LeaseServicer(pbg.LeaseServiceServicer):
    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.leases = proxy.store.leases

    @rpc
    async def AcquireLease(self, request: pb.AcquireLeaseRequest, context) -> pb.AcquireLeaseResponse:
        return await self.leases.acquire(request.run_id, request.worker_id, _worker_info(request),
                                         **self.proxy.worker_quota(context))

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context) -> pb.HeartbeatResponse:
        b = await self.leases.heartbeat(request.run_id, request.lease_id, request.worker_id)
        status = {"ok": pb.HeartbeatResponse.OK, "lost": pb.HeartbeatResponse.LOST,
                  "revoked": pb.HeartbeatResponse.REVOKED}[b.status]
        return pb.HeartbeatResponse(status=status, deadline_ms=b.deadline_ms,
                                    latest_adapter_version=b.latest_version, message=b.message)

    @rpc
    async def CompleteLease(self, request: pb.CompleteLeaseRequest, context) -> pb.CompleteLeaseResponse:
        manifest = request.manifest if request.HasField("manifest") else None
        check_manifest_worker(request.worker_id, manifest)
        nxt = request.next if request.HasField("next") else None
        if nxt is not None and (nxt.run_id, nxt.worker_id) != (request.run_id, request.worker_id):
            raise InvalidArgument("next: a worker acquires its own next lease in the same run "
                                  "(next.run_id and next.worker_id must be the request's)")
        if nxt is None:
            c = await self.leases.complete(request.run_id, request.lease_id, request.worker_id, manifest)
            return pb.CompleteLeaseResponse(duplicate=c.duplicate)
        # one gRPC call per batch instead of two (the per-call cost, grpc's event loop and poller, is
        # most of the proxy's CPU per lease cycle), and one Redis call: the completion and the grant
        # are one script
        c, lease = await self.leases.complete_and_acquire(request.run_id, request.lease_id, request.worker_id,
                                                          manifest, _worker_info(nxt),
                                                          **self.proxy.worker_quota(context))
        return pb.CompleteLeaseResponse(duplicate=c.duplicate, next=lease)

    @rpc
    async def FailLease(self, request: pb.FailLeaseRequest, context) -> pb.FailLeaseResponse:
        f = await self.leases.fail(request.run_id, request.lease_id, request.worker_id, request.reason,
                                   request.message)
        return pb.FailLeaseResponse(requeued=f.requeued, deadlettered=f.deadlettered, next_attempt=f.next_attempt)

    @rpc
    async def SubmitContribution(self, request: pb.SubmitContributionRequest, context
                                 ) -> pb.SubmitContributionResponse:
        manifest = request.manifest if request.HasField("manifest") else None
        c = await self.leases.submit(request.run_id, request.trainer_id, list(request.lease_ids), manifest)
        return pb.SubmitContributionResponse(duplicate=c.duplicate)


def _worker_info(request: pb.AcquireLeaseRequest) -> pb.WorkerInfo:
    return pb.WorkerInfo(worker_id=request.worker_id, capacity_class=request.capacity_class,
                         price_per_hour=request.price_per_hour, engine=request.engine)


def _poll_ms(wait_ms: int, context: grpc.aio.ServicerContext) -> int:
    """A long poll's wait: answer (empty) before the caller's deadline, not after it."""
    remaining = context.time_remaining()
    return wait_ms if remaining is None else min(wait_ms, max(0, int(remaining * 1000) - 200))


class LearnerServicer(pbg.LearnerServiceServicer):
    def __init__(self, proxy: Proxy):
        self.learner = proxy.store.learner
        self.pulls = proxy.pulls

    @rpc
    async def PullRollouts(self, request: pb.PullRolloutsRequest, context) -> pb.PullRolloutsResponse:
        with self.pulls.hold(client_address(context)):
            pulled = await self.learner.pull(request.run_id, request.learner_id, request.max_manifests,
                                             _poll_ms(request.wait_ms, context), request.include_pending)
        return pb.PullRolloutsResponse(
            rollouts=[pb.PulledRollout(delivery_id=d, manifest=m) for d, m in pulled.rollouts],
            latest_adapter_version=pulled.latest_version,
        )

    @rpc
    async def PullContributions(self, request: pb.PullContributionsRequest, context) -> pb.PullContributionsResponse:
        with self.pulls.hold(client_address(context)):
            pulled = await self.learner.pull_contributions(
                request.run_id, request.aggregator_id, request.max_contributions, _poll_ms(request.wait_ms, context),
                request.include_pending)
        return pb.PullContributionsResponse(
            contributions=[pb.PulledContribution(delivery_id=d, manifest=m) for d, m in pulled.contributions],
            latest_adapter_version=pulled.latest_version,
        )

    @rpc
    async def AckRollouts(self, request: pb.AckRolloutsRequest, context) -> pb.AckRolloutsResponse:
        acked = await self.learner.ack(request.run_id, request.learner_id, list(request.delivery_ids),
                                       list(request.consumed_batch_ids), list(request.rejected_batch_ids),
                                       request.step, request.metrics_json)
        return pb.AckRolloutsResponse(acked=acked)

    @rpc
    async def PublishAdapter(self, request: pb.PublishAdapterRequest, context) -> pb.PublishAdapterResponse:
        manifest = request.manifest if request.HasField("manifest") else None
        latest = await self.learner.publish(request.run_id, manifest, request.step_busy_s)
        log.info("adapter published", run=request.run_id, version=request.manifest.version, latest=latest)
        return pb.PublishAdapterResponse(latest_version=latest)


class RunServicer(pbg.RunServiceServicer):
    def __init__(self, proxy: Proxy):
        self.proxy = proxy
        self.store = proxy.store

    @rpc
    async def CreateRun(self, request: pb.CreateRunRequest, context) -> pb.CreateRunResponse:
        if not request.HasField("spec"):
            raise InvalidArgument("spec is required")
        await self.proxy.claim_run(context, request.spec.run_id)  # runs per credential (tokens file)
        limit = self.proxy.limits.max_prompts
        if len(request.prompts) > limit:
            raise InvalidArgument(f"{len(request.prompts)} prompts; a run takes at most {limit}")
        # a million prompts take seconds to check and encode: off the event loop, which serves everyone
        # (the request itself was counted and parsed in pieces: bulk.py)
        spec, encoded = await asyncio.to_thread(_prepare_run, request)
        run = spec.run_id
        # no code from the wire: the reward functions this host would not import, nor would the
        # workers by default (paths name files on the workers' hosts: each worker checks those)
        if refused := check_spec(spec, CodePolicy.from_env(bucket=self.proxy.bucket_url), sources=False):
            raise InvalidArgument(f"run {run}: refused by the proxy's code policy: {'; '.join(refused)}")
        if not await self.store.runs.exists(run):
            spec_bytes = spec.SerializeToString(deterministic=True)
            if self.proxy.bucket is not None:
                await self.proxy.store_run(run, spec_bytes, await asyncio.to_thread(prompt_bundle, run, encoded))
        created = await self.store.runs.create(spec, request.prompts, exist_ok=request.exist_ok, encoded=encoded)
        log.info("run created" if created else "run exists", run=run, prompts=len(encoded))
        return pb.CreateRunResponse(run_id=run, created=created)

    @rpc
    async def GetRun(self, request: pb.RunRef, context) -> pb.RunState:
        return await self.store.views.run_state(request.run_id)

    @rpc
    async def ListRuns(self, request: pb.ListRunsRequest, context) -> pb.ListRunsResponse:
        """One page of runs (each a few Redis reads): a thousand runs are ten calls, not one huge one."""
        ids, after = await self.store.runs.page(request.page_token, request.page_size or 100)
        states = []
        for run in ids:
            try:
                states.append(await self.store.views.run_state(run))
            except NotFound:  # listed but half-created or removed: skip it
                continue
        return pb.ListRunsResponse(runs=states, next_page_token=after)

    @rpc_stream
    async def WatchRun(self, request: pb.WatchRunRequest, context) -> AsyncIterator[pb.Event]:
        with self.proxy.streams.hold(client_address(context)):
            async for event in self.store.views.events(request.run_id, request.after_id, request.from_start):
                yield event

    @rpc
    async def ListLeases(self, request: pb.RunRef, context) -> pb.ListLeasesResponse:
        return pb.ListLeasesResponse(leases=await self.store.views.list_leases(request.run_id))

    @rpc
    async def ListWorkers(self, request: pb.RunRef, context) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(workers=await self.store.views.list_workers(request.run_id))

    @rpc
    async def ListAdapters(self, request: pb.RunRef, context) -> pb.ListAdaptersResponse:
        return pb.ListAdaptersResponse(adapters=await self.store.views.list_adapters(request.run_id))

    @rpc
    async def GetMetrics(self, request: pb.GetMetricsRequest, context) -> pb.GetMetricsResponse:
        return pb.GetMetricsResponse(steps=await self.store.views.metrics(request.run_id, request.last))

    @rpc
    async def ListDeadLetters(self, request: pb.RunRef, context) -> pb.ListDeadLettersResponse:
        return pb.ListDeadLettersResponse(dead_letters=await self.store.views.dead_letters(request.run_id))


def _prepare_run(request: pb.CreateRunRequest) -> tuple[pb.RunSpec, tuple[bytes, ...]]:
    """The spec with its defaults filled in, checked, and each prompt's bytes."""
    spec = fill_defaults(request.spec)  # unset fields: the declared defaults
    check_run_spec(spec, request.prompts)
    # a slice at a time (list() of a million prompts is one C call that holds the GIL, and so the
    # event loop, for a second), and no list of a million prompt objects: each slice is freed once
    # encoded, so they never pile up for the garbage collector to walk (a full collection holds the GIL too)
    # tuples of bytes: the garbage collector stops tracking them, where it would walk a list of a
    # million on every full collection (tens of ms of the event loop's time, with a few such lists)
    chunks = []
    with BULK_WORK:
        for start in range(0, len(request.prompts), BREATHE_EVERY):
            chunks.append(tuple([p.SerializeToString(deterministic=True)
                                 for p in request.prompts[start:start + BREATHE_EVERY]]))
            breathe()  # the event loop's turn (runs.breathe)
        return spec, tuple(itertools.chain.from_iterable(chunks))


# ---------------------------------------------------------------- server lifecycle

async def open_bucket_or_none(url: str) -> Any:
    """The bucket for run.pb and prompts, or None (no URL, or the bucket library unavailable)."""
    if not url:
        return None
    try:
        from brigade.bucket import open_bucket  # type: ignore[attr-defined]
    except ImportError:
        log.warning("bucket library unavailable; run specs are kept in Redis only", bucket=url)
        return None
    bucket = open_bucket(url)
    if inspect.isawaitable(bucket):
        bucket = await bucket
    return bucket


@dataclass
class ProxyServer:
    server: grpc.aio.Server
    port: int
    proxy: Proxy
    health: Any
    _monitor: asyncio.Task | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self, grace: float | None = 1.0) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)
        await self.proxy.close()


async def _watch_redis(store: Store, health: Any, period: float = 2.0) -> None:
    """Health follows Redis: NOT_SERVING while it cannot be reached."""
    serving = True
    while True:
        await asyncio.sleep(period)
        try:
            ok = await asyncio.wait_for(store.ping(), timeout=period)
        except Exception:  # noqa: BLE001
            ok = False
        if ok != serving:
            serving = ok
            status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
            for name in ("", *SERVICE_NAMES):
                await health.set(name, status)
            (log.info if ok else log.error)("redis reachable" if ok else "redis unreachable", redis=store.redis_url)


async def start_server(
    redis_url: str,
    listen: str = "127.0.0.1:0",
    *,
    bucket_url: str = "",
    bucket: Any = None,
    token: str = "",
    tokens_file: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    monitor_redis: bool = True,
    pipelined: bool = True,
    limits: Limits | None = None,
    min_ping_interval_ms: int = KEEPALIVE_MS // 2,
    reuse_port: bool = False,
) -> ProxyServer:
    """Build and start a proxy on `listen` (port 0 = any free port). Returns once it accepts calls.
    `min_ping_interval_ms`: clients pinging more often than this get GOAWAY (tests shorten it).
    `reuse_port`: share the port with the other processes of `brigade proxy --processes N`.
    `token`: one-token mode (that token has every role); `tokens_file`: a credential per token, each
    with its roles and quotas (credentials.py); CredentialsError for a file that cannot be used."""
    if token and tokens_file:
        raise ValueError("give a token (--token, one-token mode) or a tokens file (--tokens-file), not both")
    tokens = credentials.TokenTable(tokens_file) if tokens_file else None
    limits = limits or Limits()
    # one blocking connection per WatchRun stream it allows, one reserved per PullRollouts
    store = Store(redis_url, pipelined=pipelined, blocking_connections=limits.max_streams,
                  pull_connections=limits.max_pulls)
    owns_bucket = bucket is None
    if bucket is None and bucket_url:
        bucket = await open_bucket_or_none(bucket_url)
    proxy = Proxy(store, bucket, bucket_url, owns_bucket=owns_bucket, limits=limits, tokens=tokens)
    # one-token mode is a table of one credential with every role and no name (no quotas)
    table = tokens if tokens is not None else credentials.TokenTable(token=token) if token else None
    interceptors = [RpcMetrics(), *([credentials.RoleAuthInterceptor(table)] if table is not None else [])]
    server = grpc.aio.server(interceptors=interceptors, maximum_concurrent_rpcs=limits.max_rpcs,
                             options=server_options(limits.max_message_bytes, min_ping_interval_ms, reuse_port))
    add_servicer(server, "LeaseService", LeaseServicer(proxy), limits)
    add_servicer(server, "LearnerService", LearnerServicer(proxy), limits)
    add_servicer(server, "RunService", RunServicer(proxy), limits, gates={"CreateRun": proxy.create_runs})
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for name in SERVICE_NAMES:
        await health.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable(server, (*SERVICE_NAMES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
    if tls_cert:
        port = server.add_secure_port(listen, server_credentials(tls_cert, tls_key))
    else:
        port = server.add_insecure_port(listen)
    if not port:
        raise RuntimeError(f"cannot listen on {listen}")
    await server.start()
    monitor = asyncio.create_task(_watch_redis(store, health)) if monitor_redis else None
    return ProxyServer(server, port, proxy, health, monitor)


def settle_heap() -> None:
    """Collect once, then move everything alive (modules, grpc, protobuf descriptors: ~80k objects)
    out of the garbage collector's sight. A full collection stops the event loop, and with it every
    call in flight, for as long as it takes to walk every tracked object: with the startup objects in
    sight it ran every few seconds of leases and took 40 ms (on a loaded 2-core machine), 1.6 ms
    without them. What is allocated later is still collected; a frozen startup object is never freed,
    which a server's startup objects never are anyway."""
    gc.collect()
    gc.freeze()


async def serve(
    listen: str,
    redis_url: str,
    *,
    bucket_url: str = "",
    token: str = "",
    tokens_file: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    grace: float = 5.0,
    pipelined: bool = True,
    limits: Limits | None = None,
    metrics_port: int = 0,
    metrics_host: str = "",
    metrics_token: str = "",
    reuse_port: bool = False,
) -> None:
    """Run a proxy until SIGTERM or SIGINT, then drain in-flight calls for up to `grace` seconds."""
    started = time.monotonic()
    running = await start_server(redis_url, listen, bucket_url=bucket_url, token=token, tokens_file=tokens_file,
                                 tls_cert=tls_cert,
                                 tls_key=tls_key, pipelined=pipelined, limits=limits, reuse_port=reuse_port)
    try:
        await running.proxy.store.ping()
        redis_ok = True
    except Exception as e:  # noqa: BLE001
        redis_ok = False
        log.error("redis unreachable at start; calls answer UNAVAILABLE until it is back", redis=redis_url,
                  error=str(e))
    try:
        if redis_ok:  # runs this version cannot read (LegacyKeys): refuse to serve rather than answer "no run"
            await running.proxy.store.runs.check_layout()
        # before "listening": a process that says it listens serves all it was asked to
        # on the --listen host unless told otherwise: not every interface for a proxy listening on loopback
        metrics = start_metrics(metrics_port, running.proxy.store, metrics_host or listen_host(listen),
                                metrics_token)  # SystemExit: its port is taken
    except (LegacyKeys, SystemExit):
        await running.stop(0)
        raise
    log.info("proxy listening", listen=listen, port=running.port, redis=redis_url, redis_ok=redis_ok,
             bucket=bucket_url or None,
             auth="tokens file" if tokens_file else "one token" if token else None, tls=bool(tls_cert), metrics_port=metrics_port or None,
             pid=os.getpid(), startup_ms=round((time.monotonic() - started) * 1000))
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if running.proxy.tokens is not None:  # rotation: re-read the tokens file now (it is also checked each second)
        loop.add_signal_handler(signal.SIGHUP, running.proxy.tokens.reload)
    await stop.wait()
    log.info("proxy stopping", grace_s=grace)
    await running.stop(grace)
    if metrics is not None:
        metrics.cancel()
    log.info("proxy stopped")
