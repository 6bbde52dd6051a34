"""A whole brigade system as real processes, for the chaos and fault tests (not a test module).

`System`, a `brigade_cli.system.LocalSystem`, starts a redis-server (append-only file on), moto's
S3 server (optionally behind the fault-injecting proxy of `faulty_s3`), `brigade proxy`, `brigade
janitor`, `brigade learner` and N rollout workers (`brigade rollout`, or the slow worker host of
`brigade_testing.slow_worker`), each its own process with its own log, and lets a test kill
(SIGKILL), restart, freeze (SIGSTOP) any of them; every worker restart is a new worker id. It
records what the test did in events.json. A `BucketWatcher` thread records the sha256 of every
write-once object (adapter versions, complete checkpoints' manifests, rollout objects) the moment
it appears, so overwriting any of them later is caught. `System.audit()` reads Redis and the
bucket after the run and accounts for every batch ever cut.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
import yaml

from brigade import keys
from brigade.spec_file import build_spec, merge_spec_data, spec_to_dict
from brigade.v1 import brigade_pb2 as pb
from brigade_cli.devservers import MOTO_ENV
from brigade_cli.system import LocalSystem, Service, read_json_lines, run_each

TOKEN = "chaos-token"
IN_FLIGHT_LEASE_PERIODS = 4  # the audit's bound on how long a batch may have been in flight at the end


def stream_ms(entry_id: bytes) -> int:
    """The time (ms) in a stream entry id."""
    return int(entry_id.split(b"-")[0])


def chaos_spec(run_id: str, max_steps: int, **overrides: Any) -> pb.RunSpec:
    """The demo task, made as cheap as it gets: 4 prompts x 4 samples x 4 new tokens per batch,
    LoRA on two projections, short leases so a killed worker's batch comes back within seconds."""
    base: dict[str, Any] = {
        "run_id": run_id, "model": "demo", "dataset": "demo", "dtype": "float32", "device": "cpu", "seed": 7,
        "max_steps": max_steps, "prompts_per_batch": 4, "batches_per_step": 1, "eval_every": 0,
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "grpo": {"learning_rate": 2e-3},
        "staleness": {"max_staleness": 2, "lease_seconds": 6, "max_attempts": 3},
        "rewards": [{"function": "demo_sum"}],
    }
    return build_spec(merge_spec_data(base, overrides))


# ---------------------------------------------------------------- the bucket, read directly


def s3_client(endpoint: str):
    import botocore.session
    from botocore.config import Config

    session = botocore.session.get_session()
    return session.create_client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id=MOTO_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_ENV["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard", "max_attempts": 5}))


def list_keys(client, bucket: str, prefix: str) -> list[str]:
    out: list[str] = []
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", ())]
    except client.exceptions.NoSuchBucket:
        return []
    return out


class BucketWatcher(threading.Thread):
    """Polls the run's prefix and records sha256 of each write-once object when first seen.

    Write-once here: everything under adapters/, each complete checkpoint's manifest.json, and
    every rollout object. (Other checkpoint files may be replaced until their manifest exists.)"""

    def __init__(self, endpoint: str, bucket: str, root: str, run: str, interval: float = 0.5):
        super().__init__(name="bucket-watcher", daemon=True)
        self.client = s3_client(endpoint)
        self.bucket, self.interval = bucket, interval
        self.prefix = f"{root}/{keys.run_prefix(run)}"
        self.first_seen: dict[str, str] = {}
        self.changed: list[str] = []
        self.polls = 0
        self._halt = threading.Event()

    @staticmethod
    def write_once(rel: str) -> bool:
        return (rel.startswith(("adapters/", "rounds/", "contributions/"))
                or (rel.startswith("checkpoints/") and rel.endswith("/manifest.json"))
                or (rel.startswith("rollouts/") and rel.endswith(".safetensors")))

    def _digest(self, key: str) -> str | None:
        try:
            return hashlib.sha256(self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()).hexdigest()
        except self.client.exceptions.NoSuchKey:
            return None

    def poll(self, recheck: bool = False) -> None:
        for key in list_keys(self.client, self.bucket, self.prefix):
            rel = key[len(self.prefix):]
            if not self.write_once(rel):
                continue
            if rel not in self.first_seen:
                digest = self._digest(key)
                if digest is not None:
                    self.first_seen[rel] = digest
            elif recheck and self._digest(key) != self.first_seen[rel]:
                self.changed.append(rel)
        self.polls += 1

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                self.poll()
            except Exception:  # noqa: BLE001 - a poll racing moto's shutdown; the final check is what counts
                pass
            self._halt.wait(self.interval)

    def finish(self) -> None:
        """Stop polling, then read every recorded object once more: none may have changed."""
        self._halt.set()
        self.join(10)
        self.poll(recheck=True)


# ---------------------------------------------------------------- Redis's append-only file


def aof_tail_file(redis_dir: Path) -> Path:
    """The file Redis appends to now: with Redis 7's multi-part AOF, the newest incr file its
    manifest names under appendonlydir (a rewrite starts a new one)."""
    folder = redis_dir / "appendonlydir"
    name = ""
    for line in (folder / "appendonly.aof.manifest").read_text().splitlines():
        fields = line.split()
        entry = dict(zip(fields[::2], fields[1::2], strict=False))
        if entry.get("type") == "i":
            name = entry["file"]
    if not name:
        raise FileNotFoundError(f"no incr file in {folder}/appendonly.aof.manifest")
    return folder / name


def show_report(capsys, text: str) -> None:
    """A run's report: in the test's captured output (pytest shows it with a failure, under
    pytest-xdist too, which drops what a worker writes past capture) and, in a plain pytest run
    (make chaos), on the terminal as well."""
    print(text)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        with capsys.disabled():
            print("\n" + text, flush=True)


def locate_batches(created: list[str], holders, problems: list[str]) -> list[str]:
    """Every batch cut must be in exactly one of `holders` ((where, batch ids) pairs): the problems
    go to `problems`; returns the batches that are nowhere (vanished)."""
    places: dict[str, list[str]] = {b: [] for b in created}
    for where, ids in holders:
        for b in ids:
            if b not in places:
                problems.append(f"{where} holds {b!r}, which was never cut")
                continue
            places[b].append(where)
    vanished = sorted(b for b, p in places.items() if not p)
    twice = {b: p for b, p in places.items() if len(p) > 1}
    if vanished:
        problems.append(f"{len(vanished)} batches vanished: {vanished[:10]}")
    if twice:
        problems.append(f"batches in more than one terminal/queued state: {dict(list(twice.items())[:10])}")
    return vanished


# ---------------------------------------------------------------- processes


def clean_env() -> dict[str, str]:
    """This process's environment without the caller's BRIGADE_* and AWS_* settings (the system sets
    its own), one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("BRIGADE_", "AWS_")) or k == "BRIGADE_CACHE"}
    return env | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
                  "PYTHONWARNINGS": "ignore", "PYTHONDONTWRITEBYTECODE": "1"}


class System(LocalSystem):
    """One run, every service a process, on moto's S3 (behind the fault-injecting proxy when given
    `faults`). Use as a context manager (everything is stopped on exit)."""

    driver = "learner"         # the service whose exit 0 ends the run
    fleet = "rollout-"         # the replaceable processes, one slot each

    def __init__(self, workdir: Path, spec: pb.RunSpec, *, workers: int = 3, faults=None, token: str = TOKEN,
                 janitor_interval: float = 0.5, worker_args: dict[int, list[str]] | None = None):
        self.bucket_name = f"chaos-{uuid.uuid4().hex[:10]}"
        self.bucket_root = "root"
        super().__init__(workdir, appendonly=True, s3=True, bucket=f"s3://{self.bucket_name}/{self.bucket_root}",
                         token=token, run=spec.run_id, env=clean_env())
        self.spec = spec
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

    # ------------------------------------------------------------ start / stop

    @property
    def s3_endpoint(self) -> str:
        """What the services use (the faulty proxy when there is one)."""
        return self.faulty.url if self.faulty is not None else self.moto.url

    def start(self) -> None:
        from brigade.model import resolve_model

        resolve_model("demo")  # build once (cached), before several processes race to do it
        self.start_servers()
        if self.faults is not None:
            from faulty_s3 import start_in_thread

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

    def spawn(self, name: str, args: list[str], module: str = "brigade_cli.main") -> Service:
        self.note("start", name)
        return super().spawn(name, args, module)

    def restart(self, name: str, args: list[str] | None = None) -> Service:
        self.note("start", name)
        if name.startswith(self.fleet):
            args, _ = self._worker_life(int(name.split("-")[1]))
        return super().restart(name, args)

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.services[name].alive():
            self.note("kill", name)
        super().kill(name, sig)

    def _worker_life(self, i: int) -> tuple[list[str], str]:
        """Arguments and module of worker slot i's next life: each is a new machine with a new worker
        id (as a new spot VM would be)."""
        self.worker_gen[i] += 1
        wid = self.worker_ids[f"rollout-{i}"] = f"w{i}-{self.worker_gen[i]}"
        if i in self.worker_args:
            return (["--runs", self.run, "--worker-id", wid, "--price-per-hour", "0.5", *self.worker_args[i]],
                    "brigade_testing.slow_worker")
        return (["rollout", "--run", self.run, "--worker-id", wid, "--exit-when-finished", "--price-per-hour", "0.5"],
                "brigade_cli.main")

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

    # ------------------------------------------------------------ the audit

    def audit(self) -> dict[str, Any]:
        """Account for every batch ever cut, from Redis; check the learner's lineage in the bucket.
        Returns the counts; raises AssertionError on any violation."""
        problems: list[str] = []
        k = keys.RunKeys(self.run)
        with self.r() as r:
            cursor = int(r.get(k.cursor) or 0)
            consumed = {b.decode() for b in r.smembers(k.consumed)}
            rejected = {b.decode(): v.decode() for b, v in r.hgetall(k.rejected).items()}
            dead = [(f[b"batch"].decode(), f[b"reason"].decode()) for _, f in r.xrange(k.deadletter)]
            work_entries = [(i, f[b"batch"].decode()) for i, f in r.xrange(k.work) if b"batch" in f]
            rollout_entries = [(i, f[b"batch"].decode()) for i, f in r.xrange(k.rollouts) if b"batch" in f]
            completed = {b.decode() for b in r.smembers(k.completed)}
            stats = {a.decode(): int(b) for a, b in r.hgetall(k.stats).items()}
            latest = int(r.get(k.adapter_latest) or 0)
            learner_step = int(r.get(k.learner_step) or 0)
            published = sorted(int(v) for v in r.hkeys(k.adapters))
            metrics_entries = [(i, json.loads(f[b"json"])) for i, f in r.xrange(k.metrics) if f.get(b"json")]
            announced = sorted(int(f[b"version"]) for _, f in r.xrange(k.events)
                               if f.get(b"type") == b"AdapterPublished")
            now_ms = int(r.time()[0]) * 1000
        work = [b for _, b in work_entries]
        pending_rollouts = [b for _, b in rollout_entries]
        metrics_rows = [m for _, m in metrics_entries]
        created = self.created_batches(cursor)

        # every batch in exactly one place
        dead_ids = [b for b, _ in dead]
        vanished = locate_batches(created, (("consumed", consumed), ("rejected", rejected), ("deadlettered", dead_ids),
                                            ("queued_or_leased", work), ("completed_not_acked", pending_rollouts)),
                                  problems)
        if not completed >= consumed | {b for b, why in rejected.items() if why == "learner"}:
            problems.append("a batch was consumed or rejected by the learner without ever being completed")
        for b, reason in dead:
            if not reason:
                problems.append(f"dead letter {b} has no reason")
        in_flight = len(work) + len(pending_rollouts)
        # in flight at the end is fine (the learner stopped at max_steps), but not for long: an entry
        # older than a few lease periods when the last step was acked is stranded (a delivery no
        # reply brought back holds an admission slot for good)
        end_ms = stream_ms(metrics_entries[-1][0]) if metrics_entries else now_ms
        limit_ms = IN_FLIGHT_LEASE_PERIODS * self.spec.staleness.lease_seconds * 1000
        stuck = [(where, b, round((end_ms - stream_ms(i)) / 1000, 1)) for where, entries in
                 (("queued_or_leased", work_entries), ("completed_not_acked", rollout_entries))
                 for i, b in entries if end_ms - stream_ms(i) > limit_ms]
        if stuck:
            problems.append(f"{len(stuck)} batches in flight for more than {IN_FLIGHT_LEASE_PERIODS} lease periods "
                            f"when the last step was acked (where, batch, age s): {stuck[:10]}")

        # the learner's lineage, from the bucket: one checkpoint per step, each loads, no batch twice
        lineage = asyncio.run(self._lineage())
        problems += lineage.pop("problems")
        history: list[str] = lineage.pop("history")
        duplicates = len(history) - len(set(history))
        if duplicates:
            problems.append(f"{duplicates} batches trained twice: {[b for b, n in Counter(history).items() if n > 1]}")
        if set(history) != consumed:
            problems.append(f"checkpoint lineage ({len(set(history))} batches) != Redis consumed set ({len(consumed)}): "
                            f"only in lineage {sorted(set(history) - consumed)[:5]}, "
                            f"only in Redis {sorted(consumed - set(history))[:5]}")
        steps_metrics = {m["step"]: m for m in metrics_rows}
        if sum(m.get("accepted_batches", 0) for m in steps_metrics.values()) != len(consumed):
            problems.append("per-step metrics in Redis do not add up to the consumed set")
        # Redis's counters agree with the learner's newest checkpoint (Redis may lose writes; the
        # learner must have repaired them)
        final = lineage.pop("final")
        if final is not None and (final["step"], final["version"], final["consumed"]) != (
                learner_step, latest, len(consumed)):
            problems.append(f"Redis (step {learner_step}, version {latest}, {len(consumed)} consumed) disagrees "
                            f"with the newest checkpoint {final}")
        if sorted(steps_metrics) != list(range(1, learner_step + 1)):
            problems.append(f"Redis's metrics stream lacks steps: has {sorted(steps_metrics)}")

        # versions: contiguous, published == in the bucket, never overwritten
        max_steps = self.spec.max_steps
        bucket_versions = lineage["bucket_versions"]
        if published != list(range(1, latest + 1)) or bucket_versions != published:
            problems.append(f"adapter versions not contiguous: redis {published}, bucket {bucket_versions}, "
                            f"latest {latest}")
        if sorted(set(announced)) != published:
            problems.append(f"AdapterPublished events {sorted(set(announced))} != versions in Redis {published}")
        if learner_step != max_steps or latest != max_steps // max(1, self.spec.publish_every):
            problems.append(f"learner_step {learner_step} / latest version {latest}, expected {max_steps}")
        changed = []
        if self.watcher is not None:
            self.watcher.finish()
            changed = self.watcher.changed
            if changed:
                problems.append(f"write-once objects were overwritten: {changed[:10]}")

        # why the learner rejected what it rejected: its log says, per batch (Redis records only "learner")
        learner_reasons = {e.get("batch"): e.get("reason") for e in self.log_events("learner", new_only=False)
                           if e.get("event") == "rollout_rejected"}
        self.detail = {"consumed": consumed, "rejected": rejected, "learner_reasons": learner_reasons,
                       "deadletter": dead}
        reasons: Counter = Counter()
        for b, why in rejected.items():
            if why == "learner":
                why = "learner:" + str(learner_reasons.get(b, "unlogged"))
            reasons[why] += 1
        report = {
            "steps": learner_step,
            "batches_created": cursor,
            "consumed": len(consumed),
            "duplicates": duplicates,
            "rejected": len(rejected),
            "stale_rejected": reasons["stale (janitor)"] + reasons["learner:stale"],
            "rejected_by_reason": dict(reasons),
            "deadlettered": len(dead),
            "in_flight": in_flight,
            "vanished": len(vanished),
            "versions": latest,
            "checkpoints_loaded": lineage["checkpoints_loaded"],
            "write_once_objects_watched": len(self.watcher.first_seen) if self.watcher else 0,
            "overwritten": len(changed),
            "expired_leases": stats.get("expired", 0),
            "revoked_leases": stats.get("revoked", 0),
            "duplicate_completions": stats.get("duplicates", 0),
            "kills": sum(s.kills for s in self.services.values()),
            "kills_by_service": dict(sum((Counter({n.split("-")[0]: s.kills}) for n, s in self.services.items()),
                                         Counter())),
            "rejection_reasons": lineage["rejection_reasons"],
        }
        if report["batches_created"] != (report["consumed"] + report["rejected"] + report["deadlettered"]
                                         + report["in_flight"] + report["vanished"]):
            problems.append("created != consumed + rejected + deadlettered + in_flight + vanished")
        report["problems"] = problems
        return report

    def created_batches(self, cursor: int) -> list[str]:
        """The ids of the first `cursor` batches cut, in order."""
        bpe = -(-len(self._prompts()) // self.spec.prompts_per_batch)
        return [keys.batch_id(self.run, n // bpe, n % bpe) for n in range(cursor)]

    def _prompts(self) -> list[pb.Prompt]:
        from brigade.datasets import load_prompts

        return load_prompts(self.spec.dataset)

    async def _lineage(self) -> dict[str, Any]:
        """Read every checkpoint (directly from moto, no faults): each step 1..max_steps complete and
        loadable into a fresh trainer; the per-step consumed lists chain without repeats."""
        from brigade import adapters
        from brigade.bucket.s3 import S3Bucket
        from brigade_learner import checkpoint
        from brigade_learner.trainer import Trainer

        problems: list[str] = []
        history: list[str] = []
        saved = {k: os.environ.get(k) for k in MOTO_ENV}
        os.environ.update(MOTO_ENV)
        bucket = S3Bucket(self.bucket, endpoint_url=self.moto.url)
        try:
            steps = await checkpoint.steps(bucket, self.run)
            trainer = await asyncio.to_thread(Trainer.create, self.spec)
            seen: set[str] = set()
            loaded = 0
            final = None
            for step in range(1, self.spec.max_steps + 1):
                if step not in steps:
                    problems.append(f"no checkpoint for step {step}")
                    continue
                files = await checkpoint.load_files(bucket, self.run, step)
                if files is None:
                    problems.append(f"checkpoint {step} is incomplete or damaged")
                    continue
                state = await asyncio.to_thread(checkpoint.decode, trainer, files)
                loaded += 1
                if state.step != step:
                    problems.append(f"checkpoint {step} says step {state.step}")
                new = list(state.ack.consumed)
                history += new
                if state.consumed != seen | set(new) or seen & set(new):
                    problems.append(f"checkpoint {step}: consumed {len(state.consumed)} != previous {len(seen)} "
                                    f"+ this step's {new}")
                seen = state.consumed
                final = {"step": state.step, "version": state.version, "consumed": len(state.consumed)}
            versions = sorted({int(key.split("/")[3][1:]) for key in await bucket.list(f"runs/{self.run}/adapters/")})
            for v in versions:
                try:
                    _, files = await adapters.read_version(bucket, self.run, v)
                    adapters.apply(trainer.model, adapters.decode(files))
                except Exception as e:  # noqa: BLE001
                    problems.append(f"adapter v{v} does not load: {e}")
            reasons: Counter = Counter()
            for key in await bucket.list(f"runs/{self.run}/metrics/"):
                m = json.loads(await bucket.get(key))
                reasons.update({k.split("/", 1)[1]: v for k, v in m.items() if k.startswith("rejected/")})
        finally:
            await bucket.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return {"problems": problems, "history": history, "checkpoints_loaded": loaded, "bucket_versions": versions,
                "rejection_reasons": dict(reasons), "final": final}
