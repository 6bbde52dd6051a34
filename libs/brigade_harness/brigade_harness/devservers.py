"""Local servers for tests, benchmarks and `brigade up` (through brigade_harness.system.LocalSystem):
a redis-server, a Redis Cluster of three masters, and an S3 API (moto).

They run as child processes on free loopback ports, so nothing shares the machine's own Redis
on 6379 and nothing competes with the caller for the GIL.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_ports_at(offsets: tuple[int, ...], low: int, high: int, what: str) -> int:
    """A random port P in [low, high] with P + each offset free on the loopback."""
    for _ in range(200):
        port = random.randint(low, high)
        try:
            with contextlib.ExitStack() as stack:
                for offset in offsets:
                    stack.enter_context(socket.socket()).bind(("127.0.0.1", port + offset))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free {what}")


def free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000, where the nodes of a Redis Cluster talk) is free too."""
    return _free_ports_at((0, 10_000), 20_000, 55_000, "port pair for a Redis Cluster node")


def free_port_run(count: int) -> int:
    """The first of `count` consecutive free ports (`brigade proxy --processes N --metrics-port P`
    serves P..P+N-1), below the kernel's ephemeral range: a port in that range can be taken between
    this check and the server's bind by any outgoing connection's local end (connect() favours the
    odd ports, so P+1 of an even P from bind(0) is exactly where one lands)."""
    try:
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except OSError:  # not Linux
        ephemeral_low = 32_768
    return _free_ports_at(tuple(range(count)), 10_000, ephemeral_low - count, f"run of {count} ports")


def wait_for_port(port: int, timeout: float = 15.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout:.0f}s")


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    url: str
    workdir: Path | None = None
    argv: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def restart(self, timeout: float = 15.0) -> None:
        """Start the same server again on the same port (same data folder: AOF survives)."""
        self.stop()
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port, timeout, self.proc)


def start_redis(workdir: str | Path, port: int | None = None, appendonly: bool = False,
                cluster: bool = False) -> ServerProcess:
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = port or (free_cluster_port() if cluster else free_port())
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(workdir),
        "--save", "", "--appendonly", "yes" if appendonly else "no",
        "--appendfsync", "everysec", "--protected-mode", "no", "--daemonize", "no",
    ]
    if cluster:
        argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "5000"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for_port(port, proc=proc)
    return ServerProcess(proc, port, f"redis://127.0.0.1:{port}/0", workdir, argv)


@dataclass
class LocalCluster:
    """A Redis Cluster of masters on this machine; `url` names one node, as a client would."""

    nodes: list[ServerProcess]
    url: str

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def start_redis_cluster(workdir: str | Path, masters: int = 3, appendonly: bool = False,
                        timeout: float = 30.0) -> LocalCluster:
    """`masters` cluster-enabled redis-servers joined with `redis-cli --cluster create` (no replicas),
    returned once every node says cluster_state:ok (about a second)."""
    cli = shutil.which("redis-cli")
    if cli is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
    workdir = Path(workdir)
    nodes: list[ServerProcess] = []
    try:  # every node started so far is stopped if a later one (or the create) fails
        for i in range(masters):
            nodes.append(start_redis(workdir / f"node-{i}", appendonly=appendonly, cluster=True))
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes), "--cluster-replicas",
                        "0", "--cluster-yes"], check=True, capture_output=True, timeout=timeout)
        deadline = time.monotonic() + timeout
        for node in nodes:
            while b"cluster_state:ok" not in subprocess.run([cli, "-p", str(node.port), "cluster", "info"],
                                                            capture_output=True, timeout=5).stdout:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the Redis Cluster on ports {[n.port for n in nodes]} did not come up")
                time.sleep(0.1)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return LocalCluster(nodes, f"redis+cluster://127.0.0.1:{nodes[0].port}")


def start_moto(port: int | None = None) -> ServerProcess:
    """moto's S3 HTTP server (server mode, as aiobotocore's own tests use it)."""
    port = port or free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    # moto imports all of its service backends before it listens: about 5 s of CPU here,
    # and more than 30 s of wall on a 2-core machine that other jobs keep busy.
    wait_for_port(port, timeout=120, proc=proc)
    return ServerProcess(proc, port, f"http://127.0.0.1:{port}", None, argv)


# Credentials moto accepts; set for a process that talks to a local moto server.
MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
