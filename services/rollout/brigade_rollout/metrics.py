"""A rollout worker's Prometheus metrics (served with --metrics-port): throughput, batches by outcome,
adapter swaps and how long getting an adapter took (a prefetched one: almost nothing)."""

from __future__ import annotations

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from brigade.prom import LATENCY_BUCKETS

TOKENS_PER_S = Gauge("brigade_rollout_tokens_per_second", "Generated tokens per second of the last batch")
TOKENS = Counter("brigade_rollout_generated_tokens_total", "Completion tokens generated and handed in")
SWAPS = Counter("brigade_rollout_adapter_swaps_total", "Times the engine switched adapter versions")
FETCH_SECONDS = Histogram("brigade_rollout_adapter_fetch_duration_seconds",
                          "Time from the lease to its adapter loaded in the engine (a prefetched one: the load only)",
                          buckets=LATENCY_BUCKETS)
ADAPTER_VERSION = Gauge("brigade_rollout_adapter_version", "The adapter version the engine holds")


class _Batches:
    """`brigade_rollout_batches_total{outcome}` read from the worker's own tallies on scrape."""

    def __init__(self) -> None:
        self.stats: dict[str, int] = {}

    def collect(self):
        family = CounterMetricFamily("brigade_rollout_batches", "Leased batches by outcome", labels=["outcome"])
        for outcome, n in self.stats.items():
            family.add_metric([outcome], n)
        yield family


BATCHES = _Batches()
REGISTRY.register(BATCHES)
_loaded: list[int] = []


def watch(stats: dict[str, int]) -> None:
    """Serve this worker's tallies (the newest worker of the process, in tests that make several)."""
    BATCHES.stats = stats


def adapter_loaded(version: int, fetch_s: float) -> None:
    FETCH_SECONDS.observe(fetch_s)
    if _loaded != [version]:
        SWAPS.inc()
        _loaded[:] = [version]
        ADAPTER_VERSION.set(version)


def batch_done(tokens: int, generate_s: float) -> None:
    TOKENS.inc(tokens)
    TOKENS_PER_S.set(tokens / max(generate_s, 1e-9))
