"""The janitor's Prometheus metrics (served with --metrics-port): how long sweeps take and what they did."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import Counter, Gauge, Histogram

from brigade.prom import LATENCY_BUCKETS
from brigade.store import SweepResult

SWEEP_SECONDS = Histogram("brigade_janitor_sweep_duration_seconds", "One sweep over every run",
                          buckets=LATENCY_BUCKETS)
SWEPT = Counter("brigade_janitor_swept_total", "What sweeps did, by outcome",
                ["outcome"])  # expired, revoked, stale_removed, deadlettered
HOLDING = Gauge("brigade_janitor_holding_lock", "1 while this janitor is the active one")


def observe_sweep(seconds: float, results: Iterable[SweepResult]) -> None:
    SWEEP_SECONDS.observe(seconds)
    for r in results:
        for outcome in ("expired", "revoked", "stale_removed", "deadlettered"):
            SWEPT.labels(outcome).inc(getattr(r, outcome))
