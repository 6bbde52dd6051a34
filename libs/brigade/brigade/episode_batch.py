"""A batch of prompts as episodes (brigade.episodes): what a rollout worker and the evaluator do
instead of one generate call when the run names tools or an environment.

    episodes = run(runner, engine, prompts, sampling, seed, version, should_stop)  # group_size a prompt
    samples(episodes)                                          # what build_rollout takes
    await score(rewards, call, episodes, classes, generate_s)  # TRL's reward arguments, the environment's
                                                               # reward, failed episodes dropped, metrics
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

import structlog

from brigade.datasets import prompt_value, row_columns
from brigade.engine.base import Engine, Sample, StopFn
from brigade.episodes import Episode, EpisodeRunner
from brigade.reward_call import RewardCall
from brigade.rewards import RewardSet, Scores
from brigade.v1 import brigade_pb2 as pb

log = structlog.get_logger()


def run(runner: EpisodeRunner, engine: Engine, prompts: Sequence[pb.Prompt], sampling: pb.SamplingSpec, seed: int,
        adapter_version: int, should_stop: StopFn) -> list[Episode]:
    """The prompts' episodes, group_size per prompt, each with its own environment instance."""
    episodes = []
    for g, p in enumerate(prompts):
        messages = prompt_value(p)
        row = {"prompt": messages, **row_columns(p)}  # what TRL passes reset: the dataset row
        episodes += [runner.start(g, messages, row) for _ in range(sampling.group_size)]
    runner.run(engine, episodes, sampling, seed, adapter_version, should_stop)
    failed = [e for e in episodes if e.end == "failed"]
    if failed:
        log.warning("episodes failed; their samples are dropped", failed=len(failed), episodes=len(episodes),
                    first=failed[0].error)
    return episodes


def samples(episodes: list[Episode]) -> list[Sample]:
    return [Sample(e.group, e.prompt, e.ids, e.logprobs, e.finished, env_mask=e.env_mask) for e in episodes]


async def score(rewards: RewardSet, call: RewardCall, episodes: list[Episode], classes: list[type],
                generate_s: float) -> Scores:
    scores = await rewards.score(score_call(call, episodes))
    finish(scores, episodes, classes)
    scores.episode_metrics = step_metrics(episodes, generate_s)
    return scores


def score_call(call: RewardCall, episodes: list[Episode]) -> RewardCall:
    """TRL's reward arguments for episodes: the prompt as the model saw it, the completion as its
    messages (assistant, tool, assistant...), and each episode's environment instance."""
    return dataclasses.replace(call, prompts=[e.messages for e in episodes], completions=[e.completion for e in episodes],
                               environments=[e.environment for e in episodes])


def finish(scores: Scores, episodes: list[Episode], classes: list[type]) -> None:
    """Add each environment class's own reward as a part (named after the class, weight 1, None for
    episodes of other classes: TRL's rule), and leave failed episodes unscored."""
    for cls in classes:
        scores.add(cls.__name__, [e.env_reward if type(e.environment) is cls else None for e in episodes])
    for i, e in enumerate(episodes):
        if e.end == "failed":
            scores.drop(i)


def step_metrics(episodes: list[Episode], generate_s: float) -> dict[str, list[float]]:
    """[sum, count] per metric, averaged over a step by the learner like a reward's log_metric:
    per episode, its turns, tool calls, tool errors and tokens; per batch, the share of generation
    time spent in the environment, TRL's tools/ frequencies, and how episodes ended."""
    n = len(episodes)
    calls = sum(e.tool_calls for e in episodes)
    errors = sum(e.tool_errors for e in episodes)
    out = {
        "episode/turns": [float(sum(e.turns for e in episodes)), n],
        "episode/tool_calls": [float(calls), n],
        "episode/tool_errors": [float(errors), n],
        "episode/length": [float(sum(len(e.ids) for e in episodes)), n],
        "episode/env_tokens": [float(sum(sum(e.env_mask) for e in episodes)), n],
        "episode/env_time_frac": [sum(e.env_s for e in episodes) / max(generate_s, 1e-9), 1],
        "tools/call_frequency": [float(calls), n],
        "tools/failure_frequency": [float(errors) / calls if calls else 0.0, 1],
    }
    ends = Counter(e.end for e in episodes)
    for end in ("answered", "environment", "turns", "length", "failed"):
        out[f"episode/end_{end}"] = [float(ends.get(end, 0)), n]
    return out
