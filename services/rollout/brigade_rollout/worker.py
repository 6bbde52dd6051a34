"""The rollout worker loop: lease -> adapter -> generate -> score -> upload -> complete.

    lease = AcquireLease()                          # back off with jitter while not granted
    while running:
        adapter = cache.get(lease.adapter_version)  # usually prefetched already (WatchRun)
        samples = generate(batch, G, seed=lease.seed)   # or episodes; in a thread, heartbeats flow
        rewards = score(samples)
        put_new(rollout object), put_new(text sidecar)  # upload first ...
        lease = CompleteLease(manifest, next=...)       # ... then complete, retried until answered;
                                                        # the same call acquires the next lease

At start, the bucket must refuse a second create-only put (brigade.bucket.probe), else the worker
exits 2 with one line naming the store.

Failure handling, in one place (the retry policy and its exceptions: brigade_rollout.retries):
- the proxy or the bucket unreachable: retried with exponential backoff and full jitter, each try
  bounded by a timeout, forever while the process lives (logged);
- a heartbeat answered REVOKED or LOST: generation stops at the next token, the work is dropped,
  and the next lease is taken;
- SIGTERM/SIGINT: generation stops, FailLease(PREEMPTED) requeues the batch at once, exit 0. If the
  signal lands while a finished rollout is being committed, the commit gets COMMIT_GRACE_S first,
  and a next lease its answer carried is handed back the same way;
- a CompleteLease that fails acquires nothing: the loop asks AcquireLease, as it does when the
  last batch (max_batches) or a shutdown leaves nothing to ask for;
- anything else wrong with one batch (a corrupt adapter, an engine error): FailLease(ERROR) and go
  on (the heartbeat stops first); the proxy dead-letters a batch that keeps failing;
- the attempt's rollout key already holds other bytes (Redis lost writes and granted the attempt
  again; an engine that is not bit-reproducible): the object there is adopted when it is this
  lease's rollout (same run, batch, attempt, version), else the lease is handed back PREEMPTED, so
  the next attempt gets a new key; neither counts as a failure and no object is written twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import grpc
import structlog

from brigade import code_policy, episode_batch, keys
from brigade.adapters import InvalidAdapter
from brigade.bucket import (
    Bucket,
    CorruptObject,
    CreateOnlyIgnored,
    ObjectExists,
    ObjectNotFound,
    check_create_only,
    open_bucket,
    sha256_hex,
)
from brigade.datasets import prompt_value
from brigade.engine import make_engine
from brigade.engine.base import Engine, Sample, Stopped
from brigade.episodes import EnvironmentCode, EpisodeRunner
from brigade.reward_call import RewardCall, TrainerState
from brigade.reward_sandbox import RqSandbox
from brigade.rewards import RewardSet
from brigade.rollout_format import Rollout, build_rollout, from_bytes
from brigade.rpc import ProxyClient, describe_rpc_error, is_transient
from brigade.spec import adapter_slots, episodic
from brigade.v1 import brigade_pb2 as pb
from brigade_rollout import metrics
from brigade_rollout.adapter_cache import AdapterCache
from brigade_rollout.config import WorkerConfig
from brigade_rollout.retries import (
    BACKOFF,
    BUCKET_TIMEOUT_S,
    RPC_TIMEOUT_S,
    BatchError,
    FatalError,
    KeyTaken,
    LeaseGone,
    bucket_retryable,
    rpc_retryable,
    with_retries,
)
from brigade_rollout.sidecar import reward_mean, text_sidecar

log = structlog.get_logger()

COMMIT_GRACE_S = 5.0       # a signal during upload/complete waits this long before giving up the batch


# ---------------------------------------------------------------- the worker


class Worker:
    def __init__(self, cfg: WorkerConfig, engine: Engine | None = None):
        self.cfg = cfg
        self.engine = engine
        self.log = log.bind(worker=cfg.worker_id, run=cfg.run)
        self.client: ProxyClient | None = None
        self.bucket: Bucket | None = None
        self.cache: AdapterCache | None = None
        self.rewards: RewardSet | None = None
        self.spec: pb.RunSpec | None = None
        self.episodes: EpisodeRunner | None = None  # the run's rollouts are episodes (tools, environments)
        self.stats = {"completed": 0, "duplicates": 0, "revoked": 0, "lost": 0, "failed": 0, "preempted": 0,
                      "rewards_rejected": 0, "key_taken": 0}
        metrics.watch(self.stats)
        self._main: asyncio.Task | None = None
        self._run_task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self._lease_stop: threading.Event | None = None
        self._committing = False
        self._next: pb.AcquireLeaseResponse | None = None  # the answer for the next lease, from CompleteLease
        # set, and replaced by a fresh one, on each AdapterPublished: a refusal at the sync barrier
        # waits on the one current when its request went out (see _back_off)
        self._published = asyncio.Event()
        self._next_asked = self._published  # the one current when self._next was asked for

    # -------------------------------------------------------------- lifecycle

    async def run(self) -> int:
        """Serve leases until max_batches, finished (with exit_when_finished) or stop(); the exit code."""
        watcher = None
        self._run_task = asyncio.current_task()
        try:
            await self._setup()
            watcher = asyncio.create_task(self._watch(), name="watch-run")
            # the loop runs as its own task so stop() can cancel it without cancelling our caller
            self._main = asyncio.create_task(self._loop(), name="rollout-loop")
            await self._main
            return 0
        except asyncio.CancelledError:
            if not self._stopping.is_set():
                raise
            if (me := asyncio.current_task()) is not None:
                me.uncancel()  # stop() cancelled us during setup (or the loop): a clean exit, not an error
            return 0
        except FatalError as e:
            self.log.error("rollout worker cannot continue", error=str(e))
            return 2
        finally:
            if watcher is not None:
                watcher.cancel()
            await self._hand_back_next()
            await self._close()

    def stop(self) -> None:
        """SIGTERM/SIGINT: stop generating, hand the lease back (PREEMPTED), exit."""
        if self._stopping.is_set():
            return
        self.log.info("stopping", committing=self._committing)
        self._stopping.set()
        if self._lease_stop is not None:
            self._lease_stop.set()
        target = self._main or self._run_task  # before the loop starts: interrupt the setup
        if target is not None and not target.done():
            if self._committing:
                asyncio.get_running_loop().call_later(COMMIT_GRACE_S, target.cancel)
            else:
                target.cancel()

    async def _setup(self) -> None:
        cfg = self.cfg
        self.client = ProxyClient.connect(cfg.proxy, cfg.token, cfg.tls_ca)
        state = await with_retries(
            "GetRun", lambda: self.client.runs.GetRun(pb.RunRef(run_id=cfg.run), timeout=RPC_TIMEOUT_S),
            rpc_retryable, RPC_TIMEOUT_S + 1)
        self.spec = spec = state.spec
        if spec.topology == "local_sgd":
            raise FatalError(f"run {cfg.run} has topology local_sgd: its batches are generated and trained by "
                             "`brigade trainer` processes, not rollout workers")
        policy = code_policy.CodePolicy.from_env(bucket=cfg.bucket)
        code_policy.install(policy)
        if refused := code_policy.refusal(spec, policy):  # before anything of the spec is imported or read
            await self._refuse_run(f"refused by this host's code policy: {refused}")
        self.bucket = open_bucket(cfg.bucket)
        try:
            await with_retries("probing the bucket's create-only writes",
                               lambda: check_create_only(self.bucket, cfg.run), bucket_retryable, BUCKET_TIMEOUT_S)
        except CreateOnlyIgnored as e:
            raise FatalError(str(e)) from e
        self.cache = AdapterCache(self.bucket, cfg.run, capacity=adapter_slots(spec))
        if state.latest_version:
            self.cache.prefetch(state.latest_version)  # overlaps with loading the model
        sandbox = None
        if any(r.sandboxed for r in spec.rewards) and cfg.redis_url:
            sandbox = RqSandbox(cfg.redis_url, keys.reward_queue(cfg.run), start_worker=cfg.reward_workers)
        try:
            code = EnvironmentCode.from_spec(spec) if episodic(spec) else None
            self.rewards = RewardSet.from_specs(spec.rewards, sandbox, device=cfg.device or spec.device,
                                                trust_remote_code=spec.trust_remote_code)
        except ValueError as e:
            if sandbox is not None:
                sandbox.close()
            raise FatalError(f"run {cfg.run}: {e}") from e
        if self.engine is None:
            t0 = time.monotonic()
            try:
                self.engine = await asyncio.to_thread(make_engine, cfg.engine, spec, device=cfg.device or None)
            except (RuntimeError, ValueError, OSError, ImportError) as e:  # no vllm/GPU, bad model path, ...
                raise FatalError(f"cannot start the {cfg.engine} engine for model {spec.model!r}: {e}") from e
            self.log.info("engine ready", engine=cfg.engine, model=spec.model, seconds=round(time.monotonic() - t0, 2))
        try:
            self.episodes = code and EpisodeRunner(code, self.engine.tokenizer)
        except ValueError as e:
            raise FatalError(f"run {cfg.run}: {e}") from e

    async def _refuse_run(self, why: str) -> None:
        """The run's spec names code or files this host does not allow: hand one lease back with the
        reason (PREEMPTED: the batch's attempts are not spent, and the run's events say why this
        worker will not work on it), then exit 2 (FatalError, the one line logged)."""
        req = self._acquire_request()
        with contextlib.suppress(grpc.aio.AioRpcError, TimeoutError):
            resp = await self.client.lease.AcquireLease(req, timeout=RPC_TIMEOUT_S)
            if resp.granted:
                await self.client.lease.FailLease(pb.FailLeaseRequest(
                    run_id=resp.lease.run_id, lease_id=resp.lease.lease_id, worker_id=self.cfg.worker_id,
                    reason=pb.FailLeaseRequest.PREEMPTED, message=why[:1000]), timeout=3)
        raise FatalError(f"run {self.cfg.run}: {why}")

    async def _close(self) -> None:
        for closer in (self.cache and self.cache.close, self.rewards and self.rewards.close,
                       self.bucket and self.bucket.close, self.client and self.client.close):
            if closer:
                try:
                    await asyncio.wait_for(closer(), 5)
                except Exception as e:  # shutting down: report and go on closing the rest
                    self.log.debug("close failed", error=repr(e))

    # -------------------------------------------------------------- the loop

    def _acquire_request(self) -> pb.AcquireLeaseRequest:
        cfg = self.cfg
        return pb.AcquireLeaseRequest(run_id=cfg.run, worker_id=cfg.worker_id, capacity_class=cfg.capacity_class,
                                      price_per_hour=cfg.price_per_hour, engine=cfg.engine)

    async def _loop(self) -> None:
        cfg, done, idle = self.cfg, 0, 0
        while not self._stopping.is_set() and (cfg.max_batches == 0 or done < cfg.max_batches):
            resp, self._next = self._next, None
            asked = self._next_asked
            if resp is None:  # nothing came with the last CompleteLease
                asked, req = self._published, self._acquire_request()
                resp = await with_retries(
                    "AcquireLease", lambda req=req: self.client.lease.AcquireLease(req, timeout=RPC_TIMEOUT_S),
                    rpc_retryable, RPC_TIMEOUT_S + 1)
            if not resp.granted:
                if resp.reason == "finished" and cfg.exit_when_finished:
                    self.log.info("run finished; exiting", batches=done)
                    return
                if idle % 20 == 0:
                    self.log.info("no lease", reason=resp.reason, retry_after_ms=resp.retry_after_ms)
                idle += 1
                await self._back_off(resp, asked)
                continue
            idle = 0
            if await self._process(resp.lease, want_next=cfg.max_batches == 0 or done + 1 < cfg.max_batches):
                done += 1

    async def _back_off(self, resp: pb.AcquireLeaseResponse, published: asyncio.Event) -> None:
        """Wait out a refusal's retry delay. At the sync barrier or the lookahead bound, an adapter
        published since the refused request went out ends the wait at once: both wait for exactly
        that, and sleeping out the delay cost every synchronous step about 250 ms (bench fleet's
        sync_barrier_release_s). The delay stays as the fallback for a broken WatchRun stream."""
        delay = max(50, resp.retry_after_ms) / 1000 * random.uniform(0.5, 1.5)
        if resp.reason not in ("sync_barrier", "lookahead"):
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(published.wait(), delay)

    async def _process(self, lease: pb.Lease, want_next: bool = False) -> bool:
        """One lease, start to finish. True when the rollout was handed to the proxy. With `want_next`,
        the completing call also asks for the next lease (kept in self._next for the loop)."""
        t0 = time.monotonic()
        stop = self._lease_stop = threading.Event()
        lost: list[str] = []
        hb = asyncio.create_task(self._heartbeat(lease, stop, lost), name="heartbeat")
        blog = self.log.bind(batch=lease.batch.batch_id, attempt=lease.attempt, version=lease.adapter_version)
        handed_over = False
        try:
            adapter = await self._adapter(lease.adapter_version)
            await asyncio.to_thread(self.engine.load_adapter, adapter.version, adapter.state)
            metrics.adapter_loaded(adapter.version, time.monotonic() - t0)
            prompts = [prompt_value(p) for p in lease.batch.prompts]
            t_gen = time.monotonic()
            episodes = self.episodes and await asyncio.to_thread(
                episode_batch.run, self.episodes, self.engine, lease.batch.prompts, self.spec.sampling, lease.seed,
                lease.adapter_version, stop.is_set)
            samples = episode_batch.samples(episodes) if episodes else await asyncio.to_thread(
                self.engine.generate, prompts, self.spec.sampling, lease.seed, lease.adapter_version, stop.is_set)
            t_gen = time.monotonic() - t_gen
            completions = self.engine.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
            scores = await self._score(lease, samples, completions, episodes, t_gen)
            self.stats["rewards_rejected"] += bool(scores.rejected)  # uploaded unscored: the learner refuses it
            if stop.is_set():
                raise Stopped()
            self._committing = True
            manifest = await self._upload(lease, samples, completions, scores, adapter.payload, t0)
            duplicate = await self._complete(lease, manifest, want_next)
            handed_over = True
            self.stats["duplicates" if duplicate else "completed"] += 1
            metrics.batch_done(manifest.num_tokens, t_gen)
            blog.info("batch done", samples=manifest.num_samples, tokens=manifest.num_tokens,
                      reward_mean=round(manifest.reward_mean, 4), generate_s=round(t_gen, 3),
                      total_s=round(manifest.compute_seconds, 3), duplicate=duplicate)
            return True
        except (Stopped, asyncio.CancelledError) as e:
            if self._stopping.is_set():  # SIGTERM: requeue the batch at once, unless it was handed over
                if not handed_over:
                    await self._fail(lease, pb.FailLeaseRequest.PREEMPTED, "worker shutting down", blog)
                    self.stats["preempted"] += 1
                raise asyncio.CancelledError() from None
            if isinstance(e, asyncio.CancelledError):
                raise
            why = lost[0] if lost else "lost"
            self.stats[why] += 1
            blog.warning("lease taken back; work discarded", why=why)
            return False
        except LeaseGone as e:
            self.stats["lost"] += 1
            blog.warning("lease taken back before completion; rollout discarded", reason=str(e))
            return False
        except KeyTaken as e:
            hb.cancel()
            self.stats["key_taken"] += 1
            blog.warning("rollout key taken; handing the lease back uncounted", error=str(e))
            await self._fail(lease, pb.FailLeaseRequest.PREEMPTED, f"rollout key taken: {e}", blog)
            return False
        except FatalError:
            raise
        except Exception as e:
            hb.cancel()  # the lease is handed back: a heartbeat now would only report it lost
            self.stats["failed"] += 1
            blog.error("batch failed", error=f"{type(e).__name__}: {e}", exc_info=not isinstance(e, BatchError))
            await self._fail(lease, pb.FailLeaseRequest.ERROR, f"{type(e).__name__}: {e}", blog)
            await asyncio.sleep(BACKOFF.delay(3))  # a broken setup should not spin through the queue
            return False
        finally:
            hb.cancel()
            self._lease_stop = None
            self._committing = False

    async def _adapter(self, version: int):
        try:
            return await with_retries(f"fetching adapter v{version}", lambda: self.cache.get(version),
                                      bucket_retryable, BUCKET_TIMEOUT_S)
        except (ObjectNotFound, CorruptObject, InvalidAdapter) as e:
            raise BatchError(f"adapter v{version} is unusable: {e}") from e

    async def _score(self, lease: pb.Lease, samples: list[Sample], completions: list[str], episodes=None, gen_s=0.0):
        state = TrainerState(global_step=lease.adapter_version, max_steps=self.spec.max_steps,
                             epoch=float(lease.batch.epoch), num_train_epochs=self.spec.epochs)
        call = RewardCall.for_samples(lease.batch.prompts, samples, completions, state)
        if episodes is None:
            return await self.rewards.score(call)
        return await episode_batch.score(self.rewards, call, episodes, self.episodes.code.reward_classes(), gen_s)

    async def _upload(self, lease: pb.Lease, samples, completions, scores, payload: str, t0: float) -> pb.RolloutManifest:
        cfg = self.cfg
        totals = scores.total
        pad = self.engine.tokenizer.pad_token_id
        rollout = build_rollout(lease, samples, totals, scores.parts, scores.names, 0 if pad is None else pad,
                                scores.step_metrics())
        data = rollout.to_bytes()
        text = text_sidecar(lease, cfg.worker_id, samples, completions, totals, scores.parts, scores.names, scores)
        key = keys.rollout_key(lease.run_id, lease.batch.batch_id, lease.attempt)
        text_key = keys.rollout_text_key(lease.run_id, lease.batch.batch_id, lease.attempt)
        digest, existing = await self._put_once(key, data)
        if existing is not None:
            rollout, data = self._adopt(lease, existing), existing
            self.log.info("rollout key held this lease's rollout already; adopted", key=key)
        await self._put_once(text_key, text)
        if all(r is None for r in totals):
            self.log.warning("no sample of the batch was scored", batch=lease.batch.batch_id)
        return pb.RolloutManifest(
            run_id=lease.run_id, batch_id=lease.batch.batch_id, attempt=lease.attempt, worker_id=cfg.worker_id,
            policy_version=lease.adapter_version, uri=key, sha256=digest, size_bytes=len(data),
            num_samples=rollout.num_samples, num_tokens=rollout.num_tokens,
            reward_mean=reward_mean(rollout.rewards.tolist()),
            compute_seconds=time.monotonic() - t0, price_per_hour=cfg.price_per_hour,
            capacity_class=cfg.capacity_class, adapter_payload=payload, engine=self.engine.name,
            created_ms=int(time.time() * 1000), text_uri=text_key,
        )

    async def _put_once(self, key: str, data: bytes) -> tuple[str, bytes | None]:
        """Create-only put, idempotent across our own retries (a try that landed before its answer was
        lost leaves the same bytes). Returns the sha256 of what the key holds, and those bytes when
        they are not `data`: the same attempt generated before, by an engine that is not
        bit-reproducible or with the grant repeated after Redis lost writes."""
        digest = sha256_hex(data)
        try:
            return await with_retries(f"uploading {key}", lambda: self.bucket.put_new(key, data),
                                      bucket_retryable, BUCKET_TIMEOUT_S), None
        except ObjectExists:
            existing = await with_retries(f"reading {key}", lambda: self.bucket.get(key), bucket_retryable,
                                          BUCKET_TIMEOUT_S)
            held = sha256_hex(existing)
            return held, None if held == digest else existing

    @staticmethod
    def _adopt(lease: pb.Lease, data: bytes) -> Rollout:
        """The rollout already at this attempt's key, when it is one for this lease (the learner checks
        the same metadata); else KeyTaken."""
        try:
            r = from_bytes(data)
        except Exception as e:  # noqa: BLE001 - whatever is there, it is not this lease's rollout
            raise KeyTaken(f"not a rollout: {type(e).__name__}: {str(e)[:200]}") from None
        got = (r.run_id, r.batch_id, r.attempt, r.policy_version)
        want = (lease.run_id, lease.batch.batch_id, lease.attempt, lease.adapter_version)
        if got != want:
            raise KeyTaken(f"it holds (run, batch, attempt, version) {got}, this lease is {want}")
        return r

    async def _complete(self, lease: pb.Lease, manifest: pb.RolloutManifest, want_next: bool = False) -> bool:
        req = pb.CompleteLeaseRequest(run_id=lease.run_id, lease_id=lease.lease_id, worker_id=self.cfg.worker_id,
                                      manifest=manifest)
        if want_next and not self._stopping.is_set():
            self._next_asked = self._published
            # A retry after a lost answer completes as a duplicate and acquires again: the lease the
            # lost answer carried expires and is requeued, as after a lost AcquireLease answer.
            req.next.CopyFrom(self._acquire_request())

        # only "did not get there", or a transient refusal (Redis full: nothing was written); anything
        # else is an answer
        def retryable(e: BaseException) -> bool:
            return isinstance(e, TimeoutError) or is_transient(e)

        try:
            resp = await with_retries(
                "CompleteLease", lambda: self.client.lease.CompleteLease(req, timeout=RPC_TIMEOUT_S),
                retryable, RPC_TIMEOUT_S + 1)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND):
                # expired or revoked while we uploaded: the batch is already back in the queue
                raise LeaseGone(e.details() or e.code().name) from e
            raise BatchError(f"the proxy refused the rollout: {describe_rpc_error(e)}") from e
        if resp.HasField("next"):
            self._next = resp.next
        return resp.duplicate

    async def _hand_back_next(self) -> None:
        """A next lease that came with the last completion and will not be worked on (shutdown, or
        an error that ends the worker): requeue it now rather than at its expiry."""
        resp, self._next = self._next, None
        if resp is not None and resp.granted and self.client is not None:
            blog = self.log.bind(batch=resp.lease.batch.batch_id, attempt=resp.lease.attempt)
            await self._fail(resp.lease, pb.FailLeaseRequest.PREEMPTED, "worker shutting down", blog)
            self.stats["preempted"] += 1

    async def _fail(self, lease: pb.Lease, reason: int, message: str, blog) -> None:
        req = pb.FailLeaseRequest(run_id=lease.run_id, lease_id=lease.lease_id, worker_id=self.cfg.worker_id,
                                  reason=reason, message=message[:1000])
        try:  # one bounded try: if it does not land, the lease expires and the janitor requeues it
            resp = await asyncio.shield(self.client.lease.FailLease(req, timeout=3))
            blog.info("lease handed back", reason=pb.FailLeaseRequest.Reason.Name(reason), requeued=resp.requeued,
                      next_attempt=resp.next_attempt, deadlettered=resp.deadlettered)
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            blog.warning("FailLease did not land; the lease will expire instead", error=repr(e)[:200])

    # -------------------------------------------------------------- background tasks

    async def _heartbeat(self, lease: pb.Lease, stop: threading.Event, lost: list[str]) -> None:
        interval = max(0.1, (lease.lease_seconds or 60) / 3)
        req = pb.HeartbeatRequest(run_id=lease.run_id, lease_id=lease.lease_id, worker_id=self.cfg.worker_id)
        while True:
            await asyncio.sleep(interval)
            try:
                resp = await self.client.lease.Heartbeat(req, timeout=interval)
            except grpc.aio.AioRpcError as e:  # keep trying: the lease lives until its deadline
                self.log.warning("heartbeat failed", error=describe_rpc_error(e))
                continue
            if resp.status in (pb.HeartbeatResponse.REVOKED, pb.HeartbeatResponse.LOST):
                lost.append("revoked" if resp.status == pb.HeartbeatResponse.REVOKED else "lost")
                stop.set()
                self.log.warning("lease " + lost[0], batch=lease.batch.batch_id, message=resp.message)
                return
            if resp.latest_adapter_version > lease.adapter_version:
                self.cache.prefetch(resp.latest_adapter_version)

    async def _watch(self) -> None:
        """Prefetch each adapter version as soon as it is published, off the critical path, and wake
        a worker waiting at the sync barrier (_back_off)."""
        after, attempt = "", 0
        while True:
            try:
                async for ev in self.client.runs.WatchRun(pb.WatchRunRequest(run_id=self.cfg.run, after_id=after)):
                    after, attempt = ev.id, 0
                    if ev.type != "AdapterPublished":
                        continue
                    self._published.set()
                    self._published = asyncio.Event()
                    if ev.attrs.get("version", "").isdigit():
                        self.log.info("adapter published; prefetching", version=int(ev.attrs["version"]))
                        self.cache.prefetch(int(ev.attrs["version"]))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the stream broke (proxy restart): resubscribe after the last event seen
                self.log.debug("WatchRun ended; resubscribing", error=repr(e)[:200])
            await asyncio.sleep(BACKOFF.delay(attempt))
            attempt += 1

