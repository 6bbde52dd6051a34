"""`brigade proxy` as a process: starts, serves, logs JSON, shuts down cleanly on SIGTERM."""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from proxy_support import make_prompts, make_spec, new_run_id

from brigade.v1 import brigade_pb2 as pb
from brigade.v1 import brigade_pb2_grpc as pbg
from brigade_harness.devservers import free_port, free_port_run, wait_for_port


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


def test_proxy_refuses_a_taken_port(redis_url, tmp_path):
    """A crash at start: one line saying what and where, its record in the proxy's crash journal."""
    port = free_port()
    first = subprocess.Popen([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                              "--redis-url", redis_url, "--bucket", ""],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, proc=first)
        env = dict(os.environ, BRIGADE_LOG_FORMAT="json", BRIGADE_STATE_DIR=str(tmp_path))
        second = subprocess.run([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                                 "--redis-url", redis_url, "--bucket", ""], env=env, capture_output=True, text=True,
                                timeout=30)
        assert second.returncode == 1 and "Traceback" not in second.stderr, second.stderr
        crashed = [json.loads(line) for line in second.stderr.splitlines() if '"crashed"' in line]
        assert len(crashed) == 1, second.stderr
        assert crashed[0]["error"].startswith("RuntimeError: ") and f"127.0.0.1:{port}" in crashed[0]["error"]
        assert crashed[0]["where"].startswith("brigade_proxy/server.py:") and crashed[0]["where"].endswith("start_server")
        assert crashed[0]["journal"] == str(tmp_path / "crashes" / "proxy-all.jsonl")
    finally:
        first.terminate()
        first.wait(10)


def _listening(stderr_lines: list[str]) -> list[dict]:
    return [entry for entry in _json_entries(stderr_lines) if entry.get("event") == "proxy listening"]


def _json_entries(stderr_lines: list[str]):
    """Every JSON object of the lines. The processes share one stderr, and a line is written as the
    text and then its newline, so two processes' lines can land as `{...}{...}` on one line."""
    decoder = json.JSONDecoder()
    for line in stderr_lines:
        text, at = line.strip(), 0
        while text.startswith("{", at):
            try:
                entry, at = decoder.raw_decode(text, at)
            except ValueError:
                break
            yield entry


def _listening_pids(stderr_lines: list[str]) -> set[int]:
    return {entry["pid"] for entry in _listening(stderr_lines)}


def _read_until(proc: subprocess.Popen, done, timeout: float = 60) -> list[str]:
    """stderr lines of `proc` until done(lines) holds (or the process ends, or `timeout` passes).
    Reads the pipe's bytes itself: a buffered readline() can pull two lines off the pipe and return one,
    and select() then waits on an empty pipe while the other line sits in the buffer."""
    lines: list[str] = []
    pending = b""
    fd = proc.stderr.fileno()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while not done(lines) and time.monotonic() < deadline:
        if sel.select(timeout=1) and (chunk := os.read(fd, 65536)):
            *complete, pending = (pending + chunk).split(b"\n")
            lines += [line.decode() + "\n" for line in complete]
        elif proc.poll() is not None:
            break
    sel.close()
    return lines


def _list_runs_served(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('brigade_proxy_rpcs_total{') and 'method="ListRuns"' in line)


def test_proxy_processes_share_one_port(redis_url):
    """--processes 2: two proxies on one port (SO_REUSEPORT), each serving the connections the kernel
    gives it and its own metrics (P, P+1); SIGTERM stops both cleanly, and a child that dies takes the
    other down with a non-zero exit."""
    port = free_port_run(3)  # the gRPC port, then the two processes' metrics ports
    metrics = port + 1
    argv = [sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_url,
            "--bucket", "", "--processes", "2", "--metrics-port", str(metrics)]
    env = dict(os.environ, BRIGADE_LOG_FORMAT="json")
    for ending in ("sigterm", "child dies"):
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            lines = _read_until(proc, lambda lines: len(_listening_pids(lines)) == 2)
            pids = _listening_pids(lines)
            assert len(pids) == 2 and proc.pid not in pids, lines
            # a connection each (not gRPC's one shared connection): the kernel spreads them over both
            calls = 40
            try:
                for _ in range(calls):
                    with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
                        pbg.RunServiceStub(ch).ListRuns(pb.ListRunsRequest(), timeout=10)
            except grpc.RpcError as e:  # what the proxies said is the explanation (SIGTERM: the parent stops them)
                proc.send_signal(signal.SIGTERM)
                raise AssertionError(f"{e.code()}: {e.details()}; the proxies logged:\n"
                                     f"{''.join(lines)}{proc.communicate(timeout=30)[1]}") from e
            served = [_list_runs_served(metrics), _list_runs_served(metrics + 1)]
            assert sum(served) == calls and min(served) > 0, served
            if ending == "sigterm":
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(20) == 0
            else:
                os.kill(sorted(pids)[0], signal.SIGKILL)
                assert proc.wait(20) == 1
                assert "a proxy process exited; stopping the others" in proc.stderr.read()
            for pid in pids:  # no child left behind
                assert not os.path.exists(f"/proc/{pid}") or "Z" in open(f"/proc/{pid}/stat").read().split()[2]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_proxy_processes_need_a_port():
    out = subprocess.run([sys.executable, "-m", "brigade_proxy", "--listen", "127.0.0.1:0", "--processes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "not port 0" in out.stderr


def test_proxy_processes_stop_on_a_taken_metrics_port(redis_url):
    """The second process's metrics port (P+1) is taken: it says which port, never that it listens,
    and the others stop with it (exit 1, no traceback)."""
    port = free_port_run(3)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", port + 2))
        taken.listen()
        out = subprocess.run([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                              "--redis-url", redis_url, "--bucket", "", "--processes", "2",
                              "--metrics-port", str(port + 1)],
                             env=dict(os.environ, BRIGADE_LOG_FORMAT="json"), capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1, out.stderr
    # on the --listen host (127.0.0.1), not every interface
    assert f"brigade: cannot serve metrics on 127.0.0.1:{port + 2} (--metrics-host, --metrics-port)" in out.stderr
    assert "Traceback" not in out.stderr
    listening = _listening(out.stderr.splitlines())
    assert all(entry["metrics_port"] == port + 1 for entry in listening), listening
