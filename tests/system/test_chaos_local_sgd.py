"""Chaos, topology local_sgd: local trainers and the aggregator die at any moment, and nothing is
merged twice, no contribution vanishes and no round is overwritten.

A real run (brigade_testing's AuditedSystem: redis-server with its append-only file, moto's S3
server, `brigade proxy`, `brigade janitor`, a bearer token) with `brigade aggregator` and 3 `brigade
trainer` processes (M = 2 of K = 3, so some contributions arrive late and are down-weighted or
dropped). While it runs,
a trainer holding a round of leases is SIGKILLed once the run has passed rounds 1, 3 and 5 (by
progress, not by time: a fast machine gets the same kills) and replaced by a new one (a new id, as a
new spot VM), and the aggregator is SIGKILLed the moment it logs a round as recorded (its
adapter, publish and ack still to come), twice, and restarted. At the end:

- every batch ever cut is in exactly one place: consumed, rejected, dead-lettered, queued or leased,
  or inside a contribution still waiting for the aggregator;
- every contribution submitted is merged into exactly one round, or rejected, or still waiting: none
  vanished, none merged twice; the batches the round records consumed are Redis's consumed set;
- versions are 1..max_steps in Redis and in the bucket, each derived from its round record (the
  record's master, encoded, is the published adapter's bytes: what a restarted aggregator rewrites),
  and no write-once object (round records, contributions, adapters) changed after it appeared.

It prints its counts as one JSON line.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from chaos_support import chaos_spec, show_report

from brigade import keys
from brigade.v1 import brigade_pb2 as pb
from brigade_testing.audit import locate_batches
from brigade_testing.audited_system import AuditedSystem

ROUNDS = 8
TRAINERS = 3
TRAINER_KILL_ROUNDS = (1, 3, 5)     # a trainer holding its round's leases is SIGKILLed once the run passes each
AGGREGATOR_KILL_VERSIONS = (2, 5)   # SIGKILLed when it logs this version's round as recorded
TIMEOUT_S = 240

pytestmark = pytest.mark.timeout(TIMEOUT_S + 120)


class LocalSgdSystem(AuditedSystem):
    """brigade_testing's AuditedSystem with the aggregator and local trainers in place of learner and
    workers."""

    driver = "aggregator"
    fleet = "trainer-"

    def start_training(self, spec_path: Path) -> None:
        # every round record is kept: the audit reads the whole lineage from them
        self.spawn("aggregator", ["aggregator", "--run", self.run, "--keep-rounds", "0"])
        for i in range(self.n_workers):
            self.spawn(f"trainer-{i}", *self._worker_life(i))

    def _worker_life(self, i: int) -> tuple[list[str], str]:
        self.worker_gen[i] += 1
        tid = self.worker_ids[f"trainer-{i}"] = f"t{i}-{self.worker_gen[i]}"
        return ["trainer", "--run", self.run, "--trainer-id", tid, "--exit-when-finished"], "brigade_cli.main"

    def audit_rounds(self) -> dict:
        problems: list[str] = []
        k = keys.RunKeys(self.run)
        with self.r() as r:
            cursor = int(r.get(k.cursor) or 0)
            consumed = {b.decode() for b in r.smembers(k.consumed)}
            rejected = {b.decode(): v.decode() for b, v in r.hgetall(k.rejected).items()}
            dead = [f[b"batch"].decode() for _, f in r.xrange(k.deadletter)]
            work = [f[b"batch"].decode() for _, f in r.xrange(k.work) if b"batch" in f]
            waiting = [pb.ContributionManifest.FromString(f[b"m"]) for _, f in r.xrange(k.contributions) if b"m" in f]
            latest = int(r.get(k.adapter_latest) or 0)
            step = int(r.get(k.learner_step) or 0)
            published = sorted(int(v) for v in r.hkeys(k.adapters))
            metrics = sorted(int(f[b"step"]) for _, f in r.xrange(k.metrics))
            events = [f for _, f in r.xrange(k.events)]
        submitted = {f[b"contribution"].decode() for f in events if f.get(b"type") == b"ContributionSubmitted"}
        announced = sorted({int(f[b"version"]) for f in events if f.get(b"type") == b"AdapterPublished"})
        vanished = locate_batches(self.created_batches(cursor), (
            ("consumed", consumed), ("rejected", rejected), ("deadlettered", dead), ("queued_or_leased", work),
            ("in_waiting_contribution", [b for m in waiting for b in m.batch_ids])), problems)

        lineage = asyncio.run(self._rounds())
        problems += lineage["problems"]
        merged: Counter = Counter(c for ids in lineage["new_merged"] for c in ids)
        if twice := [c for c, n in merged.items() if n > 1]:
            problems.append(f"contributions merged twice: {twice[:5]}")
        record_consumed = [b for batches in lineage["consumed"] for b in batches]
        if len(record_consumed) != len(set(record_consumed)) or set(record_consumed) != consumed:
            problems.append(f"round records consumed {len(record_consumed)} batches ({len(set(record_consumed))} "
                            f"distinct), Redis {len(consumed)}")
        waiting_ids = {m.contribution_id for m in waiting}
        dropped = {e.get("contribution") for e in self.log_events("aggregator", new_only=False)
                   if e.get("event") == "contribution_rejected"}
        fates = Counter("merged" if c in merged else "waiting" if c in waiting_ids else
                        "rejected" if c in dropped else "vanished" for c in submitted)
        if fates["vanished"]:
            problems.append(f"{fates['vanished']} submitted contributions are neither merged, rejected nor waiting")
        if not set(merged) <= submitted:
            problems.append("a merged contribution was never submitted")
        if not (published == announced == lineage["versions"] == list(range(1, ROUNDS + 1))
                and latest == step == ROUNDS and metrics == published):
            problems.append(f"versions: redis {published}, events {announced}, records {lineage['versions']}, "
                            f"latest {latest}, step {step}, metrics {metrics}")
        changed = self.watcher.finish() if self.watcher is not None else []
        if changed:
            problems.append(f"write-once objects were overwritten: {changed[:10]}")
        return {
            "rounds": step, "batches_created": cursor, "consumed": len(consumed), "rejected": len(rejected),
            "deadlettered": len(dead), "vanished": len(vanished), "contributions": dict(fates),
            "merged_twice": len(twice), "records_derived": lineage["derived"], "overwritten": len(changed),
            "write_once_objects_watched": len(self.watcher.first_seen) if self.watcher else 0,
            "late_merged": lineage["late"], "rejected_contributions": lineage["rejected_by_reason"],
            "expired_leases": int(self.r().hget(k.stats, "expired") or 0),
            "kills_by_service": dict(sum((Counter({n.split("-")[0]: s.kills}) for n, s in self.services.items()),
                                         Counter())), "problems": problems,
        }

    async def _rounds(self) -> dict:
        """Every round record, read directly from moto: the merged ids it added, the batches it
        consumed, and whether its master encodes to the published adapter's bytes."""
        from brigade import adapters
        from brigade.bucket import sha256_hex
        from brigade.bucket.s3 import S3Bucket
        from brigade_aggregator import rounds
        from brigade_harness.devservers import MOTO_ENV

        os.environ.update(MOTO_ENV)
        bucket = S3Bucket(self.bucket, endpoint_url=self.moto.url)
        out = {"problems": [], "new_merged": [], "consumed": [], "derived": 0, "late": 0,
               "rejected_by_reason": Counter()}
        try:
            out["versions"] = await rounds.versions(bucket, self.run)
            before: set[str] = set()
            for v in out["versions"]:
                s = rounds.decode(self.run, v, await bucket.get(keys.round_key(self.run, v)))
                if not before <= s.merged:
                    out["problems"].append(f"round {v} forgot merged contributions")
                out["new_merged"].append(s.merged - before)
                before = s.merged
                out["consumed"].append(s.ack.consumed)
                out["late"] += sum(n for key, n in s.metrics.items() if key.startswith("staleness/") and key != "staleness/0")
                out["rejected_by_reason"].update({key.split("/")[1]: n for key, n in s.metrics.items()
                                                  if key.startswith("rejected/")})
                files, _ = adapters.encode(s.master, s.config_json, self.spec.adapter_payload)
                manifest = await adapters.read_manifest(bucket, self.run, v)
                if {f.name: f.sha256 for f in manifest.files} == {n: sha256_hex(d) for n, d in files.items()}:
                    out["derived"] += 1
                else:
                    out["problems"].append(f"adapter v{v} is not what its round record encodes to")
        finally:
            await bucket.close()
        return out


class AggregatorAssassin(threading.Thread):
    """SIGKILLs the aggregator the moment it logs `round_recorded` for an armed version: its record
    is written, its adapter, publish and ack are under way or not started."""

    def __init__(self, system: LocalSgdSystem, versions: tuple[int, ...]):
        super().__init__(name="aggregator-assassin", daemon=True)
        self.s, self.versions = system, list(versions)
        self.killed, self.done = threading.Event(), threading.Event()
        self.kills: list[dict] = []

    def phase_of(self, version: int) -> str:
        k = keys.RunKeys(self.s.run)
        with self.s.r() as r:
            if any(int(f[b"step"]) == version for _, f in r.xrevrange(k.metrics, count=5)):
                return "after_ack"
            return "after_publish" if r.hexists(k.adapters, str(version)) else "after_record"

    def run(self) -> None:
        while not self.done.is_set() and self.versions:
            if not self.killed.is_set() and any(
                    e.get("event") == "round_recorded" and e.get("version") == self.versions[0]
                    for e in self.s.log_events("aggregator")):
                self.killed.set()
                self.s.kill("aggregator")
                v = self.versions.pop(0)
                self.kills.append({"version": v, "phase": self.phase_of(v)})
            time.sleep(0.005)


def test_chaos_local_sgd(tmp_path, one_torch_thread, capsys):
    t0 = time.monotonic()
    run = f"lsgd-{uuid.uuid4().hex[:8]}"
    spec = chaos_spec(run, ROUNDS, topology="local_sgd", staleness={"lease_seconds": 5},
                      local_sgd={"local_steps": 3, "min_contributions": 2, "round_timeout_s": 3})
    rng = random.Random(int.from_bytes(os.urandom(4), "big"))
    with LocalSgdSystem(tmp_path, spec, workers=TRAINERS) as system:
        system.start()
        assassin = AggregatorAssassin(system, AGGREGATOR_KILL_VERSIONS)
        assassin.start()
        deadline, kill_rounds, trainer_kills = time.monotonic() + TIMEOUT_S, list(TRAINER_KILL_ROUNDS), 0
        try:
            while system.services["aggregator"].alive() or assassin.killed.is_set():
                assert time.monotonic() < deadline, f"the run did not finish in {TIMEOUT_S}s: {system.describe()}"
                system.check_no_crash()
                if assassin.killed.is_set() and not system.services["aggregator"].alive():
                    time.sleep(0.5)
                    system.restart("aggregator")
                    assassin.killed.clear()
                busy = [n for n in system.worker_names() if system.services[n].alive()
                        and system.worker_ids[n] in system.lease_holders()]
                # mid-round: it holds its round's leases
                if kill_rounds and busy and system.learner_step() >= kill_rounds[0]:
                    kill_rounds.pop(0)
                    victim = rng.choice(busy)
                    system.kill(victim)
                    system.restart(victim)
                    trainer_kills += 1
                time.sleep(0.05)
        finally:
            assassin.done.set()
        system.finish(timeout=120)
        report = system.audit_rounds()
    problems = report.pop("problems")
    report.update(aggregator_kills=assassin.kills, trainer_kills=trainer_kills, wall_s=round(time.monotonic() - t0, 1))
    show_report(capsys, "CHAOS-LOCAL-SGD " + json.dumps(report))
    assert not problems, "\n".join(problems)
    assert not assassin.versions, f"the aggregator kills never happened: {assassin.versions}"
    assert report["merged_twice"] == 0 and report["vanished"] == 0 and report["overwritten"] == 0
    assert report["records_derived"] == ROUNDS
    assert report["kills_by_service"].get("aggregator") == len(AGGREGATOR_KILL_VERSIONS)
    assert not kill_rounds, f"the run ended before the trainer kills at rounds {kill_rounds}"
    assert report["kills_by_service"].get("trainer") == trainer_kills == len(TRAINER_KILL_ROUNDS)
