"""Reward functions: the built-ins, and containment of functions that raise, hang or return NaN,
in process and sandboxed as rq jobs (a real Redis, a real rq worker subprocess). TRL's own
functions and the rest of TRL's contract: tests/integration/test_trl_rewards.py."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from brigade import reward_builtins, rewards
from brigade.reward_builtins import math_reward
from brigade.reward_call import RewardCall
from brigade.reward_sandbox import RqSandbox
from brigade.rewards import RewardRejected, RewardSet, Scores, clean

# ---------------------------------------------------------------- functions used by reference below


def good(prompts, completions, completion_ids=None, **columns):
    return [float(len(c)) for c in completions]


def boom(prompts, completions, completion_ids=None, **columns):
    raise RuntimeError("reward exploded")


def nan_and_inf(prompts, completions, completion_ids=None, **columns):
    return [math.nan, math.inf, 1.0, None][: len(completions)]


def hang(prompts, completions, completion_ids=None, **columns):
    time.sleep(60)
    return [1.0] * len(completions)


def short(prompts, completions, completion_ids=None, **columns):
    return [1.0]


def needs_ids(prompts, completions, completion_ids=None, **columns):
    return [float(len(ids)) + float(a) for ids, a in zip(completion_ids, columns["answer"], strict=True)]


def spec(function, weight=1.0, sandboxed=False, timeout_s=5.0):
    return SimpleNamespace(function=function, weight=weight, sandboxed=sandboxed, timeout_s=timeout_s)


PROMPTS = ["a", "b", "c", "d"]
COMPLETIONS = ["x", "yy", "zzz", "wwww"]
IDS = [[1], [1, 2], [1, 2, 3], [1, 2, 3, 4]]
COLUMNS = {"answer": ["1", "2", "3", "4"]}


def call(prompts=PROMPTS, completions=COMPLETIONS, ids=IDS, columns=COLUMNS):
    return RewardCall(list(prompts), list(completions), ids, columns)

# ---------------------------------------------------------------- built-ins


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("so the answer is 42", "42", 1.0),
        ("The total is 1,000.", "1000", 1.0),
        ("= 1000.0", "1,000", 1.0),
        ("we get \\boxed{\\frac{1}{2}} here", "0.5", 1.0),
        ("\\boxed{$12$} and then 13", "12", 1.0),
        ("first 3 then 7", "7", 1.0),
        ("first 3 then 7", "3", 0.0),
        ("no number at all", "3", 0.0),
        ("x = -2.50", "-2.5", 1.0),
        ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),
        ("it is 50%", "50", 1.0),
        ("answer: 3/4", "0.75", 1.0),
        ("anything", "", None),
    ],
)
def test_math_reward(completion, answer, expected):
    assert math_reward(["q"], [completion], None, answer=[answer]) == [expected]


def test_math_reward_without_answer_column_is_unscored():
    assert math_reward(["q", "q"], ["1", "2"]) == [None, None]


def test_demo_sum_builtin():
    fn = rewards.resolve("demo_sum")
    assert fn(prompts=["3+5=", "3+5="], completions=["8", "9"], completion_ids=None, answer=["8", "8"]) == [1.0, 0.0]


def test_resolve_errors():
    with pytest.raises(ValueError, match="built-in.*a Hub id is .owner/name."):
        rewards.resolve("no_such_reward")  # refused at once: not a folder nor a Hub id, so no Hub lookup
    with pytest.raises(ValueError, match="cannot be imported"):
        rewards.resolve("brigade.recipes.nothing_here:fn")  # an allowed module that is not there
    assert rewards.resolve("test_rewards:good") is good


def test_clean():
    assert clean([1, 2.5, None, True], 4) == [1.0, 2.5, None, 1.0]
    with pytest.raises(RewardRejected, match="returned 1 rewards for 3 completions"):
        clean([1.0], 3)
    with pytest.raises(RewardRejected, match="returned a float"):
        clean(1.0, 1)
    with pytest.raises(RewardRejected, match="reward 1 is nan, not a finite number"):
        clean([1.0, math.nan], 2)
    with pytest.raises(RewardRejected, match="reward 0 is -inf"):
        clean([-math.inf], 1)
    with pytest.raises(RewardRejected, match="reward 0 is a str"):
        clean(["2"], 1)


def test_code_exec_reward(monkeypatch):
    monkeypatch.setattr(reward_builtins, "CODE_WALL_S", 2.0)
    programs = [
        "```python\nprint(sum(range(5)))\n```",          # right
        "print(11)",                                     # wrong output
        "import sys; print(10); sys.exit(3)",            # right output, non-zero exit
        "while True: pass",                              # CPU limit / timeout
        "x = bytearray(2 << 30)\nprint(10)",             # over the memory limit
    ]
    t0 = time.monotonic()
    out = reward_builtins.code_exec_reward(["p"] * 5, programs, None, answer=["10"] * 5)
    assert out == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert time.monotonic() - t0 < 10
    assert reward_builtins.code_exec_reward(["p"], ["print(1)"], None, answer=[None]) == [None]


def test_run_python_timeout_kills_sleeper():
    code, out = reward_builtins.run_python("import time; print('a', flush=True); time.sleep(30)", timeout_s=0.5)
    assert code is None and out == ""


# ---------------------------------------------------------------- combining and containment


def test_scores_total_is_trls_weighted_nansum():
    s = Scores(["a", "b"], [[1.0, None, 2.0, None], [0.5, 1.0, None, None]], [2.0, -1.0])
    assert s.total == [1.5, -1.0, 4.0, None]  # None = "does not apply"; a sample nobody scored stays None
    s.rejected = {"b": "returned 1 rewards for 4 completions"}
    assert s.total == [None] * 4  # a rejected result leaves the batch unscored, not silently partial


async def test_in_process_containment():
    rs = RewardSet.from_specs([spec("test_rewards:good", 0.5), spec("test_rewards:nan_and_inf")])
    s = await rs.score(call())
    assert s.parts[0] == [1.0, 2.0, 3.0, 4.0]
    assert s.parts[1] == [None] * 4 and "not a finite number" in s.rejected["test_rewards:nan_and_inf"]
    assert s.total == [None] * 4 and rs.rejected == 1

    rs = RewardSet.from_specs([spec("test_rewards:good"), spec("test_rewards:boom"), spec("test_rewards:short"),
                               spec("test_rewards:hang", timeout_s=0.3), spec("test_rewards:needs_ids")])
    t0 = time.monotonic()
    s = await rs.score(call(columns={"answer": [1, 2, 3, 4]}))
    assert time.monotonic() - t0 < 5
    assert s.parts[0] == [1.0, 2.0, 3.0, 4.0]
    assert s.parts[1] == s.parts[2] == s.parts[3] == [None] * 4   # raised, wrong length, hung
    assert set(s.rejected) == {"test_rewards:boom", "test_rewards:short", "test_rewards:hang"}
    assert s.parts[4] == [2.0, 4.0, 6.0, 8.0]                     # completion_ids and columns reach it
    assert s.total == [None] * 4


def test_sandboxed_needs_a_queue():
    with pytest.raises(ValueError, match="Redis URL"):
        RewardSet.from_specs([spec("test_rewards:good", sandboxed=True)])


def test_unknown_in_process_function_fails_at_start():
    with pytest.raises(ValueError, match="cannot be imported"):
        RewardSet.from_specs([spec("test_rewards:missing")])


async def test_sandboxed_rewards_are_contained(redis_url, monkeypatch):
    # the rq worker subprocess imports this module by name, like any user reward package
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    sandbox = RqSandbox(redis_url, "brigade:test-sandbox:rewards", start_worker=True)
    rs = RewardSet.from_specs([
        spec("test_rewards:good", sandboxed=True),
        spec("test_rewards:boom", sandboxed=True),
        spec("test_rewards:hang", sandboxed=True, timeout_s=1.0),
        spec("test_rewards:nan_and_inf", sandboxed=True),
        spec("code_exec", sandboxed=True, timeout_s=20),
    ], sandbox)
    try:
        t0 = time.monotonic()
        s = await rs.score(call(completions=["print(1)", "print(2)", "print(4)", "while True: pass"]))
        assert time.monotonic() - t0 < 45  # the 60 s hang was cut off at its 1 s timeout
        assert s.parts[0] == [8.0, 8.0, 8.0, 16.0]
        assert s.parts[1] == s.parts[2] == s.parts[3] == [None] * 4
        assert set(s.rejected) == {"test_rewards:boom", "test_rewards:hang", "test_rewards:nan_and_inf"}
        assert s.parts[4] == [1.0, 1.0, 0.0, 0.0]
        # the rq worker survived its hung job and still serves
        again = await rs.score(call(PROMPTS[:1], ["print(1)"], IDS[:1], {"answer": ["1"]}))
        assert again.parts[0] == [8.0] and again.parts[4] == [1.0]
    finally:
        await rs.close()
    assert sandbox.worker.poll() is not None
