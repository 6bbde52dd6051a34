"""One GRPO step on a real (tiny) transformers model with a real PEFT adapter."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from brigade import adapters
from brigade.bucket import open_bucket
from brigade_learner.ingest import drop_nonfinite
from brigade_learner.trainer import Trainer, micro_batches
from brigade_testing.tiny import make_rollout, tiny_model, tiny_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = torch.tensor([[0, 1, 6, 13, 7, 12], [1, 8, 13, 9, 12, 4]])  # left-padded ids of the char tokenizer
PROMPT_MASK = (PROMPTS != 0).long()




@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model", heads=4, tied=True, eos_boost=1.0)


def rollout(trainer: Trainer, version: int = 0, seed: int = 0, batch: str = "tiny:0:0"):
    spec = trainer.spec
    return make_rollout(trainer.model, PROMPTS, PROMPT_MASK, run=spec.run_id, batch_id=batch, attempt=1,
                        version=version, group_size=spec.sampling.group_size,
                        max_new_tokens=spec.sampling.max_new_tokens, temperature=spec.sampling.temperature, seed=seed)


def lora_params(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in adapters.adapter_state(trainer.model).items()}


def test_on_policy_batch_has_ratio_exactly_one_and_kl_zero_before_the_first_step(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir, grpo={"beta": 0.05}))
    m = trainer.train_step([rollout(trainer)])
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0 and m["ratio_mean"] == pytest.approx(1.0, abs=1e-9)
    assert m["clip_low_frac"] == 0.0 and m["clip_high_frac"] == 0.0
    assert m["kl"] == 0.0  # the adapter starts at B = 0: the policy IS the reference
    assert m["skipped_nonfinite"] == 0 and m["grad_norm"] > 0
    # only adapter parameters train
    assert all(("lora_" in n) == p.requires_grad for n, p in trainer.model.named_parameters())
    # after a step the policy has moved: a second on-policy batch now has KL > 0, ratio still 1
    m2 = trainer.train_step([rollout(trainer, seed=1)])
    assert m2["ratio_min"] == 1.0 and m2["ratio_max"] == 1.0 and m2["kl"] > 0


def test_stale_batch_engages_the_clip_around_the_behaviour_policy(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir, grpo={"learning_rate": 0.05, "max_grad_norm": 0.0, "tis_cap": 0}))
    old = rollout(trainer, version=0)
    for seed in range(4):  # move the policy away from the one that generated `old`
        trainer.train_step([rollout(trainer, version=seed, seed=seed + 10)])
    m = trainer.train_step([old])
    assert m["ratio_min"] < 0.8 or m["ratio_max"] > 1.28
    assert m["clip_low_frac"] + m["clip_high_frac"] > 0


def test_the_decoupled_default_trains_on_a_stale_batch_with_bounded_weights(model_dir):
    """The default objective clips around the learner's own policy, so staleness clips nothing (every
    token keeps its gradient); the lag is corrected by importance weights, truncated at tis_cap."""
    trainer = Trainer.create(tiny_spec(model_dir, grpo={"learning_rate": 0.05, "max_grad_norm": 0.0}))
    assert trainer.spec.grpo.tis_cap == 3.0
    old = rollout(trainer, version=0)
    for seed in range(4):
        trainer.train_step([rollout(trainer, version=seed, seed=seed + 10)])
    before = lora_params(trainer)
    m = trainer.train_step([old])
    assert m["clip_low_frac"] == m["clip_high_frac"] == 0
    assert m["is_weight_mean"] != pytest.approx(1.0, abs=1e-3) and 0 <= m["is_weight_capped_frac"] < 1
    after = lora_params(trainer)
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_nonfinite_samples_are_dropped_with_a_counted_reason(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir))
    r = rollout(trainer)
    r.rewards[0] = float("nan")
    r.logprobs[1, 0] = float("nan")
    r.logprobs[2, -1] = float("inf")  # even on a padding position it would poison 0 * x
    r.rewards[3] = float("-inf")
    clean, dropped = drop_nonfinite(r)
    assert dropped == {"nonfinite_reward": 2, "nonfinite_logprob": 2}
    assert clean.num_samples == r.num_samples - 4
    assert torch.isfinite(clean.rewards).all() and torch.isfinite(clean.logprobs).all()
    m = trainer.train_step([clean])
    assert math.isfinite(m["loss"]) and m["skipped_nonfinite"] == 0
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_nonfinite_gradient_skips_the_update_and_never_produces_nan_parameters(model_dir):
    # clipped around the behaviour policy, whose absurd log-probs overflow the ratio (the default's
    # weight is truncated, so it stays finite)
    trainer = Trainer.create(tiny_spec(model_dir, grpo={"tis_cap": 0}))
    r = rollout(trainer)
    r.logprobs[:] = -1e30 * r.completion_mask  # finite, but the ratios overflow to inf
    r.rewards[:] = torch.arange(r.num_samples, dtype=torch.float32)
    before = lora_params(trainer)
    m = trainer.train_step([r])
    assert m["skipped_nonfinite"] == 1
    after = lora_params(trainer)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert all(torch.isfinite(v).all() for s in trainer.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


@pytest.mark.parametrize("agg", ["grpo", "dapo", "dr_grpo"])
def test_micro_batches_accumulate_to_the_full_batch_step(model_dir, agg):
    spec_full = tiny_spec(model_dir, grpo={"loss_agg": agg, "micro_batch_tokens": 100000})
    spec_micro = tiny_spec(model_dir, grpo={"loss_agg": agg, "micro_batch_tokens": 30})
    full, micro = Trainer.create(spec_full), Trainer.create(spec_micro)
    rollouts = [rollout(full, seed=3), rollout(full, seed=4, batch="tiny:0:1")]
    assert len(micro_batches(rollouts, 30)) > len(rollouts)  # really split
    m_full, m_micro = full.train_step(rollouts), micro.train_step(rollouts)
    assert m_micro["micro_batches"] > m_full["micro_batches"]
    assert m_micro["loss"] == pytest.approx(m_full["loss"], abs=1e-6)
    assert m_micro["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)
    # Adam divides by sqrt(v): near-zero gradients amplify float rounding, hence atol, not equality
    a, b = lora_params(full), lora_params(micro)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=2e-5, rtol=1e-4)


def _sgd(trainer: Trainer) -> Trainer:
    """The trainer with plain SGD at lr 1: a step moves each parameter by exactly minus its gradient."""
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    trainer.optimizer = torch.optim.SGD(params, lr=1.0)
    trainer.scheduler = torch.optim.lr_scheduler.LambdaLR(trainer.optimizer, lambda s: 1.0)
    return trainer


def _every_row(monkeypatch) -> None:
    """Make the learner run every row, as it did before it left out zero-advantage ones."""
    import brigade_learner.trainer as trainer_module

    run_all = trainer_module.micro_batches
    monkeypatch.setattr(trainer_module, "micro_batches", lambda rollouts, budget, advantages=None: run_all(
        rollouts, budget))


@pytest.mark.parametrize("agg", ["grpo", "dapo", "dr_grpo"])
def test_zero_advantage_rows_are_not_run_and_the_step_is_the_same(model_dir, monkeypatch, agg):
    spec = tiny_spec(model_dir, grpo={"loss_agg": agg, "max_grad_norm": 0.0, "micro_batch_tokens": 30})
    skipping, every = _sgd(Trainer.create(spec)), _sgd(Trainer.create(spec))
    r = rollout(skipping, seed=3)
    r.rewards[: spec.sampling.group_size] = 0.5  # the first group's rewards all agree: advantage 0
    m_skip = skipping.train_step([r])
    _every_row(monkeypatch)
    m_all = every.train_step([r])
    assert m_all["trained_frac"] == 1.0 and 0 < m_skip["trained_frac"] < 1
    assert m_skip["loss"] == pytest.approx(m_all["loss"], abs=1e-7)
    assert m_skip["grad_norm"] == pytest.approx(m_all["grad_norm"], rel=1e-5)
    a, b = lora_params(skipping), lora_params(every)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_a_step_whose_advantages_are_all_zero_runs_no_row_but_still_steps_adam(model_dir, monkeypatch):
    """With nothing to learn, Adam's moments still decay and move the weights, as they would have
    on the zero gradient that running every row computes."""
    spec = tiny_spec(model_dir)
    skipping, every = Trainer.create(spec), Trainer.create(spec)
    first = rollout(skipping, seed=3)
    flat = rollout(skipping, seed=4, batch="tiny:1:0")
    flat.rewards[:] = 1.0
    skipping.train_step([first])
    before = lora_params(skipping)
    m = skipping.train_step([flat])
    assert m["trained_frac"] == 0 and m["micro_batches"] == 0 and m["grad_norm"] == 0
    _every_row(monkeypatch)
    every.train_step([first])
    every.train_step([flat])
    a, b = lora_params(skipping), lora_params(every)
    assert any(not torch.equal(before[k], a[k]) for k in a)  # momentum moved them
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


def test_micro_batches_keep_only_the_columns_their_rows_fill_within_the_budget(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir, sampling={"max_new_tokens": 12}))
    r = rollout(trainer, seed=5)
    r.completion_mask[0, 2:] = 0  # one short completion, so lengths differ
    prompt_len, completion_len = r.prompt_mask.sum(1), r.completion_mask.sum(1)
    advantages = torch.ones(r.num_samples)
    advantages[1] = 0
    chunks = micro_batches([r], 40, [advantages])
    rows = torch.cat([mb.rows for mb in chunks]).tolist()
    assert sorted(rows) == [i for i in range(r.num_samples) if i != 1]  # each once, the zero one left out
    for mb in chunks:
        width = r.prompt_ids.shape[1] - mb.prompt_from + mb.completion_to
        assert len(mb.rows) == 1 or len(mb.rows) * width <= 40
        assert (prompt_len[mb.rows] <= r.prompt_ids.shape[1] - mb.prompt_from).all()
        assert (completion_len[mb.rows] <= mb.completion_to).all()
        assert int(completion_len[mb.rows].max()) == mb.completion_to  # no column of padding only
    lengths = [int((prompt_len + completion_len)[mb.rows].max()) for mb in chunks]
    assert lengths == sorted(lengths)  # short rows share micro-batches

async def test_recompute_logprobs_scores_the_generating_version_with_the_learner_numerics(model_dir, tmp_path):
    spec = tiny_spec(model_dir, grpo={"recompute_logprobs": True, "tis_cap": 2.0})
    learner = Trainer.create(spec)
    learner.train_step([rollout(learner)])  # fp32 weights now differ from v0
    files, _ = learner.adapter_files("bf16")
    async with open_bucket(f"file://{tmp_path}/bucket") as bucket:
        await adapters.write_version(bucket, spec.run_id, 1, 1, files, "bf16")
        _, read = await adapters.read_version(bucket, spec.run_id, 1)
    v1 = adapters.decode(read)
    # a "worker" generates with v1 as published (bf16-rounded), on its own copy of the model
    worker = Trainer.create(spec)
    adapters.apply(worker.model, v1)
    r = rollout(worker, version=1, seed=5)
    before = lora_params(learner)
    prox = learner.proximal_logprobs([r], micro_batches([r], 4096), {1: v1})[0]
    after = lora_params(learner)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the learner's own weights are back
    torch.testing.assert_close(prox, r.logprobs, atol=1e-5, rtol=0)  # the same policy, the learner's numerics
    m = learner.train_step([r], {1: v1})
    assert m["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    # ratios are against the recomputed v1: the fp32 learner is one bf16 rounding away from it
    assert abs(m["ratio_mean"] - 1.0) < 1e-2


def test_tis_without_recompute_weights_against_the_engine(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir, grpo={"tis_cap": 1.5}))
    r = rollout(trainer)
    r.logprobs -= 0.5 * r.completion_mask  # the "engine" thought these tokens were less likely
    m = trainer.train_step([r])
    # weight = min(exp(learner - engine), cap) = min(e^0.5, 1.5) = 1.5 on every token
    assert m["is_weight_mean"] == pytest.approx(1.5)
    assert m["ratio_min"] == 1.0 and m["ratio_max"] == 1.0


def test_int8_payload_reports_its_quantization_error(model_dir):
    trainer = Trainer.create(tiny_spec(model_dir, adapter_payload="int8"))
    trainer.train_step([rollout(trainer)])
    files, err = trainer.adapter_files("int8")
    assert 0 < err < 0.05
    bf16, _ = trainer.adapter_files("bf16")
    assert len(files[adapters.WEIGHTS_INT8]) < len(bf16[adapters.WEIGHTS])
    decoded = adapters.decode(files)
    state = adapters.adapter_state(trainer.model)
    for k, v in state.items():
        assert (decoded[k] - v).abs().max() <= v.abs().max() / 127 + 1e-7
    # the learner's own weights stay float32
    assert all(v.dtype == torch.float32 for v in state.values())


def test_an_episodes_environment_tokens_are_context_and_never_train(model_dir):
    """Only a completion's first token is the model's here: with a causal model its log-prob depends
    on the prompt alone, so if the environment's tokens after it trained nothing, the step equals
    the step on that one token."""
    spec = tiny_spec(model_dir, environment={"factory": "brigade.recipes.missing_number:Hint"})
    first = Trainer.create(spec)
    r = rollout(first)
    width = r.completion_ids.shape[1]
    env = torch.zeros_like(r.completion_mask)
    env[:, 1:] = r.completion_mask[:, 1:]
    episode = dataclasses.replace(r, env_mask=env, logprobs=r.logprobs * (1 - env))
    one_token = dataclasses.replace(r, completion_ids=r.completion_ids[:, :1], completion_mask=r.completion_mask[:, :1],
                                    logprobs=r.logprobs[:, :1])
    assert width > 1 and int(env.sum()) > 0
    m = first.train_step([episode])
    second = Trainer.create(spec)
    m1 = second.train_step([one_token])
    assert m["completion_tokens"] == m1["completion_tokens"] == r.num_samples
    assert m["loss"] == pytest.approx(m1["loss"], abs=1e-6)
    for (name, a), b in zip(lora_params(first).items(), lora_params(second).values(), strict=True):
        assert torch.allclose(a, b, atol=1e-6), name
