"""The proxy's Prometheus metrics (served with --metrics-port).

An interceptor counts every RPC and times it by method and status code, and reads the lease
outcomes off the responses (granted, refused by reason, revoked on heartbeat, dead-lettered on
failure), so the servicers stay as they are. The run state (queue depths, learner step, the lease
counts the janitor moves: expired, revoked, dead-lettered) is read from the store's views every
few seconds and served from that cache: a scrape never waits on Redis.

Every label comes from a closed set, so no caller can grow the registry (each label set is a series
a scrape serves forever):
- `method`: a method the server registered (brigade's services, health, reflection), else `other`;
  a call refused for its token is counted as `unauthenticated` whatever path it named (that series
  exists from the start: an unauthenticated call never creates one). A path the server does not
  serve, asked with the token or without auth, is answered UNIMPLEMENTED by gRPC and not counted.
- `code`: a gRPC status name.
- `run`: the first MAX_RUN_LABELS runs this proxy counts a lease outcome of, then `_other` (not a
  valid run id); the run-state series cover the first MAX_RUN_LABELS run ids in byte order, and
  `brigade_proxy_runs_unlabelled` counts the runs left out."""

from __future__ import annotations

import asyncio
import functools
import time
from typing import Any

import grpc
import structlog
from prometheus_client import REGISTRY, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from brigade.prom import LATENCY_BUCKETS, serve_metrics
from brigade.store import NotFound, Store
from brigade.v1 import brigade_pb2 as pb

OTHER = "other"  # the method label of a path the server does not register
UNAUTHENTICATED = "unauthenticated"  # ... of a call refused for its token, whatever its path
OTHER_RUN = "_other"  # the run label beyond MAX_RUN_LABELS (a run id starts with [a-z0-9])
MAX_RUN_LABELS = 100  # distinct run label values per proxy process (read when the server starts)

log = structlog.get_logger()

RPCS = Counter("brigade_proxy_rpcs_total", "RPCs handled", ["method", "code"])
RPC_SECONDS = Histogram("brigade_proxy_rpc_duration_seconds", "RPC latency", ["method", "code"],
                        buckets=LATENCY_BUCKETS)
LEASES_GRANTED = Counter("brigade_proxy_leases_granted_total", "Leases granted", ["run"])
LEASES_REFUSED = Counter("brigade_proxy_admission_refusals_total", "AcquireLease answered without a lease",
                         ["run", "reason"])
LEASES_REVOKED = Counter("brigade_proxy_leases_revoked_total", "Heartbeats answered REVOKED", ["run"])
LEASES_DEADLETTERED = Counter("brigade_proxy_leases_deadlettered_total", "FailLease calls that dead-lettered",
                              ["run"])


# labels() takes a lock and builds its key on every call; these run on every lease call, so each
# label set's child is looked up once (bounded: methods x status codes, and runs, which are capped)
@functools.lru_cache(maxsize=4096)
def _child(metric: Counter | Histogram, *labels: str) -> Any:
    return metric.labels(*labels)


class RunLabels:
    """The run label of a run: its id for the first `cap` runs seen, then OTHER_RUN. Only runs a call
    succeeded on are seen (a lease outcome is counted off a response), so they exist."""

    __slots__ = ("cap", "seen")

    def __init__(self, cap: int):
        self.cap, self.seen = cap, set()

    def __call__(self, run: str) -> str:
        if run in self.seen:
            return run
        if len(self.seen) < self.cap:
            self.seen.add(run)
            return run
        return OTHER_RUN


def _count_acquire(run: str, response: pb.AcquireLeaseResponse) -> None:
    if response.granted:
        _child(LEASES_GRANTED, run).inc()
    else:
        _child(LEASES_REFUSED, run, response.reason or "unknown").inc()


def _count_outcome(method: str, request: Any, response: Any, runs: RunLabels) -> None:
    if method == "AcquireLease":
        _count_acquire(runs(request.run_id), response)
    elif method == "CompleteLease" and response.HasField("next"):  # the next lease, asked for in the same call
        _count_acquire(runs(request.run_id), response.next)
    elif method == "Heartbeat" and response.status == pb.HeartbeatResponse.REVOKED:
        _child(LEASES_REVOKED, runs(request.run_id)).inc()
    elif method == "FailLease" and response.deadlettered:
        _child(LEASES_DEADLETTERED, runs(request.run_id)).inc()


_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def _code(context: grpc.aio.ServicerContext, default: grpc.StatusCode) -> str:
    """The status the handler set (abort() sets it; grpc.aio may hand back the C enum's int)."""
    code = context.code()
    if isinstance(code, int):
        code = _BY_VALUE.get(code)
    return (code or default).name


class _Timed:
    """Counts and times one call under the status it ended with (a class, not @contextmanager,
    whose generator and wrapper objects cost more on a path every call takes)."""

    __slots__ = ("method", "context", "stream", "start")

    def __init__(self, method: str, context: grpc.aio.ServicerContext, stream: bool = False):
        self.method, self.context, self.stream = method, context, stream

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        if kind is None:
            code = "OK"
        elif self.stream and issubclass(kind, asyncio.CancelledError):
            code = "CANCELLED"  # a watcher going away: the usual end of a stream
        else:  # a unary call keeps the status it was given, cancelled or not
            code = _code(self.context, grpc.StatusCode.UNKNOWN)
        # refused for its token: one fixed series, whatever path it named (the path is the caller's)
        _observe(UNAUTHENTICATED if code == "UNAUTHENTICATED" else self.method, code, time.perf_counter() - self.start)


def known_methods() -> dict[str, str]:
    """Each method path the proxy registers -> its label (the method's name)."""
    from grpc_health.v1 import health_pb2
    from grpc_reflection.v1alpha import reflection_pb2

    services = [*pb.DESCRIPTOR.services_by_name.values(), *health_pb2.DESCRIPTOR.services_by_name.values(),
                *reflection_pb2.DESCRIPTOR.services_by_name.values()]
    paths = {f"/{s.full_name}/{m.name}": m.name for s in services for m in s.methods}
    # reflection v1 serves the same method under its own package (brigade_proxy.reflection)
    paths |= {p.replace("/grpc.reflection.v1alpha.", "/grpc.reflection.v1."): m for p, m in paths.items()
              if p.startswith("/grpc.reflection.v1alpha.")}
    return paths


class RpcMetrics(grpc.aio.ServerInterceptor):
    """Counts and times every call the server answers, labelled from closed sets (the module's doc)."""

    def __init__(self, max_runs: int | None = None):
        self.methods = known_methods()
        self.runs = RunLabels(MAX_RUN_LABELS if max_runs is None else max_runs)
        for code in ("UNAUTHENTICATED",):  # present from the start: a refused call never adds a series
            _child(RPCS, UNAUTHENTICATED, code)
            _child(RPC_SECONDS, UNAUTHENTICATED, code)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        method = self.methods.get(details.method, OTHER)
        runs = self.runs
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):
                with _Timed(method, context):
                    response = await inner(request, context)
                    _count_outcome(method, request, response, runs)
                    return response

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.unary_stream:
            inner_stream = handler.unary_stream

            async def stream(request, context):
                with _Timed(method, context, stream=True):
                    async for item in inner_stream(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                        handler.response_serializer)
        if handler.stream_unary:
            # a unary method the proxy serves as request-streaming so it can refuse before the body
            # is read (a gated CreateRun, a call without the token): timed and counted, never read here
            inner_gated = handler.stream_unary

            async def gated(request_iterator, context):
                with _Timed(method, context):
                    return await inner_gated(request_iterator, context)

            return grpc.stream_unary_rpc_method_handler(gated, handler.request_deserializer,
                                                        handler.response_serializer)
        return handler


def _observe(method: str, code: str, seconds: float) -> None:
    _child(RPCS, method, code).inc()
    _child(RPC_SECONDS, method, code).observe(seconds)


# ---------------------------------------------------------------- run state, from the store's views

_GAUGES = {  # RunState field -> (metric, help)
    "latest_version": ("brigade_run_adapter_version", "Newest published adapter version"),
    "learner_step": ("brigade_run_learner_step", "The learner's step as the proxy knows it"),
    "queued": ("brigade_run_batches_queued", "Batches in the work stream, not leased"),
    "leased": ("brigade_run_batches_leased", "Batches out on lease"),
    "completed": ("brigade_run_batches_completed", "Completed batches waiting for the learner"),
    "finished": ("brigade_run_finished", "1 once the run is finished"),
    "lookahead": ("brigade_run_lookahead", "Versions ahead of the newest a batch may be cut now (admission)"),
    "generation_s": ("brigade_run_generation_seconds", "A batch's grant-to-completion time, moving average"),
    "step_busy_s": ("brigade_run_learner_step_busy_seconds", "The learner's busy time per step, moving average"),
}
_COUNTERS = {  # cumulative counts kept in Redis (so they survive proxy restarts)
    "batches_created": ("brigade_run_batches_created", "Batches created"),
    "consumed": ("brigade_run_batches_consumed", "Batches the learner trained on"),
    "rejected": ("brigade_run_batches_rejected", "Batches the learner rejected at ingestion"),
    "expired": ("brigade_run_leases_expired", "Leases expired by the janitor"),
    "revoked": ("brigade_run_leases_revoked", "Leases revoked as too stale"),
    "deadlettered": ("brigade_run_batches_deadlettered", "Batches dead-lettered"),
    "stale_removed": ("brigade_run_manifests_stale_removed", "Completed manifests dropped as too stale"),
    "duplicates": ("brigade_run_duplicates", "Duplicate completions"),
}


class RunStateCollector:
    """Serves the last snapshot of every run's state; `refresh` (a task on the proxy's loop) renews it."""

    def __init__(self) -> None:
        self.states: list[pb.RunState] = []
        self.unlabelled = 0  # runs beyond MAX_RUN_LABELS, not shown

    def collect(self):
        families = {f: GaugeMetricFamily(name, doc, labels=["run"]) for f, (name, doc) in _GAUGES.items()}
        families |= {f: CounterMetricFamily(name, doc, labels=["run"]) for f, (name, doc) in _COUNTERS.items()}
        for s in self.states:
            for field, family in families.items():
                family.add_metric([s.spec.run_id], float(getattr(s, field)))
        yield from families.values()
        yield GaugeMetricFamily("brigade_proxy_runs_unlabelled",
                                f"Runs beyond the first {MAX_RUN_LABELS} (by id) that the run-state series leave out",
                                value=self.unlabelled)

    async def refresh(self, store: Store, period_s: float = 5.0) -> None:
        while True:
            try:
                states = []
                ids = await store.runs.ids()
                for run in ids[:MAX_RUN_LABELS]:
                    try:
                        states.append(await store.views.run_state(run))
                    except NotFound:
                        continue
                self.states, self.unlabelled = states, max(0, len(ids) - MAX_RUN_LABELS)
            except Exception as e:  # noqa: BLE001 - Redis down: keep the last snapshot, try again
                log.debug("run_state_refresh_failed", error=str(e)[:200])
            await asyncio.sleep(period_s)


RUN_STATE = RunStateCollector()
REGISTRY.register(RUN_STATE)


def start_metrics(port: int, store: Store, host: str = "127.0.0.1", token: str = "") -> asyncio.Task | None:
    """Serve /metrics on host:`port` (0 = off; to a scrape bearing `token` if set) and keep the
    run-state snapshot fresh; the task to cancel."""
    if port <= 0:
        return None
    serve_metrics(port, host, token)
    return asyncio.create_task(RUN_STATE.refresh(store))
