"""No code from the wire: a run spec's reward functions, models and datasets resolve only against
what the executing host allows (brigade.code_policy), and a refused function is never imported."""

from __future__ import annotations

import json

import pytest

from brigade import code_policy
from brigade.code_policy import CodePolicy, check_spec
from brigade.rewards import resolve
from brigade.spec_file import build_spec


@pytest.fixture
def default_host(monkeypatch, tmp_path):
    """A host with the default policy (the test session's BRIGADE_ALLOW_* removed), working in tmp_path."""
    for var in ("BRIGADE_ALLOW_CODE", "BRIGADE_ALLOW_PATHS", "BRIGADE_ALLOW_REMOTE_CODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(tmp_path)
    code_policy.install(None)
    return tmp_path


@pytest.mark.parametrize("function, kwargs", [
    ("subprocess:run", lambda m: {"args": ["touch", m]}),
    ("os:system", lambda m: {"command": f"touch {m}"}),
    ("builtins:eval", lambda m: {"source": f"open({m!r}, 'w')"}),
    ("brigade.reward_builtins:os", lambda m: {}),  # a module an allowed one imported is not allowed by it
])
def test_resolve_refuses_unallowed_code_before_importing_it(default_host, function, kwargs):
    marker = default_host / "marker"
    with pytest.raises(ValueError, match="not allowed on this host|is not a function name|is defined in"):
        resolve(function, json.dumps(kwargs(str(marker))) if kwargs(str(marker)) else "")
    assert not marker.exists()


def test_resolve_refuses_a_function_an_allowed_module_merely_imported(default_host, monkeypatch):
    import subprocess

    import brigade.demo.task as task

    monkeypatch.setattr(task, "run", subprocess.run, raising=False)  # as `from subprocess import run` would
    with pytest.raises(ValueError, match="defined in 'subprocess'"):
        resolve("brigade.demo.task:run", json.dumps({"args": ["true"]}))


def test_allowed_by_default_and_by_the_host(default_host, monkeypatch):
    assert callable(resolve("trl.rewards:get_soft_overlong_punishment", json.dumps({"max_completion_len": 8,
                                                                                    "soft_punish_cache": 2})))
    assert callable(resolve("brigade.recipes.word_problems:correct"))
    assert callable(resolve("demo_sum"))
    with pytest.raises(ValueError, match="not allowed"):
        resolve("json:loads")
    monkeypatch.setenv("BRIGADE_ALLOW_CODE", "json")
    assert callable(resolve("json:loads"))
    monkeypatch.setenv("BRIGADE_ALLOW_CODE", "*")
    assert callable(resolve("textwrap:dedent"))


def spec(**over):
    return build_spec({"model": "demo", "dataset": "demo", "rewards": [{"function": "demo_sum"}], **over})


def test_check_spec_refuses_paths_code_and_remote_code_in_one_line_each(default_host):
    policy = CodePolicy.from_env(bucket="s3://mine/runs")
    assert check_spec(spec(), policy) == []
    assert check_spec(spec(model="HuggingFaceTB/SmolLM2-135M", dataset="data/train.jsonl",
                           rewards=[{"function": "brigade.recipes.word_problems:correct"},
                                    {"function": "trl.rewards:think_format_reward"}]), policy) == []
    (line,) = check_spec(spec(model="/etc"), policy)
    assert line.startswith("model '/etc': outside the folders this host allows")
    (line,) = check_spec(spec(dataset="/etc/passwd.jsonl"), policy)
    assert line.startswith("dataset '/etc/passwd.jsonl'")
    (line,) = check_spec(spec(dataset="../../../../etc/x.jsonl"), policy)
    assert "outside" in line
    (line,) = check_spec(spec(model="s3://theirs/model"), policy)
    assert "not under this host's bucket" in line
    assert check_spec(spec(model="s3://mine/runs/models/m"), policy) == []
    (line,) = check_spec(spec(rewards=[{"function": "subprocess:run", "kwargs": {"args": ["id"]}}]), policy)
    assert line.startswith("rewards[0]: reward function 'subprocess:run': module 'subprocess' is not allowed")
    (line,) = check_spec(spec(trust_remote_code=True), policy)
    assert line.startswith("trust_remote_code:")
    opted_in = CodePolicy.from_env(bucket="s3://mine/runs", environ={"BRIGADE_ALLOW_REMOTE_CODE": "1"})
    assert check_spec(spec(trust_remote_code=True), opted_in) == []


def test_a_wildcard_allows_anything(default_host):
    anything = CodePolicy.from_env(environ={"BRIGADE_ALLOW_CODE": "*", "BRIGADE_ALLOW_PATHS": "*"})
    assert check_spec(spec(model="/etc", dataset="s3://theirs/x.jsonl",
                           rewards=[{"function": "subprocess:run"}]), anything) == []


def test_brigade_up_allows_what_the_local_spec_file_names(default_host):
    s = spec(model="/models/mine", rewards=[{"function": "mymodule:score"}], trust_remote_code=True)
    env = code_policy.local_allowance(s, {})
    assert env == {"BRIGADE_ALLOW_CODE": "mymodule", "BRIGADE_ALLOW_PATHS": "/models/mine",
                   "BRIGADE_ALLOW_REMOTE_CODE": "1"}
    assert check_spec(s, CodePolicy.from_env(environ=env)) == []
