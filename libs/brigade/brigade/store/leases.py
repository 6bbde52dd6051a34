"""What a rollout worker does with a lease: acquire, heartbeat, complete, fail; and what a local
trainer (topology local_sgd) does with a round of them: submit them with its contribution."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from brigade import keys
from brigade.spec import MAX_WORKER_IDS_PER_RUN, MAX_WORKERS_PER_RUN
from brigade.store.runs import RunInfo, Runs, require_topology
from brigade.store.scripts import Scripts, text, unwrap
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import (
    check_contribution,
    check_fail_reason,
    check_id,
    check_lease_ref,
    check_rollout_manifest,
    check_worker_info,
    require_manifest,
)


@dataclass
class Beat:
    status: str               # ok | lost | revoked
    message: str = ""
    deadline_ms: int = 0
    latest_version: int = 0


@dataclass
class Completion:
    duplicate: bool
    delivery_id: str = ""


@dataclass
class Failure:
    requeued: bool
    deadlettered: bool
    next_attempt: int = 0


def _completion(reply: list) -> Completion:
    """complete.lua's reply: {'completed', delivery id} | {'duplicate'}."""
    outcome, *values = reply
    return Completion(True) if text(outcome) == "duplicate" else Completion(False, text(values[0]))


def _retry_after_ms(reason: str, over: int, info: RunInfo) -> int:
    if reason == "finished":
        return 5_000
    if reason in ("sync_barrier", "lookahead"):
        # both wait for the next version; a worker wakes on its AdapterPublished event before this
        return 250 + random.randint(0, 250)
    # admission: back off longer the further over capacity we are
    return min(1_000, int(200 * max(1.0, over / max(1, info.capacity)))) + random.randint(0, 200)


class Leases:
    def __init__(self, runs: Runs, scripts: Scripts):
        self.runs = runs
        self.scripts = scripts

    async def acquire(self, run: str, worker: str, info: pb.WorkerInfo | None = None, credential: str = "",
                      max_credential_workers: int = MAX_WORKERS_PER_RUN) -> pb.AcquireLeaseResponse:
        """A lease on the next batch, ready to send: its prompts, seed, adapter version and deadline.
        `credential` (the proxy's caller, "" = the only one): a new worker id counts against that
        credential's `max_credential_workers` in this run (acquire.lua)."""
        ri, values = await self._acquire_args(run, worker, info, credential, max_credential_workers)
        return await self._lease(ri, await self.scripts.acquire(ri.keys, **values))

    async def heartbeat(self, run: str, lease_id: str, worker: str) -> Beat:
        check_lease_ref(run, lease_id, worker)
        ri = await self.runs.get(run)
        status, message, deadline, latest = await self.scripts.heartbeat(
            ri.keys, lease=ri.keys.lease(lease_id), lease_id=lease_id, worker=worker, lease_ms=ri.lease_ms,
            lease_ttl_ms=ri.lease_ttl_ms)
        return Beat(text(status), text(message), int(deadline), int(latest))

    async def complete(self, run: str, lease_id: str, worker: str, manifest: pb.RolloutManifest | None) -> Completion:
        ri, values = await self._complete_args(run, lease_id, worker, manifest)
        return _completion(await self.scripts.complete(ri.keys, **values))

    async def complete_and_acquire(
            self, run: str, lease_id: str, worker: str, manifest: pb.RolloutManifest | None,
            info: pb.WorkerInfo | None = None, credential: str = "",
            max_credential_workers: int = MAX_WORKERS_PER_RUN) -> tuple[Completion, pb.AcquireLeaseResponse]:
        """`complete`, then `acquire` for the same worker, in one script: a worker's whole lease cycle
        is one Redis call. Both are checked before anything is written; a refused completion grants
        nothing. A refused grant (StoreError) is raised after the completion has landed, as it was
        when they were two calls: the worker's retry of the completion is a duplicate."""
        ri, done = await self._complete_args(run, lease_id, worker, manifest)
        _, grant = await self._acquire_args(run, worker, info, credential, max_credential_workers)
        completed, acquired = await self.scripts.complete_acquire(ri.keys, **(done | grant))  # `worker` in both
        completion = _completion(unwrap("complete", completed))
        return completion, await self._lease(ri, unwrap("acquire", acquired))

    async def _acquire_args(self, run: str, worker: str, info: pb.WorkerInfo | None, credential: str = "",
                            max_credential_workers: int = MAX_WORKERS_PER_RUN) -> tuple[RunInfo, dict]:
        check_id("run_id", run)
        check_id("worker_id", worker)
        info = info or pb.WorkerInfo()
        check_worker_info(info)
        ri = await self.runs.get(run)
        await self.runs.load_prompts(ri)  # before granting: a lease is never handed out without its batch
        spec = ri.spec
        return ri, dict(
            worker=worker, lease_prefix=ri.lease_prefix, lease_ms=ri.lease_ms,
            batches_per_epoch=ri.batches_per_epoch, total_batches=ri.total_batches, capacity=ri.capacity,
            batches_per_step=max(1, spec.batches_per_step), sync=int(spec.sync), max_steps=spec.max_steps, run=run,
            worker_info=info.SerializeToString(), lease_ttl_ms=ri.lease_ttl_ms,
            # one credential: the run's cap as always; several: each its own, under a run-wide backstop
            max_workers=MAX_WORKER_IDS_PER_RUN if credential else MAX_WORKERS_PER_RUN,
            credential=credential, max_credential_workers=max_credential_workers,
            lookahead=ri.lookahead, max_lookahead=ri.max_staleness, publish_every=max(1, spec.publish_every))

    async def _lease(self, ri: RunInfo, reply: list) -> pb.AcquireLeaseResponse:
        """The answer to a worker from acquire.lua's reply."""
        outcome, *values = reply
        reason = text(outcome)
        if reason != "granted":
            return pb.AcquireLeaseResponse(granted=False, reason=reason,
                                           retry_after_ms=_retry_after_ms(reason, int(values[0]), ri))
        lease_id, batch_id = text(values[0]), text(values[1])
        attempt, version, deadline_ms = int(values[2]), int(values[3]), int(values[4])
        epoch = keys.parse_batch_id(batch_id)[1]
        if not ri.has_permutation(epoch):  # a new epoch: shuffling a million prompts takes 0.5 s, off the loop
            await asyncio.to_thread(ri.permutation, epoch)
        run = ri.run
        return pb.AcquireLeaseResponse(granted=True, lease=pb.Lease(
            lease_id=lease_id, run_id=run, batch=ri.batch(batch_id), adapter_version=version,
            seed=keys.batch_seed(ri.spec.seed, batch_id, attempt),
            attempt=attempt, deadline_ms=deadline_ms, lease_seconds=ri.lease_ms // 1000))

    async def _complete_args(self, run: str, lease_id: str, worker: str,
                             manifest: pb.RolloutManifest | None) -> tuple[RunInfo, dict]:
        check_lease_ref(run, lease_id, worker)
        require_manifest(manifest)
        ri = await self.runs.get(run)
        require_topology(ri, "central", "CompleteLease")
        check_rollout_manifest(run, manifest)
        return ri, dict(lease=ri.keys.lease(lease_id), lease_id=lease_id, worker=worker, batch=manifest.batch_id,
                        attempt=manifest.attempt, policy_version=manifest.policy_version,
                        manifest=manifest.SerializeToString())

    async def submit(self, run: str, trainer: str, lease_ids: list[str],
                     manifest: pb.ContributionManifest | None) -> Completion:
        """Complete every lease of a trainer's round at once and queue its contribution (local_sgd)."""
        check_id("run_id", run)
        check_id("trainer_id", trainer)
        for lease_id in lease_ids:
            check_lease_ref(run, lease_id, trainer)
        require_manifest(manifest)
        ri = await self.runs.get(run)
        require_topology(ri, "local_sgd", "SubmitContribution")
        check_contribution(run, trainer, lease_ids, manifest)
        outcome, *values = await self.scripts.contribute(
            ri.keys, worker=trainer, lease_prefix=ri.lease_prefix, contribution=manifest.contribution_id,
            base_version=manifest.base_version, manifest=manifest.SerializeToString(), n=len(lease_ids),
            ids=[*lease_ids, *manifest.batch_ids])
        if text(outcome) == "duplicate":
            return Completion(True)
        return Completion(False, text(values[0]))

    async def fail(self, run: str, lease_id: str, worker: str, reason: int, message: str = "") -> Failure:
        """`reason`: FailLeaseRequest.ERROR (counts toward max_attempts) or PREEMPTED (does not)."""
        check_lease_ref(run, lease_id, worker)
        preempted = check_fail_reason(reason)
        ri = await self.runs.get(run)
        kind = "preempted" if preempted else "error"
        (nxt,) = await self.scripts.fail(
            ri.keys, lease=ri.keys.lease(lease_id), lease_id=lease_id, worker=worker, counted=0 if preempted else 1,
            max_attempts=ri.max_attempts, reason=kind + (f": {message[:500]}" if message else ""), kind=kind)
        return Failure(requeued=int(nxt) > 0, deadlettered=int(nxt) == 0, next_attempt=int(nxt))
