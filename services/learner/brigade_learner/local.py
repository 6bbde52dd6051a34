"""A local trainer (topology local_sgd): a rollout worker and a learner in one process. It leases
batches as a worker does, generates them with the very weights it trains (the engine wraps the
trainer's model, so every local step is on-policy), takes `local_sgd.local_steps` GRPO steps with the
learner's Trainer, then uploads its trained LoRA factors and submits them with the round's leases. An
aggregator (brigade_aggregator) merges the contributions of a round into the next global version.

    while the run is not finished:
        base = the newest global version; load its trained factors (frozen_a: B; A stays the seeded v0)
        for each of H local steps (or until local_sgd.upload_seconds):
            leases += AcquireLease x batches_per_step     # heartbeated until submitted
            rollouts = generate + score each batch with the live local weights
            Trainer.train_step(rollouts)
        put contributions/v{base}/{id}.safetensors (create-only), SubmitContribution(leases, manifest)

Failures, in one place:
- killed (SIGKILL, a reclaimed VM): the round's local steps are lost, nothing else; its leases stop
  being heartbeated and the janitor requeues their batches as new attempts;
- SIGTERM: the leases go back at once (FailLease PREEMPTED, not counted) and it exits 0;
- a lease taken back (LOST, REVOKED) or the global version more than max_staleness past the round's
  base (the aggregator would drop the contribution): the round is abandoned, its other leases handed
  back PREEMPTED, and the next round starts from the newest version;
- SubmitContribution refused because a lease is gone: the upload stays unreferenced, the round is lost;
- the proxy or the bucket unreachable: called again with backoff, for as long as the process lives.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import structlog
from safetensors.torch import save as st_save

from brigade import adapters, keys
from brigade.bucket import (
    Bucket,
    BucketError,
    CorruptObject,
    ObjectExists,
    open_bucket,
    probe_at_start,
)
from brigade.code_policy import refuse_code
from brigade.config import ConfigError
from brigade.datasets import prompt_value
from brigade.engine.base import Stopped
from brigade.engine.hf import HFEngine
from brigade.model import load_tokenizer
from brigade.retry import retry
from brigade.reward_call import RewardCall, TrainerState
from brigade.reward_sandbox import RqSandbox
from brigade.rewards import RewardSet
from brigade.rollout_format import Rollout, build_rollout
from brigade.rpc import ProxyClient, retry_unavailable
from brigade.service import until_signal
from brigade.v1 import brigade_pb2 as pb
from brigade_learner.config import TrainerConfig
from brigade_learner.ingest import READ_BACKOFF, drop_nonfinite
from brigade_learner.trainer import Trainer

log = structlog.get_logger()
CONTRIBUTION_FORMAT = "brigade-contribution-1"
RPC_TIMEOUT_S = 15.0
NEXT_VERSION_POLL_S = 0.25   # GetRun while waiting for the round to close
NEXT_VERSION_SLACK_S = 5.0   # beyond round_timeout_s: the aggregator's merge and publish


class RoundLost(Exception):
    """The round's contribution can no longer be merged (a lease taken back, too stale)."""


async def read_trained(bucket: Bucket, run: str, version: int, names: list[str]) -> dict:
    """The trained factors of a published version, as the trainers load them (sha256-checked)."""
    _, files = await adapters.read_version(bucket, run, version)
    published = adapters.decode(files)
    return {n: published[n] for n in names}


class LocalTrainer:
    def __init__(self, cfg: TrainerConfig, spec: pb.RunSpec, bucket: Bucket, client: ProxyClient, trainer: Trainer,
                 tokenizer, rewards: RewardSet):
        self.cfg, self.spec, self.bucket, self.client, self.trainer = cfg, spec, bucket, client, trainer
        self.run_id, self.rewards, self.tokenizer = spec.run_id, rewards, tokenizer
        self.engine = HFEngine(trainer.model, tokenizer)  # generates with the weights being trained
        self.trained = adapters.trained_names(trainer.v0, spec.local_sgd.merge)
        self.base = -1                  # the global version the current round started from
        self.latest = 0                 # the newest global version heard of
        self.held: dict[str, pb.Lease] = {}
        self.spoiled = ""               # why the round in progress is lost
        self.rounds = {"submitted": 0, "lost": 0, "duplicates": 0}
        self._stopping = asyncio.Event()
        self._global: tuple[int, dict] = (0, {})  # the last global version read, its trained factors

    async def _call(self, what: str, fn):
        return await retry_unavailable(what, fn, self.cfg.proxy)

    # ------------------------------------------------------------ start

    async def publish_base(self) -> None:
        """The seeded v0 adapter (the same in every process) and its adapter_config.json, written once
        for the aggregator to start from. A trainer whose v0 differs (another model, seed or LoRA
        shape) refuses to start: its contributions could not be merged with the others'."""
        state = {n: t.float().contiguous() for n, t in self.trainer.v0.items()}
        # one metadata entry: safetensors writes several in an order that differs between processes
        data = st_save(state, metadata={"adapter_config": self.trainer.adapter_config_json().decode()})
        key = keys.base_adapter_key(self.run_id)
        try:
            await self._bucket_op("writing the v0 adapter", lambda: adapters.put_once(self.bucket, key, data))
        except ObjectExists:
            raise ConfigError(f"this trainer's seeded v0 adapter differs from the run's at {key}: another model, "
                              "seed, LoRA shape or PEFT version") from None

    async def _bucket_op(self, what: str, fn):
        def log_retry(attempt: int, delay: float, e: BaseException) -> None:
            log.warning("bucket_retry", what=what, attempt=attempt, error=str(e)[:300])

        return await retry(fn, retryable=lambda e: isinstance(e, BucketError | OSError) and not isinstance(
            e, ObjectExists | CorruptObject), backoff=READ_BACKOFF, on_retry=log_retry)

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        await self.publish_base()
        state = await self._run_state()
        while not self._stopping.is_set():
            if state.finished and self.cfg.exit_when_finished:
                break
            await self._start_from(state.latest_version)
            try:
                if not await self.round():
                    if self.cfg.exit_when_finished:
                        break
                    await asyncio.sleep(5)
                state = await self._next_version()
            except RoundLost as e:
                self.rounds["lost"] += 1
                log.warning("round_lost", base=self.base, reason=str(e)[:300])
                state = await self._run_state()
            finally:
                await self._hand_back()
        log.info("trainer_done", **self.rounds)

    async def _run_state(self) -> pb.RunState:
        return await self._call("GetRun", lambda: self.client.runs.GetRun(pb.RunRef(run_id=self.run_id),
                                                                           timeout=RPC_TIMEOUT_S))

    async def _next_version(self) -> pb.RunState:
        """After submitting: wait for the round it joined to close (a version past this round's base),
        at most as long as a round can stay open; then the next round starts from the newest version.
        A trainer joins each round once, and one that missed a round (slow) joins the next one late:
        the aggregator down-weights or drops that contribution by its staleness."""
        deadline = time.monotonic() + self.spec.local_sgd.round_timeout_s + NEXT_VERSION_SLACK_S
        while True:
            state = await self._run_state()
            if state.latest_version > self.base or state.finished or time.monotonic() > deadline:
                return state
            await asyncio.sleep(NEXT_VERSION_POLL_S)

    def stop(self) -> None:
        self._stopping.set()

    async def _start_from(self, version: int) -> None:
        """Load global `version`'s trained factors over the local ones (a new round restarts from a
        global version even when it is the one the last round started from: its steps were sent)."""
        if version > 0 and self._global[0] != version:
            self._global = (version, await self._bucket_op(f"reading adapter v{version}", lambda: read_trained(
                self.bucket, self.run_id, version, self.trained)))
        state = dict(self.trainer.v0)
        if version > 0:
            state.update(self._global[1])
        await asyncio.to_thread(adapters.apply, self.trainer.model, state)
        self.base = self.latest = version

    async def round(self) -> bool:
        """One round from self.base; False when the run is finished (nothing submitted)."""
        spec, ls = self.spec, self.spec.local_sgd
        self.spoiled, t0, steps, samples, reward_sum = "", time.monotonic(), 0, 0, 0.0
        order: list[pb.Lease] = []
        empty: list[str] = []
        beats = asyncio.create_task(self._heartbeat(max(0.1, spec.staleness.lease_seconds / 3)))
        try:
            while steps < ls.local_steps and not (steps and ls.upload_seconds
                                                   and time.monotonic() - t0 >= ls.upload_seconds):
                rollouts = []
                for _ in range(max(1, spec.batches_per_step)):
                    lease = await self._acquire()
                    if lease is None:
                        return False
                    order.append(lease)
                    rollout = await self._rollout(lease)
                    if rollout is None:
                        empty.append(lease.batch.batch_id)
                    else:
                        rollouts.append(rollout)
                    self._check()
                if rollouts:
                    train = await asyncio.to_thread(self.trainer.train_step, rollouts)
                    steps += 1
                    n = sum(r.num_samples for r in rollouts)
                    samples, reward_sum = samples + n, reward_sum + train["reward_mean"] * n
                    log.info("local_step", base=self.base, step=steps, samples=n, **{
                        k: round(train[k], 4) for k in ("reward_mean", "loss", "kl", "grad_norm")})
                self._check()
        finally:
            beats.cancel()
        await self._submit(order, empty, steps, samples, reward_sum / max(samples, 1), time.monotonic() - t0)
        return True

    def _check(self) -> None:
        if self._stopping.is_set():
            raise asyncio.CancelledError()
        if self.spoiled:
            raise RoundLost(self.spoiled)
        if self.latest - self.base > self.spec.staleness.max_staleness:
            raise RoundLost(f"global version {self.latest} is more than max_staleness past this round's base "
                            f"{self.base}: the aggregator would drop it")

    async def _acquire(self) -> pb.Lease | None:
        """The next lease, held until submitted; None once the run is finished."""
        cfg = self.cfg
        req = pb.AcquireLeaseRequest(run_id=self.run_id, worker_id=cfg.trainer_id, capacity_class=cfg.capacity_class,
                                     price_per_hour=cfg.price_per_hour, engine="hf")
        while True:
            resp = await self._call("AcquireLease", lambda: self.client.lease.AcquireLease(req, timeout=RPC_TIMEOUT_S))
            if resp.granted:
                self.held[resp.lease.lease_id] = resp.lease
                return resp.lease
            if resp.reason == "finished":
                return None
            await asyncio.sleep(max(50, resp.retry_after_ms) / 1000 * random.uniform(0.5, 1.5))
            self._check()

    async def _rollout(self, lease: pb.Lease) -> Rollout | None:
        """The batch generated with the live local weights and scored; None when no sample is usable."""
        spec = self.spec
        prompts = [prompt_value(p) for p in lease.batch.prompts]
        try:
            samples = await asyncio.to_thread(self.engine.generate, prompts, spec.sampling, lease.seed,
                                              self.engine.version, lambda: bool(self.spoiled) or self._stopping.is_set())
        except Stopped:
            self._check()
            raise
        texts = self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
        state = TrainerState(global_step=self.base, max_steps=spec.max_steps, epoch=float(lease.batch.epoch),
                             num_train_epochs=spec.epochs)
        scores = await self.rewards.score(RewardCall.for_samples(lease.batch.prompts, samples, texts, state))
        pad = self.tokenizer.pad_token_id
        rollout = build_rollout(lease, samples, scores.total, scores.parts, scores.names, 0 if pad is None else pad,
                                scores.step_metrics())
        rollout, _dropped = drop_nonfinite(rollout)
        return rollout if rollout.num_samples else None

    async def _submit(self, order: list[pb.Lease], empty: list[str], steps: int, samples: int, reward_mean: float,
                      seconds: float) -> None:
        lease_ids = [lease.lease_id for lease in order]
        cid = keys.contribution_id(self.run_id, self.cfg.trainer_id, lease_ids)
        key = keys.contribution_key(self.run_id, self.base, cid)
        state = adapters.adapter_state(self.trainer.model)
        data = st_save({n: state[n].cpu().float().contiguous() for n in self.trained},
                       metadata={"format": CONTRIBUTION_FORMAT})
        digest = await self._bucket_op(f"uploading {key}", lambda: adapters.put_once(self.bucket, key, data))
        manifest = pb.ContributionManifest(
            run_id=self.run_id, contribution_id=cid, trainer_id=self.cfg.trainer_id, base_version=self.base,
            local_steps=steps, batch_ids=[lease.batch.batch_id for lease in order], empty_batch_ids=empty, uri=key,
            sha256=digest, size_bytes=len(data), num_samples=samples, reward_mean=reward_mean, compute_seconds=seconds,
            price_per_hour=self.cfg.price_per_hour, capacity_class=self.cfg.capacity_class,
            created_ms=int(time.time() * 1000))
        req = pb.SubmitContributionRequest(run_id=self.run_id, trainer_id=self.cfg.trainer_id, lease_ids=lease_ids,
                                           manifest=manifest)
        try:
            resp = await self._call("SubmitContribution",
                                    lambda: self.client.lease.SubmitContribution(req, timeout=RPC_TIMEOUT_S))
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:
                raise
            raise RoundLost(f"the proxy refused the contribution: {e.details()}") from None
        self.held.clear()
        self.rounds["duplicates" if resp.duplicate else "submitted"] += 1
        log.info("contribution_submitted", base=self.base, contribution=cid, local_steps=steps, samples=samples,
                 reward_mean=round(reward_mean, 4), batches=len(order), empty=len(empty), bytes=len(data),
                 seconds=round(seconds, 2), duplicate=resp.duplicate)

    async def _hand_back(self) -> None:
        """Give every lease still held back at once (PREEMPTED: not counted against the batch); one
        bounded try each, else the janitor requeues it when it expires."""
        for lease_id in list(self.held):
            req = pb.FailLeaseRequest(run_id=self.run_id, lease_id=lease_id, worker_id=self.cfg.trainer_id,
                                      reason=pb.FailLeaseRequest.PREEMPTED, message="local round abandoned")
            try:
                await asyncio.shield(self.client.lease.FailLease(req, timeout=3))
            except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
                log.debug("FailLease did not land; the lease will expire instead", error=repr(e)[:200])
        self.held.clear()

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            for lease in list(self.held.values()):
                req = pb.HeartbeatRequest(run_id=self.run_id, lease_id=lease.lease_id, worker_id=self.cfg.trainer_id)
                try:
                    resp = await self.client.lease.Heartbeat(req, timeout=interval)
                except grpc.aio.AioRpcError as e:  # keep trying: the lease lives until its deadline
                    log.warning("heartbeat_failed", error=str(e.details())[:200])
                    continue
                self.latest = max(self.latest, resp.latest_adapter_version)
                if resp.status in (pb.HeartbeatResponse.REVOKED, pb.HeartbeatResponse.LOST) and not self.spoiled:
                    self.spoiled = f"lease {lease.lease_id} {pb.HeartbeatResponse.Status.Name(resp.status)}: " \
                                   f"{resp.message}"


# ---------------------------------------------------------------- wiring

async def serve(cfg: TrainerConfig) -> signal.Signals | None:
    """Train rounds until the run is finished (with exit_when_finished) or SIGTERM / SIGINT."""
    client = ProxyClient.connect(cfg.proxy, cfg.token, cfg.tls_ca)
    bucket = open_bucket(cfg.bucket)
    rewards = None
    try:
        await bucket.ensure()
        await probe_at_start(bucket, cfg.run)
        spec = (await retry_unavailable("GetRun", lambda: client.runs.GetRun(
            pb.RunRef(run_id=cfg.run), timeout=RPC_TIMEOUT_S), cfg.proxy)).spec
        refuse_code(cfg.run, spec, cfg.bucket)
        if spec.topology != "local_sgd":
            raise ConfigError(f"run {cfg.run} has topology {spec.topology or 'central'}: it is trained by "
                              "`brigade learner` and `brigade rollout` workers, not local trainers")
        if cfg.device:
            spec.device = cfg.device
        sandbox = None
        if any(r.sandboxed for r in spec.rewards) and cfg.redis_url:
            sandbox = RqSandbox(cfg.redis_url, keys.reward_queue(cfg.run), start_worker=cfg.reward_workers)
        try:
            rewards = RewardSet.from_specs(spec.rewards, sandbox, device=spec.device,
                                           trust_remote_code=spec.trust_remote_code)
        except ValueError as e:
            raise ConfigError(f"run {cfg.run}: {e}") from None
        trainer = await asyncio.to_thread(Trainer.create, spec, spec.max_steps * spec.local_sgd.local_steps)
        tokenizer = await asyncio.to_thread(load_tokenizer, spec)
        local = LocalTrainer(cfg, spec, bucket, client, trainer, tokenizer, rewards)
        log.info("trainer_ready", run=cfg.run, trainer=cfg.trainer_id, model=spec.model, merge=spec.local_sgd.merge,
                 local_steps=spec.local_sgd.local_steps, trained=len(local.trained))
        # a signal hands the round's leases back (run()'s finally), then the trainer exits 0
        return await until_signal(local.run(), on_signal=lambda sig: local.stop())
    finally:
        if rewards is not None:
            await rewards.close()
        await bucket.close()
        await client.close()
