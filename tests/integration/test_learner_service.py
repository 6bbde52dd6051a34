"""The learner process end to end: a real redis-server, the real proxy (in-process grpc.aio server), a
real bucket, the real `brigade learner` command in a subprocess, and a driver that plays the rollout
workers: it leases batches, generates them with the tiny model at the leased adapter version, and
hands in the rollout objects.

The learner is SIGKILLed between steps, in the middle of a checkpoint, between writing an adapter
version and publishing it, and at an arbitrary moment from outside; every restart must resume from
the newest complete checkpoint with no batch trained twice, none lost, contiguous versions, and a
state that reproduces exactly from the previous checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
import redis.asyncio as aioredis
import torch
import yaml

from brigade import adapters, keys
from brigade.bucket import ObjectExists, open_bucket, sha256_hex
from brigade.rollout_format import from_bytes
from brigade.rpc import ProxyClient
from brigade.spec_file import build_spec
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import start_redis
from brigade_learner import checkpoint
from brigade_learner.trainer import Trainer
from brigade_testing.tiny import encode_prompts, make_rollout, tiny_model

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(240)]

MAX_STEPS = 6
HOSTILE = 2  # the driver's third rollout is not safetensors




@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A redis-server of this module's own: the runs made here stay out of other tests' listings."""
    server = start_redis(tmp_path_factory.mktemp("learner-redis"))
    yield server.url
    server.stop()


def write_spec(tmp_path: Path, run: str, model_dir: Path, **overrides) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                               for a in range(5) for b in range(4)))
    spec = {
        "run_id": run, "model": str(model_dir), "dtype": "float32", "device": "cpu", "dataset": str(prompts),
        "seed": 3, "max_steps": MAX_STEPS, "prompts_per_batch": 2, "batches_per_step": 1,
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"]},
        "sampling": {"group_size": 4, "max_new_tokens": 6},
        "grpo": {"learning_rate": 0.02, "loss_agg": "grpo", "beta": 0.01},
        "staleness": {"max_staleness": 2, "lease_seconds": 60},
        "rewards": [{"function": "demo_sum"}],
        "eval_every": 0,
        **overrides,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


async def unless_unavailable(call):
    """A call answered again while the proxy says UNAVAILABLE (Redis restarting under it)."""
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            await asyncio.sleep(0.2)


async def drive_workers(addr: str, bucket_url: str, run: str, model_dir: Path, stop: asyncio.Event,
                        gate: asyncio.Event | None = None, parked: asyncio.Event | None = None) -> int:
    """Lease, generate with the leased version, upload, complete; until the run is finished. With a
    `gate`, each lease waits for it to be set (`parked` is set while it waits)."""
    from transformers import AutoTokenizer

    completed = 0
    async with ProxyClient.connect(addr) as client, open_bucket(bucket_url) as bucket:
        while True:  # the learner creates the run
            try:
                spec = (await client.runs.GetRun(pb.RunRef(run_id=run), timeout=5)).spec
                break
            except Exception:
                if stop.is_set():
                    return completed
                await asyncio.sleep(0.2)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        worker = Trainer.create(spec)  # the same v0 as the learner (seeded), used for sampling only
        version = 0
        while not stop.is_set():
            if gate is not None and not gate.is_set():
                parked.set()
                await gate.wait()
                parked.clear()
            resp = await unless_unavailable(lambda: client.lease.AcquireLease(pb.AcquireLeaseRequest(
                run_id=run, worker_id="driver", capacity_class="spot", price_per_hour=0.5, engine="hf"), timeout=10))
            if not resp.granted:
                if resp.reason == "finished":
                    return completed
                await asyncio.sleep(min(resp.retry_after_ms, 500) / 1000)
                continue
            lease = resp.lease
            if lease.adapter_version != version:
                state = worker.v0
                if lease.adapter_version > 0:
                    _, files = await adapters.read_version(bucket, run, lease.adapter_version)
                    state = adapters.decode(files)
                adapters.apply(worker.model, state)
                version = lease.adapter_version
            t0 = time.monotonic()
            ids, mask = encode_prompts(tokenizer, [p.text for p in lease.batch.prompts])
            r = make_rollout(worker.model, ids, mask, run=run, batch_id=lease.batch.batch_id, attempt=lease.attempt,
                             version=version, group_size=spec.sampling.group_size,
                             max_new_tokens=spec.sampling.max_new_tokens, seed=lease.seed % 2**31,
                             eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id)
            data = b"\x80\x04not a rollout" if completed == HOSTILE else r.to_bytes()
            key = keys.rollout_key(run, lease.batch.batch_id, lease.attempt)
            try:
                sha = await bucket.put_new(key, data)
            except ObjectExists:  # generated before Redis lost the grant: what the key holds stands (as a worker's)
                data = await bucket.get(key)
                sha = sha256_hex(data)
            manifest = pb.RolloutManifest(
                run_id=run, batch_id=lease.batch.batch_id, attempt=lease.attempt, worker_id="driver",
                policy_version=version, uri=key, sha256=sha, size_bytes=len(data), num_samples=r.num_samples,
                num_tokens=r.num_tokens, reward_mean=float(r.rewards.mean()), compute_seconds=time.monotonic() - t0,
                price_per_hour=0.5, capacity_class="spot", adapter_payload="bf16", engine="hf",
                created_ms=int(time.time() * 1000))
            done = pb.CompleteLeaseRequest(run_id=run, lease_id=lease.lease_id, worker_id="driver", manifest=manifest)
            await unless_unavailable(lambda req=done: client.lease.CompleteLease(req, timeout=10))
            completed += 1
    return completed


async def run_learner(addr: str, bucket_url: str, run: str, spec_path: Path, log_path: Path,
                      die_at: str | None = None, kill_after_step: int | None = None,
                      term_after_step: int | None = None) -> tuple[int, list[dict]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", BRIGADE_LOG_FORMAT="json", PYTHONWARNINGS="ignore")
    env.pop("BRIGADE_LEARNER_DIE_AT", None)
    if die_at:
        env["BRIGADE_LEARNER_DIE_AT"] = die_at
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "brigade_cli.main", "learner", "--proxy", addr, "--bucket", bucket_url, "--run", run,
        "--spec", str(spec_path), "--price-per-hour", "2.0", "--keep-checkpoints", "0", env=env, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    events = []
    with log_path.open("a") as log:
        log.write(f"--- start die_at={die_at} kill_after_step={kill_after_step}\n")
        async for line in proc.stderr:
            log.write(line.decode())
            try:
                event = json.loads(line)
            except ValueError:
                continue
            events.append(event)
            if kill_after_step is not None and event.get("event") == "step" and event.get("step") == kill_after_step:
                proc.send_signal(signal.SIGKILL)  # from outside, wherever the learner happens to be
            if term_after_step is not None and event.get("event") == "step" and event.get("step") == term_after_step:
                proc.send_signal(signal.SIGTERM)  # a node drain: stop now, and say it did not finish
    return await proc.wait(), events


@dataclass
class Rig:
    addr: str            # the proxy's
    spec_path: Path
    log_path: Path       # every learner life appends to it
    stop: asyncio.Event  # set: the workers' driver stops
    driver: asyncio.Task


@contextlib.asynccontextmanager
async def learner_rig(tmp_path: Path, redis_url: str, bucket_url: str, run: str):
    """A real proxy and the workers' driver, around the learner processes a test starts (run_learner)."""
    from brigade_proxy.server import start_server

    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir)
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=bucket_url)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive_workers(addr, bucket_url, run, model_dir, stop))
    try:
        yield Rig(addr, spec_path, tmp_path / "learner.log", stop, driver)
    finally:
        stop.set()
        driver.cancel()
        await server.stop(0)


async def test_learner_survives_sigkill_anywhere(tmp_path, redis_url, file_bucket_url):
    run = f"kill-{os.getpid()}-{int(time.time())}"
    async with learner_rig(tmp_path, redis_url, file_bucket_url, run) as rig:
        addr, spec_path, log_path = rig.addr, rig.spec_path, rig.log_path
        lives = [dict(die_at="after_ack@1"),          # between steps
                 dict(die_at="mid_checkpoint@2"),     # part of the checkpoint written, no manifest
                 dict(die_at="after_adapter@3"),      # version written, never published
                 dict(kill_after_step=4),             # from outside, right after step 4 trained
                 dict(term_after_step=5),             # SIGTERM: stops, exits 143 (not finished)
                 dict()]                              # to the end
        resumed, rejections = [], []
        for life in lives:
            rc, events = await asyncio.wait_for(run_learner(addr, file_bucket_url, run, spec_path, log_path, **life), 120)
            resumed += [e for e in events if e.get("event") == "resumed"]
            rejections += [e for e in events if e.get("event") == "rollout_rejected"]
            expected = 0 if not life else 128 + signal.SIGTERM if "term_after_step" in life else -signal.SIGKILL
            assert rc == expected, f"learner exited {rc} in life {life}; log: {log_path.read_text()[-3000:]}"
        rig.stop.set()
        completed = await asyncio.wait_for(rig.driver, 30)
    assert completed > MAX_STEPS

    # every restart resumed from the newest complete checkpoint: 1, then 1 again (2 was half written), ...
    assert [e["step"] for e in resumed][:3] == [1, 1, 3]

    r = aioredis.from_url(redis_url)
    k = keys.RunKeys(run)
    consumed = {b.decode() for b in await r.smembers(k.consumed)}
    rejected = {b.decode(): v.decode() for b, v in (await r.hgetall(k.rejected)).items()}
    completed_ids = {b.decode() for b in await r.smembers(k.completed)}
    pending_ids = {f[b"batch"].decode() for _, f in await r.xrange(k.rollouts) if b"batch" in f}
    latest = int(await r.get(k.adapter_latest))
    await r.aclose()

    async with open_bucket(file_bucket_url) as bucket:
        # versions contiguous, each complete, none beyond the last step
        versions = sorted({int(key.split("/")[3][1:]) for key in await bucket.list(f"runs/{run}/adapters/")})
        assert versions == list(range(1, MAX_STEPS + 1)) and latest == MAX_STEPS
        for v in versions:
            await adapters.read_version(bucket, run, v)
        # one complete checkpoint per step; each step consumed exactly one new batch
        ckpts = {}
        for step in range(1, MAX_STEPS + 1):
            files = await checkpoint.load_files(bucket, run, step)
            assert files is not None, f"checkpoint {step} incomplete"
            ckpts[step] = (files, json.loads(files[checkpoint.STATE]))
        seen: set[str] = set()
        per_step = {}
        for step in range(1, MAX_STEPS + 1):
            now = set(ckpts[step][1]["consumed"])
            new = now - seen
            assert seen <= now and len(new) == 1, f"step {step} consumed {sorted(new)} (before: {sorted(seen)})"
            per_step[step] = new.pop()
            seen = now
        # no batch trained twice, none lost: the proxy agrees, nothing was both consumed and rejected,
        # and every completed batch is consumed, rejected, or still waiting in the stream
        assert consumed == seen
        assert not consumed & set(rejected)
        assert completed_ids <= consumed | set(rejected) | pending_ids
        # the hostile object was rejected, and the learner said why (the count goes into the next
        # step's metrics too, unless that step was lost to a kill and redone)
        invalid = {e["batch"] for e in rejections if e["reason"] == "invalid"}
        assert len(invalid) == 1 and rejected[invalid.pop()] == "learner"
        metrics = [json.loads(await bucket.get(keys.metrics_key(run, s))) for s in range(1, MAX_STEPS + 1)]
        assert [m["step"] for m in metrics] == list(range(1, MAX_STEPS + 1))
        assert all(m["accepted_samples"] == 8 and m["dollars_per_sample"] > 0 for m in metrics)

        # the state after a restart is exactly the checkpoint: replaying step 2 from checkpoint 1
        # (the process that trained it had been killed and restarted in between) reproduces checkpoint 2
        spec = build_spec({"run_id": run}, path=spec_path)
        replay = Trainer.create(spec)
        checkpoint.decode(replay, ckpts[1][0])
        batch = per_step[2]
        attempts = await bucket.list(f"runs/{run}/rollouts/{batch}/")
        rollout = from_bytes(await bucket.get(attempts[-1]), replay.vocab_size)
        replay.train_step([rollout])
        expected = Trainer.create(spec)
        checkpoint.decode(expected, ckpts[2][0])
        for (name, a), (_, b) in zip(replay.model.named_parameters(), expected.model.named_parameters(), strict=True):
            assert torch.equal(a, b), name


async def test_publish_and_checkpoint_every_two_steps_in_process(tmp_path, redis_url, file_bucket_url):
    """publish_every / checkpoint_every 2, int8 payload, TIS + recompute: versions still contiguous,
    acks wait for the checkpoint, and a second learner continues where the first stopped; the
    bucket keeps the newest two checkpoints."""
    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import serve
    from brigade_proxy.server import start_server

    run = f"every2-{os.getpid()}-{int(time.time())}"
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir, publish_every=2, checkpoint_every=2, max_steps=6,
                           adapter_payload="int8",
                           grpo={"learning_rate": 0.02, "recompute_logprobs": True, "tis_cap": 2.0})
    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=file_bucket_url)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive_workers(addr, file_bucket_url, run, model_dir, stop))
    cfg = LearnerConfig(proxy=addr, bucket=file_bucket_url, run=run, spec_path=str(spec_path), price_per_hour=1.0,
                        pull_wait_ms=200, keep_checkpoints=2)
    try:
        await asyncio.wait_for(serve(LearnerConfig(**{**cfg.__dict__, "max_steps": 4})), 90)
        async with open_bucket(file_bucket_url) as bucket:
            assert await checkpoint.steps(bucket, run) == [2, 4]
            versions = {k.split("/")[3] for k in await bucket.list(f"runs/{run}/adapters/")}
            assert versions == {"v00000001", "v00000002"}
        await asyncio.wait_for(serve(cfg), 90)  # resumes at step 4, runs to the spec's 6
        stop.set()
        await asyncio.wait_for(driver, 30)
    finally:
        stop.set()
        driver.cancel()
        await server.stop(0)

    async with open_bucket(file_bucket_url) as bucket:
        assert await checkpoint.steps(bucket, run) == [4, 6]
        manifests = [(await adapters.read_version(bucket, run, v))[0] for v in (1, 2, 3)]
        assert [m.step for m in manifests] == [2, 4, 6] and all(m.payload == "int8" for m in manifests)
        assert not await bucket.exists(keys.adapter_manifest_key(run, 4))
        metrics = [json.loads(await bucket.get(keys.metrics_key(run, s))) for s in range(1, 7)]
    assert [m["version"] for m in metrics] == [0, 1, 1, 2, 2, 3]
    assert [m["published"] for m in metrics] == [0, 1, 0, 1, 0, 1]
    # (the tiny adapter's safetensors header is large next to its tensors, so less than 3/4 is saved)
    assert all(0 < m["quantization_error"] < 0.05 and m["adapter_size_saved"] > 0.3
               for m in metrics if m["published"])
    # the driver generated with the int8 payload; the learner recomputed with the same: weight 1
    assert all(m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4) for m in metrics)
    r = aioredis.from_url(redis_url)
    assert int(await r.get(keys.RunKeys(run).learner_step)) == 6
    assert await r.scard(keys.RunKeys(run).consumed) == 6
    await r.aclose()


async def test_redis_restart_between_delivery_and_reply_strands_no_batch(tmp_path, file_bucket_url, monkeypatch):
    """Redis restarts right after the delivering read of a pull, and the pull's reply is lost with
    it: the delivered entry sits in the learner's pending list, where no read of new entries finds
    it. The learner reads its pending entries again after the failed pull and trains it; nothing
    is left holding an admission slot."""
    from brigade.store.learner import Learner as StoreLearner
    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import serve
    from brigade_proxy.server import start_server

    redis_server = start_redis(tmp_path / "redis", appendonly=True)
    run = f"restart-{os.getpid()}-{int(time.time())}"
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir, max_steps=4)
    deliver, stranded, deliveries = StoreLearner._deliver, [], []

    async def deliver_then_restart(self, k, learner, count, wait_ms):
        res = await deliver(self, k, learner, count, wait_ms)
        deliveries.append(bool(res))
        # the second delivery: the first may come from the start-up pull, which reads pending first anyway
        if res and deliveries.count(True) == 2:
            stranded.extend(entry_id.decode() for _, entries in res for entry_id, _ in entries)
            await asyncio.to_thread(redis_server.restart)  # SIGTERM: the AOF keeps the delivery
            raise redis.exceptions.ConnectionError("Connection closed by server.")
        return res

    monkeypatch.setattr(StoreLearner, "_deliver", deliver_then_restart)
    server = await start_server(redis_server.url, "127.0.0.1:0", bucket_url=file_bucket_url)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive_workers(addr, file_bucket_url, run, model_dir, stop))
    r = aioredis.from_url(redis_server.url)
    try:
        await asyncio.wait_for(serve(LearnerConfig(proxy=addr, bucket=file_bucket_url, run=run,
                                                   spec_path=str(spec_path), pull_wait_ms=200)), 120)
        k = keys.RunKeys(run)
        assert stranded, "the hook never ran"
        async with open_bucket(file_bucket_url) as bucket:
            _, files = await checkpoint.latest(bucket, run)
        trained = json.loads(files[checkpoint.STATE])["consumed"]
        assert len(trained) == 4 and set(trained) == {b.decode() for b in await r.smembers(k.consumed)}
        # the stranded delivery was trained and acked: off the stream, out of admission's count
        for entry_id in stranded:
            assert await r.xrange(k.rollouts, entry_id, entry_id) == []
        pending = await r.xpending(k.rollouts, keys.LEARNER_GROUP)
        assert pending["pending"] <= 1  # at most what the prefetcher pulled ahead of a step never taken
        assert int(await r.get(k.learner_step)) == 4 and int(await r.get(k.adapter_latest)) == 4
    finally:
        stop.set()
        driver.cancel()
        await server.stop(0)
        await r.aclose()
        redis_server.stop()


async def train_with_driver(redis_url: str, bucket_url: str, run: str, model_dir: Path, spec_path: Path,
                            gate: asyncio.Event, parked: asyncio.Event) -> None:
    """The proxy in this process, `drive_workers` as the fleet, the learner until it finishes."""
    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import serve
    from brigade_proxy.server import start_server

    server = await start_server(redis_url, "127.0.0.1:0", bucket_url=bucket_url)
    addr = f"127.0.0.1:{server.port}"
    stop = asyncio.Event()
    driver = asyncio.create_task(drive_workers(addr, bucket_url, run, model_dir, stop, gate, parked))
    try:
        await asyncio.wait_for(serve(LearnerConfig(proxy=addr, bucket=bucket_url, run=run,
                                                   spec_path=str(spec_path), pull_wait_ms=200)), 120)
    finally:
        stop.set()
        gate.set()
        driver.cancel()
        await server.stop(0)


async def test_learner_repairs_redis_that_lost_its_last_writes(tmp_path, file_bucket_url, monkeypatch):
    """Redis is SIGKILLed right after the learner's step-2 commit and comes back from an append-only
    file cut back to before it (a host crash under appendfsync everysec): v2's publish and the
    step-2 ack are gone. The running learner notices at its next commit, re-publishes v2 from the
    bucket and re-sends the ack; Redis ends equal to the checkpoint, with no hole in its versions."""
    from chaos_support import aof_tail_file

    from brigade_learner.learner import Learner

    redis_dir = tmp_path / "redis"
    redis_server = start_redis(redis_dir, appendonly=True)
    run = f"lost-{os.getpid()}-{int(time.time())}"
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir, max_steps=4)
    gate, parked, commit = asyncio.Event(), asyncio.Event(), Learner._commit
    gate.set()

    async def commit_then_lose_it(self, step):
        if step != 2:
            return await commit(self, step)
        gate.clear()  # no worker write in the lost window: only the learner's
        await parked.wait()
        aof = aof_tail_file(redis_dir)
        size = aof.stat().st_size
        await commit(self, step)
        assert aof.stat().st_size > size
        redis_server.kill()
        with aof.open("r+b") as f:
            f.truncate(size)
        await asyncio.to_thread(redis_server.restart)
        gate.set()

    monkeypatch.setattr(Learner, "_commit", commit_then_lose_it)
    r = aioredis.from_url(redis_server.url)
    k = keys.RunKeys(run)
    try:
        await train_with_driver(redis_server.url, file_bucket_url, run, model_dir, spec_path, gate, parked)
        async with open_bucket(file_bucket_url) as bucket:
            _, files = await checkpoint.latest(bucket, run)
        state = json.loads(files[checkpoint.STATE])
        assert (state["step"], state["version"]) == (4, 4)
        assert int(await r.get(k.learner_step)) == 4 and int(await r.get(k.adapter_latest)) == 4
        assert sorted(int(v) for v in await r.hkeys(k.adapters)) == [1, 2, 3, 4]
        assert {b.decode() for b in await r.smembers(k.consumed)} == set(state["consumed"])
        assert sorted(int(f[b"step"]) for _, f in await r.xrange(k.metrics)) == [1, 2, 3, 4]
        assert (await r.xpending(k.rollouts, keys.LEARNER_GROUP))["pending"] <= 1  # a prefetched one at most
    finally:
        await r.aclose()
        redis_server.stop()


async def test_learner_repairs_two_lost_commits_with_the_batches_they_trained(tmp_path, file_bucket_url, monkeypatch):
    """The lost second holds two commits (steps 2 and 3), the completion of the batch step 2 trained
    (its lease Redis then holds as live for another minute) and the cuts of the batches after it
    (Redis's cursor is back before them). The learner's repair acks each commit again with the
    batches its checkpoint recorded, which recovers them (BatchRecovered) unless they were cut again
    and came back as duplicates first: none waits for a lease to expire, and Redis ends agreeing
    with the checkpoint though the run ends one step after the repair."""
    from chaos_support import aof_tail_file

    from brigade.store.leases import Leases
    from brigade_learner.learner import Learner

    redis_dir = tmp_path / "redis"
    redis_server = start_redis(redis_dir, appendonly=True)
    run = f"lost2-{os.getpid()}-{int(time.time())}"
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec_path = write_spec(tmp_path, run, model_dir, max_steps=4)
    r = aioredis.from_url(redis_server.url)
    k = keys.RunKeys(run)
    complete, commit, completions, cut_at = Leases.complete, Learner._commit, [], []
    gate, parked = asyncio.Event(), asyncio.Event()
    gate.set()

    async def complete_second_after_step_1(self, run_id, lease_id, worker, manifest):
        completions.append(manifest.batch_id)
        if len(completions) == 2:  # the batch step 2 trains: its completion falls in the lost second
            while int(await r.get(k.learner_step) or 0) < 1:
                await asyncio.sleep(0.05)
            cut_at.append(aof_tail_file(redis_dir).stat().st_size)
        return await complete(self, run_id, lease_id, worker, manifest)

    async def commit_then_lose_two(self, step):
        if step != 3:
            return await commit(self, step)
        gate.clear()  # the driver's lease in flight ends before the crash (its lost lease would stop it)
        await parked.wait()
        await commit(self, step)
        redis_server.kill()
        with aof_tail_file(redis_dir).open("r+b") as f:
            f.truncate(cut_at[0])
        await asyncio.to_thread(redis_server.restart)
        gate.set()

    monkeypatch.setattr(Leases, "complete", complete_second_after_step_1)
    monkeypatch.setattr(Learner, "_commit", commit_then_lose_two)
    try:
        await train_with_driver(redis_server.url, file_bucket_url, run, model_dir, spec_path, gate, parked)
        async with open_bucket(file_bucket_url) as bucket:
            _, files = await checkpoint.latest(bucket, run)
            step_3 = await checkpoint.read_ack(bucket, run, 3)
        state = json.loads(files[checkpoint.STATE])
        await r.aclose()  # its connection died with the Redis it was opened on
        r = aioredis.from_url(redis_server.url)
        assert {b.decode() for b in await r.smembers(k.consumed)} == set(state["consumed"])
        recovered = {f[b"batch"].decode(): f[b"lost"].decode()
                     for _, f in await r.xrange(k.events) if f.get(b"type") == b"BatchRecovered"}
        assert recovered[completions[1]] == "completion"
        # step 3's batch: recovered, or cut again and acked as a duplicate first (whichever came first)
        assert all(recovered.get(b) == "cut" or completions.count(b) == 2 for b in step_3.consumed)
        assert int(await r.get(k.learner_step)) == 4 and int(await r.get(k.adapter_latest)) == 4
        assert sorted(int(f[b"step"]) for _, f in await r.xrange(k.metrics)) == [1, 2, 3, 4]
    finally:
        await r.aclose()
        redis_server.stop()


async def test_an_ack_naming_a_batch_redis_lost_still_lands(redis_url):
    """An ack names a batch id Redis cannot place: not outstanding work, and no lost cut either (the
    run has 5 batches an epoch; test_store.py has the ids an ack recovers). It is refused (never
    completed); the rest of that ack must still land (deliveries, step, metrics, the other batches'
    fates)."""
    from proxy_support import make_prompts, make_spec, new_run_id

    from brigade.store import Store
    from brigade_learner.config import LearnerConfig
    from brigade_learner.learner import Learner
    from brigade_proxy.server import start_server

    store = Store(redis_url)
    run = new_run_id("lost")
    await store.runs.create(make_spec(run), make_prompts(10))
    g = await store.leases.acquire(run, "w")
    batch = g.lease.batch.batch_id
    await store.leases.complete(run, g.lease.lease_id, "w", pb.RolloutManifest(
        run_id=run, batch_id=batch, attempt=g.lease.attempt, worker_id="w", policy_version=0,
        uri=keys.rollout_key(run, batch, g.lease.attempt), sha256="0" * 64, num_samples=2))
    (delivery, _), = (await store.learner.pull(run, "learner", 1)).rollouts
    server = await start_server(redis_url, "127.0.0.1:0")
    learner = Learner.__new__(Learner)  # only its proxy calls are used here
    learner.cfg = LearnerConfig(proxy=f"127.0.0.1:{server.port}", bucket="", run=run)
    learner.run_id, learner.client = run, ProxyClient.connect(learner.cfg.proxy)
    try:
        lost = keys.batch_id(run, 0, 9)  # index 9 of an epoch of 5: no batch of this run
        await learner._ack([delivery], [batch, lost], [], 1, '{"step": 1}')
        state = await store.views.run_state(run)
        assert (state.learner_step, state.consumed, state.completed) == (1, 1, 0)
        assert [m.step for m in await store.views.metrics(run)] == [1]
    finally:
        await learner.client.close()
        await server.stop(0)
        await store.close()
