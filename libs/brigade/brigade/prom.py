"""Prometheus metrics: each long-running service serves `/metrics` on a port of its own
(`--metrics-port`, env BRIGADE_METRICS_PORT; off when unset). Names follow Prometheus' conventions,
as vLLM's do: `brigade_<service>_<what>_<unit>`, `_total` for counters, `_seconds` for durations.
Each service declares its metrics in its own `metrics.py`, on prometheus-client's default registry."""

from __future__ import annotations

import structlog
from prometheus_client import start_http_server

log = structlog.get_logger()

# seconds: from a Redis round trip to a slow optimizer step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def serve_metrics(port: int, addr: str = "0.0.0.0") -> None:
    """Serve the default registry at http://addr:port/metrics from a daemon thread; port 0 = off.
    A port it cannot take stops the service with one line naming it (SystemExit, status 1): every
    caller is a service starting up, and a bare "[Errno 98] Address already in use" names no port."""
    if port <= 0:
        return
    try:
        start_http_server(port, addr=addr)
    except OSError as e:
        raise SystemExit(f"brigade: cannot serve metrics on {addr}:{port} (--metrics-port): {e.strerror}") from e
    log.info("metrics_serving", port=port, path="/metrics")
