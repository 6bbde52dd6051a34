"""The contract plumbing: generated protobuf code, run spec validation, settings precedence, cost."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from brigade.config import ConfigError
from brigade.keys import batch_id, batch_seed, eval_seed, parse_batch_id
from brigade.settings import REDIS_URL, RUN, TOKEN, command
from brigade.spec_file import build_spec, read_spec_file, spec_to_dict
from brigade_cli.cost import advantage, break_even_discount

ROOT = Path(__file__).resolve().parents[2]


def test_generated_protobuf_code_is_up_to_date(tmp_path):
    """`make proto` output is committed; regenerating must give the same bytes."""
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-I", str(ROOT / "proto"), f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", str(ROOT / "proto/brigade/v1/brigade.proto")]
    subprocess.run(cmd, check=True)
    for name in ("brigade_pb2.py", "brigade_pb2.pyi", "brigade_pb2_grpc.py"):
        fresh = (tmp_path / "brigade/v1" / name).read_bytes()
        committed = (ROOT / "libs/brigade/brigade/v1" / name).read_bytes()
        assert fresh == committed, f"libs/brigade/brigade/v1/{name} is stale: run `make proto` and commit"


def test_spec_defaults_and_file_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("run_id: exp-1\nsampling:\n  group_size: 4\ngrpo:\n  beta: 0.05\n")
    spec = build_spec(path=path)
    assert spec.run_id == "exp-1"
    assert spec.sampling.group_size == 4
    assert spec.sampling.temperature == 1.0  # untouched default survives a partial section
    assert spec.grpo.beta == pytest.approx(0.05)
    toml = tmp_path / "run.toml"
    toml.write_text('run_id = "exp-2"\n[lora]\nrank = 8\n')
    assert build_spec(path=toml).lora.rank == 8
    assert spec_to_dict(build_spec(path=toml))["lora"]["rank"] == 8


def test_spec_errors_name_every_bad_field():
    with pytest.raises(ConfigError) as err:
        build_spec({"run_id": "Bad Id", "grpo": {"loss_agg": "sum", "eps_low": 1.5}, "sampling": {"group_size": 1}})
    text = str(err.value)
    for field in ("run_id", "grpo.loss_agg", "grpo.eps_low", "sampling.group_size"):
        assert field in text
    with pytest.raises(ConfigError, match="no field named"):
        build_spec({"eps_low": 0.1})  # grpo's field at the top level (TRL's learning_rate is a name there now)
    with pytest.raises(ConfigError, match="beta"):
        build_spec({"grpo": {"beta": float("nan")}})
    with pytest.raises(ConfigError, match="finite"):
        build_spec({"grpo": {"tis_cap": "Infinity"}})


def test_spec_file_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        read_spec_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        read_spec_file(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        read_spec_file(listy)


def test_reward_entries_get_defaults():
    spec = build_spec({"rewards": [{"function": "math", "weight": 2.0}]})
    assert spec.rewards[0].timeout_s == 10.0 and spec.rewards[0].weight == 2.0


def test_settings_precedence(monkeypatch):
    """A flag beats its BRIGADE_* variable, which beats the default (brigade.settings.command)."""
    monkeypatch.setenv("BRIGADE_REDIS_URL", "redis://env:1/0")
    monkeypatch.setenv("BRIGADE_RUN", "from-env")
    monkeypatch.delenv("BRIGADE_TOKEN", raising=False)

    @dataclass
    class Shared:
        redis_url: str = REDIS_URL.field()
        run: str = RUN.field()
        token: str = TOKEN.field()

    got: list[Shared] = []
    app = typer.Typer()
    app.command()(command(Shared)(got.append))
    result = CliRunner().invoke(app, ["--run", "from-flag"])
    assert result.exit_code == 0, result.output
    s = got[0]
    assert s.redis_url == "redis://env:1/0"
    assert s.run == "from-flag"
    assert s.token == ""


def test_batch_ids_and_seeds():
    bid = batch_id("run-a", 2, 17)
    assert parse_batch_id(bid) == ("run-a", 2, 17)
    with pytest.raises(ValueError, match="malformed"):
        parse_batch_id("run-a:x:1")
    assert batch_seed(0, bid, 1) == batch_seed(0, bid, 1)
    assert batch_seed(0, bid, 1) != batch_seed(0, bid, 2)
    assert 0 <= batch_seed(0, bid, 3) < 2**63


def test_batch_seeds_follow_the_spec_seed_not_the_run_id():
    """Two runs of one spec (different run ids) draw the same samples; another seed draws others,
    and so does every other epoch, index and attempt."""
    a, b = batch_id("run-a", 2, 17), batch_id("run-b", 2, 17)
    assert batch_seed(5, a, 1) == batch_seed(5, b, 1)
    seeds = {batch_seed(seed, batch_id("r", epoch, index), attempt)
             for seed in (0, 1, 2**64 - 1) for epoch in (0, 1) for index in (0, 1, 17) for attempt in (1, 2, 3)}
    assert len(seeds) == 3 * 2 * 3 * 3 and all(0 <= s < 2**63 for s in seeds)
    # the fields are separated before hashing: epoch 1 index 11 is not epoch 11 index 1
    assert batch_seed(1, batch_id("r", 1, 11), 1) != batch_seed(1, batch_id("r", 11, 1), 1)
    # the evaluator's seeds come from the same seed, per version, and are never a batch's
    evals = {eval_seed(seed, v) for seed in (0, 1) for v in range(4)}
    assert len(evals) == 8 and not evals & seeds and eval_seed(3, 2) == eval_seed(3, 2)
    with pytest.raises(TypeError, match="not str 'run-a'"):  # the old first argument, the run id
        batch_seed("run-a", a, 1)


def test_cost_matches_the_essay():
    assert advantage(0.70, 0.15, 1.5) == pytest.approx(1.889, abs=1e-3)
    assert advantage(0.60, 0.15, 1.5) == pytest.approx(1.417, abs=1e-3)
    assert advantage(0.80, 0.15, 1.5) == pytest.approx(2.833, abs=1e-3)
    assert break_even_discount(0.15, 1.5) == pytest.approx(0.433, abs=1e-3)


def test_cost_cli_prints_json():
    out = subprocess.run([sys.executable, "-m", "brigade_cli.main", "cost", "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["advantage"] == pytest.approx(1.889, abs=1e-3)
    bad = subprocess.run([sys.executable, "-m", "brigade_cli.main", "cost", "--discount", "1.5"], capture_output=True, text=True)
    assert bad.returncode != 0 and "discount" in bad.stderr
