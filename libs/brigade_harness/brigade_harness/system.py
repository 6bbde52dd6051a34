"""The whole system on one machine, each service its own process, for `brigade up`, the benchmarks
and the chaos tests: the harness package's core, beside the servers it starts (brigade_harness.devservers).

`LocalSystem` starts Redis (a given one that answers, else a redis-server of its own; for a given
Redis Cluster, also a single redis-server for rq's queues unless BRIGADE_RQ_REDIS_URL names one), optionally
moto's S3 server, and then whatever services its caller spawns (`brigade proxy`, `janitor`,
`learner`, `rollout`, `evaluator`, or a host module of the caller's that drives a service's own
classes), each with its log under `root/logs`. It can kill, freeze, thaw and restart any of them,
restart the ones that died (supervision), and stops everything in order on `close()`.

A service is `python -m module *args` (by default `python -m brigade_cli.main`, the `brigade`
command) unless the system was given a forker (`brigade up`'s fork server): any object with
`forks(module, args)`, saying which commands it starts, and `spawn(args, env, log)`, returning a
process with Popen's interface. The harness imports no launcher: it only runs one.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from brigade.log import json_env
from brigade_harness.devservers import (
    MOTO_ENV,
    ServerProcess,
    free_port,
    start_moto,
    start_redis,
    wait_for_port,
)

LAUNCHER = "brigade_cli.main"  # `python -m brigade_cli.main ARGS` is `brigade ARGS`

# stop order: workers and trainers first (they hand their leases back), the learner or the aggregator, then
# the coordination layer (the janitor and the proxy do not need each other: they stop together)
STOP_ORDER = {"rollout": 0, "trainer": 0, "evaluator": 0, "learner": 1, "aggregator": 1, "janitor": 2, "proxy": 2}
# exit statuses of a service that a restart would only repeat (brigade.service)
NOT_RESTARTED = {2: "a bad configuration", 3: "a crash loop"}


class Forker(Protocol):
    """What starts some of a system's services in place of a fresh python
    (brigade_cli.forkserver.ForkServer)."""

    def forks(self, module: str, args: list[str]) -> bool:
        """Whether `python -m module *args` is one of the commands this forker starts."""

    def spawn(self, args: list[str], env: dict[str, str], log: Path) -> Any:
        """The command started, as a process with Popen's poll, wait, send_signal, kill and returncode."""


@dataclass
class Service:
    """One service process: every start appends to the same log."""

    name: str
    module: str                                        # run as `python -m module *args`
    args: list[str]
    log: Path
    env: dict[str, str]
    proc: subprocess.Popen | Any = None                # Popen, or what the forker's spawn returned
    starts: int = 0
    kills: int = 0                                     # lives ended by LocalSystem.kill()
    forker: Forker | None = None                       # started by it (torch preloaded), else a fresh python
    _terminated: object = None                         # the proc that was sent SIGTERM

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        if self.forker is not None:  # a child of the fork server: its own session too, the same interface
            self.proc = self.forker.spawn(self.args, self.env, self.log)
            self.starts += 1
            return
        # own process group: Ctrl-C in the terminal reaches the launcher, which stops services in order
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        self.starts += 1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crashed(self) -> bool:
        """Exited, and not with 0 (a learner after max_steps, a worker after the run finished)."""
        return self.proc is not None and self.proc.poll() not in (None, 0)

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            self.proc.send_signal(sig)

    def terminate(self) -> None:
        """SIGTERM (after SIGCONT: a frozen process cannot handle it), once per life."""
        if self.alive() and self._terminated is not self.proc:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = self.proc

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (unless `terminate` sent it), SIGKILL after `timeout`."""
        if not self.alive():
            return
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def last_problems(self, n: int = 2, chars: int = 200_000) -> list[str]:
        """The newest `n` distinct warnings or errors of this service's log, oldest first, one line
        each: a JSON log line's event and details, or the closing line of a Python traceback."""
        found: dict[str, str] = {}  # event -> its newest line; insertion order = recency
        for line in self.tail(chars).splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                doc = None
            if isinstance(doc, dict) and doc.get("level") in ("warning", "error", "critical"):
                details = " ".join(f"{k}={v}" for k, v in doc.items()
                                   if k not in ("event", "level", "timestamp", "service", "exception"))
                kind, text = str(doc.get("event")), f"{doc.get('event')}: {details}".strip(": ")
            elif doc is None and re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", line):
                kind, text = line.split(":")[0], line.strip()  # the closing line of a traceback
            else:
                continue
            found.pop(kind, None)
            found[kind] = text[:400]
        return list(found.values())[-n:]

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


class LocalSystem:
    """Redis, an optional moto S3 server and the services, all under `root`. `env` is the
    environment the services inherit (default: this process's); the system adds where Redis, the
    bucket and the proxy are."""

    def __init__(self, root: Path, *, redis_url: str = "", appendonly: bool = False, s3: bool = False,
                 bucket: str = "", port: int = 0, token: str = "", run: str = "",
                 env: dict[str, str] | None = None, forker: Forker | None = None):
        self.root = Path(root)
        self.logs = self.root / "logs"
        self.redis_url, self.appendonly, self.s3 = redis_url, appendonly, s3
        self.bucket = bucket or f"file://{self.root / 'bucket'}"
        self.proxy = f"127.0.0.1:{port or free_port()}"
        self.token, self.run = token, run
        self.base_env = dict(os.environ if env is None else env)
        self.redis: ServerProcess | None = None        # ours, when no given Redis answered
        self.rq_url = ""                               # rq's single-node Redis, when redis_url is a cluster
        self.rq_redis: ServerProcess | None = None     # ours, when no given one answered
        self.moto: ServerProcess | None = None
        self.services: dict[str, Service] = {}
        self.forker = forker  # the commands it forks (torch services) start from it; the rest as processes

    def __enter__(self) -> LocalSystem:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ servers and services

    def start_servers(self) -> None:
        from brigade.redis_clients import is_cluster

        if not self.redis_url or not redis_answers(self.redis_url):
            self.redis = start_redis(self.root / "redis", appendonly=self.appendonly)
            self.redis_url = self.redis.url
        if is_cluster(self.redis_url):  # rq cannot use a cluster: its queues get a Redis of their own
            given = self.base_env.get("BRIGADE_RQ_REDIS_URL", "")
            if given and redis_answers(given):
                self.rq_url = given
            else:
                self.rq_redis = start_redis(self.root / "rq-redis", appendonly=self.appendonly)
                self.rq_url = self.rq_redis.url
        if self.s3:
            self.moto = start_moto()

    @property
    def s3_endpoint(self) -> str:
        """Where the services reach S3."""
        return self.moto.url

    def service_env(self) -> dict[str, str]:
        # the crash journals (brigade.crash_loop) in the run's folder: this run's crashes, no one else's
        env = dict(process_env(self.base_env), BRIGADE_REDIS_URL=self.redis_url, BRIGADE_BUCKET=self.bucket,
                   BRIGADE_PROXY=self.proxy, BRIGADE_LISTEN=self.proxy, BRIGADE_TOKEN=self.token,
                   BRIGADE_STATE_DIR=str(self.root / "state"))
        # the trackers' files (TensorBoard, W&B offline, trackio) in the run's folder, not the caller's cwd
        env.setdefault("BRIGADE_TRACKER_DIR", str(self.root / "trackers"))
        if self.run:
            env["BRIGADE_RUN"] = self.run
        if self.rq_url:
            env["BRIGADE_RQ_REDIS_URL"] = self.rq_url
        if self.moto is not None:
            env.update(MOTO_ENV, AWS_ENDPOINT_URL=self.s3_endpoint)
        return env

    def spawn(self, name: str, args: list[str], module: str = LAUNCHER) -> Service:
        """Start `python -m module *args` as service `name` (by the system's forker, when it has one
        that forks this command)."""
        forker = self.forker if self.forker is not None and self.forker.forks(module, args) else None
        svc = Service(name, module, args, self.logs / f"{name}.log", self.service_env(), forker=forker)
        self.services[name] = svc
        return self._launch(svc)

    def start_proxy(self, *args: str) -> Service:
        """`brigade proxy` on self.proxy."""
        return self.spawn("proxy", ["proxy", *args])

    def _launch(self, svc: Service) -> Service:
        svc.start()
        if svc.name == "proxy":  # everything else talks to it: wait until it listens
            wait_for_port(int(self.proxy.rsplit(":", 1)[1]), 60, svc.proc)
        return svc

    def create_run(self, spec, timeout: float = 60, prompts=None) -> None:
        asyncio.run(create_run(self.proxy, self.token, spec, timeout, prompts))

    def get_run(self, run: str):
        """The run's RunState, or None when the proxy's Redis has no such run."""
        return asyncio.run(get_run(self.proxy, self.token, run))

    # ------------------------------------------------------------ faults

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """SIGKILL (no handler runs, nothing is flushed) or SIGTERM, and wait for the exit."""
        svc = self.services[name]
        if svc.alive():
            svc.proc.send_signal(signal.SIGCONT)
            svc.proc.send_signal(sig)
            svc.proc.wait()
            svc.kills += 1

    def freeze(self, names: list[str]) -> None:
        for n in names:
            self.services[n].signal(signal.SIGSTOP)

    def thaw(self, names: list[str]) -> None:
        for n in names:
            self.services[n].signal(signal.SIGCONT)

    def restart(self, name: str, args: list[str] | None = None) -> Service:
        """Start a dead service again (its log and counts go on), with new arguments if given."""
        svc = self.services[name]
        if svc.alive():
            raise RuntimeError(f"{name} is still running")
        svc.args = svc.args if args is None else args
        return self._launch(svc)

    def restart_crashed(self, max_restarts: int) -> str | None:
        """Start again every service that died: each resumes where its state (Redis, the bucket)
        says, which is the point of the design. Returns an error when one keeps dying, or exited
        with a status a restart would only repeat (2 a bad configuration, 3 a crash loop), naming
        its last line."""
        for svc in list(self.services.values()):
            if not svc.crashed():
                continue
            rc = svc.proc.returncode
            if rc in NOT_RESTARTED:
                last = (svc.last_problems(1) or [svc.tail(400).strip().rsplit("\n", 1)[-1]])[0]
                return f"{svc.name} exited with {rc} ({NOT_RESTARTED[rc]}), not restarted: {last}"
            if svc.starts > max_restarts:
                return f"{svc.name} exited with {rc} {svc.starts} times; its log: {svc.log}"
            print(f"{svc.name} exited with {rc}: restarting it ({svc.starts}/{max_restarts})", file=sys.stderr)
            self.restart(svc.name)
        return None

    # ------------------------------------------------------------ stopping

    def stop_services(self, keep: Iterable[str] = ()) -> None:
        """Stop every service but those named in `keep`, in STOP_ORDER; the services of one rank
        (the workers, say) are sent SIGTERM together and then waited for."""
        ranks: dict[int, list[Service]] = {}
        for svc in self.services.values():
            if svc.name not in keep:
                ranks.setdefault(STOP_ORDER.get(svc.name.split("-")[0], 0), []).append(svc)
        for rank in sorted(ranks):
            for svc in ranks[rank]:
                svc.terminate()
            for svc in ranks[rank]:
                svc.stop()

    def close(self) -> None:
        """Stop the services, then the servers."""
        run_each([self.stop_services, self.moto and self.moto.stop, self.redis and self.redis.stop,
                  self.rq_redis and self.rq_redis.stop])


def process_env(base: dict[str, str]) -> dict[str, str]:
    """What every service process needs before it imports anything (the fork server's too)."""
    env = dict(base, **json_env())  # JSON lines only: grpc-core and tqdm silenced before they load
    env.setdefault("OMP_NUM_THREADS", "1")  # N torch processes on a few cores: one thread each
    # glibc's per-thread malloc arenas each keep their freed peak: with torch's large, varying
    # tensors and a few threads per service that is gigabytes of RSS held for nothing
    env.setdefault("MALLOC_ARENA_MAX", "2")
    env.pop("BRIGADE_METRICS_PORT", None)  # one port for every service on one machine: they would collide
    return env


def run_each(steps: Iterable[Callable[[], object] | None]) -> None:
    """Run every step (None: skipped) even if an earlier one failed, so no server is leaked; then
    raise the first error."""
    errors = []
    for step in steps:
        try:
            if step:
                step()
        except Exception as e:  # noqa: BLE001 - raised once the rest has run
            errors.append(e)
    if errors:
        raise errors[0]


def read_json_lines(path: Path, since: int = 0) -> tuple[list[dict], int]:
    """The JSON lines of a service's log from byte `since` on, whole lines only (a line still being
    written is left for the next read), and the byte where they end."""
    if not path.exists():
        return [], since
    with path.open("rb") as f:
        f.seek(since)
        data = f.read()
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out, since + end


def redis_answers(url: str) -> bool:
    """Whether the Redis (or Redis Cluster) at `url` answers a PING within half a second."""
    import redis

    from brigade.redis_clients import is_cluster, redis_py_url

    try:
        if is_cluster(url):
            with redis.RedisCluster.from_url(redis_py_url(url), socket_connect_timeout=0.5) as r:
                return bool(r.ping())
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


async def get_run(proxy: str, token: str, run: str):
    import grpc

    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    async with ProxyClient.connect(proxy, token) as client:
        try:
            return await client.runs.GetRun(pb.RunRef(run_id=run), timeout=20)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise


async def create_run(proxy: str, token: str, spec, timeout: float = 60, prompts=None) -> None:
    """CreateRun with the spec's dataset (read once, unless the caller has `prompts`), retried
    through whatever may pass (the proxy still starting, a bucket fault while it stores run.pb); a
    refusal (a bad spec, another run with this id, a wrong token) is raised at once."""
    import grpc

    refusals = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION,
                grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED,
                grpc.StatusCode.UNIMPLEMENTED}

    from brigade.datasets import train_prompts
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    request = pb.CreateRunRequest(spec=spec, prompts=prompts if prompts is not None else train_prompts(spec), exist_ok=True)
    deadline = time.monotonic() + timeout
    async with ProxyClient.connect(proxy, token) as client:
        while True:
            try:
                await client.runs.CreateRun(request, timeout=20)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() in refusals or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.3)
