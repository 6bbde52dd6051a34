"""Chaos: any process can die at any moment, and nothing is lost, repeated, or let in.

A real run, every service its own process (redis-server with its append-only file, moto's S3
server, `brigade proxy`, `brigade janitor`, `brigade learner`, 3 `brigade rollout` workers, a
bearer token on every call). While it runs, rollout workers holding a lease are SIGKILLed again
and again (and replaced by new ones, as a spot fleet would), the learner is SIGKILLed the moment
it reports a trained step (while that step is being made durable), the proxy and the janitor are SIGKILLed
once each; everything killed is restarted. `make chaos` (BRIGADE_CHAOS_LONG=1) runs longer with
more of everything, and adds what an outside chaos round found: Redis restarted under load, Redis
SIGKILLed with the last second of its append-only file lost, Redis at maxmemory for a while (writes
refused), and the learner SIGKILLed with a file of its newest checkpoint cut in half (state, optimizer,
adapter, manifest, in turn), which must cost that step and nothing more. At the end:

- the learner reached max_steps and exited 0;
- no batch was trained twice: the per-step consumed lists of every checkpoint chain with no repeat,
  and equal the consumed set in Redis;
- every batch ever cut is in exactly one place: consumed, rejected (stale, with its reason),
  dead-lettered (with its reason), or still in flight (queued, leased, completed and not acked:
  the learner stopped at max_steps); vanished == 0;
- adapter versions are 1..max_steps, the same in Redis and in the bucket, and no write-once
  object (adapter files, checkpoint manifests, rollout objects) changed after it first appeared;
- every checkpoint and every adapter version loads into a fresh trainer.

It prints the counts as one JSON line, the faults of the long mode with them (the damaged files and
the steps retrained beside them, the bytes each Redis crash lost, the writes Redis refused when full).

`test_chaos_a_store_that_ignores_create_only_stops_every_writer` (`make chaos`): the system against an
S3 endpoint that drops `If-None-Match`: every service that writes a create-only object refuses it.

`test_chaos_redis_crash_loses_its_last_second`: Redis itself is SIGKILLed twice and comes back from
an append-only file cut back to its size a second before the kill (what a host crash under
appendfsync everysec may lose: grants, completions, the learner's publishes and acks). The same
audit must come out clean, which also fails on a batch left in flight for several lease periods,
on a version announced or stored in one place and not the other, and on Redis counters that
disagree with the learner's newest checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
import uuid
from collections import Counter

import botocore.exceptions
import pytest
import yaml
from chaos_support import aof_tail_file, chaos_spec, show_report

from brigade import keys
from brigade.spec_file import spec_to_dict
from brigade_harness.devservers import free_port
from brigade_testing.audited_system import AuditedSystem
from brigade_testing.bucket_watch import list_keys, s3_client
from brigade_testing.faulty_s3 import Faults, start_in_thread

LONG = os.environ.get("BRIGADE_CHAOS_LONG", "") not in ("", "0")

# short: fits `make test` on a 2-core machine; long: `make chaos`
MAX_STEPS = 100 if LONG else 20
WORKER_KILL_EVERY_STEPS = 3   # a busy worker is SIGKILLed (and replaced) every few steps of progress
WORKER_KILL_MIN_GAP_S = 3.0
LEARNER_KILL_STEPS = (5, 40, 75) if LONG else (6,)   # SIGKILLed the moment it logs having trained this step
JANITOR_KILL_STEPS = (3, 55) if LONG else (3,)
PROXY_KILL_STEPS = (10, 50, 85) if LONG else (12,)
REDIS_RESTART_STEPS = (65,) if LONG else ()           # long: Redis restarted (AOF) under load, unannounced
FREEZE_STEPS = (15, 30, 60, 90) if LONG else (16,)    # a busy worker is SIGSTOPped past its lease, then resumed
# long: the learner SIGKILLed and a file of its newest checkpoint cut in half, one file kind each time
DAMAGE_STEPS = ((20, "state.json"), (45, "optimizer.safetensors"), (70, "adapter.safetensors"),
                (95, "manifest.json")) if LONG else ()
REDIS_LOST_SECOND_STEPS = (30, 80) if LONG else ()    # long: Redis SIGKILLed, its AOF cut back by 1 s
REDIS_FULL_STEPS = (35, 85) if LONG else ()           # long: Redis at maxmemory (writes refused) for a while
REDIS_FULL_S = 6.0
WORKER_SPEED = 200.0        # each token costs 200x its real time (asleep, no CPU): the fleet, not the learner, sets the pace
SLOW_WORKER_SPEED = 800.0   # worker 2 is a slower machine: its batches tend to be revoked or go stale
TIMEOUT_S = 1200 if LONG else 300
CRASH_MAX_STEPS = 10          # the Redis-crash case: short, it runs in `make test`
REDIS_CRASH_STEPS = (3, 6)    # Redis SIGKILLed once the learner step reaches these, its AOF cut back by 1 s
LOST_WINDOW_S = 1.0           # appendfsync everysec: a host crash may lose about the last second of writes

pytestmark = pytest.mark.timeout(TIMEOUT_S + 120)


class LearnerAssassin(threading.Thread):
    """Tails the learner's log every few milliseconds and SIGKILLs it the moment it logs `step` for
    an armed step number: the step is trained, and its checkpoint, adapter, publish and ack are
    under way (or not started). Restarting it is the main loop's job."""

    def __init__(self, system: AuditedSystem, steps: tuple[int, ...]):
        super().__init__(name="learner-assassin", daemon=True)
        self.s, self.steps = system, list(steps)
        self.kills: list[dict] = []
        self.retries = 3
        self.killed = threading.Event()
        self.done = threading.Event()

    def phase_of(self, step: int) -> str:
        """Where in step `step` the (dead) learner was: its checkpoint, publish and ack leave traces."""
        k = keys.RunKeys(self.s.run)
        with self.s.r() as r:
            acked = any(int(f[b"step"]) == step for _, f in r.xrevrange(k.metrics, count=20))
            published = r.hexists(k.adapters, str(step))  # publish_every 1: version == step
        if acked:
            return "after_ack"
        if published:
            return "after_publish"
        try:
            s3_client(self.s.moto.url).head_object(
                Bucket=self.s.bucket_name,
                Key=f"{self.s.bucket_root}/{keys.checkpoint_prefix(self.s.run, step)}manifest.json")
            return "after_checkpoint"
        except botocore.exceptions.ClientError:
            return "before_checkpoint"

    def run(self) -> None:
        path = self.s.logs / "learner.log"
        pos = 0
        while not self.done.is_set() and self.steps:
            if self.killed.is_set() or not path.exists():
                time.sleep(0.005)
                continue
            with path.open("rb") as f:
                f.seek(pos)
                data = f.read()
            end = data.rfind(b"\n") + 1
            pos += end
            for line in data[:end].splitlines():
                if b'"step"' not in line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if event.get("event") == "step" and event.get("step") == self.steps[0]:
                    self.killed.set()  # first: the main loop must not take the dead learner for a finished one
                    self.s.kill("learner")
                    step = self.steps.pop(0)
                    try:
                        phase = self.phase_of(step)
                    except Exception as e:  # noqa: BLE001 - Redis restarting (long mode)
                        phase = f"unknown ({type(e).__name__})"
                    self.kills.append({"step": step, "phase": phase})
                    if phase == "after_ack" and self.retries > 0 and step + 2 < MAX_STEPS:
                        # too late to be mid-step: try again a little later
                        self.retries -= 1
                        self.steps.insert(0, step + 2)
                    break
            time.sleep(0.005)


class Chaos:
    """The kill schedule, driven by the learner's progress and the clock."""

    def __init__(self, system: AuditedSystem, seed: int):
        self.s = system
        self.rng = random.Random(seed)
        self.assassin = LearnerAssassin(system, LEARNER_KILL_STEPS)
        self.janitor_kills = list(JANITOR_KILL_STEPS)
        self.proxy_kills = list(PROXY_KILL_STEPS)
        self.freezes = list(FREEZE_STEPS)
        self.redis_restarts = list(REDIS_RESTART_STEPS)
        self.damages = list(DAMAGE_STEPS)
        self.redis_crashes = list(REDIS_LOST_SECOND_STEPS)
        self.redis_fulls = list(REDIS_FULL_STEPS)
        self.aof = AofSizes(system.redis.workdir)
        self.faults: dict[str, list] = {"damaged": [], "redis_crashes": [], "redis_full": []}
        self.frozen: tuple[str, float] | None = None
        self.next_worker_kill = 1
        self.last_worker_kill = 0.0
        self.freeze_log: list[dict] = []

    def pending(self) -> bool:
        return bool(self.assassin.steps or self.janitor_kills or self.proxy_kills or self.freezes or self.frozen
                    or self.redis_restarts or self.damages or self.redis_crashes or self.redis_fulls)

    def tick(self) -> None:
        s = self.s
        if self.assassin.killed.is_set() and not s.services["learner"].alive():
            time.sleep(0.5)
            s.restart("learner")
            self.assassin.killed.clear()
        step = s.learner_step()
        if self.janitor_kills and step >= self.janitor_kills[0]:
            self.janitor_kills.pop(0)
            s.kill("janitor")
            time.sleep(1.0)
            s.restart("janitor")
        if self.proxy_kills and step >= self.proxy_kills[0]:
            self.proxy_kills.pop(0)
            s.kill("proxy")
            time.sleep(1.0)
            s.restart("proxy")
        if self.redis_restarts and step >= self.redis_restarts[0]:
            self.redis_restarts.pop(0)
            s.redis.restart()
            s.note("restart", "redis")
        if self.damages and step >= self.damages[0][0] and not self.assassin.killed.is_set():
            _, name = self.damages.pop(0)
            s.kill("learner")
            damaged_step, attempt = s.damage_newest_checkpoint(name)
            self.faults["damaged"].append({"file": name, "step": damaged_step, "attempt": attempt})
            s.restart("learner")
        if self.redis_crashes and step >= self.redis_crashes[0]:
            self.redis_crashes.pop(0)
            self.faults["redis_crashes"].append(crash_redis(s, self.aof))
        if self.redis_fulls and step >= self.redis_fulls[0]:
            self.redis_fulls.pop(0)
            self.faults["redis_full"].append(fill_redis(s, REDIS_FULL_S))
        self.freeze_a_worker(step)
        self.kill_a_worker(step)

    def busy_workers(self) -> list[str]:
        holders = self.s.lease_holders()
        frozen = self.frozen[0] if self.frozen else None
        return [n for n in self.s.worker_names()
                if n != frozen and self.s.services[n].alive() and self.s.worker_ids[n] in holders]

    def freeze_a_worker(self, step: int) -> None:
        """A paused VM / a partition: SIGSTOP a worker holding a lease until well past the lease's
        end (the janitor requeues its batch), then SIGCONT it. It must learn that it lost the lease
        and never get its stale work counted twice."""
        s = self.s
        if self.frozen is not None:
            name, until = self.frozen
            if time.monotonic() >= until:
                s.thaw([name])
                s.note("thaw", name)
                self.frozen = None
            return
        if self.freezes and step >= self.freezes[0]:
            try:
                busy = self.busy_workers()
            except Exception:  # noqa: BLE001 - Redis restarting: next tick
                return
            if busy:
                self.freezes.pop(0)
                name = self.rng.choice(busy)
                s.freeze([name])
                s.note("freeze", name)
                self.freeze_log.append({"worker": s.worker_ids[name], "step": step})
                self.frozen = (name, time.monotonic() + s.spec.staleness.lease_seconds + 4)

    def kill_a_worker(self, step: int) -> None:
        """Every few steps, SIGKILL a worker that holds a lease (so its batch must come back through
        lease expiry or revocation), as long as another worker is busy too, and start a replacement
        at once. Paced by progress, not the clock, so a slow machine does not get a kill storm."""
        s, now = self.s, time.monotonic()
        if step < self.next_worker_kill or now - self.last_worker_kill < WORKER_KILL_MIN_GAP_S:
            return
        try:
            busy = self.busy_workers()
        except Exception:  # noqa: BLE001 - Redis busy: next tick
            return
        if len(busy) < 2:
            return
        victim = self.rng.choice(busy)
        s.kill(victim)
        s.restart(victim)
        self.last_worker_kill = now
        self.next_worker_kill = step + WORKER_KILL_EVERY_STEPS


def test_chaos(tmp_path, one_torch_thread, capsys):
    t0 = time.monotonic()
    run = f"chaos-{uuid.uuid4().hex[:8]}"
    speeds = {i: ["--speed-factor", str(WORKER_SPEED)] for i in range(2)}
    speeds[2] = ["--speed-factor", str(SLOW_WORKER_SPEED), "--capacity-class", "on-demand"]
    spec = chaos_spec(run, MAX_STEPS, staleness={"lease_seconds": 5})
    with AuditedSystem(tmp_path, spec, workers=3, worker_args=speeds) as system:
        system.start()
        chaos = Chaos(system, seed=int.from_bytes(os.urandom(4), "big"))
        chaos.assassin.start()
        chaos.aof.start()
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while system.services["learner"].alive() or chaos.assassin.killed.is_set() or chaos.frozen:
                assert time.monotonic() < deadline, f"the run did not finish in {TIMEOUT_S}s: {system.describe()}"
                system.check_no_crash()
                chaos.tick()
                time.sleep(0.05)
        finally:
            chaos.assassin.done.set()
            chaos.aof.halt.set()
        if chaos.frozen:
            system.thaw([chaos.frozen[0]])
        system.finish(timeout=120)
        report = system.audit()
    problems = report.pop("problems")
    reasons = report.pop("rejection_reasons")
    report.update(mode="long" if LONG else "short", learner_kills=chaos.assassin.kills, freezes=chaos.freeze_log,
                  redis_restarts=len(REDIS_RESTART_STEPS), **chaos.faults,
                  wall_s=round(time.monotonic() - t0, 1))
    show_report(capsys, f"rejection reasons in the learner's metrics: {reasons}\nCHAOS " + json.dumps(report))
    assert not problems, "\n".join(problems)
    assert not chaos.pending(), f"part of the schedule never happened: {chaos.__dict__}"
    assert report["steps"] == MAX_STEPS
    assert report["duplicates"] == 0 and report["vanished"] == 0 and report["overwritten"] == 0
    assert report["checkpoints_loaded"] == MAX_STEPS
    # each damaged checkpoint cost its step (retrained beside it), not the run
    assert sorted(report["retrained_steps"]) == sorted(d["step"] for d in chaos.faults["damaged"])
    assert all(c["lost_bytes"] > 0 for c in chaos.faults["redis_crashes"]), chaos.faults
    assert all(f["refused_writes"] > 0 for f in chaos.faults["redis_full"]), chaos.faults
    kills = report["kills_by_service"]
    assert kills.get("learner") >= len(LEARNER_KILL_STEPS) and kills.get("proxy") == len(PROXY_KILL_STEPS)
    assert kills.get("janitor") == len(JANITOR_KILL_STEPS)
    assert kills.get("rollout", 0) >= MAX_STEPS // WORKER_KILL_EVERY_STEPS // 2
    # at least one learner kill landed before its step was acked: mid-step, not between steps
    assert any(k["phase"] != "after_ack" for k in chaos.assassin.kills), chaos.assassin.kills
    # killed and frozen workers' leases came back (through expiry, or revocation when too stale by then)
    assert report["expired_leases"] + report["revoked_leases"] >= 1


class AofSizes(threading.Thread):
    """Records the size of the file Redis appends to, every 0.1 s: a crash then cuts the file back to
    its size LOST_WINDOW_S before the kill, as a host crash under appendfsync everysec may."""

    def __init__(self, redis_dir):
        super().__init__(name="aof-sizes", daemon=True)
        self.redis_dir = redis_dir
        self.samples: list[tuple[float, str, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                tail = aof_tail_file(self.redis_dir)
                self.samples.append((time.monotonic(), str(tail), tail.stat().st_size))
            except OSError:  # Redis restarting, or rewriting its AOF
                pass
            self.halt.wait(0.1)

    def size_at(self, tail, t: float) -> int | None:
        """The newest size of `tail` recorded at or before `t` (None: none that old)."""
        older = [size for when, path, size in self.samples if path == str(tail) and when <= t]
        return older[-1] if older else None


def crash_redis(system: AuditedSystem, sizes: AofSizes) -> dict:
    """SIGKILL Redis, cut its AOF back by the last second, start it again."""
    step = system.learner_step()
    killed_at = time.monotonic()
    system.redis.kill()
    tail = aof_tail_file(system.redis.workdir)
    end = tail.stat().st_size
    keep = sizes.size_at(tail, killed_at - LOST_WINDOW_S)
    keep = end if keep is None else keep
    with tail.open("r+b") as f:
        f.truncate(keep)
    system.redis.restart()
    system.note("crash", "redis", lost_bytes=end - keep)
    return {"step": step, "lost_bytes": end - keep}


def fill_redis(system: AuditedSystem, seconds: float) -> dict:
    """Redis at maxmemory (noeviction): every write that may grow memory is refused for `seconds`,
    as when a run outgrows the instance, then it has room again. No service may exit over it."""
    with system.r() as r:
        before = _oom_errors(r)
        r.config_set("maxmemory", 1)
        system.note("full", "redis")
        try:
            time.sleep(seconds)
        finally:
            r.config_set("maxmemory", 0)
        refused = _oom_errors(r) - before
    system.check_no_crash()
    return {"step": system.learner_step(), "seconds": seconds, "refused_writes": refused}


def _oom_errors(r) -> int:
    """How many commands Redis refused as out of memory (INFO errorstats)."""
    return int(r.info("errorstats").get("errorstat_OOM", {}).get("count", 0))


def test_chaos_redis_crash_loses_its_last_second(tmp_path, one_torch_thread, capsys):
    t0 = time.monotonic()
    run = f"crash-{uuid.uuid4().hex[:8]}"
    spec = chaos_spec(run, CRASH_MAX_STEPS, staleness={"lease_seconds": 5})
    speeds = {i: ["--speed-factor", str(WORKER_SPEED)] for i in range(2)}
    crashes, pending = [], list(REDIS_CRASH_STEPS)
    with AuditedSystem(tmp_path, spec, workers=2, worker_args=speeds) as system:
        system.start()
        sizes = AofSizes(system.redis.workdir)
        sizes.start()
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while system.services["learner"].alive():
                assert time.monotonic() < deadline, f"the run did not finish in {TIMEOUT_S}s: {system.describe()}"
                system.check_no_crash()
                if pending and system.learner_step() >= pending[0]:
                    pending.pop(0)
                    crashes.append(crash_redis(system, sizes))
                time.sleep(0.05)
        finally:
            sizes.halt.set()
        system.finish(timeout=120)
        report = system.audit()
        # what the learner had to do about it (shown, not asserted: a lost second need not hold a commit)
        repairs = Counter(e["event"] for e in system.log_events("learner", new_only=False) if e.get("event") in (
            "redis_behind_checkpoint", "ack_refused", "batch_fate_refused", "rollout_duplicate", "proxy_unreachable"))
        with system.r() as r:  # trained batches whose lost completion the learner's ack restored
            repairs["batch_recovered"] = sum(f.get(b"type") == b"BatchRecovered"
                                             for _, f in r.xrange(keys.RunKeys(system.run).events))
    problems = report.pop("problems")
    report.pop("rejection_reasons")
    report.update(mode="redis-crash", redis_crashes=crashes, learner=dict(repairs),
                  wall_s=round(time.monotonic() - t0, 1))
    show_report(capsys, "CHAOS " + json.dumps(report))
    assert not problems, "\n".join(problems)
    assert not pending, "the run ended before every Redis crash happened"
    assert all(c["lost_bytes"] > 0 for c in crashes), crashes  # each crash lost writes
    assert report["steps"] == CRASH_MAX_STEPS and report["checkpoints_loaded"] == CRASH_MAX_STEPS
    assert report["duplicates"] == 0 and report["vanished"] == 0 and report["overwritten"] == 0


WRITERS = ("proxy-with-bucket", "learner", "rollout-0", "evaluator")  # each writes create-only objects


@pytest.mark.skipif(not LONG, reason="make chaos; tests/integration/test_bucket_probe.py checks each writer alone")
def test_chaos_a_store_that_ignores_create_only_stops_every_writer(tmp_path, capsys):
    """The whole system started against an S3 endpoint that drops `If-None-Match` (a store that would
    silently overwrite versioned objects): every service that writes one (a proxy given the bucket,
    the learner, a rollout worker, the evaluator) refuses at start with one line and exit 2; the
    janitor, which writes nothing to the bucket, runs on; nothing but the probes' keys is written."""
    t0 = time.monotonic()
    spec = chaos_spec(f"ignored-{uuid.uuid4().hex[:8]}", 4)
    with AuditedSystem(tmp_path, spec, workers=1, faults=Faults(drop_headers=("if-none-match",))) as system:
        system.start_servers()
        system.faulty = start_in_thread(system.moto.url, system.faults)
        spec_path = tmp_path / "run.yaml"
        spec_path.write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))
        system.spawn("proxy-with-bucket", ["proxy", "--listen", f"127.0.0.1:{free_port()}"])
        system.start_proxy("--bucket", "")  # the one the others talk to keeps run specs in Redis only
        system.create_run(spec)
        system.spawn("janitor", ["janitor", "--interval", "0.5", "--lock-ttl-ms", "2000"])
        system.spawn("learner", ["learner", "--run", system.run, "--spec", str(spec_path)])
        system.spawn("rollout-0", ["rollout", "--run", system.run, "--worker-id", "w0"])
        system.spawn("evaluator", ["evaluator", "--run", system.run])
        deadline = time.monotonic() + 180
        while any(system.services[n].alive() for n in WRITERS):
            assert time.monotonic() < deadline, system.describe()
            time.sleep(0.2)
        codes = {n: system.services[n].proc.returncode for n in WRITERS}
        lines = {n: sum("If-None-Match" in line for line in (system.logs / f"{n}.log").read_text().splitlines())
                 for n in WRITERS}
        janitor_alive = system.services["janitor"].alive()
        written = list_keys(s3_client(system.moto.url), system.bucket_name, "")
    report = {"mode": "create-only-ignored", "exit_codes": codes, "refusal_lines": lines,
              "janitor_alive": janitor_alive, "objects": len(written),
              "probe_objects": sum("/probe/" in k for k in written), "wall_s": round(time.monotonic() - t0, 1)}
    show_report(capsys, "CHAOS " + json.dumps(report))
    assert codes == dict.fromkeys(WRITERS, 2)
    assert lines == dict.fromkeys(WRITERS, 1)
    assert janitor_alive
    assert written and all("/probe/" in k for k in written), written
