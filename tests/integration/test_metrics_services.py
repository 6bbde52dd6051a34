"""`--metrics-port` on the janitor, a rollout worker and the evaluator: each real process serves
/metrics over HTTP, parsed with prometheus-client's parser (the proxy's and the learner's are
checked with live traffic in test_metrics_proxy.py and test_learner_trackers.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from brigade_harness.devservers import free_port


def scrape_when_up(proc: subprocess.Popen, port: int, ready, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        except OSError:
            time.sleep(0.2)
            continue
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        if ready(samples):
            return samples
        time.sleep(0.2)
    raise AssertionError(f"no ready /metrics on port {port} in {timeout_s} s")


@pytest.mark.parametrize("service, args, ready", [
    ("janitor", ["--interval", "0.1", "--lock-ttl-ms", "1000"],
     lambda s: s.get("brigade_janitor_sweep_duration_seconds_count", 0) >= 2 and s["brigade_janitor_holding_lock"] == 1),
    ("rollout", ["--proxy", "127.0.0.1:9", "--run", "nothing-here"],
     lambda s: "brigade_rollout_tokens_per_second" in s and "brigade_rollout_adapter_fetch_duration_seconds_count" in s),
    ("evaluator", ["--no-worker", "--run", "nothing-here"],
     lambda s: "brigade_evaluator_evaluations_queued_total" in s),
])
def test_service_serves_metrics(service, args, ready, redis_url, file_bucket_url):
    port = free_port()
    # (the evaluator probes its bucket at start: a folder of the test's, not ./brigade-runs)
    env = dict(os.environ, BRIGADE_METRICS_PORT=str(port), BRIGADE_REDIS_URL=redis_url, BRIGADE_LOG_FORMAT="json",
               BRIGADE_BUCKET=file_bucket_url)
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", service, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        scrape_when_up(proc, port, ready)
    finally:
        proc.kill()  # how each stops is tested elsewhere; a worker still importing torch takes its time
        proc.wait(20)


def test_dashboard_and_scrape_config_name_what_the_services_serve():
    import json
    import re
    from pathlib import Path

    import yaml
    from prometheus_client import REGISTRY

    import brigade_evaluator.cli  # noqa: F401  (each registers its metrics on import)
    import brigade_janitor.metrics  # noqa: F401
    import brigade_learner.metrics  # noqa: F401
    import brigade_proxy.metrics  # noqa: F401
    import brigade_rollout.metrics  # noqa: F401

    root = Path(__file__).resolve().parents[2]
    served = {s.name for family in REGISTRY.collect() for s in family.samples}
    served |= {f.name + {"counter": "_total", "histogram": "_bucket"}.get(f.type, "") for f in REGISTRY.collect()}
    from brigade_proxy.metrics import _COUNTERS, _GAUGES  # the run-state families appear once a run exists

    served |= {name for name, _ in _GAUGES.values()} | {name + "_total" for name, _ in _COUNTERS.values()}
    dashboard = json.loads((root / "deploy/grafana/brigade-dashboard.json").read_text())
    used = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"brigade_[a-z_]+", t["expr"])}
    assert used and used - served == set(), f"the dashboard queries metrics nobody serves: {sorted(used - served)}"
    scrape = yaml.safe_load((root / "deploy/prometheus/prometheus.yml").read_text())
    assert {j["job_name"] for j in scrape["scrape_configs"]} >= {"brigade-compose", "brigade-kubernetes"}


def test_proxy_process_serves_metrics(redis_url):
    """`brigade proxy --metrics-port`: the health checks a container runtime makes are counted too."""
    port, grpc_port = free_port(), free_port()
    env = dict(os.environ, BRIGADE_METRICS_PORT=str(port), BRIGADE_LOG_FORMAT="json")
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "proxy", "--listen", f"127.0.0.1:{grpc_port}",
                             "--redis-url", redis_url, "--bucket", ""], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def health_checked(samples: dict) -> bool:
        if samples.get("brigade_proxy_rpcs_total", 0) >= 1:
            return True
        subprocess.run([sys.executable, "-m", "brigade.healthcheck", f"127.0.0.1:{grpc_port}"],
                       capture_output=True, timeout=30)
        return False

    try:
        scrape_when_up(proc, port, health_checked)
    finally:
        proc.terminate()
        proc.wait(20)
