"""The audit of a chaos or fault run (`AuditedSystem.audit`): every batch ever cut accounted for
from Redis, and the learner's lineage read from the bucket (one loadable checkpoint per step, no
batch trained twice, versions contiguous and never overwritten)."""

from __future__ import annotations

import asyncio
import json
import os
from collections import Counter
from typing import Any

from brigade import keys
from brigade_harness.devservers import MOTO_ENV

IN_FLIGHT_LEASE_PERIODS = 4  # the audit's bound on how long a batch may have been in flight at the end


def stream_ms(entry_id: bytes) -> int:
    """The time (ms) in a stream entry id."""
    return int(entry_id.split(b"-")[0])


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


def audit_run(system: Any) -> dict[str, Any]:
    """Account for every batch ever cut of an AuditedSystem's run, from Redis; check the learner's lineage
    in the bucket. Returns the counts, with the violations found under "problems"."""
    problems: list[str] = []
    k = keys.RunKeys(system.run)
    with system.r() as r:
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
    created = system.created_batches(cursor)

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
    limit_ms = IN_FLIGHT_LEASE_PERIODS * system.spec.staleness.lease_seconds * 1000
    stuck = [(where, b, round((end_ms - stream_ms(i)) / 1000, 1)) for where, entries in
             (("queued_or_leased", work_entries), ("completed_not_acked", rollout_entries))
             for i, b in entries if end_ms - stream_ms(i) > limit_ms]
    if stuck:
        problems.append(f"{len(stuck)} batches in flight for more than {IN_FLIGHT_LEASE_PERIODS} lease periods "
                        f"when the last step was acked (where, batch, age s): {stuck[:10]}")

    # the learner's lineage, from the bucket: one checkpoint per step, each loads, no batch twice
    lineage = asyncio.run(lineage_of(system))
    problems += lineage.pop("problems")
    history: list[str] = lineage.pop("history")
    duplicates = len(history) - len(set(history))
    if duplicates:
        problems.append(f"{duplicates} batches trained twice: {[b for b, n in Counter(history).items() if n > 1]}")
    # A step retrained beside a damaged checkpoint: the batches of the lost attempt were consumed
    # (acked) and their training is lost with it, so Redis may hold up to that many more than the
    # lineage; Redis keeps the first metrics of a step, so the retrained batches may be missing there.
    retrained: dict[int, dict] = lineage.pop("retrained")
    lost_bound = system.spec.batches_per_step * system.spec.checkpoint_every * len(retrained)
    retrained_batches = sum(r["batches"] for r in retrained.values())
    lost = consumed - set(history)
    if set(history) - consumed or len(lost) > lost_bound:
        problems.append(f"checkpoint lineage ({len(set(history))} batches) != Redis consumed set ({len(consumed)}): "
                        f"only in lineage {sorted(set(history) - consumed)[:5]}, "
                        f"only in Redis {sorted(lost)[:5]} (at most {lost_bound} may be lost with damaged "
                        f"checkpoints; {len(retrained)} steps retrained)")
    steps_metrics = {m["step"]: m for m in metrics_rows}
    in_metrics = sum(m.get("accepted_batches", 0) for m in steps_metrics.values())
    if not len(consumed) - retrained_batches <= in_metrics <= len(consumed):
        problems.append(f"per-step metrics in Redis ({in_metrics} batches) do not add up to the consumed set "
                        f"({len(consumed)}, {retrained_batches} of them retrained)")
    # Redis's counters agree with the learner's newest checkpoint (Redis may lose writes; the
    # learner must have repaired them)
    final = lineage.pop("final")
    if final is not None and (final["step"], final["version"], final["consumed"] + len(lost)) != (
            learner_step, latest, len(consumed)):
        problems.append(f"Redis (step {learner_step}, version {latest}, {len(consumed)} consumed) disagrees "
                        f"with the newest checkpoint {final}")
    if sorted(steps_metrics) != list(range(1, learner_step + 1)):
        problems.append(f"Redis's metrics stream lacks steps: has {sorted(steps_metrics)}")

    # versions: contiguous, published == in the bucket, never overwritten
    max_steps = system.spec.max_steps
    bucket_versions = lineage["bucket_versions"]
    if published != list(range(1, latest + 1)) or bucket_versions != published:
        problems.append(f"adapter versions not contiguous: redis {published}, bucket {bucket_versions}, "
                        f"latest {latest}")
    if sorted(set(announced)) != published:
        problems.append(f"AdapterPublished events {sorted(set(announced))} != versions in Redis {published}")
    # a retrained step that publishes may add a version (when its lost attempt had published one)
    versions_expected = max_steps // max(1, system.spec.publish_every)
    versions_extra = sum(r["published"] for r in retrained.values())
    if learner_step != max_steps or not versions_expected <= latest <= versions_expected + versions_extra:
        problems.append(f"learner_step {learner_step} / latest version {latest}, expected {max_steps} / "
                        f"{versions_expected} (+ up to {versions_extra} for retrained steps)")
    changed = system.watcher.finish() if system.watcher is not None else []
    if changed:
        problems.append(f"write-once objects were overwritten: {changed[:10]}")

    # why the learner rejected what it rejected: its log says, per batch (Redis records only "learner")
    learner_reasons = {e.get("batch"): e.get("reason") for e in system.log_events("learner", new_only=False)
                       if e.get("event") == "rollout_rejected"}
    system.detail = {"consumed": consumed, "rejected": rejected, "learner_reasons": learner_reasons,
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
        "retrained_steps": sorted(retrained),
        "lost_with_damaged_checkpoints": len(lost),
        "write_once_objects_watched": len(system.watcher.first_seen) if system.watcher else 0,
        "overwritten": len(changed),
        "expired_leases": stats.get("expired", 0),
        "revoked_leases": stats.get("revoked", 0),
        "duplicate_completions": stats.get("duplicates", 0),
        "kills": sum(s.kills for s in system.services.values()),
        "kills_by_service": dict(sum((Counter({n.split("-")[0]: s.kills}) for n, s in system.services.items()),
                                     Counter())),
        "rejection_reasons": lineage["rejection_reasons"],
    }
    if report["batches_created"] != (report["consumed"] + report["rejected"] + report["deadlettered"]
                                     + report["in_flight"] + report["vanished"]):
        problems.append("created != consumed + rejected + deadlettered + in_flight + vanished")
    report["problems"] = problems
    return report


async def lineage_of(system: Any) -> dict[str, Any]:
    """Read every checkpoint (directly from moto, no faults): each step 1..max_steps complete (its
    newest attempt) and loadable into a fresh trainer; the per-step consumed lists chain without
    repeats. `retrained`: the steps saved again beside a damaged checkpoint (attempt > 0)."""
    from brigade import adapters
    from brigade.bucket.s3 import S3Bucket
    from brigade_learner import checkpoint
    from brigade_learner.trainer import Trainer

    problems: list[str] = []
    history: list[str] = []
    saved = {k: os.environ.get(k) for k in MOTO_ENV}
    os.environ.update(MOTO_ENV)
    bucket = S3Bucket(system.bucket, endpoint_url=system.moto.url)
    try:
        steps = await checkpoint.step_attempts(bucket, system.run)
        trainer = await asyncio.to_thread(Trainer.create, system.spec)
        seen: set[str] = set()
        loaded = 0
        final = None
        retrained: dict[int, dict] = {}
        for step in range(1, system.spec.max_steps + 1):
            if step not in steps:
                problems.append(f"no checkpoint for step {step}")
                continue
            found = await checkpoint.read(bucket, system.run, step, steps[step])
            if found is None:
                problems.append(f"checkpoint {step} is incomplete or damaged")
                continue
            attempt, files = found
            state = await asyncio.to_thread(checkpoint.decode, trainer, files)
            loaded += 1
            if state.step != step:
                problems.append(f"checkpoint {step} says step {state.step}")
            new = list(state.ack.consumed)
            if attempt:  # retrained after resuming from the checkpoint before a damaged one
                retrained[step] = {"attempt": attempt, "batches": len(new), "published": state.published}
            history += new
            if state.consumed != seen | set(new) or seen & set(new):
                problems.append(f"checkpoint {step}: consumed {len(state.consumed)} != previous {len(seen)} "
                                f"+ this step's {new}")
            seen = state.consumed
            final = {"step": state.step, "version": state.version, "consumed": len(state.consumed)}
        versions = sorted({int(key.split("/")[3][1:]) for key in await bucket.list(f"runs/{system.run}/adapters/")})
        for v in versions:
            try:
                _, files = await adapters.read_version(bucket, system.run, v)
                adapters.apply(trainer.model, adapters.decode(files))
            except Exception as e:  # noqa: BLE001
                problems.append(f"adapter v{v} does not load: {e}")
        reasons: Counter = Counter()
        for key in await bucket.list(f"runs/{system.run}/metrics/"):
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
            "rejection_reasons": dict(reasons), "final": final, "retrained": retrained}
