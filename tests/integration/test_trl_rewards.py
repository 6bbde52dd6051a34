"""TRL GRPOTrainer's reward contract, with TRL installed: its own reward functions unchanged
(conversational completions, a factory configured by `kwargs` in the spec), `trainer_state`, async
functions awaited concurrently, None aggregated as TRL does, `log_metric`/`log_extra` reaching the
learner's step metrics, typed dataset columns, a sequence-classification reward model scored on
the worker, and one clear line for a function that cannot be used."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import pytest
import torch

from brigade.config import ConfigError
from brigade.datasets import to_prompt
from brigade.reward_call import RewardCall, TrainerState
from brigade.rewards import RewardSet
from brigade.rollout_format import from_bytes
from brigade.spec_file import build_spec
from brigade.task import check_task
from brigade.v1 import brigade_pb2 as pb
from brigade_learner.trainer import reward_stats
from brigade_rollout.worker import build_rollout
from brigade_testing.tiny import chat_tokenizer

trl_rewards = pytest.importorskip("trl.rewards")

CHAT = [{"role": "user", "content": "What is 2+2?"}]
TEXTS = ["<think>\nadd</think>\n4", "4", "<think>\nguess</think>\n5", "no idea"]


def sample(group: int, ids: list[int]):
    return SimpleNamespace(group=group, completion_ids=ids)


def batch(prompt=CHAT, answer=4, texts=TEXTS, step=3) -> RewardCall:
    """Two prompts x two completions, the way the worker builds the call (typed columns from the wire)."""
    prompts = [to_prompt("t", i, {"prompt": prompt, "answer": answer + i, "tags": ["a"]}, "prompt") for i in range(2)]
    prompts = list(pb.PromptBatch.FromString(pb.PromptBatch(prompts=prompts).SerializeToString()).prompts)
    samples = [sample(i // 2, list(range(1, 2 + 3 * i))) for i in range(len(texts))]
    return RewardCall.for_samples(prompts, samples, texts, TrainerState(global_step=step, max_steps=10))


def rewards_of(entries: list[dict], **spec) -> RewardSet:
    return RewardSet.from_specs(build_spec({"rewards": entries, **spec}).rewards)


# ---------------------------------------------------------------- functions named by import path below


def int_answer(prompts, completions, answer, **kwargs):
    """Compares as a TRL user would: `answer` is the dataset's int, not its string."""
    return [float(c[0]["content"].strip().endswith(str(a)) and isinstance(a, int)) for c, a in zip(
        completions, answer, strict=True)]


def by_step(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)


def only_long(completions, completion_ids, **kwargs):
    return [1.0 if len(ids) > 3 else None for ids in completion_ids]


def never(completions, **kwargs):
    return [None] * len(completions)


def logs(completions, log_metric, log_extra, **kwargs):
    log_metric("judge_calls", 2.0)
    log_extra("length", [len(c[0]["content"]) for c in completions])
    return [0.0] * len(completions)


async def slow_a(completions, **kwargs):
    await asyncio.sleep(0.6)
    return [1.0] * len(completions)


async def slow_b(completions, **kwargs):
    await asyncio.sleep(0.6)
    return [2.0] * len(completions)


def returns_coroutine(**kwargs):
    return slow_b(**kwargs)


def no_kwargs(prompts, completions):
    return [0.0] * len(completions)


def needs_solution(completions, solution, **kwargs):
    return [0.0] * len(completions)


def too_few(completions, **kwargs):
    return [1.0]


# ---------------------------------------------------------------- tests


async def test_trl_builtins_unchanged_with_conversational_completions_and_a_factory():
    call = batch()
    assert call.completions[0] == [{"role": "assistant", "content": TEXTS[0]}] and call.prompts[0] == CHAT
    rs = rewards_of([
        {"function": "trl.rewards:think_format_reward"},
        {"function": "trl.rewards:get_soft_overlong_punishment", "kwargs": {"max_completion_len": 6,
                                                                          "soft_punish_cache": 4}},
    ])
    s = await rs.score(call)
    assert s.parts[0] == trl_rewards.think_format_reward(call.completions) == [1.0, 0.0, 1.0, 0.0]
    factory = trl_rewards.get_soft_overlong_punishment(max_completion_len=6, soft_punish_cache=4)
    assert s.parts[1] == factory(completion_ids=call.completion_ids) == [0.0, -0.5, -1.0, -1.0]  # 1, 4, 7, 10 ids
    assert not s.rejected and s.total == [1.0, -0.5, 0.0, -1.0]


async def test_trl_accuracy_reward_with_math_verify():
    pytest.importorskip("math_verify")  # a dev requirement; users install it beside trl
    # TRL's accuracy_reward reads the completion's last \boxed{} answer and compares it with the solution
    call = batch(texts=["so \\boxed{4}", "\\boxed{5}", "it is $\\boxed{5}$", "\\boxed{9}"])
    call.columns["solution"] = ["$4$", "$4$", "$5$", "$5$"]
    s = await rewards_of([{"function": "trl.rewards:accuracy_reward"}]).score(call)
    assert s.parts[0] == [1.0, 0.0, 1.0, 0.0]


async def test_typed_columns_trainer_state_and_trls_none_aggregation():
    rs = rewards_of([
        {"function": "test_trl_rewards:int_answer", "weight": 2.0},
        {"function": "test_trl_rewards:by_step", "weight": 0.5},
        {"function": "test_trl_rewards:only_long"},
    ])
    s = await rs.score(batch(step=3))
    assert s.parts[0] == [1.0, 1.0, 1.0, 0.0]           # answers 4 and 5 arrived as ints
    assert s.parts[1] == [3.0] * 4                       # global_step = the version generated with
    assert s.parts[2] == [None, 1.0, 1.0, 1.0]           # does not apply to the short completion
    assert s.total == [3.5, 4.5, 4.5, 2.5]               # nansum of weight x reward

    s = await rewards_of([{"function": "test_trl_rewards:never"}, {"function": "test_trl_rewards:only_long"}]
                         ).score(batch())
    assert s.total == [None, 1.0, 1.0, 1.0] and not s.rejected  # nobody scored the first: dropped, warned


async def test_async_functions_are_awaited_concurrently():
    rs = rewards_of([{"function": "test_trl_rewards:slow_a"}, {"function": "test_trl_rewards:slow_b"},
                     {"function": "test_trl_rewards:returns_coroutine"}])
    t0 = time.monotonic()
    s = await rs.score(batch())
    assert time.monotonic() - t0 < 1.1  # 0.6 s each, side by side
    assert s.parts == [[1.0] * 4, [2.0] * 4, [2.0] * 4]


async def test_log_metric_and_log_extra_land_in_the_learners_step_metrics():
    s = await rewards_of([{"function": "test_trl_rewards:logs"}]).score(batch())
    assert s.extra == {"length": [len(t) for t in TEXTS]}
    lease = pb.Lease(run_id="r", batch=pb.PromptBatch(batch_id="r:0:0"), attempt=1, adapter_version=1)
    samples = [SimpleNamespace(group=i // 2, prompt_ids=[1, 5], completion_ids=[5, 2], logprobs=[-1.0, -1.0])
               for i in range(4)]
    rollout = from_bytes(build_rollout(lease, samples, [0.0, 1.0, 0.0, 1.0], s.parts, s.names, 0,
                                       s.step_metrics()).to_bytes())
    metrics = reward_stats([rollout, rollout])
    assert metrics["metric/judge_calls"] == 2.0
    assert math.isclose(metrics["extra/length"], sum(map(len, TEXTS)) / 4)


async def test_a_wrong_count_rejects_the_batch_and_the_run_goes_on():
    rs = rewards_of([{"function": "test_trl_rewards:too_few"}, {"function": "test_trl_rewards:by_step"}])
    s = await rs.score(batch())
    assert s.rejected == {"test_trl_rewards:too_few": "returned 1 rewards for 4 completions"}
    assert s.total == [None] * 4 and rs.rejected == 1
    again = await rewards_of([{"function": "test_trl_rewards:by_step"}]).score(batch())
    assert again.total == [3.0] * 4


def test_unusable_functions_are_one_line_each_before_anything_starts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "What is 2+2?", "answer": 4}) + "\n")
    spec = build_spec({"dataset": str(path), "eval_every": 0, "rewards": [
        {"function": "test_trl_rewards:no_kwargs"},
        {"function": "test_trl_rewards:needs_solution"},
        {"function": "trl.rewards:get_soft_overlong_punishment", "kwargs": {"max_len": 3}},
        {"function": "test_trl_rewards:nothing_here"},
    ]})
    with pytest.raises(ConfigError) as e:
        check_task(spec)
    lines = [line.strip() for line in str(e.value).splitlines()[1:]]
    assert len(lines) == 4
    assert lines[0].startswith("rewards[0]: reward function 'test_trl_rewards:no_kwargs' has the wrong signature: "
                               "it takes no **kwargs")
    assert "it needs 'solution', which is neither a reward argument" in lines[1] and "(answer)" in lines[1]
    assert lines[2].startswith("rewards[2]: reward function 'trl.rewards:get_soft_overlong_punishment': calling "
                               "the factory with kwargs")
    assert "cannot be imported" in lines[3]


async def test_a_sequence_classification_reward_model_scored_as_trl_scores_it(tmp_path):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = chat_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")
    rs = rewards_of([{"function": str(tmp_path / "rm")}])
    call = batch(texts=["4", "yes", "The answer is 4", "no"])
    s = await rs.score(call)
    # TRL: prompt + completion messages through the reward tokenizer's template, right-padded, logits[:, 0]
    model = LlamaForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    texts = [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(call.prompts, call.completions,
                                                                             strict=True)]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    with torch.no_grad():
        want = model(**enc).logits[:, 0].tolist()
    assert not s.rejected and len(set(s.parts[0])) > 1
    assert s.parts[0] == pytest.approx(want, abs=1e-5)
