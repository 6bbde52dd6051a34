"""The run-spec declarations (`brigade.spec`): they match the proto, docs/configuration.md's table comes
from them, the proxy's defaults equal a spec file's, hyperparameters survive the wire exactly, and
errors name fields as a spec file spells them."""

from __future__ import annotations

from pathlib import Path

import pytest

from brigade.config import ConfigError
from brigade.spec import FIELDS, fill_defaults, validate_spec
from brigade.spec_file import build_spec, spec_to_dict
from brigade.spec_table import with_table
from brigade.v1 import brigade_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
SECTION_TYPES = {"": pb.RunSpec, "lora": pb.LoraSpec, "sampling": pb.SamplingSpec, "grpo": pb.GrpoSpec,
                 "staleness": pb.StalenessSpec, "local_sgd": pb.LocalSgdSpec, "rewards[]": pb.RewardSpec,
                 "environment": pb.EnvironmentSpec}


def test_every_proto_field_is_declared_once_and_only_those():
    declared = [(f.section, f.name) for f in FIELDS]
    assert len(declared) == len(set(declared))
    in_proto = {(section, fd.name) for section, message in SECTION_TYPES.items() for fd in message.DESCRIPTOR.fields
                if fd.is_repeated or fd.message_type is None}  # a singular message is a section, not a field
    assert set(declared) == in_proto


def test_a_legal_zero_that_is_not_the_default_has_presence_on_the_wire():
    """The module docstring's rule: otherwise the proxy would turn an explicit 0 into the default."""
    for f in FIELDS:
        fd = SECTION_TYPES[f.section].DESCRIPTOR.fields_by_name[f.name]
        zero = [] if fd.is_repeated else fd.default_value
        if not f.required and zero != f.default and f.problem(zero) is None:
            assert fd.has_presence, f"{f.path}: 0 is legal and not the default, so the proto field must be optional"


def test_configuration_doc_table_is_generated_from_the_declarations():
    doc = (ROOT / "docs/configuration.md").read_text()
    assert with_table(doc) == doc, "docs/configuration.md's run-spec table is stale: run `make docs-tables` and commit"


def test_proxy_defaults_equal_a_spec_files_defaults():
    bare = pb.RunSpec(run_id="exp-1", model="org/model", dataset="prompts.jsonl")
    filled = fill_defaults(bare)
    assert filled == build_spec({"run_id": "exp-1", "model": "org/model", "dataset": "prompts.jsonl"})
    assert not bare.HasField("lora")  # the request is not changed
    assert fill_defaults(filled) == filled
    validate_spec(filled)


def test_proxy_defaults_keep_what_the_client_set():
    spec = pb.RunSpec(run_id="r", model="m", dataset="d", eval_every=0, eval_dataset="", prompts_per_batch=3,
                      grpo=pb.GrpoSpec(eps_low=0.0, max_grad_norm=0.0, learning_rate=3e-5),
                      staleness=pb.StalenessSpec(max_staleness=0), rewards=[pb.RewardSpec(function="math")])
    filled = fill_defaults(spec)
    assert filled.eval_every == 0 and filled.eval_dataset == "" and filled.prompts_per_batch == 3
    assert filled.grpo.eps_low == 0.0 and filled.grpo.max_grad_norm == 0.0 and filled.grpo.learning_rate == 3e-5
    assert filled.grpo.eps_high == 0.28 and filled.staleness.max_staleness == 0
    assert [(r.function, r.weight, r.timeout_s) for r in filled.rewards] == [("math", 1.0, 10.0)]


def test_proxy_defaults_leave_required_fields_to_validation():
    with pytest.raises(ConfigError) as err:
        validate_spec(fill_defaults(pb.RunSpec(rewards=[pb.RewardSpec(weight=2.0)])))
    for field in ("run_id", "model", "dataset", "rewards[0].function"):
        assert f"\n  {field}: is required" in str(err.value)


def test_hyperparameters_read_back_exactly():
    """As proto float, 1e-4 read back as 9.999999747378752e-05."""
    spec = build_spec({"grpo": {"learning_rate": 1e-4, "weight_decay": 0.1}, "sampling": {"temperature": 0.7}})
    wire = pb.RunSpec.FromString(spec.SerializeToString())
    assert wire.grpo.learning_rate == 1e-4 and wire.grpo.weight_decay == 0.1 and wire.sampling.temperature == 0.7
    assert spec_to_dict(wire)["grpo"]["learning_rate"] == 1e-4
    assert build_spec({"grpo": {"learning_rate": "1e-4"}}).grpo.learning_rate == 1e-4  # YAML reads 1e-4 as a string


def test_unknown_keys_are_named_as_written_with_a_suggestion(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("promptsPerBatch: 4\neps_low: 0.1\nnum_generationz: 4\ngrpo:\n  betta: 0.1\n"
                    "rewards:\n  - function: math\n    wieght: 2\n")
    with pytest.raises(ConfigError) as err:
        build_spec(path=path)
    lines = str(err.value).splitlines()[1:]
    assert lines == [
        "  promptsPerBatch: no field named 'promptsPerBatch' here; did you mean 'prompts_per_batch'?",
        "  eps_low: no field named 'eps_low' here; did you mean 'grpo.eps_low'?",
        "  num_generationz: no field named 'num_generationz' here; did you mean 'num_generations'?",  # TRL's name
        "  grpo.betta: no field named 'betta' here; did you mean 'grpo.beta'?",
        "  rewards[0].wieght: no field named 'wieght' here; did you mean 'rewards[0].weight'?",
    ]
    assert "Per" not in str(err.value).replace("promptsPerBatch", "")  # no camelCase of our own
    toml = tmp_path / "run.toml"
    toml.write_text("[grpo]\nlearning_rat = 1e-4\n")
    with pytest.raises(ConfigError, match=r"grpo\.learning_rat: .* did you mean 'grpo\.learning_rate'\?"):
        build_spec(path=toml)


def test_every_unparsable_value_gets_its_own_line():
    with pytest.raises(ConfigError) as err:
        build_spec({"prompts_per_batch": "x", "seed": -1, "lora": {"alpha": "big"}, "sampling": 3, "sync": "yes"})
    fields = [line.split(":")[0].strip() for line in str(err.value).splitlines()[1:]]
    assert fields == ["prompts_per_batch", "seed", "sync", "lora.alpha", "sampling"]


def test_reward_kwargs_are_a_mapping_in_the_file_and_exact_json_on_the_wire():
    import json

    import yaml

    spec = build_spec({"rewards": [{"function": "trl.rewards:get_soft_overlong_punishment",
                                    "kwargs": {"max_completion_len": 512, "soft_punish_cache": 64}}]})
    wire = pb.RunSpec.FromString(spec.SerializeToString())
    assert json.loads(wire.rewards[0].kwargs) == {"max_completion_len": 512, "soft_punish_cache": 64}
    assert isinstance(json.loads(wire.rewards[0].kwargs)["max_completion_len"], int)  # not 512.0
    assert build_spec(yaml.safe_load(yaml.safe_dump(spec_to_dict(spec)))) == spec  # run.yaml reads back
    with pytest.raises(ConfigError, match=r"rewards\[0\].kwargs: '\[1\]' is not a mapping of arguments"):
        build_spec({"rewards": [{"function": "m:f", "kwargs": [1]}]})


def test_topology_local_sgd_refuses_what_its_rounds_replace():
    spec = build_spec({"topology": "local_sgd", "local_sgd": {"local_steps": 2, "outer_optimizer": "nesterov"}})
    assert spec.topology == "local_sgd" and spec.local_sgd.local_steps == 2 and spec.local_sgd.outer_momentum == 0.9
    assert build_spec().topology == "central"
    with pytest.raises(ConfigError) as e:
        build_spec({"topology": "local_sgd", "sync": True, "grpo": {"recompute_logprobs": True},
                    "local_sgd": {"stale_weight": 0.0, "merge": "svd"}})
    lines = str(e.value).splitlines()[1:]
    assert [line.split(":")[0].strip() for line in lines] == [
        "local_sgd.merge", "local_sgd.stale_weight", "sync", "grpo.recompute_logprobs"], lines
