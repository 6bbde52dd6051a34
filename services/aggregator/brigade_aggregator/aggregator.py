"""The aggregator: the learner of topology local_sgd. It pulls the local trainers' contributions,
checks them, closes a round once `local_sgd.min_contributions` usable ones are waiting (or
`round_timeout_s` after the round opened, with at least one), merges them (averaging.py) and
publishes the result as the next adapter version, exactly as the learner publishes a step: same
bucket layout, same PublishAdapter, so `ctl adapters`, the evaluator and every consumer work unchanged.

Per round, in this order, so that a SIGKILL at any point loses nothing and merges nothing twice:

    round record rounds/v{v+1} (create-only)  ->  adapter v+1  ->  PublishAdapter  ->  metrics  ->  AckRollouts

Until the ack, the proxy keeps the merged contributions pending for this aggregator, and the record
(written first) lists them as merged. A restart loads the newest record and replays its tail (the
same adapter bytes, the same publish, the same ack), then reads its pending contributions again:
any the records call merged is acked as a duplicate, never merged again. Before the record, nothing
of the round exists anywhere, so a restart may close the round with other contributions.

What a contribution must pass (the rest is rejected with a reason, counted, its batches recorded
rejected): the proxy's manifest checks again; its object at its key with its sha256; safetensors
holding exactly the trained tensors, in the master's shapes, finite; a base version the aggregator
has published, at most `staleness.max_staleness` behind the round (older: stale); usable samples.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import time
from collections import Counter
from dataclasses import dataclass

import structlog
import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load

from brigade import adapters, crash_loop, keys
from brigade.bucket import (
    Bucket,
    BucketError,
    CorruptObject,
    ObjectExists,
    ObjectNotFound,
    open_bucket,
    probe_at_start,
)
from brigade.config import ConfigError
from brigade.errors import InvalidArgument
from brigade.retry import Backoff, retry
from brigade.rpc import ProxyClient, retry_unavailable
from brigade.service import until_signal
from brigade.v1 import brigade_pb2 as pb
from brigade.wire import MAX_METRICS_JSON, check_contribution_manifest
from brigade_aggregator import averaging, rounds
from brigade_aggregator.config import AggregatorConfig
from brigade_aggregator.rounds import RoundAck, RoundState

log = structlog.get_logger()
READ_BACKOFF = Backoff(base_s=0.5, cap_s=5.0)
V0_WAIT_S = 1.0   # until the first trainer has written the seeded v0
HEADER_SLACK = 1 << 20  # a contribution's safetensors header, beyond its float32 tensors


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass
class Candidate:
    delivery_id: str
    manifest: pb.ContributionManifest
    delta: averaging.Delta


def metrics_json(metrics: dict) -> str:
    text = json.dumps(metrics)
    return text if len(text.encode()) <= MAX_METRICS_JSON else ""


class Aggregator:
    def __init__(self, cfg: AggregatorConfig, spec: pb.RunSpec, bucket: Bucket, client: ProxyClient):
        self.cfg, self.spec, self.bucket, self.client = cfg, spec, bucket, client
        self.run_id, self.ls = spec.run_id, spec.local_sgd
        self.state: RoundState | None = None
        self.trained: list[str] = []
        self.v0: dict[str, torch.Tensor] = {}
        self._published: dict[int, dict[str, torch.Tensor]] = {}   # version -> trained tensors as published
        self.waiting: dict[str, Candidate] = {}                    # contribution id -> checked, not merged
        self._rejected: Counter = Counter()                        # contributions, by reason, since the last round
        self._late: list[Candidate] = []                           # waiting ones a new version left too stale
        self._repull = True

    # ------------------------------------------------------------ proxy calls (retried while unreachable)

    async def _call(self, what: str, fn):
        return await retry_unavailable(what, fn, self.cfg.proxy)

    async def _ack(self, delivery_ids: list[str], consumed: list[str], rejected: list[str], step: int = 0,
                   metrics: str = "") -> None:
        req = pb.AckRolloutsRequest(run_id=self.run_id, delivery_ids=delivery_ids, consumed_batch_ids=consumed,
                                    rejected_batch_ids=rejected, step=step, learner_id=self.cfg.aggregator_id,
                                    metrics_json=metrics)
        await self._call("AckRollouts", lambda: self.client.learner.AckRollouts(req, timeout=30))

    async def _run_state(self) -> pb.RunState:
        return await self._call("GetRun", lambda: self.client.runs.GetRun(pb.RunRef(run_id=self.run_id), timeout=30))

    async def _bucket(self, what: str, fn):
        def log_retry(attempt: int, delay: float, e: BaseException) -> None:
            log.warning("bucket_retry", what=what, attempt=attempt, error=str(e)[:300])

        return await retry(fn, retryable=lambda e: isinstance(e, BucketError | OSError) and not isinstance(
            e, ObjectExists | ObjectNotFound | CorruptObject), backoff=READ_BACKOFF, on_retry=log_retry)

    # ------------------------------------------------------------ start

    async def resume(self) -> None:
        """Continue from the newest round record (replaying its tail), or start from the seeded v0."""
        self.state = await self._bucket("reading the round records", lambda: rounds.latest(self.bucket, self.run_id))
        v0_state, config = await self._read_v0()
        self.trained = adapters.trained_names(v0_state, self.ls.merge)
        self.v0 = {n: v0_state[n] for n in self.trained}
        if self.state is None:
            if (await self._run_state()).latest_version > 0:
                raise ConfigError(f"run {self.run_id} has published versions but no round records under "
                                  f"{keys.round_key(self.run_id, 0).rsplit('/', 1)[0]}/: they are not this "
                                  "aggregator's to continue")
            self.state = RoundState(0, v0_state, {}, set(), config)
            log.info("starting", version=0, merge=self.ls.merge, outer=self.ls.outer_optimizer, trained=len(self.trained))
            return
        log.info("resumed", version=self.state.version, merged=len(self.state.merged))
        await self._publish_and_ack(self.state)

    async def _read_v0(self) -> tuple[dict[str, torch.Tensor], bytes]:
        """The seeded v0 the trainers wrote (brigade_learner.local): A, B and adapter_config.json."""
        key = keys.base_adapter_key(self.run_id)
        for tries in itertools.count():
            try:
                data = await self._bucket("reading the v0 adapter", lambda: self.bucket.get(key))
                break
            except ObjectNotFound:
                if tries % 60 == 0:
                    log.info("waiting for a trainer to write the v0 adapter", key=key)
                await asyncio.sleep(V0_WAIT_S)
        try:
            return st_load(data), rounds.metadata(data)["adapter_config"].encode()
        except (SafetensorError, ValueError, KeyError) as e:
            raise ConfigError(f"{key} is not a brigade v0 adapter: {e}") from None

    # ------------------------------------------------------------ the loop

    def finished(self) -> bool:
        return self.spec.max_steps > 0 and self.state.version >= self.spec.max_steps

    async def run(self) -> None:
        await self.resume()
        while not self.finished():
            await self.round()
        log.info("finished", version=self.state.version)

    async def round(self) -> None:
        """Wait for enough usable contributions, merge them, publish version + 1."""
        v = self.state.version
        crash_loop.at_step(v + 1)  # a crash in this round is recorded at the version it makes
        deadline = self.state.created_ms / 1000 + self.ls.round_timeout_s
        while True:
            self._drop_stale(v)
            usable = len(self.waiting)
            timed_out = time.time() >= deadline
            if usable >= self.ls.min_contributions or (usable and timed_out):
                break
            wait_ms = self.cfg.pull_wait_ms if timed_out else min(self.cfg.pull_wait_ms, int((deadline - time.time()) * 1000))
            await self._pull(max(0, wait_ms))
        chosen = sorted(self.waiting.values(), key=lambda c: c.manifest.contribution_id)
        self.waiting = {}
        await self._commit(self._merge(chosen, "count" if len(chosen) >= self.ls.min_contributions else "deadline"))

    async def _pull(self, wait_ms: int) -> None:
        req = pb.PullContributionsRequest(run_id=self.run_id, max_contributions=32, wait_ms=wait_ms,
                                          include_pending=self._repull, aggregator_id=self.cfg.aggregator_id)
        failed = []
        resp = await retry_unavailable(
            "PullContributions", lambda: self.client.learner.PullContributions(req, timeout=wait_ms / 1000 + 30),
            self.cfg.proxy, on_failure=lambda: failed.append(True))
        # after a failed try, the delivering read may have handed over entries no reply brought back
        self._repull = bool(failed) or (self._repull and len(resp.contributions) == req.max_contributions)
        for p in resp.contributions:
            await self._admit(p)

    async def _admit(self, p: pb.PulledContribution) -> None:
        m = p.manifest
        if m.contribution_id in self.waiting:
            return  # delivered again (a pending read)
        if m.contribution_id in self.state.merged:  # merged before its ack was lost: record its fate, once
            log.info("contribution_duplicate", contribution=m.contribution_id)
            await self._ack([p.delivery_id], _usable(m), list(m.empty_batch_ids))
            return
        try:
            delta = await self._check(m)
        except Rejected as e:
            log.warning("contribution_rejected", contribution=m.contribution_id[:64], trainer=m.trainer_id[:200],
                        base=m.base_version, reason=e.reason, detail=e.detail[:500])
            self._rejected[e.reason] += 1
            ours = m.run_id == self.run_id and all(b.startswith(self.run_id + ":") for b in m.batch_ids)
            await self._ack([p.delivery_id], [], list(m.batch_ids) if ours else [])
            return
        self.waiting[m.contribution_id] = Candidate(p.delivery_id, m, delta)

    def _drop_stale(self, v: int) -> None:
        """Waiting contributions that version `v` left beyond the cap are rejected as stale; their
        batches are acked as rejected with the round's ack (a restart before it finds them pending
        and rejects them again)."""
        for cid, c in list(self.waiting.items()):
            if v - c.manifest.base_version > self.spec.staleness.max_staleness:
                del self.waiting[cid]
                self._rejected["stale"] += 1
                self._late.append(c)
                log.warning("contribution_rejected", contribution=cid, trainer=c.manifest.trainer_id[:200],
                            base=c.manifest.base_version, reason="stale", detail=f"left behind by version {v}")

    async def _check(self, m: pb.ContributionManifest) -> averaging.Delta:
        v, cap = self.state.version, self.spec.staleness.max_staleness
        try:
            check_contribution_manifest(self.run_id, m)
        except InvalidArgument as e:
            raise Rejected("invalid", str(e)) from None
        if m.base_version > v:
            raise Rejected("future_version", f"base version {m.base_version} is newer than the aggregator's {v}")
        if v - m.base_version > cap:
            raise Rejected("stale", f"base version {m.base_version} is {v - m.base_version} behind {v} (max {cap})")
        if m.num_samples == 0 or m.local_steps == 0:
            raise Rejected("empty", "no usable sample was trained on")
        limit = sum(self.state.master[n].numel() * 4 for n in self.trained) + HEADER_SLACK
        if m.size_bytes > limit:
            raise Rejected("invalid", f"{m.size_bytes} bytes; float32 trained factors take at most {limit}")
        try:
            data = await self._bucket(f"reading {m.uri}", lambda: self.bucket.get(m.uri, sha256=m.sha256))
        except CorruptObject as e:
            raise Rejected("corrupt", str(e)) from None
        except ObjectNotFound as e:
            raise Rejected("missing", str(e)) from None
        if len(data) != m.size_bytes:
            raise Rejected("corrupt", f"object is {len(data)} bytes, the manifest says {m.size_bytes}")
        try:
            tensors = st_load(data)
        except (SafetensorError, ValueError) as e:
            raise Rejected("invalid", f"not safetensors: {e}") from None
        if sorted(tensors) != self.trained:
            raise Rejected("invalid", f"holds {len(tensors)} tensors, not the {len(self.trained)} trained ones "
                           f"({self.ls.merge}); e.g. {sorted(set(tensors) ^ set(self.trained))[:2]}")
        for name, t in tensors.items():
            if t.shape != self.state.master[name].shape or not t.dtype.is_floating_point:
                raise Rejected("invalid", f"{name} is {t.dtype} {tuple(t.shape)}, the adapter's is "
                               f"{tuple(self.state.master[name].shape)}")
            if not torch.isfinite(t).all():
                raise Rejected("invalid", f"{name} has NaN or infinite values")
        base = await self._published_trained(m.base_version)
        return averaging.Delta(m.contribution_id, m.base_version, m.num_samples, averaging.delta(tensors, base))

    async def _published_trained(self, version: int) -> dict[str, torch.Tensor]:
        """The trained tensors of `version` as the trainers loaded them (the published payload)."""
        if version == 0:
            return self.v0
        if version not in self._published:
            _, files = await self._bucket(f"reading adapter v{version}", lambda: adapters.read_version(
                self.bucket, self.run_id, version))
            decoded = adapters.decode(files)
            self._published[version] = {n: decoded[n] for n in self.trained}
        oldest = self.state.version - self.spec.staleness.max_staleness
        self._published = {u: t for u, t in self._published.items() if u >= oldest}
        return self._published[version]

    # ------------------------------------------------------------ merge and commit

    def _merge(self, chosen: list[Candidate], closed_by: str) -> RoundState:
        s, ls = self.state, self.ls
        deltas = [c.delta for c in chosen]
        w = averaging.weights(deltas, s.version, ls.stale_weight)
        error = averaging.averaging_error(s.master, deltas, w)
        step = averaging.outer_step(s.master, s.momentum, averaging.average(deltas, w), ls.outer_optimizer,
                                    ls.outer_lr, ls.outer_momentum)
        late, self._late = self._late, []
        rejected, self._rejected = self._rejected, Counter()
        ms = [c.manifest for c in chosen]
        samples = sum(m.num_samples for m in ms)
        staleness = Counter(s.version - m.base_version for m in ms)
        version = s.version + 1
        metrics = {
            "step": version, "version": version, "trained_at_version": s.version,
            "reward_mean": sum(m.reward_mean * m.num_samples for m in ms) / samples,
            "accepted_samples": samples, "accepted_batches": sum(len(_usable(m)) for m in ms),
            "contributions": len(ms), "closed_by": closed_by, "local_steps": sum(m.local_steps for m in ms),
            "staleness_mean": sum(k * n for k, n in staleness.items()) / len(ms),
            **{f"staleness/{k}": n for k, n in sorted(staleness.items())},
            "rejected_batches": sum(rejected.values()),
            "rejection_rate": sum(rejected.values()) / (sum(rejected.values()) + len(ms)),
            **{f"rejected/{k}": n for k, n in sorted(rejected.items())},
            "weight_max": max(w), "averaging_error": error, "pseudo_grad_norm": step.pseudo_grad_norm,
            "update_norm": step.update_norm, "bytes_in": sum(m.size_bytes for m in ms),
            "round_s": time.time() - s.created_ms / 1000,
            "rollout_dollars": sum(m.compute_seconds * m.price_per_hour / 3600 for m in ms),
            "time_unix": time.time(),
        }
        ack = RoundAck([c.delivery_id for c in chosen], [b for m in ms for b in _usable(m)],
                       [b for m in ms for b in m.empty_batch_ids] + [b for c in late for b in c.manifest.batch_ids])
        ack.delivery_ids += [c.delivery_id for c in late]
        return RoundState(version, step.master, step.momentum, s.merged | {m.contribution_id for m in ms},
                          s.config_json, ack, metrics)

    async def _commit(self, new: RoundState) -> None:
        key = keys.round_key(self.run_id, new.version)
        data = rounds.encode(self.run_id, new)
        try:
            await self._bucket(f"writing {key}", lambda: adapters.put_once(self.bucket, key, data))
        except ObjectExists:
            raise ConfigError(f"{key} already holds another round: is a second aggregator running on "
                              f"run {self.run_id}? Run one.") from None
        self.state = new
        log.info("round_recorded", version=new.version, contributions=new.metrics["contributions"])
        await self._publish_and_ack(new)
        log.info("round", **{k: round(v, 6) if isinstance(v, float) else v for k, v in new.metrics.items()
                              if not k.startswith(("staleness/", "rejected/"))})
        try:
            await rounds.prune(self.bucket, self.run_id, self.cfg.keep_rounds)
        except BucketError as e:  # housekeeping: the next round tries again
            log.warning("round_prune_failed", error=str(e)[:300])

    async def _publish_and_ack(self, s: RoundState) -> None:
        """Adapter v from the record, published; its metrics; the round's ack. Every part repeats
        harmlessly, which is what a restart's replay relies on."""
        payload = self.spec.adapter_payload
        files, quant_error = adapters.encode(s.master, s.config_json, payload)
        manifest = await self._bucket(f"writing adapter v{s.version}", lambda: adapters.write_version(
            self.bucket, self.run_id, s.version, s.version, files, payload, quant_error))
        decoded = adapters.decode(files)
        self._published[s.version] = {n: decoded[n] for n in self.trained}
        # versions Redis lost (a crash without its last second of writes) first: it takes latest + 1 only
        latest = (await self._run_state()).latest_version
        for u in range(latest + 1, s.version + 1):
            m = manifest if u == s.version else await adapters.read_manifest(self.bucket, self.run_id, u)
            req = pb.PublishAdapterRequest(run_id=self.run_id, manifest=m)
            await self._call("PublishAdapter", lambda req=req: self.client.learner.PublishAdapter(req, timeout=30))
        metrics = {**s.metrics, "quantization_error": quant_error,
                   "adapter_bytes": sum(f.size_bytes for f in manifest.files if f.name != adapters.CONFIG)}
        try:
            await self.bucket.put_new(keys.metrics_key(self.run_id, s.version), json.dumps(metrics, indent=1).encode())
        except ObjectExists:
            pass  # written before a crash: the round it describes is the same recorded round
        await self._ack(s.ack.delivery_ids, s.ack.consumed, s.ack.rejected, s.version, metrics_json(metrics))


def _usable(m: pb.ContributionManifest) -> list[str]:
    """The batches a contribution trained on (the rest of its leases had no usable sample)."""
    empty = set(m.empty_batch_ids)
    return [b for b in m.batch_ids if b not in empty]


# ---------------------------------------------------------------- wiring

async def serve(cfg: AggregatorConfig) -> signal.Signals | None:
    """Merge rounds until max_steps; returns the signal that stopped it first, if one did."""
    client = ProxyClient.connect(cfg.proxy, cfg.token, cfg.tls_ca)
    bucket = open_bucket(cfg.bucket)
    try:
        await bucket.ensure()
        # round records and versions are create-only: a store that ignores If-None-Match is refused (exit 2)
        await probe_at_start(bucket, cfg.run)
        spec = (await retry_unavailable("GetRun", lambda: client.runs.GetRun(pb.RunRef(run_id=cfg.run), timeout=30),
                                        cfg.proxy)).spec
        if spec.topology != "local_sgd":
            raise ConfigError(f"run {cfg.run} has topology {spec.topology or 'central'}: it has a learner, "
                              "not an aggregator")
        return await until_signal(Aggregator(cfg, spec, bucket, client).run())  # every point is crash-safe
    finally:
        await bucket.close()
        await client.close()
