"""The evaluation job: score one adapter version on held-out prompts.

Runs inside an rq worker (see cli.py). The base model stays loaded in the worker process between
jobs; each job swaps in the version's adapter (sha256-checked), samples `EVAL_GROUP` completions per
held-out prompt with a seed fixed per version, and scores them with the run's reward functions.
Results go to the bucket (`evals/v{version:08d}.json`, written once) and, through the store's
views, to Redis, where `brigade ctl adapters` and `metrics` read them.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from brigade import keys

EVAL_GROUP = 4
_engines: dict = {}  # run -> HFEngine (and (run, "episodes") -> its EpisodeRunner), kept across jobs
_trackers: dict[str, object] = {}  # run -> its experiment trackers (report_to), likewise


def _engine(run: str, spec):
    from brigade.engine.hf import HFEngine

    if run not in _engines:
        _engines[run] = HFEngine.from_spec(spec)
    return _engines[run]


def _episodes(run: str, spec, engine):
    """The run's episode runner (tools, environments), or None: kept beside the engine."""
    from brigade.episodes import EnvironmentCode, EpisodeRunner
    from brigade.spec import episodic

    if not episodic(spec):
        return None
    if (run, "episodes") not in _engines:
        _engines[(run, "episodes")] = EpisodeRunner(EnvironmentCode.from_spec(spec), engine.tokenizer)
    return _engines[(run, "episodes")]


async def _evaluate(run: str, version: int, bucket_url: str, redis_url: str, rq_url: str = "") -> dict:
    from brigade import adapters, episode_batch
    from brigade.bucket import ObjectExists, open_bucket
    from brigade.datasets import eval_prompts, prompt_value
    from brigade.reward_call import RewardCall, TrainerState
    from brigade.reward_sandbox import RqSandbox
    from brigade.rewards import RewardSet
    from brigade.store import NotFound, Store
    from brigade.v1 import brigade_pb2 as pb

    started = time.monotonic()
    store = Store(redis_url, max_connections=2, blocking_connections=1, pipelined=False)
    try:
        try:
            spec = (await store.runs.get(run)).spec
        except NotFound:
            raise ValueError(f"no run {run!r} in Redis") from None
        from brigade.code_policy import refuse_code

        refuse_code(run, spec, bucket_url)  # one line (ConfigError) before the model or any reward is loaded
        engine = _engine(run, spec)
        async with open_bucket(bucket_url) as bucket:
            state, step = None, 0
            if version > 0:
                manifest, files = await adapters.read_version(bucket, run, version)
                step = manifest.step
                state = adapters.decode(files)
            engine.load_adapter(version, state)
            prompts = eval_prompts(spec)
            sampling = pb.SamplingSpec()
            sampling.CopyFrom(spec.sampling)
            sampling.group_size = EVAL_GROUP
            seed = keys.eval_seed(spec.seed, version)
            runner = _episodes(run, spec, engine)
            generate_s = time.monotonic()
            episodes = runner and await asyncio.to_thread(episode_batch.run, runner, engine, prompts, sampling, seed,
                                                          version, lambda: False)
            generate_s = time.monotonic() - generate_s
            samples = episode_batch.samples(episodes) if episodes else await asyncio.to_thread(
                engine.generate, [prompt_value(p) for p in prompts], sampling, seed, version, lambda: False)
            texts = engine.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
            # sandboxed rewards run as rq jobs on the run's reward queue, served by our own rq worker
            sandbox = None
            if any(r.sandboxed for r in spec.rewards):
                sandbox = RqSandbox(rq_url or redis_url, keys.reward_queue(run), start_worker=True)
            rewards = RewardSet.from_specs(spec.rewards, sandbox, device=spec.device,
                                           trust_remote_code=spec.trust_remote_code)
            state = TrainerState(global_step=version, max_steps=spec.max_steps, num_train_epochs=spec.epochs)
            call = RewardCall.for_samples(prompts, samples, texts, state)
            scores = await (episode_batch.score(rewards, call, episodes, runner.code.reward_classes(), generate_s) if episodes
                            else rewards.score(call))
            await rewards.close()
            total = [v for v in scores.total if v is not None and math.isfinite(v)]
            result = {
                "run": run, "version": version, "prompts": len(prompts), "samples": len(samples),
                "reward_mean": sum(total) / len(total) if total else None,
                "scored": len(total),
                "per_function": {n: _mean(p) for n, p in zip(scores.names, scores.parts, strict=True)},
                "rejected": scores.rejected,  # function -> why its result was refused (nothing scored then)
                **({"episodes": {k: v[0] / v[1] for k, v in scores.episode_metrics.items()}} if episodes else {}),
                "eval_s": round(time.monotonic() - started, 3), "time_unix": time.time(),
            }
            try:
                await bucket.put_new(keys.eval_key(run, version), json.dumps(result, indent=2).encode())
                _tracked(run, spec).log_eval({**result, "version": version}, step)
            except ObjectExists:
                pass  # a retried job: the first result stands (and was logged to the trackers)
        await store.views.record_eval(run, version, json.dumps(result))
        return result
    finally:
        await store.close()


def _tracked(run: str, spec):
    """The run's trackers, opened once per worker process, at the learner's tracker folder; the
    learner's override (BRIGADE_REPORT_TO) applies here too."""
    import os

    from brigade.spec_file import spec_to_dict
    from brigade.trackers import open_trackers, parse_report_to

    if run not in _trackers:
        names = parse_report_to(os.environ.get("BRIGADE_REPORT_TO", ""))
        _trackers[run] = open_trackers(spec.report_to if names is None else names, run, spec_to_dict(spec),
                                       os.environ.get("BRIGADE_TRACKER_DIR", "trackers"), role="evaluator")
    return _trackers[run]


def _mean(values: list) -> float | None:
    ok = [v for v in values if v is not None and math.isfinite(v)]
    return sum(ok) / len(ok) if ok else None


def evaluate(run: str, version: int, bucket_url: str, redis_url: str, rq_url: str = "") -> dict:
    """rq entry point (rq calls plain functions). `rq_url`: the single-node Redis of the job queues
    (sandboxed rewards), when `redis_url` is a cluster; a job queued without it uses `redis_url`."""
    return asyncio.run(_evaluate(run, version, bucket_url, redis_url, rq_url))
