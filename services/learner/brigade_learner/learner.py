"""The learner service: pull manifests, fetch rollouts, train, checkpoint, publish, ack. Repeat.

Per step, in this order, so that a SIGKILL at any point loses nothing and trains nothing twice:

    take rollouts (prefetched)  ->  train  ->  checkpoint  ->  write adapter v+1  ->  PublishAdapter
                                                                                  ->  AckRollouts

Until the ack, the proxy still holds the step's manifests as pending for this learner, and the
checkpoint (written first) lists their batch ids as consumed. A restart resumes from the newest
complete checkpoint, replays its idempotent tail (the same adapter bytes, the same publish, the same
ack), then pulls again with include_pending and skips whatever the checkpoint already consumed.

Redis can also come back from a crash without its last second of writes (appendfsync everysec):
before each commit's publish the learner compares Redis with what its last commit told it, and
re-sends what Redis lost (the versions from the bucket's manifests, the acks) with the same
idempotent calls as that replay, so Redis converges to the checkpoint without a restart.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
import torch

from brigade import adapters, crash_loop, keys
from brigade.bucket import Bucket, BucketError, ObjectExists, ObjectNotFound, open_bucket, probe_at_start
from brigade.code_policy import refuse_code
from brigade.config import ConfigError
from brigade.rpc import ProxyClient, retry_unavailable
from brigade.service import until_signal
from brigade.spec_file import build_spec, spec_to_dict
from brigade.trackers import open_trackers
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_METRICS_JSON
from brigade_learner import checkpoint
from brigade_learner import metrics as prom
from brigade_learner.checkpoint import LearnerState, PendingAck
from brigade_learner.config import LearnerConfig
from brigade_learner.crash import CrashPoints
from brigade_learner.ingest import Prefetcher, StepData, manifest_dollars
from brigade_learner.trainer import Trainer

# Every step trains on this one thread. Through asyncio.to_thread a step lands on whichever pool
# thread is idle (the prefetcher parses rollouts on others), and glibc gives each thread its own
# malloc arena, each keeping the freed peak of a step: a 135M model's learner grew ~2 GB a step
# until the OOM killer took it. One thread, one arena: measured flat.
_TRAIN_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="train")

log = structlog.get_logger()
T = TypeVar("T")
# a restart logs at most this many missing steps to its trackers (a GET each): enough for every kill,
# bounded when a tracker is first turned on late in a long run
MAX_TRACKER_BACKFILL = 1000
REDIS_CHECK_S = 5.0  # while a step's rollouts are slow to come, how often Learner._take looks at Redis


def metrics_for_proxy(metrics: dict | None) -> str:
    """A step's metrics as AckRollouts carries them: "" beyond the proxy's bound (the bucket keeps
    every step's full metrics either way)."""
    text = json.dumps(metrics) if metrics else ""
    return text if len(text.encode()) <= MAX_METRICS_JSON else ""


@dataclass
class Told:
    """What the newest commit told Redis (or, resumed from its checkpoint, was to tell it)."""

    step: int
    version: int
    ack: PendingAck
    metrics_json: str


class Learner:
    def __init__(self, cfg: LearnerConfig, spec: pb.RunSpec, bucket: Bucket, client: ProxyClient, trainer: Trainer):
        self.cfg, self.spec, self.bucket, self.client, self.trainer = cfg, spec, bucket, client, trainer
        self.run_id = spec.run_id
        self.max_steps = trainer.max_steps
        self.state = LearnerState()
        self.durable_step = 0            # the newest step covered by a complete checkpoint
        self.config_json = trainer.adapter_config_json()
        self._published_files: tuple[dict[str, bytes], float] | None = None
        # seconds each step since the last publish spent busy (its cycle less its wait for rollouts):
        # the proxy weighs generation against it to choose how far ahead workers may run
        self._busy_s: list[float] = []
        self._proximal: dict[int, dict] = {}  # decoded adapter versions, for recompute_logprobs
        self._tokens_total = 0  # prompt and completion tokens trained on since step 1 (TRL's num_tokens)
        self._pruning: asyncio.Task | None = None   # checkpoint retention, beside the next step
        self._told: Told | None = None
        self.crash = CrashPoints.from_env()
        self.prefetch = Prefetcher(self._pull, self._ack_now, bucket, self.run_id, trainer.vocab_size,
                                   want=spec.batches_per_step, consumed=self.state.consumed,
                                   max_staleness=spec.staleness.max_staleness, limits=trainer.rollout_limits)
        self.trackers = open_trackers(spec.report_to if cfg.report_to is None else cfg.report_to, self.run_id,
                                      spec_to_dict(spec), cfg.tracker_dir)

    # ------------------------------------------------------------ proxy calls (retried while unreachable)

    async def _call(self, what: str, fn: Callable[[], Awaitable[T]], on_failure: Callable[[], None] = lambda: None
                    ) -> T:
        return await retry_unavailable(what, fn, self.cfg.proxy, on_failure)

    async def _pull(self, n: int, include_pending: bool) -> tuple[list[pb.PulledRollout], bool]:
        """The rollouts, and whether a try failed first (the prefetcher then reads its pending ones)."""
        req = pb.PullRolloutsRequest(run_id=self.run_id, max_manifests=n, wait_ms=self.cfg.pull_wait_ms,
                                     include_pending=include_pending, learner_id=self.cfg.learner_id)
        timeout = self.cfg.pull_wait_ms / 1000 + 30
        failed = []
        resp = await self._call("PullRollouts", lambda: self.client.learner.PullRollouts(req, timeout=timeout),
                                on_failure=lambda: failed.append(True))
        return list(resp.rollouts), bool(failed)

    async def _ack(self, delivery_ids: list[str], consumed: list[str], rejected: list[str], step: int,
                   metrics_json: str = "") -> None:
        try:
            await self._ack_once(delivery_ids, consumed, rejected, step, metrics_json)
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.INVALID_ARGUMENT or not (consumed or rejected):
                raise
            # a batch id Redis cannot place (ack.lua recovers the completions and cuts a crash lost):
            # dead-lettered since, or a bug's. The rest of the ack must still land: each batch alone,
            # then the deliveries and the step (after the batches: the proxy holds a step to what the
            # consumed batches make).
            log.warning("ack_refused", batch_ids=[*consumed, *rejected][:20], error=e.details())
            for fate in [([b], []) for b in consumed] + [([], [b]) for b in rejected]:
                try:
                    await self._ack_once([], *fate, 0, "")
                except grpc.aio.AioRpcError as e:
                    if e.code() != grpc.StatusCode.INVALID_ARGUMENT:
                        raise
                    log.warning("batch_fate_refused", consumed=fate[0], rejected=fate[1], error=e.details())
            await self._ack_once(delivery_ids, [], [], step, metrics_json)

    async def _ack_once(self, delivery_ids: list[str], consumed: list[str], rejected: list[str], step: int,
                        metrics_json: str) -> None:
        req = pb.AckRolloutsRequest(run_id=self.run_id, delivery_ids=delivery_ids, consumed_batch_ids=consumed,
                                    rejected_batch_ids=rejected, step=step, learner_id=self.cfg.learner_id,
                                    metrics_json=metrics_json)
        await self._call("AckRollouts", lambda: self.client.learner.AckRollouts(req, timeout=30))

    async def _ack_pending(self, step: int) -> None:
        """Ack what the steps up to `step` trained on, with the last step's metrics for the proxy."""
        s = self.state
        told = Told(step, s.version, s.ack, metrics_for_proxy(s.metrics[-1] if s.metrics else None))
        await self._send_ack(told)
        self.prefetch.settled(s.ack.delivery_ids)
        s.ack, s.metrics = PendingAck(), []

    async def _send_ack(self, told: Told) -> None:
        a = told.ack
        await self._ack(a.delivery_ids, a.consumed, a.rejected, told.step, told.metrics_json)
        self._told = told

    async def _ack_now(self, delivery_ids: list[str], consumed: list[str], rejected: list[str]) -> None:
        """Rejections and duplicates are final: ack them at once (not with the next step), or they
        would count as outstanding work at the proxy and could hold admission shut."""
        # step 0: these acks complete no step; only a step's own ack may move the proxy's step (and
        # emit StepCompleted), and the proxy's script only ever moves it forward
        await self._ack(delivery_ids, consumed, rejected, 0)

    async def _publish(self, manifest: pb.AdapterManifest, step_busy_s: float = 0.0) -> int:
        req = pb.PublishAdapterRequest(run_id=self.run_id, manifest=manifest, step_busy_s=step_busy_s)
        resp = await self._call("PublishAdapter", lambda: self.client.learner.PublishAdapter(req, timeout=30))
        return resp.latest_version

    async def _run_state(self) -> pb.RunState:
        return await self._call("GetRun", lambda: self.client.runs.GetRun(pb.RunRef(run_id=self.run_id), timeout=30))

    # ------------------------------------------------------------ start

    async def resume(self) -> None:
        """Continue from the newest complete checkpoint, or start at step 0 with adapter v0."""
        proxy_latest = (await self._run_state()).latest_version
        found = await checkpoint.latest(self.bucket, self.run_id)
        if found is None:
            self.state = LearnerState()
            # the only randomness in a step is LoRA dropout (torch's global generator; a checkpoint
            # carries its state on): start it from the spec's seed, not the process's fresh one, so
            # a run is reproducible from its spec (docs/guarantees.md)
            torch.manual_seed(self.spec.seed)
            if proxy_latest > 0:
                log.warning("no_checkpoint_but_versions_published", latest=proxy_latest,
                            note="training restarts from v0 weights; version numbers continue after the latest")
        else:
            step, files = found
            self.state = await asyncio.to_thread(checkpoint.decode, self.trainer, files)
            self.config_json = files[checkpoint.CONFIG]
            self.durable_step = step
            self._tokens_total = int((self.state.metrics or [{}])[-1].get("tokens_total", 0))
            log.info("resumed", step=step, version=self.state.version, published=self.state.published,
                     consumed=len(self.state.consumed))
            await self._replay_tail()
        # never reuse a version number: continue after whatever is newest anywhere
        self.state.version = max(self.state.version, proxy_latest)
        self.prefetch.consumed = self.state.consumed
        prom.STEP.set(self.state.step)

    async def _replay_tail(self) -> None:
        """Redo what the checkpointed step may not have finished: every part is idempotent."""
        s = self.state
        if s.published:
            files, quant_error = self.trainer.adapter_files(self.spec.adapter_payload, self.config_json)
            await adapters.write_version(self.bucket, self.run_id, s.version, s.step, files,
                                         self.spec.adapter_payload, quant_error)
        await self._backfill_trackers(before=min((m["step"] for m in s.metrics), default=s.step + 1))
        await self._write_metrics(s.metrics)
        self._told = Told(s.step, s.version, s.ack, metrics_for_proxy(s.metrics[-1] if s.metrics else None))
        s.ack, s.metrics = PendingAck(), []
        await self._repair_redis(self._told)

    async def _repair_redis(self, told: Told) -> None:
        """Bring Redis up to `told` where it is behind (a restart that lost its last writes, or a
        commit cut short): publish every version it lacks from the bucket's manifests (create-only
        objects, the same manifest bytes: a repeat is a no-op), then ack each commit after its step
        again, in order, with its metrics and the deliveries and batches its checkpoint recorded. A
        lost second can hold several commits, and the completions of the batches they trained: ack.lua
        recovers those only when an ack names them (else they wait to be leased again, and can run out
        of attempts first). A commit whose checkpoint is pruned is acked with its step alone: its
        deliveries come back pending and are acked as duplicates when read again."""
        run = await self._run_state()
        if run.latest_version >= told.version and run.learner_step >= told.step:
            return
        log.warning("redis_behind_checkpoint", redis_version=run.latest_version, redis_step=run.learner_step,
                    version=told.version, step=told.step)
        for v in range(run.latest_version + 1, told.version + 1):
            await self._publish(await adapters.read_manifest(self.bucket, self.run_id, v))
        if run.learner_step < told.step:
            for step in await checkpoint.steps(self.bucket, self.run_id):
                if run.learner_step < step < told.step:
                    a = await checkpoint.read_ack(self.bucket, self.run_id, step) or PendingAck()
                    await self._ack(a.delivery_ids, a.consumed, a.rejected, step, await self._read_metrics(step))
            await self._send_ack(told)
            self.prefetch.repull()

    async def _backfill_trackers(self, before: int) -> None:
        """Log to the trackers the committed steps before `before` that one of them lacks, from the
        bucket's metrics objects (a tracker's writer killed with the learner loses its last records)."""
        held = self.trackers.oldest_step()
        if held < 0 or held >= before - 1:
            return
        first = max(held + 1, before - MAX_TRACKER_BACKFILL)
        if first > held + 1:
            log.warning("tracker_backfill_capped", missing=before - held - 1, logged=MAX_TRACKER_BACKFILL)
        metrics = []
        for step in range(first, before):  # every committed step wrote its metrics object
            key = keys.metrics_key(self.run_id, step)
            try:
                metrics.append(json.loads(await self.bucket.get(key)))
            except (ObjectNotFound, ValueError) as e:  # one unreadable step costs that step's plot point
                log.warning("tracker_backfill_skipped", key=key, error=str(e)[:200])
        if metrics:
            log.info("trackers_backfilled", steps=[m["step"] for m in metrics][:20], count=len(metrics))
            self.trackers.log_steps(metrics)

    async def _read_metrics(self, step: int) -> str:
        try:
            return metrics_for_proxy(json.loads(await self.bucket.get(keys.metrics_key(self.run_id, step))))
        except ObjectNotFound:
            return ""

    # ------------------------------------------------------------ the loop

    def finished(self) -> bool:
        return self.max_steps > 0 and self.state.step >= self.max_steps

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self.trackers.close()

    async def _run(self) -> None:
        await self.resume()
        if self.finished():
            log.info("finished", step=self.state.step, max_steps=self.max_steps)
            return
        self.prefetch.start()
        try:
            cycle_start = time.monotonic()
            while not self.finished():
                cycle_start = await self.step(cycle_start)
        finally:
            await self.prefetch.stop()
            if self._pruning is not None:
                await asyncio.wait([self._pruning])
        if self._pruning is not None:
            self._pruning.result()  # a bug in the last background prune surfaces here
        await self._prune_checkpoints()  # the last commit's, which a prune still running may have skipped
        log.info("finished", step=self.state.step, version=self.state.version)

    async def step(self, cycle_start: float) -> float:
        """One step; returns when its training ended (the start of the next cycle)."""
        s, spec = self.state, self.spec
        data = await self._take(s.version)
        step = s.step + 1
        crash_loop.at_step(step)  # a crash in this step is recorded at it
        self.crash.at("before_train", step)
        # in batch order, not arrival order: dropout draws its masks and gradients accumulate in
        # this order, so a sync run is reproducible whichever worker finished first (guarantees.md)
        rollouts = [a.rollout for a in sorted(data.accepted, key=lambda a: keys.parse_batch_id(a.batch_id)[1:])]
        proximal = await self._proximal_adapters(rollouts) if spec.grpo.recompute_logprobs else None
        train = await asyncio.get_running_loop().run_in_executor(_TRAIN_THREAD, self.trainer.train_step, rollouts,
                                                                 proximal)
        self.crash.at("after_train", step)
        trained_at, version_used = time.monotonic(), s.version

        ids = [a.batch_id for a in data.accepted]
        s.step = step
        s.consumed.update(ids)
        s.ack.add_trained([a.delivery_id for a in data.accepted], ids)
        final = step == self.max_steps
        s.published = step % spec.publish_every == 0 or final
        if s.published:
            s.version += 1
            self._published_files = self.trainer.adapter_files(spec.adapter_payload, self.config_json)
        self._busy_s.append(trained_at - cycle_start - data.wait_s)
        s.metrics.append(self._metrics(step, version_used, data, train, trained_at - cycle_start))
        log.info("step", **{k: v for k, v in s.metrics[-1].items() if k in LOGGED})
        prom.observe_step(s.metrics[-1])
        if s.published or step % spec.checkpoint_every == 0 or final:
            await self._commit(step)
        return trained_at

    async def _take(self, version: int) -> StepData:
        """The step's rollouts. While they are slow to come, look every REDIS_CHECK_S whether Redis
        lost the newest commit (a restart that lost its last second): a lost ack leaves the batches
        it consumed counted as outstanding work, which can fill admission's lookahead room, and the
        usual repair, at the next commit, would wait for rollouts that cannot come before it."""
        take = asyncio.ensure_future(self.prefetch.take(version))
        try:
            while not (await asyncio.wait({take}, timeout=REDIS_CHECK_S))[0]:
                if self._told is not None:
                    await self._repair_redis(self._told)
            return take.result()
        finally:
            take.cancel()  # a no-op once done: only a step cancelled itself cancels its take

    async def _commit(self, step: int) -> None:
        """checkpoint -> adapter version -> PublishAdapter -> metrics -> AckRollouts."""
        s = self.state
        files = await asyncio.to_thread(checkpoint.encode, self.trainer, s)
        await checkpoint.save(self.bucket, self.run_id, step, files,
                              before_manifest=lambda: self.crash.at("mid_checkpoint", step))
        self.durable_step = step
        self.crash.at("after_checkpoint", step)
        if self._told is not None:  # first: a version published over a hole Redis lost would stay a hole
            await self._repair_redis(self._told)
        if s.published:
            payload, quant_error = self._published_files
            manifest = await adapters.write_version(self.bucket, self.run_id, s.version, step, payload,
                                                    self.spec.adapter_payload, quant_error)
            self.crash.at("after_adapter", step)
            # per step since the last publish; the one before the first step on resume is not known
            busy = sum(self._busy_s) / len(self._busy_s) if self._busy_s else 0.0
            self._busy_s = []
            await self._publish(manifest, busy)
            self.crash.at("after_publish", step)
        await self._write_metrics(s.metrics)
        await self._ack_pending(step)
        self.crash.at("after_ack", step)
        self._prune_in_background()

    def _prune_in_background(self) -> None:
        """Retention beside the next step, not in front of it: on S3 it is a LIST and a DELETE per
        file. One at a time; a commit that finds one still running leaves its folders to the next."""
        if self._pruning is not None:
            if not self._pruning.done():
                return
            self._pruning.result()  # a bug in it surfaces here, not as a task exception nobody reads
        self._pruning = asyncio.create_task(self._prune_checkpoints())

    async def _prune_checkpoints(self) -> None:
        # after the ack: the newest checkpoint is the one a restart resumes from, whatever happens here
        try:
            removed = await checkpoint.prune(self.bucket, self.run_id, self.cfg.keep_checkpoints)
        except BucketError as e:  # retention is housekeeping: the next commit tries again
            log.warning("checkpoint_prune_failed", error=str(e)[:300])
            return
        if removed:
            log.debug("checkpoints_pruned", steps=removed, keep=self.cfg.keep_checkpoints)

    async def _write_metrics(self, metrics: list[dict[str, Any]]) -> None:
        for m in metrics:
            try:
                await self.bucket.put_new(keys.metrics_key(self.run_id, m["step"]), json.dumps(m, indent=1).encode())
            except ObjectExists:
                pass  # written before a crash; the step it describes is the same checkpointed step
        self.trackers.log_steps(metrics)  # committed steps only, so a replayed step is the same step

    async def _proximal_adapters(self, rollouts) -> dict[int, dict]:
        """The published tensors of each version that generated these rollouts (v0 is built in)."""
        for v in sorted({r.policy_version for r in rollouts} - {0} - set(self._proximal)):
            _, files = await adapters.read_version(self.bucket, self.run_id, v)
            self._proximal[v] = adapters.decode(files)
        oldest = self.state.version - self.spec.staleness.max_staleness
        self._proximal = {v: t for v, t in self._proximal.items() if v >= oldest}
        return self._proximal

    # ------------------------------------------------------------ metrics

    def _metrics(self, step: int, version: int, data: StepData, train: dict[str, float], cycle_s: float) -> dict:
        accepted = data.accepted
        samples = sum(a.rollout.num_samples for a in accepted)
        n_rejected = sum(data.rejected.values())
        rollout_dollars = sum(manifest_dollars(a.manifest) for a in accepted)
        learner_dollars = cycle_s * self.cfg.price_per_hour / 3600.0
        staleness_mean = sum(k * n for k, n in data.staleness.items()) / max(len(accepted), 1)
        self._tokens_total += int(train.get("tokens", 0))
        m: dict[str, Any] = {"tokens_total": self._tokens_total,
            "step": step, "version": self.state.version, "trained_at_version": version,
            "reward_mean": train["reward_mean"], "reward_std": train["reward_std"],
            "loss": train["loss"], "kl": train["kl"], "staleness_mean": staleness_mean,
            "rejection_rate": n_rejected / max(n_rejected + len(accepted), 1),
            "accepted_samples": samples, "accepted_batches": len(accepted), "rejected_batches": n_rejected,
            "duplicates": data.duplicates,
            **{k: v for k, v in train.items() if k not in ("reward_mean", "reward_std", "loss", "kl")},
            **{f"rejected/{k}": v for k, v in sorted(data.rejected.items())},
            **{f"dropped/{k}": v for k, v in sorted(data.dropped.items())},
            **{f"staleness/{k}": v for k, v in sorted(data.staleness.items())},
            "wait_s": data.wait_s, "wait_frac": data.wait_s / max(cycle_s, 1e-9), "step_s": cycle_s,
            "rollout_dollars": rollout_dollars, "learner_dollars": learner_dollars,
            "dollars_per_sample": (rollout_dollars + learner_dollars) / max(samples, 1),
            "published": int(self.state.published), "time_unix": time.time(),
        }
        if self.state.published and self._published_files is not None:
            files, quant_error = self._published_files
            size = sum(len(v) for k, v in files.items() if k != adapters.CONFIG)
            full = sum(t.numel() * 4 for t in adapters.adapter_state(self.trainer.model).values())
            m.update({"adapter_payload": self.spec.adapter_payload, "adapter_bytes": size,
                      "adapter_size_saved": 1.0 - size / max(full, 1), "quantization_error": quant_error})
        return m


LOGGED = ("step", "version", "reward_mean", "loss", "kl", "clip_low_frac", "clip_high_frac", "ratio_mean",
          "staleness_mean", "rejection_rate", "accepted_samples", "wait_frac", "tokens_per_s", "step_s",
          "dollars_per_sample", "grad_norm", "lr")


# ---------------------------------------------------------------- wiring

async def ensure_run(client: ProxyClient, target: str, run: str, spec_path: str) -> pb.RunSpec:
    """The run's spec from the proxy; with a spec file, create the run first if it is missing."""
    def get_run():
        return client.runs.GetRun(pb.RunRef(run_id=run), timeout=30)

    try:
        return (await retry_unavailable("GetRun", get_run, target)).spec
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.NOT_FOUND or not spec_path:
            raise
    from brigade.datasets import train_prompts

    spec = build_spec({"run_id": run}, path=spec_path)
    prompts = train_prompts(spec)
    req = pb.CreateRunRequest(spec=spec, prompts=prompts, exist_ok=True)
    await retry_unavailable("CreateRun", lambda: client.runs.CreateRun(req, timeout=60), target)
    log.info("run_created", run=run, dataset=spec.dataset, prompts=len(prompts))
    return (await retry_unavailable("GetRun", get_run, target)).spec


async def serve(cfg: LearnerConfig) -> signal.Signals | None:
    """Train until max_steps; returns the signal that stopped it first, if one did."""
    client = ProxyClient.connect(cfg.proxy, cfg.token, cfg.tls_ca)
    bucket = open_bucket(cfg.bucket)
    try:
        await bucket.ensure()
        # CreateOnlyIgnored is a ConfigError: exit 2, one line; a store that hiccups is asked again
        await probe_at_start(bucket, cfg.run)
        spec = await ensure_run(client, cfg.proxy, cfg.run, cfg.spec_path)
        refuse_code(cfg.run, spec, cfg.bucket)
        if spec.topology == "local_sgd":
            raise ConfigError(f"run {cfg.run} has topology local_sgd: it is trained by `brigade trainer` processes "
                              "and `brigade aggregator`, not by a learner")
        if cfg.spec_path:
            local = build_spec({"run_id": cfg.run}, path=cfg.spec_path)
            if local != spec:
                log.warning("spec_differs", note="the run already exists with another spec; training with the run's",
                            run_spec=spec_to_dict(spec))
        trainer = await asyncio.to_thread(Trainer.create, spec, cfg.max_steps)
        log.info("model_ready", model=spec.model, dtype=spec.dtype, device=str(trainer.device),
                 trainable=sum(p.numel() for p in trainer.model.parameters() if p.requires_grad))
        # SIGTERM (an orchestrator, `brigade up`) stops at once: every point is crash-safe anyway
        return await until_signal(Learner(cfg, spec, bucket, client, trainer).run())
    finally:
        await bucket.close()
        await client.close()
