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

from brigade_cli.devservers import free_port


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
def test_service_serves_metrics(service, args, ready, redis_url):
    port = free_port()
    env = dict(os.environ, BRIGADE_METRICS_PORT=str(port), BRIGADE_REDIS_URL=redis_url, BRIGADE_LOG_FORMAT="json")
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", service, *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        scrape_when_up(proc, port, ready)
    finally:
        proc.terminate()
        proc.wait(20)
