"""TRL's GRPOConfig names in a run spec and in brigade.GRPOConfig: what maps where, the batch
arithmetic, what is refused and why, and what GRPOTrainer sends across the process boundary."""

from __future__ import annotations

from pathlib import Path

import pytest

import brigade
from brigade.config import ConfigError
from brigade.grpo import GRPOTrainer, lora_fields, reward_entries
from brigade.spec_file import build_spec


def top_level_reward(completions, **kwargs):
    return [0.0 for _ in completions]


def test_trl_names_set_brigades_fields():
    spec = build_spec({"num_generations": 4, "max_completion_length": 16, "learning_rate": 3e-4, "beta": 0.04,
                       "epsilon": 0.1, "epsilon_high": 0.3, "loss_type": "dr_grpo", "scale_rewards": False,
                       "num_train_epochs": 2, "save_steps": 3, "eval_steps": 7, "lr_scheduler_type": "cosine",
                       "bf16": True, "use_cpu": True, "logging_steps": 5, "output_dir": "ignored"})
    assert (spec.sampling.group_size, spec.sampling.max_new_tokens) == (4, 16)
    assert (spec.grpo.learning_rate, spec.grpo.beta, spec.grpo.eps_low, spec.grpo.eps_high) == (3e-4, 0.04, 0.1, 0.3)
    assert (spec.grpo.loss_agg, spec.grpo.scale_rewards, spec.grpo.lr_schedule) == ("dr_grpo", "none", "cosine")
    assert (spec.epochs, spec.checkpoint_every, spec.eval_every) == (2, 3, 7)
    assert (spec.dtype, spec.device) == ("bfloat16", "cpu")


def test_trls_batch_arithmetic_becomes_prompts_per_step():
    # 16 completions a device-step x 2 accumulation steps / 4 generations = 8 prompts a learner step
    spec = build_spec({"num_generations": 4, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2})
    assert (spec.prompts_per_batch, spec.batches_per_step) == (8, 1)
    split = build_spec({"num_generations": 4, "per_device_train_batch_size": 16, "gradient_accumulation_steps": 2,
                        "prompts_per_batch": 2})  # brigade's batch given too: the step is 4 leased batches
    assert (split.prompts_per_batch, split.batches_per_step) == (2, 4)
    with pytest.raises(ConfigError, match="not a multiple of num_generations"):
        build_spec({"num_generations": 8, "per_device_train_batch_size": 12})


def test_what_brigade_has_no_equivalent_of_is_refused_with_why_and_defaults_pass():
    with pytest.raises(ConfigError) as e:
        build_spec({"use_vllm": True, "num_iterations": 2, "mask_truncated_completions": True})
    lines = str(e.value).splitlines()
    assert len(lines) == 3 and all("has no brigade equivalent (" in line for line in lines), lines
    assert any("brigade rollout --engine vllm" in line for line in lines)
    # TRL's defaults of the same settings change nothing, so a config copied whole is accepted
    build_spec({"use_vllm": False, "num_iterations": 1, "mask_truncated_completions": False, "delta": None})


def test_a_setting_given_both_ways_with_two_values_is_refused():
    with pytest.raises(ConfigError, match="num_generations: TRL's name for sampling.group_size, which is also given"):
        build_spec({"num_generations": 4, "sampling": {"group_size": 8}})
    assert build_spec({"num_generations": 4, "sampling": {"group_size": 4}}).sampling.group_size == 4


def test_grpo_config_checks_everything_when_made():
    config = brigade.GRPOConfig(output_dir="out", num_generations=4, max_staleness=2, learning_rate=1e-4)
    assert config.num_generations == 4 and config.output_dir == "out"
    assert config.spec_data()["staleness"] == {"max_staleness": 2}
    with pytest.raises(ConfigError, match="num_iterations"):
        brigade.GRPOConfig(num_iterations=4)
    with pytest.raises(ConfigError, match="no field named 'num_generationz'.*did you mean"):
        brigade.GRPOConfig(num_generationz=4)


def test_reward_funcs_cross_as_import_paths_and_what_has_none_is_refused():
    entries, paths = reward_entries([top_level_reward, "trl.rewards:accuracy_reward", "demo_sum"])
    assert entries == [{"function": f"{__name__}:top_level_reward"}, {"function": "trl.rewards:accuracy_reward"},
                       {"function": "demo_sum"}]
    assert len(paths) == 1 and Path(__file__).resolve().is_relative_to(paths[0])  # this module's root

    def closure(completions, **kwargs):
        return [0.0] * len(completions)

    for fn in (lambda completions, **kw: [0.0], closure):
        with pytest.raises(TypeError, match="no import path the services can use"):
            reward_entries([fn])


def test_the_trainer_takes_trls_arguments_and_refuses_objects_it_cannot_send(tmp_path):
    from peft import LoraConfig

    lora = lora_fields(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=["q_proj", "v_proj"]))
    assert lora == {"rank": 8, "alpha": 16.0, "dropout": 0.05, "target_modules": ["q_proj", "v_proj"]}
    with pytest.raises(ConfigError, match="use_dora"):
        lora_fields(LoraConfig(r=8, use_dora=True))
    trainer = GRPOTrainer("demo", [top_level_reward, "demo_sum"], brigade.GRPOConfig(
        output_dir=str(tmp_path / "run"), run_name="t1", reward_weights=[0.5, 1.0], num_generations=4),
        train_dataset=[{"prompt": "1+1=", "answer": "2"}])
    assert trainer.run_id == "t1" and trainer.output_dir == tmp_path / "run"
    assert [r["weight"] for r in trainer.data["rewards"]] == [0.5, 1.0]
    assert trainer.data["eval_every"] == 0  # no eval_dataset: no evaluation, as TRL
    with pytest.raises(TypeError, match="not a Linear object|not a .* object"):
        import torch

        GRPOTrainer(torch.nn.Linear(2, 2), [top_level_reward], train_dataset=[{"prompt": "x"}])
    with pytest.raises(ConfigError, match="reward_weights: 1 weights for 2 reward functions"):
        GRPOTrainer("demo", [top_level_reward, "demo_sum"], brigade.GRPOConfig(reward_weights=[1.0]),
                    train_dataset=[{"prompt": "x"}])


def test_step_metrics_reach_users_under_trls_names():
    from brigade.metric_names import trl_metrics

    m = trl_metrics({"step": 3, "reward_mean": 0.5, "reward_std": 0.4, "reward_group_std": 0.3, "lr": 1e-4,
                     "clip_low_frac": 0.01, "clip_high_frac": 0.02, "tokens_total": 900, "kl": 0.1,
                     "reward/trl.rewards:accuracy_reward/mean": 0.7, "reward/org/reward-model/std": 0.2,
                     "completion_clipped_frac": 0.25, "staleness_mean": 1.0, "rejection_rate": 0.0})
    assert m == {"step": 3, "reward": 0.5, "reward_std_batch": 0.4, "reward_std": 0.3, "learning_rate": 1e-4,
                 "clip_ratio/low_mean": 0.01, "clip_ratio/high_mean": 0.02, "clip_ratio/region_mean": 0.03,
                 "num_tokens": 900, "kl": 0.1, "rewards/accuracy_reward/mean": 0.7, "rewards/reward-model/std": 0.2,
                 "completions/clipped_ratio": 0.25, "staleness_mean": 1.0, "rejection_rate": 0.0}


def test_the_readmes_example_is_brigade_reals_recipe(tmp_path):
    """examples/word_problems.py (the README's TRL-style script) builds the spec `brigade real` runs."""
    import importlib.util

    from brigade.recipes.word_problems import RUN

    path = Path(__file__).resolve().parents[2] / "examples" / "word_problems.py"
    module_spec = importlib.util.spec_from_file_location("word_problems_example", path)
    example = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(example)
    trainer = example.word_problems_trainer(str(tmp_path / "word-problems"))
    spec = build_spec({**trainer.data, "dataset": "demo", "eval_dataset": "demo"})
    recipe = build_spec({**RUN, "dataset": "demo", "eval_dataset": "demo", "run_id": "word-problems"})
    for field in ("sampling", "lora", "staleness", "rewards", "prompts_per_batch", "batches_per_step", "max_steps",
                  "eval_every", "model"):
        assert getattr(spec, field) == getattr(recipe, field), field
    assert spec.grpo.learning_rate == recipe.grpo.learning_rate and trainer.run_id == "word-problems"


def test_a_dataset_object_is_written_once_into_the_runs_bucket(tmp_path):
    import json

    rows = [{"prompt": "1+1=", "answer": 2}]
    trainer = GRPOTrainer("demo", "demo_sum", brigade.GRPOConfig(output_dir=str(tmp_path / "run")), train_dataset=rows)
    uri = trainer._upload("dataset", rows)
    assert uri == f"file://{tmp_path / 'run' / 'bucket'}/runs/run/data/train.jsonl"
    assert json.loads((tmp_path / "run/bucket/runs/run/data/train.jsonl").read_text()) == rows[0]  # types kept
    assert trainer._upload("dataset", rows) == uri  # the same rows again: fine
    with pytest.raises(ConfigError, match="already holds a different runs/run/data/train.jsonl"):
        trainer._upload("dataset", [{"prompt": "2+2=", "answer": 4}])


class TopLevelEnv:
    def reset(self, **row):
        return None

    def get_reward(self) -> float:
        return 1.0


def test_trls_tools_and_environment_factory_become_the_environment_section(tmp_path):
    spec = build_spec({"tools": ["brigade.recipes.missing_number:final_answer_format"],
                       "environment_factory": "brigade.recipes.missing_number:Hint", "max_tool_calling_iterations": 3})
    assert list(spec.environment.tools) == ["brigade.recipes.missing_number:final_answer_format"]
    assert (spec.environment.factory, spec.environment.max_turns) == ("brigade.recipes.missing_number:Hint", 4)
    several = build_spec({"environment_factory": {"a": "brigade.recipes.missing_number:Hint"}})
    assert '"a"' in several.environment.factories and not several.environment.factory
    with pytest.raises(ConfigError, match="give one"):
        build_spec({"max_tool_calling_iterations": 1, "environment": {"max_turns": 5}})
    # GRPOTrainer: the class goes as its import path; the environment's get_reward may be the only reward
    trainer = GRPOTrainer(model="demo", args=brigade.GRPOConfig(output_dir=str(tmp_path / "run")),
                          train_dataset="demo", environment_factory=TopLevelEnv, tools=[top_level_reward])
    env = trainer.data["environment"]
    assert env["factory"] == "test_trl_names:TopLevelEnv" and env["tools"] == ["test_trl_names:top_level_reward"]
    assert trainer.data["rewards"] == []
    assert str(Path(__file__).parent) in trainer.pythonpath
