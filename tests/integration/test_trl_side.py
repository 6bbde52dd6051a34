"""The TRL side of `brigade bench real` (brigade_bench.trl_side): TRL's GRPOTrainer, in its own
process, trains the real model on the recipe for two steps with the spec's settings mapped onto
GRPOConfig; the LoRA states its callback saved carry brigade's adapter key names and shapes, and a
saved state scores on the held-out problems exactly as the same weights published and read back the
brigade way (bucket, sha256, decode).

Tiny settings (2 prompts x 2 completions of 4 tokens, LoRA rank 4 on q/v, 4 held-out prompts, one
sample each): the point is the plumbing on the real model, not learning. Slow: TRL's import and the
model load in a fresh process, then two steps, take one to five minutes on a shared 2-core machine.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("trl")

TINY = {"max_steps": 2, "prompts_per_batch": 2, "sampling": {"group_size": 2, "max_new_tokens": 4},
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trl_states_load_into_brigade_and_score_as_the_same_weights_published(tmp_path, one_torch_thread):
    import torch

    from brigade import adapters
    from brigade.bucket import open_bucket
    from brigade.engine.hf import HFEngine
    from brigade.spec_file import build_spec
    from brigade_bench.trl_side import grpo_config, load_state, train_rows, trl_run
    from brigade_cli.real import final_adapter, heldout_accuracy, write_recipe

    spec_path = write_recipe(tmp_path / "recipe", "trl-side", TINY)
    spec = build_spec(path=str(spec_path))
    heldout = tmp_path / "heldout4.jsonl"  # scoring is not what is tested: 4 held-out prompts will do
    heldout.write_text("".join(Path(spec.eval_dataset).read_text().splitlines(keepends=True)[:4]))
    spec.eval_dataset = str(heldout)
    config = grpo_config(spec, tmp_path)
    assert (config.per_device_train_batch_size, config.num_generations, config.max_completion_length) == (4, 2, 4)
    assert (config.loss_type, config.scale_rewards, config.beta, config.reward_weights) == ("dapo", "group", 0.0,
                                                                                             [1.0, 0.25])
    rows = train_rows(spec)
    assert rows[0]["prompt"][0]["role"] == "system" and rows[0]["answer"] == rows[0]["a"] + rows[0]["b"]

    r = trl_run(spec_path, tmp_path / "trl", {1, 2}, threads=1)
    assert r["exit"] == 0 and r["steps"] == 2, (tmp_path / "trl" / "trl.log").read_text()[-3000:]
    assert set(r["published_s"]) == {1, 2} and 0 < r["published_s"][1] < r["published_s"][2] <= r["wall_s"]

    state = load_state(tmp_path / "trl", 2)
    engine = HFEngine.from_spec(spec)
    v0 = adapters.adapter_state(engine.model)
    assert set(state) == set(v0) and all(state[k].shape == v0[k].shape for k in v0)  # brigade's own key names
    assert any(not torch.equal(state[k], v0[k].float()) for k in v0 if "lora_B" in k)  # TRL's steps moved it

    async def publish() -> None:  # as the learner publishes a version
        async with open_bucket(f"file://{tmp_path / 'bucket'}") as bucket:
            files, _ = adapters.encode(state, adapters.adapter_config_json(engine.model), "bf16")
            await adapters.write_version(bucket, "trl-side", 2, 2, files, "bf16")

    asyncio.run(publish())
    published = final_adapter(f"file://{tmp_path / 'bucket'}", "trl-side", 2)
    assert all(torch.equal(published[k], state[k]) for k in state)
    saved = heldout_accuracy(spec, {2: state}, samples=1, engine=engine)[2]
    assert heldout_accuracy(spec, {2: published}, samples=1, engine=engine)[2] == saved
