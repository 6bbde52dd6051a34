"""The rollout worker against a real proxy (in process), Redis and S3 (moto): batches end to end,
adapter pickup, revocation, SIGTERM, and reward functions that misbehave."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch

from brigade import adapters, keys
from brigade.bucket import ObjectNotFound, open_bucket, sha256_hex
from brigade.engine.hf import HFEngine
from brigade.model import attach_lora, completion_logprobs, load_base
from brigade.retry import Backoff
from brigade.rollout_format import Rollout, from_bytes
from brigade.rpc import ProxyClient
from brigade.store import Store, leases
from brigade.v1 import brigade_pb2 as pb
from brigade_harness.devservers import free_port
from brigade_harness.system import LocalSystem
from brigade_proxy.server import start_server
from brigade_rollout.config import WorkerConfig
from brigade_rollout.worker import Worker
from brigade_testing.slow_engine import SlowEngine
from brigade_testing.tiny import demo_prompts, tiny_model, tiny_spec

pytestmark = pytest.mark.asyncio(loop_scope="session")

# ---------------------------------------------------------------- reward functions used by name below


def boom(prompts, completions, completion_ids=None, **columns):
    raise ZeroDivisionError("user reward bug")


def nan_reward(prompts, completions, completion_ids=None, **columns):
    return [math.nan] * len(completions)


def hang(prompts, completions, completion_ids=None, **columns):
    time.sleep(60)


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


class Env:
    def __init__(self, redis_url, bucket_url, model_dir):
        self.redis_url, self.bucket_url, self.model_dir = redis_url, bucket_url, model_dir
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.server = None
        self.bucket = open_bucket(bucket_url)
        # a private subchannel pool: the test's calls must not share the worker's connection backoff
        self.client = ProxyClient(grpc.aio.insecure_channel(self.target, options=[("grpc.use_local_subchannel_pool", 1)]))

    async def start_proxy(self):
        self.server = await start_server(self.redis_url, self.target, bucket_url=self.bucket_url, monitor_redis=False)

    async def create_run(self, run, n_prompts, **overrides) -> pb.RunSpec:
        # no learner publishes here: workers may run as far ahead as the cap (fixed lookahead)
        staleness = overrides["staleness"] = {"max_staleness": 4} | overrides.get("staleness", {})
        staleness.setdefault("lookahead", staleness["max_staleness"])
        spec = tiny_spec(self.model_dir, run_id=run, **overrides)
        await self.client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=demo_prompts(n_prompts)))
        return spec

    def worker(self, run, engine=None, **kw) -> Worker:
        return Worker(WorkerConfig(proxy=self.target, bucket=self.bucket_url, run=run, **kw), engine=engine)

    async def pull(self, run, want, timeout=30.0) -> list[pb.PulledRollout]:
        out, deadline = [], time.monotonic() + timeout
        while len(out) < want and time.monotonic() < deadline:
            resp = await self.client.learner.PullRollouts(
                pb.PullRolloutsRequest(run_id=run, max_manifests=want - len(out), wait_ms=500, learner_id="test"))
            out += resp.rollouts
        assert len(out) == want, f"got {len(out)} manifests, wanted {want}"
        return list(out)

    async def publish(self, spec, version, scale=0.5) -> dict[str, torch.Tensor]:
        """What a learner does: write the adapter version to the bucket, then PublishAdapter."""
        model, _ = load_base(spec)
        peft_model = attach_lora(model, spec)
        g = torch.Generator().manual_seed(version)
        state = {k: torch.randn(v.shape, generator=g) * scale for k, v in adapters.adapter_state(peft_model).items()}
        files, err = adapters.encode(state, adapters.adapter_config_json(peft_model))
        manifest = await adapters.write_version(self.bucket, spec.run_id, version, version, files, "bf16", err)
        await self.client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=spec.run_id, manifest=manifest))
        return adapters.decode(files)

    async def close(self):
        await self.client.close()
        await self.bucket.close()
        if self.server is not None:
            await self.server.stop(0)


@pytest.fixture
async def env(redis_url, s3_bucket_url, model_dir):
    e = Env(redis_url, s3_bucket_url, model_dir)
    await e.bucket.ensure()
    yield e
    await e.close()


def model_with(spec, state=None):
    model, tokenizer = load_base(spec)
    peft_model = attach_lora(model, spec)
    if state is not None:
        adapters.apply(peft_model, state)
    return peft_model, tokenizer


def rescore(model, rollout, temperature):
    with torch.no_grad():
        return completion_logprobs(model, rollout.prompt_ids, rollout.prompt_mask.long(), rollout.completion_ids,
                                   rollout.completion_mask.long(), temperature)


async def wait_for(predicate, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


# ---------------------------------------------------------------- tests


async def test_batches_end_to_end(env):
    """The worker starts before the proxy (retries), completes every batch, and each manifest points
    at an object whose digest matches; a batch attempt regenerates to the same completions."""
    run = "e2e"
    worker = env.worker(run, exit_when_finished=True, price_per_hour=0.75, capacity_class="on-demand")
    task = asyncio.create_task(worker.run())
    await asyncio.sleep(1.0)  # the proxy is not up yet: GetRun is retried with backoff
    assert not task.done()
    await env.start_proxy()
    spec = await env.create_run(run, 6, rewards=[{"function": "demo_sum"}, {"function": "math", "weight": 0.5}])
    assert await asyncio.wait_for(task, 60) == 0
    assert worker.stats["completed"] == 3

    pulled = await env.pull(run, 3)
    model, tokenizer = model_with(spec)
    for p in pulled:
        m = p.manifest
        assert m.uri == keys.rollout_key(run, m.batch_id, m.attempt) and m.attempt == 1
        data = await env.bucket.get(m.uri)
        assert sha256_hex(data) == m.sha256 and len(data) == m.size_bytes
        r = from_bytes(data, vocab_size=len(tokenizer))
        assert (r.batch_id, r.attempt, r.policy_version) == (m.batch_id, 1, 0)
        assert m.num_samples == r.num_samples == 2 * 4 and m.num_tokens == r.num_tokens
        assert r.reward_names == ["demo_sum", "math"]
        assert r.group.tolist() == [0] * 4 + [1] * 4
        assert torch.allclose(r.rewards, r.reward_parts[:, 0] + 0.5 * r.reward_parts[:, 1], equal_nan=True)
        assert m.reward_mean == pytest.approx(float(r.rewards.nanmean()), abs=1e-6)
        assert (m.engine, m.adapter_payload, m.capacity_class, m.price_per_hour) == ("hf", "bf16", "on-demand", 0.75)
        assert m.compute_seconds > 0 and m.worker_id == worker.cfg.worker_id and m.created_ms > 0
        # behaviour log-probs are the learner's numerics for v0
        assert torch.allclose(r.logprobs, rescore(model, r, spec.sampling.temperature), atol=1e-4)
        # the text sidecar agrees with the tokens and the rewards
        doc = json.loads(await env.bucket.get(m.text_uri))
        texts = tokenizer.batch_decode([row[mask.bool()].tolist() for row, mask in zip(r.completion_ids, r.completion_mask,
                                                                                     strict=True)], skip_special_tokens=True)
        assert [s["completion"] for s in doc["samples"]] == texts
        answers = [s["prompt"] for s in doc["samples"]]
        assert [s["reward_parts"]["demo_sum"] for s in doc["samples"]] == r.reward_parts[:, 0].tolist()
        assert len(answers) == 8
        # the same batch and attempt (same seed) generate the same completions in a fresh engine
        prompts = [doc["samples"][i * 4]["prompt"] for i in range(2)]
        seed = keys.batch_seed(spec.seed, m.batch_id, m.attempt)
        again = HFEngine(*model_with(spec)).generate(prompts, spec.sampling, seed, 0, lambda: False)
        assert [s.completion_ids for s in again] == [row[mask.bool()].tolist() for row, mask in
                                                     zip(r.completion_ids, r.completion_mask, strict=True)]
    state = await env.client.runs.GetRun(pb.RunRef(run_id=run))
    assert state.completed == 3 and state.leased == 0 and state.deadlettered == 0


async def test_published_adapter_is_prefetched_and_used(env):
    """v1 is fetched as soon as it is published (while admission holds the worker back), exactly
    once, and the next lease generates with v1: log-probs are v1's, not v0's."""
    await env.start_proxy()
    run = "swap"
    # capacity = batches_per_step x (max_staleness + 1) = 2 outstanding batches
    spec = await env.create_run(run, 6, batches_per_step=1, staleness={"max_staleness": 1})
    worker = env.worker(run, max_batches=3)
    task = asyncio.create_task(worker.run())
    first = await env.pull(run, 2, timeout=60)
    assert {p.manifest.policy_version for p in first} == {0}

    state = await env.publish(spec, 1)
    await wait_for(lambda: asyncio.sleep(0, 1 in worker.cache), what="the prefetch of v1")
    assert worker.cache.fetches == 1 and not task.done()
    await env.client.learner.AckRollouts(pb.AckRolloutsRequest(
        run_id=run, learner_id="test", step=1, delivery_ids=[p.delivery_id for p in first],
        consumed_batch_ids=[p.manifest.batch_id for p in first]))
    assert await asyncio.wait_for(task, 60) == 0

    (third,) = await env.pull(run, 1)
    assert third.manifest.policy_version == 1
    r = from_bytes(await env.bucket.get(third.manifest.uri, sha256=third.manifest.sha256))
    assert r.policy_version == 1
    v1_model, _ = model_with(spec, state)
    assert torch.allclose(r.logprobs, rescore(v1_model, r, spec.sampling.temperature), atol=1e-4)
    v0_model, _ = model_with(spec)
    assert not torch.allclose(r.logprobs, rescore(v0_model, r, spec.sampling.temperature), atol=1e-3)
    assert worker.cache.fetches == 1  # the lease used the prefetched copy


async def test_a_worker_at_the_sync_barrier_starts_when_the_adapter_is_published(env, monkeypatch):
    """Sync mode: a worker refused at the barrier takes its next lease as soon as the adapter it
    waits for is published (WatchRun's AdapterPublished wakes it), not when the refusal's retry
    delay runs out. The delay here is a minute, so a worker that only polled would wait 30-90 s."""
    monkeypatch.setattr(leases, "_retry_after_ms", lambda reason, over, info: 60_000)
    await env.start_proxy()
    run = "barrier"
    spec = await env.create_run(run, 4, sync=True)  # a batch a step: the second waits for v1
    worker = env.worker(run, max_batches=2)
    task = asyncio.create_task(worker.run())
    # pullable once CompleteLease ran, and the same call was refused the next lease at the barrier
    (first,) = await env.pull(run, 1, timeout=60)
    assert first.manifest.policy_version == 0
    await asyncio.sleep(0.5)
    assert not task.done()
    await env.publish(spec, 1)
    assert await asyncio.wait_for(task, 20) == 0
    (second,) = await env.pull(run, 1)
    assert second.manifest.policy_version == 1


async def test_revoked_lease_stops_generation(env):
    await env.start_proxy()
    run = "revoke"
    spec = await env.create_run(run, 2, staleness={"max_staleness": 1, "lease_seconds": 1})
    # a very slow device: the batch would take hours
    worker = env.worker(run, engine=SlowEngine(await asyncio.to_thread(HFEngine.from_spec, spec), factor=5000.0))
    task = asyncio.create_task(worker.run())

    async def leased():
        return len((await env.client.runs.ListLeases(pb.RunRef(run_id=run))).leases) == 1

    await wait_for(leased, 60, "a lease")
    await env.publish(spec, 1)
    await env.publish(spec, 2)
    store = Store(env.redis_url)
    try:
        assert (await store.sweeps.revoke_stale(run)).revoked == 1
    finally:
        await store.close()
    t0 = time.monotonic()
    await wait_for(lambda: asyncio.sleep(0, worker.stats["revoked"] == 1), 10, "the worker to drop the lease")
    assert time.monotonic() - t0 < 5  # the next heartbeat (every lease_seconds / 3) stopped it
    # nothing was uploaded for the revoked attempt; the worker took the requeued batch (attempt 2)
    with pytest.raises(ObjectNotFound):
        await env.bucket.get(keys.rollout_key(run, f"{run}:0:0", 1))
    await wait_for(lambda: asyncio.sleep(0, worker._lease_stop is not None), 10, "the next lease")
    worker.stop()
    assert await asyncio.wait_for(task, 10) == 0
    assert worker.stats["preempted"] == 1


async def test_sigterm_requeues_the_batch(env, tmp_path):
    """A worker process killed mid-batch hands its lease back: the batch is leasable again at once
    with attempt + 1 and completes later; nothing is lost."""
    await env.start_proxy()
    run = "sigterm"
    await env.create_run(run, 4)
    # the worker host wraps the real engine in a very slow device, so the batch is mid-generation
    with LocalSystem(tmp_path, redis_url=env.redis_url) as system:
        doomed = system.spawn("doomed", ["--proxy", env.target, "--bucket", env.bucket_url, "--runs", run,
                                         "--worker-id", "doomed", "--speed-factor", "5000", "--log-level", "info"],
                              module="brigade_testing.slow_worker")

        async def leased():
            assert doomed.alive(), doomed.tail()
            leases = (await env.client.runs.ListLeases(pb.RunRef(run_id=run))).leases
            return any(lease.worker_id == "doomed" for lease in leases)

        await wait_for(leased, 120, "the subprocess to take a lease")
        await asyncio.sleep(0.5)  # in the middle of generating
        t0 = time.monotonic()
        # in a thread: this loop serves the proxy the worker hands its lease back to
        await asyncio.wait_for(asyncio.to_thread(system.kill, "doomed", signal.SIGTERM), 15)
    assert doomed.proc.returncode == 0, doomed.tail()
    assert time.monotonic() - t0 < 10
    assert "lease handed back" in doomed.log.read_text()
    assert not (await env.client.runs.ListLeases(pb.RunRef(run_id=run))).leases

    worker = env.worker(run, exit_when_finished=True)
    assert await asyncio.wait_for(worker.run(), 60) == 0
    pulled = await env.pull(run, 2)
    attempts = sorted((p.manifest.batch_id, p.manifest.attempt) for p in pulled)
    assert attempts == [(f"{run}:0:0", 2), (f"{run}:0:1", 1)]
    state = await env.client.runs.GetRun(pb.RunRef(run_id=run))
    assert state.completed == 2 and state.deadlettered == 0


async def test_a_finished_run_ends_the_worker_only_when_asked(env):
    """On a finished run (its one batch done) `brigade rollout` with BRIGADE_EXIT_WHEN_FINISHED=1
    exits 0 by itself; without it (the default) the worker keeps polling until it is stopped."""
    await env.start_proxy()
    run = "finished"
    await env.create_run(run, 2)  # one batch of 2 prompts
    first = env.worker(run, exit_when_finished=True)
    assert await asyncio.wait_for(first.run(), 60) == 0 and first.stats["completed"] == 1

    poller = env.worker(run, engine=first.engine)  # the default: poll a finished run
    task = asyncio.create_task(poller.run())
    await asyncio.sleep(2.0)  # setup (engine in hand) plus the first AcquireLease take well under this
    assert not task.done()
    poller.stop()
    assert await asyncio.wait_for(task, 10) == 0

    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "brigade_rollout", "--proxy", env.target, "--bucket", env.bucket_url, "--run", run,
        env={**os.environ, "BRIGADE_EXIT_WHEN_FINISHED": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
    assert proc.returncode == 0, out.decode()[-2000:]
    assert b"run finished; exiting" in out


async def test_misbehaving_rewards_are_contained(env, monkeypatch):
    """A reward that raises (in process), returns NaN or hangs (sandboxed rq jobs, short timeout)
    leaves its samples unscored; the worker carries on and the batch still completes."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    await env.start_proxy()
    run = "rewards"
    await env.create_run(run, 2, rewards=[
        {"function": "demo_sum"},
        {"function": "test_rollout_worker:boom"},
        {"function": "test_rollout_worker:nan_reward", "sandboxed": True},
        {"function": "test_rollout_worker:hang", "sandboxed": True, "timeout_s": 1.0},
    ])
    worker = env.worker(run, exit_when_finished=True, redis_url=env.redis_url)
    assert await asyncio.wait_for(worker.run(), 90) == 0
    (p,) = await env.pull(run, 1)
    r = from_bytes(await env.bucket.get(p.manifest.uri))
    assert torch.isfinite(r.reward_parts[:, 0]).all()       # demo_sum still scored
    assert torch.isnan(r.reward_parts[:, 1:]).all()         # the rest: unscored, not fake zeros
    assert torch.isnan(r.rewards).all() and p.manifest.reward_mean == 0.0
    assert worker.stats["rewards_rejected"] == 1


def int_answer(completions, answer, trainer_state, log_metric, **kwargs):
    log_metric("answer_is_int", float(all(isinstance(a, int) for a in answer)))
    return [float(trainer_state.global_step) + a for a in answer]


async def test_conversational_prompts_with_typed_columns_and_trl_rewards(env, tmp_path):
    """A chat dataset through the proxy and a lease to the worker: the prompt is rendered with the
    model's chat template (one BOS), TRL's own function gets conversational completions, an int
    column arrives as an int, and what a reward function logged travels in the rollout."""
    pytest.importorskip("trl")
    from brigade.chat import prompt_ids
    from brigade.datasets import load_prompts
    from brigade_testing.tiny import chat_tokenizer

    chat_dir = tiny_model(tmp_path / "chat", tokenizer=chat_tokenizer())
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a}) + "\n"
                            for q, a in (("What is 2+2?", 4), ("What is 3+4?", 7))))
    await env.start_proxy()
    run = "chat"
    spec = tiny_spec(chat_dir, run_id=run, dataset=str(data), rewards=[
        {"function": "test_rollout_worker:int_answer"}, {"function": "trl.rewards:think_format_reward"}])
    await env.client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=load_prompts(str(data))))
    worker = env.worker(run, exit_when_finished=True)
    assert await asyncio.wait_for(worker.run(), 60) == 0
    (p,) = await env.pull(run, 1)
    r = from_bytes(await env.bucket.get(p.manifest.uri))
    tok = chat_tokenizer()
    want = prompt_ids(tok, [{"role": "user", "content": "What is 2+2?"}])
    assert r.prompt_ids[0][r.prompt_mask[0].bool()].tolist() == want and want.count(tok.bos_token_id) == 1
    assert r.reward_parts[:, 0].tolist() == [4.0] * 4 + [7.0] * 4  # v0 + the int answer
    assert torch.isfinite(r.reward_parts[:, 1]).all()  # think_format_reward read completions[i][0]["content"]
    assert r.reward_metrics == {"metric/answer_is_int": [1.0, 1]}  # one call for the batch, logged once
    sidecar = json.loads(await env.bucket.get(p.manifest.text_uri))
    assert sidecar["samples"][0]["prompt"] == [{"role": "user", "content": "What is 2+2?"}]
    assert sidecar["rejected"] == {}


async def test_sandboxed_rewards_need_a_queue(env):
    await env.start_proxy()
    await env.create_run("nosandbox", 2, rewards=[{"function": "code_exec", "sandboxed": True}])
    assert await asyncio.wait_for(env.worker("nosandbox").run(), 30) == 2  # a clear error, not a crash loop


async def test_complete_is_retried_until_the_proxy_answers(env):
    """Upload first, then complete: an UNAVAILABLE CompleteLease is retried; a refusal is not."""
    from brigade_rollout import retries

    class Flaky:
        def __init__(self, failures, final):
            self.calls, self.failures, self.final = 0, failures, final

        async def CompleteLease(self, req, timeout=None):
            self.calls += 1
            if self.calls <= self.failures:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "down")
            if isinstance(self.final, Exception):
                raise self.final
            return pb.CompleteLeaseResponse(duplicate=self.final)

    w = env.worker("unused")
    w.client = type("C", (), {})()
    lease = pb.Lease(run_id="unused", lease_id="1-0", batch=pb.PromptBatch(batch_id="unused:0:0"))
    w.client.lease = Flaky(2, True)
    orig = retries.BACKOFF
    retries.BACKOFF = Backoff(base_s=0.01, cap_s=orig.cap_s)
    try:
        assert await w._complete(lease, pb.RolloutManifest()) is True   # the third try landed, as a duplicate
        assert w.client.lease.calls == 3
        expired = grpc.aio.AioRpcError(grpc.StatusCode.FAILED_PRECONDITION, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "lease expired")
        w.client.lease = Flaky(1, expired)
        with pytest.raises(retries.LeaseGone, match="expired"):  # taken back: discard, no FailLease
            await w._complete(lease, pb.RolloutManifest())
        assert w.client.lease.calls == 2
        refused = grpc.aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       "bad manifest")
        w.client.lease = Flaky(0, refused)
        with pytest.raises(retries.BatchError, match="refused"):
            await w._complete(lease, pb.RolloutManifest())
        assert w.client.lease.calls == 1
    finally:
        retries.BACKOFF = orig


def other_rollout(run: str, batch: str, attempt: int, version: int) -> Rollout:
    """A valid rollout object with the given metadata and arbitrary (not this engine's) contents."""
    n, c = 8, 3
    return Rollout(run_id=run, batch_id=batch, attempt=attempt, policy_version=version,
                   prompt_ids=torch.ones((n, 2), dtype=torch.int64), prompt_mask=torch.ones((n, 2), dtype=torch.int8),
                   completion_ids=torch.full((n, c), 2, dtype=torch.int64),
                   completion_mask=torch.ones((n, c), dtype=torch.int8), logprobs=torch.full((n, c), -0.5),
                   rewards=torch.arange(n, dtype=torch.float32), reward_parts=torch.arange(n, dtype=torch.float32)[:, None],
                   group=torch.arange(n, dtype=torch.int32) // 4, reward_names=["demo_sum"])


async def test_the_completing_call_brings_the_next_lease(env):
    """CompleteLease asks for the next lease in the same call; the answer waits in the worker for its
    loop, and a granted one that will not be worked on (shutdown) is handed back PREEMPTED."""

    class Proxy:
        def __init__(self):
            self.completes, self.fails = [], []

        async def CompleteLease(self, req, timeout=None):
            self.completes.append(req)
            nxt = pb.AcquireLeaseResponse(granted=True, lease=pb.Lease(run_id="r", lease_id="2-0",
                                                                        batch=pb.PromptBatch(batch_id="r:0:1")))
            return pb.CompleteLeaseResponse(next=nxt) if req.HasField("next") else pb.CompleteLeaseResponse()

        async def FailLease(self, req, timeout=None):
            self.fails.append(req)
            return pb.FailLeaseResponse(requeued=True, next_attempt=2)

    w = env.worker("r")
    w.client = type("C", (), {})()
    w.client.lease = proxy = Proxy()
    lease = pb.Lease(run_id="r", lease_id="1-0", batch=pb.PromptBatch(batch_id="r:0:0"))
    assert await w._complete(lease, pb.RolloutManifest()) is False and w._next is None   # the last batch asks nothing
    assert not proxy.completes[-1].HasField("next")
    await w._complete(lease, pb.RolloutManifest(), want_next=True)
    sent = proxy.completes[-1].next
    assert (sent.run_id, sent.worker_id, sent.engine) == ("r", w.cfg.worker_id, w.cfg.engine)
    assert w._next.lease.lease_id == "2-0"
    await w._hand_back_next()
    assert [(f.lease_id, f.reason) for f in proxy.fails] == [("2-0", pb.FailLeaseRequest.PREEMPTED)]
    assert w._next is None and w.stats["preempted"] == 1
    w._stopping.set()                                     # shutting down: nothing more is asked for
    await w._complete(lease, pb.RolloutManifest(), want_next=True)
    assert not proxy.completes[-1].HasField("next") and w._next is None


async def test_a_taken_rollout_key_costs_no_failure(env):
    """Redis lost writes and grants an attempt a second time, or the engine is not bit-reproducible:
    the attempt's key already holds other bytes. This lease's own rollout there is adopted (its
    digest goes into the manifest); anything else hands the lease back uncounted, and the next
    attempt writes a key of its own. No object is written twice, no failure is counted."""
    await env.start_proxy()
    run = "keytaken"
    await env.create_run(run, 4, rewards=[{"function": "demo_sum"}])
    ours = other_rollout(run, keys.batch_id(run, 0, 0), 1, 0).to_bytes()
    await env.bucket.put_new(keys.rollout_key(run, keys.batch_id(run, 0, 0), 1), ours)
    foreign = other_rollout(run, keys.batch_id(run, 0, 1), 1, 7).to_bytes()  # another version's
    await env.bucket.put_new(keys.rollout_key(run, keys.batch_id(run, 0, 1), 1), foreign)
    worker = env.worker(run, exit_when_finished=True)
    assert await asyncio.wait_for(worker.run(), 60) == 0
    assert (worker.stats["completed"], worker.stats["key_taken"], worker.stats["failed"]) == (2, 1, 0)
    by_batch = {p.manifest.batch_id: p.manifest for p in await env.pull(run, 2)}
    adopted, retried = by_batch[keys.batch_id(run, 0, 0)], by_batch[keys.batch_id(run, 0, 1)]
    assert (adopted.attempt, adopted.sha256, adopted.num_samples) == (1, sha256_hex(ours), 8)
    assert retried.attempt == 2 and retried.uri == keys.rollout_key(run, retried.batch_id, 2)
    assert await env.bucket.get(keys.rollout_key(run, retried.batch_id, 1)) == foreign  # untouched
    state = await env.client.runs.GetRun(pb.RunRef(run_id=run))
    assert state.deadlettered == 0 and state.completed == 2


async def test_heartbeat_stops_when_a_batch_fails(env, monkeypatch):
    """A failed batch is handed back, then the worker waits before its next lease: no heartbeat of
    the handed-back lease in that wait (it could only answer LOST and log a misleading "lease lost")."""
    from brigade_rollout import worker as wmod

    class Lease:
        def __init__(self):
            self.failed, self.heartbeats_after_fail = False, 0

        async def Heartbeat(self, req, timeout=None):
            self.heartbeats_after_fail += self.failed
            return pb.HeartbeatResponse(status=pb.HeartbeatResponse.LOST if self.failed else pb.HeartbeatResponse.OK)

        async def FailLease(self, req, timeout=None):
            self.failed = True
            return pb.FailLeaseResponse(requeued=True, next_attempt=2)

    async def unusable(version):
        await asyncio.sleep(0.5)  # a heartbeat while the lease is alive
        raise wmod.BatchError(f"adapter v{version} is unusable")

    w = env.worker("unused")
    w.client = type("C", (), {})()
    w.client.lease = Lease()
    monkeypatch.setattr(w, "_adapter", unusable)
    monkeypatch.setattr(wmod, "BACKOFF", type("Fixed", (), {"delay": lambda self, n: 1.0})())
    lease = pb.Lease(run_id="unused", lease_id="1-0", lease_seconds=1, batch=pb.PromptBatch(batch_id="unused:0:0"))
    assert await w._process(lease) is False
    assert w.client.lease.failed and w.stats["failed"] == 1
    assert w.client.lease.heartbeats_after_fail == 0  # 3 before the fix: one per 1/3 s of the 1 s wait


async def test_a_spec_naming_code_the_host_does_not_allow_is_refused(env, tmp_path, monkeypatch):
    """A run whose reward is `subprocess:run` with arguments: a proxy with the default policy refuses
    it at CreateRun; created through a proxy that allows anything, a real `brigade rollout` on a host
    with the default policy imports and calls nothing, hands one lease back with the reason
    (PREEMPTED: no attempt spent) and exits 2 with one line, before loading the model."""
    await env.start_proxy()
    run = "wire-code"
    marker = tmp_path / "marker"
    rewards = [{"function": "subprocess:run", "kwargs": {"args": ["touch", str(marker)]}}]
    host = {k: v for k, v in os.environ.items() if k != "BRIGADE_ALLOW_CODE"}
    monkeypatch.delenv("BRIGADE_ALLOW_CODE")  # the in-process proxy reads its host's policy per call
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await env.create_run(run, 2, rewards=rewards)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused by the proxy's code policy" in refused.value.details() and not marker.exists()
    monkeypatch.setenv("BRIGADE_ALLOW_CODE", "*")
    await env.create_run(run, 2, rewards=rewards)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "brigade_rollout", "--proxy", env.target, "--bucket", env.bucket_url, "--run", run,
        env=host, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        if proc.returncode is None:
            proc.kill()
    text = out.decode()
    assert proc.returncode == 2, text[-2000:]
    assert "refused by this host's code policy" in text and "'subprocess' is not allowed" in text
    assert "engine ready" not in text
    assert not marker.exists()
    state = await env.client.runs.GetRun(pb.RunRef(run_id=run))
    assert state.deadlettered == 0 and not (await env.client.runs.ListLeases(pb.RunRef(run_id=run))).leases


async def test_rollout_needs_a_run():
    """No default run: a worker started without --run (or BRIGADE_RUN) runs nothing (exit 2)."""
    host = {k: v for k, v in os.environ.items() if k != "BRIGADE_RUN"}
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "brigade_rollout", env=host,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2 and b"which run?" in out
