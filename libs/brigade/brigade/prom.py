"""Prometheus metrics: each long-running service serves `/metrics` on a port of its own
(`--metrics-port`, env BRIGADE_METRICS_PORT; off when unset), on the host `--metrics-host` names
(BRIGADE_METRICS_HOST: 127.0.0.1 by default, the proxy's `--listen` host for the proxy; containers
set 0.0.0.0 so Prometheus can reach them), and with `--metrics-token` (BRIGADE_METRICS_TOKEN) only
to a scrape that sends `Authorization: Bearer <token>` (Prometheus: `authorization: {credentials: ...}`).
Names follow Prometheus' conventions, as vLLM's do: `brigade_<service>_<what>_<unit>`, `_total` for
counters, `_seconds` for durations. Each service declares its metrics in its own `metrics.py`, on
prometheus-client's default registry."""

from __future__ import annotations

import hmac
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import make_server

import structlog
from prometheus_client import REGISTRY, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family, _SilentHandler

log = structlog.get_logger()

# seconds: from a Redis round trip to a slow optimizer step
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def listen_host(listen: str) -> str:
    """The host part of a host:port (`[::1]:50051` -> `::1`; no host, `:50051` -> 0.0.0.0, as gRPC binds it)."""
    host = listen.rpartition(":")[0] if ":" in listen else listen
    return host.strip("[]") or "0.0.0.0"


def with_token(app: Callable, token: str) -> Callable:
    """`app` answering 401 to a request without `Authorization: Bearer <token>` (compared in constant time)."""
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict, start_response: Callable) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode("latin-1", "replace")
        if not hmac.compare_digest(given, expected):
            start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                ("WWW-Authenticate", 'Bearer realm="metrics"')])
            return [b"missing or wrong bearer token\n"]
        return app(environ, start_response)

    return guarded


def serve_metrics(port: int, addr: str = "127.0.0.1", token: str = "", registry: Any = REGISTRY) -> Any:
    """Serve the default registry at http://addr:port/metrics from a daemon thread, to a scrape bearing
    `token` if one is set; port 0 = off. Returns the HTTP server (its `shutdown()` stops it), or None.
    A port it cannot take stops the service with one line naming it (SystemExit, status 1): every
    caller is a service starting up, and a bare "[Errno 98] Address already in use" names no port."""
    if port <= 0:
        return None

    class Server(ThreadingWSGIServer):
        """prometheus-client's threading server, with the address family of `addr` (IPv4 or IPv6)."""

    app = make_wsgi_app(registry)
    try:
        Server.address_family, host = _get_best_family(addr, port)
        httpd = make_server(host, port, with_token(app, token) if token else app, Server,
                            handler_class=_SilentHandler)
    except OSError as e:
        raise SystemExit(f"brigade: cannot serve metrics on {addr}:{port} (--metrics-host, --metrics-port): "
                         f"{e.strerror}") from e
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    log.info("metrics_serving", host=addr, port=port, path="/metrics", auth=bool(token))
    return httpd
