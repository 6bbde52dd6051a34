"""The whole system as real processes, observed and audited: `AuditedSystem`, the one
`brigade_harness.system.LocalSystem` subclass the chaos and fault tests (tests/chaos_support.py) and
the whole-system benchmarks (brigade_bench.fleet, .preemption) drive; the audit itself is
brigade_testing.audit, the bucket watcher brigade_testing.bucket_watch.

It records what its caller did (every start, kill and restart, with times: events.json on close),
reads services' JSON logs and Redis, waits for conditions while failing fast on a crash, and can
stop a run in order. Two ways to use it:

- with a spec (the chaos and fault tests): one run on moto's S3 (behind the fault-injecting proxy of
  `brigade_testing.faulty_s3` when given `faults`), a redis-server with its append-only file, a
  token. `start()` creates the run, starts `brigade proxy`, `brigade janitor`, `brigade learner` and
  N rollout workers (`brigade rollout`, or the slow worker host of `brigade_testing.slow_worker`);
  every worker restart is a new worker id. A `BucketWatcher` thread records the sha256 of every
  write-once object (adapter versions, complete checkpoints' manifests, rollout objects) the moment
  it appears, so overwriting any of them later is caught, and `audit()` reads Redis and the bucket
  after the run and accounts for every batch ever cut.
- without (`AuditedSystem.for_hosts`, the benchmarks): a local-folder bucket, no token, `brigade
  proxy` and `brigade janitor`; the caller creates runs and starts a learner host
  (`brigade_testing.slow_learner`) and worker hosts (`brigade_testing.slow_worker`) that wait for a
  "go" file per run (`run_until`), so every host starts together and the clock starts at go.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import redis
import yaml

from brigade import keys
from brigade.spec_file import spec_to_dict
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.system import LAUNCHER, LocalSystem, Service, read_json_lines, run_each
from brigade_testing.audit import audit_run
from brigade_testing.bucket_watch import BucketWatcher, list_keys, s3_client
from brigade_testing.slow_engine import DelayModel

TOKEN = "chaos-token"


# ---------------------------------------------------------------- processes


def clean_env() -> dict[str, str]:
    """This process's environment without the caller's BRIGADE_* and AWS_* settings (the system sets
    its own), one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BRIGADE_", "AWS_")) or k == "BRIGADE_CACHE"}
    return env | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "PYTHONWARNINGS": "ignore", "PYTHONDONTWRITEBYTECODE": "1"}


class AuditedSystem(LocalSystem):
    """With `spec`: that one run, every service a process, on moto's S3 (behind the fault-injecting
    proxy when given `faults`). Without: the benchmarks' system of hosts (see `for_hosts`). Use as a
    context manager (everything is stopped on exit)."""

    driver = "learner"         # the service whose exit 0 ends the run
    fleet = "rollout-"         # the replaceable processes, one slot each

    def __init__(self, workdir: Path, spec: pb.RunSpec | None = None, *, workers: int = 3, faults=None,
                 token: str = TOKEN, janitor_interval: float = 0.5,
                 worker_args: dict[int, list[str]] | None = None):
        if spec is not None:
            self.bucket_name = f"chaos-{uuid.uuid4().hex[:10]}"
            self.bucket_root = "root"
            super().__init__(workdir, appendonly=True, s3=True, bucket=f"s3://{self.bucket_name}/{self.bucket_root}",
                             token=token, run=spec.run_id, env=clean_env())
        else:  # a local-folder bucket (root/bucket), the caller's environment with one thread per process
            super().__init__(workdir, token=token, env=dict(os.environ, OMP_NUM_THREADS="1",
                                                            PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false"))
        self.spec = spec
        self.signals = self.root / "signals"       # the hosts' ready/go/done files
        self.n_workers = workers
        # slot -> flags of a slow worker host (brigade_testing.slow_worker) in place of `brigade rollout`
        self.worker_args = worker_args or {}
        self.faults = faults                       # a faulty_s3.Faults, or None for a clean path
        self.janitor_interval = janitor_interval
        self.worker_gen: Counter = Counter()
        self.worker_ids: dict[str, str] = {}       # service name -> the worker id of its current life
        self.events: list[dict] = []               # what the test did, with times
        self.faulty = None
        self.watcher: BucketWatcher | None = None
        self.t0 = time.monotonic()
        self._log_pos: dict[str, int] = {}

    @classmethod
    def for_hosts(cls, root: Path, janitor_interval: float = 1.0) -> AuditedSystem:
        """redis-server, a file:// bucket, `brigade proxy` and `brigade janitor`, started, with no
        token: the caller adds runs (`create_run`) and the hosts that serve them (`learner_host`,
        `worker_host`)."""
        system = cls(root, token="", janitor_interval=janitor_interval)
        try:
            system.start()
        except BaseException:
            system.close()
            raise
        return system

    # ------------------------------------------------------------ start / stop

    @property
    def s3_endpoint(self) -> str:
        """What the services use (the faulty proxy when there is one)."""
        return self.faulty.url if self.faulty is not None else self.moto.url

    def start(self) -> None:
        if self.spec is None:  # the hosts come later, from the caller
            self.signals.mkdir(parents=True, exist_ok=True)
            self.start_servers()
            self.start_proxy()
            self.spawn("janitor", ["janitor", "--interval", str(self.janitor_interval),
                                   "--lock-ttl-ms", str(int(self.janitor_interval * 5000))])
            return
        from brigade.model import resolve_model

        resolve_model("demo")  # build once (cached), before several processes race to do it
        self.start_servers()
        if self.faults is not None:
            from brigade_testing.faulty_s3 import start_in_thread

            self.faulty = start_in_thread(self.moto.url, self.faults)
        spec_path = self.root / "run.yaml"
        spec_path.write_text(yaml.safe_dump(spec_to_dict(self.spec), sort_keys=False))
        self.start_proxy()
        self.create_run(self.spec)
        self.watcher = BucketWatcher(self.moto.url, self.bucket_name, self.bucket_root, self.run)
        self.watcher.start()
        self.spawn("janitor", ["janitor", "--interval", str(self.janitor_interval), "--lock-ttl-ms", "2000"])
        self.start_training(spec_path)

    def start_training(self, spec_path: Path) -> None:
        # every checkpoint is kept: the audit reads the learner's whole lineage from them
        self.spawn("learner", ["learner", "--run", self.run, "--spec", str(spec_path), "--keep-checkpoints", "0"])
        for i in range(self.n_workers):
            self.spawn(f"rollout-{i}", *self._worker_life(i))

    def spawn(self, name: str, args: list[str], module: str = LAUNCHER) -> Service:
        self.note("start", name)
        return super().spawn(name, args, module)

    def restart(self, name: str, args: list[str] | None = None) -> Service:
        self.note("start", name)
        if self.spec is not None and name.startswith(self.fleet):
            args, _ = self._worker_life(int(name.split("-")[1]))
        return super().restart(name, args)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.services[name].alive():
            self.note("kill", name)
        super().kill(name, sig)

    def damage_newest_checkpoint(self, name: str) -> tuple[int, int]:
        """Cut file `name` of the newest checkpoint with a manifest in half, behind the learner's
        back (a disk or a store that lost half an object); returns its (step, attempt). The bucket
        watcher is told, so the cut is not counted as an overwrite."""
        from brigade_learner.checkpoint import STEP_DIR

        client = s3_client(self.moto.url)
        root = f"{self.bucket_root}/{keys.run_prefix(self.run)}checkpoints/"
        found = []
        for key in list_keys(client, self.bucket_name, root):
            m = STEP_DIR.match(key[len(root):])
            if m and key.endswith("/manifest.json"):
                found.append((int(m.group(1)), int(m.group(2) or 0)))
        step, attempt = max(found)
        key = f"{self.bucket_root}/{keys.checkpoint_prefix(self.run, step, attempt)}{name}"
        data = client.get_object(Bucket=self.bucket_name, Key=key)["Body"].read()
        client.put_object(Bucket=self.bucket_name, Key=key, Body=data[: len(data) // 2])
        if self.watcher is not None:
            self.watcher.damaged.add(key[len(f"{self.bucket_root}/{keys.run_prefix(self.run)}"):])
        self.note("damage", "bucket", key=key)
        return step, attempt

    def _worker_life(self, i: int) -> tuple[list[str], str]:
        """Arguments and module of worker slot i's next life: each is a new machine with a new worker
        id (as a new spot VM would be)."""
        self.worker_gen[i] += 1
        wid = self.worker_ids[f"rollout-{i}"] = f"w{i}-{self.worker_gen[i]}"
        if i in self.worker_args:
            return (["--runs", self.run, "--worker-id", wid, "--price-per-hour", "0.5", *self.worker_args[i]],
                    "brigade_testing.slow_worker")
        return (["rollout", "--run", self.run, "--worker-id", wid, "--exit-when-finished", "--price-per-hour", "0.5"],
                LAUNCHER)

    def note(self, what: str, name: str, **info: Any) -> None:
        self.events.append({"t": round(time.monotonic() - self.t0, 2), "what": what, "service": name, **info})

    def worker_names(self) -> list[str]:
        return sorted(n for n in self.services if n.startswith(self.fleet))

    def close(self) -> None:
        """Stop everything; each step runs even if an earlier one failed (no server is leaked)."""
        def stop_watcher() -> None:
            if self.watcher is not None and self.watcher.is_alive():
                self.watcher._halt.set()
                self.watcher.join(5)

        run_each([lambda: (self.root / "events.json").write_text(json.dumps(self.events, indent=1)),
                  self.stop_services, stop_watcher, self.faulty and self.faulty.stop, super().close])

    # ------------------------------------------------------------ observing

    def r(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url, socket_timeout=10)

    def log_events(self, name: str, new_only: bool = True) -> list[dict]:
        """JSON log lines of a service (every life: the log is appended to)."""
        events, end = read_json_lines(self.logs / f"{name}.log", self._log_pos.get(name, 0) if new_only else 0)
        if new_only:
            self._log_pos[name] = end
        return events

    def learner_step(self) -> int:
        """The last step the proxy knows was checkpointed and acked."""
        try:
            with self.r() as r:
                return int(r.get(keys.RunKeys(self.run).learner_step) or 0)
        except redis.RedisError:
            return -1

    def lease_holders(self) -> set[str]:
        """Worker ids holding a lease right now."""
        with self.r() as r:
            rows = r.xpending_range(keys.RunKeys(self.run).work, keys.WORK_GROUP, "-", "+", 1000)
        return {row["consumer"].decode() for row in rows} - {"janitor"}

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str, every: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; {self.describe()}")
            self.check_no_crash()
            time.sleep(every)

    def check_no_crash(self) -> None:
        """A service that exits on its own (not killed by the test) is a failure, except workers and the
        learner finishing the run with code 0."""
        for name, svc in self.services.items():
            rc = svc.proc.poll() if svc.proc is not None else None
            if rc is None or rc == -signal.SIGKILL:
                continue
            if rc == 0 and (name == self.driver or name.startswith(self.fleet)):
                continue
            raise AssertionError(f"{name} exited with code {rc} without being killed; log tail:\n{svc.tail()}")

    def describe(self) -> str:
        alive = {n: s.alive() for n, s in self.services.items()}
        return f"learner_step={self.learner_step()} alive={alive}"

    def finish(self, timeout: float) -> None:
        """Wait for the learner (the driver) to reach max_steps and exit 0, then for the workers to see
        the run finished and exit 0; then stop the janitor and the proxy."""
        learner = self.services[self.driver]
        self.wait_until(lambda: not learner.alive(), timeout, f"the {self.driver} to finish", every=0.2)
        assert learner.proc.returncode == 0, (f"{self.driver} exited {learner.proc.returncode}; log tail:\n"
                                              f"{(self.logs / f'{self.driver}.log').read_text()[-3000:]}")
        self.note("exit", self.driver, rc=0)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(self.services[w].alive() for w in self.worker_names()):
            time.sleep(0.2)
        for w in self.worker_names():
            svc = self.services[w]
            if svc.alive():  # still importing torch when the run ended: it would exit at its first lease call
                svc.stop(timeout=10)
            elif svc.proc.returncode != 0:
                raise AssertionError(f"{w} exited {svc.proc.returncode}; log tail:\n"
                                     f"{(self.logs / f'{w}.log').read_text()[-3000:]}")
        for name in ("janitor", "proxy"):
            self.services[name].stop(timeout=10)
            assert self.services[name].proc.returncode == 0, f"{name} did not stop cleanly"

    # ------------------------------------------------------------ hosts (without a spec)

    def learner_host(self, runs: Sequence[str], learner_step_s: float = 0.0) -> Service:
        return self.spawn("learner", ["--proxy", self.proxy, "--bucket", self.bucket,
                                      "--runs", ",".join(runs), "--signals", str(self.signals),
                                      "--learner-step-s", str(learner_step_s)],
                          module="brigade_testing.slow_learner")

    def worker_host(self, worker_id: str, factor: float, runs: Sequence[str], delay: DelayModel,
                    name: str = "") -> Service:
        return self.spawn(name or f"rollout-{worker_id}", [
            "--proxy", self.proxy, "--bucket", self.bucket, "--runs", ",".join(runs), "--signals", str(self.signals),
            "--worker-id", worker_id, "--speed-factor", str(factor), "--delay", json.dumps(asdict(delay)),
            "--engine-log", str(self.logs / f"engine-{worker_id}.jsonl"), "--device", "cpu"],
            module="brigade_testing.slow_worker")

    def touch_signal(self, name: str) -> float:
        t = time.time()
        (self.signals / name).touch()
        return t

    def wait_signals(self, names: Sequence[str], timeout: float, hosts: Sequence[Service] = ()) -> None:
        deadline = time.monotonic() + timeout
        while not all((self.signals / n).exists() for n in names):
            for h in hosts:
                if not h.alive():
                    raise RuntimeError(f"{h.name} exited with {h.proc.returncode}:\n{h.tail()}")
            if time.monotonic() > deadline:
                missing = [n for n in names if not (self.signals / n).exists()]
                raise TimeoutError(f"no {missing} after {timeout:.0f}s")
            time.sleep(0.05)

    def run_until(self, run: str, steps: int, timeout: float, hosts: Sequence[Service] = (),
                  tick: Callable[[float], None] | None = None) -> tuple[float, bool]:
        """Start `run` (the learner and workers are waiting for its go signal) and wait until the
        learner has finished `steps` steps. Returns (go time, finished in time)."""
        t_go = self.touch_signal(f"go-{run}")
        deadline = time.monotonic() + timeout
        done = self.signals / f"done-learner-{run}"
        while not done.exists():
            if time.monotonic() > deadline:
                return t_go, False
            for h in hosts:  # a host that died (not one we killed: those are not passed here) ends the run
                if not h.alive() and not done.exists() and (h.name == "learner" or h.proc.returncode != 0):
                    raise RuntimeError(f"{h.name} exited with {h.proc.returncode}:\n{h.tail()}")
            if tick is not None:
                tick(t_go)
            time.sleep(0.1)
        return t_go, True

    def engine_log(self, run: str) -> list[dict]:
        rows = []
        for path in self.logs.glob("engine-*.jsonl"):
            for line in path.read_text().splitlines():
                with contextlib.suppress(ValueError):
                    row = json.loads(line)
                    if row.get("run") == run:
                        rows.append(row)
        return rows

    def rollout_rewards(self, run: str) -> dict[int, list[float]]:
        """policy version -> every scored sample's reward of the rollouts generated with it (from the
        text sidecars the workers upload next to each rollout object)."""
        out: dict[int, list[float]] = {}
        for path in (self.root / "bucket" / "runs" / run / "rollouts").glob("*/attempt-*.json"):
            with contextlib.suppress(ValueError, OSError):
                doc = json.loads(path.read_text())
                rewards = [r["reward"] for r in doc["samples"] if r.get("reward") is not None]
                out.setdefault(int(doc["policy_version"]), []).extend(rewards)
        return out

    # ------------------------------------------------------------ the audit

    def audit(self) -> dict[str, Any]:
        """Every batch ever cut accounted for, and the learner's lineage (brigade_testing.audit)."""
        return audit_run(self)

    def created_batches(self, cursor: int) -> list[str]:
        """The ids of the first `cursor` batches cut, in order."""
        bpe = -(-len(self._prompts()) // self.spec.prompts_per_batch)
        return [keys.batch_id(self.run, n // bpe, n % bpe) for n in range(cursor)]

    def _prompts(self) -> list[pb.Prompt]:
        from brigade.datasets import load_prompts

        return load_prompts(self.spec.dataset)
