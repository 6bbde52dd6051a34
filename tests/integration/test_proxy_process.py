"""`brigade proxy` as a process: starts, serves, logs JSON, shuts down cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_support import make_prompts, make_spec, new_run_id

from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade_cli.devservers import free_port, wait_for_port


def test_proxy_process_serves_and_stops_on_sigterm(redis_url, tmp_path):
    port = free_port()
    env = dict(os.environ, BRIGADE_LOG_FORMAT="json", BRIGADE_REDIS_URL=redis_url,
               BRIGADE_BUCKET=f"file://{tmp_path / 'bucket'}", BRIGADE_TOKEN="tok")
    proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.main", "proxy", "--listen", f"127.0.0.1:{port}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_port(port, proc=proc)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            runs = pbg.RunServiceStub(channel)
            run = new_run_id("proc")
            runs.CreateRun(pb.CreateRunRequest(spec=make_spec(run), prompts=make_prompts(3)),
                           metadata=(("authorization", "Bearer tok"),), timeout=10)
        assert (tmp_path / "bucket" / "runs" / run / "run.pb").exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        logs = [json.loads(line) for line in proc.stderr.read().splitlines() if line.startswith("{")]
        events = [entry["event"] for entry in logs]
        assert "proxy listening" in events and "run created" in events and events[-1] == "proxy stopped"
        assert all(entry["service"] == "proxy" for entry in logs)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_proxy_refuses_a_taken_port(redis_url):
    port = free_port()
    first = subprocess.Popen([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                              "--redis-url", redis_url, "--bucket", ""],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=first)
        second = subprocess.run([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                                 "--redis-url", redis_url, "--bucket", ""], capture_output=True, text=True, timeout=30)
        assert second.returncode == 1
        assert "brigade proxy:" in second.stderr and "Traceback" not in second.stderr
    finally:
        first.terminate()
        first.wait(10)
