"""A published adapter version, downloaded from the bucket and loaded with
PeftModel.from_pretrained in a fresh process, computes the learner's logits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from brigade import adapters, keys
from brigade.bucket import open_bucket
from brigade_learner import checkpoint
from brigade_learner.checkpoint import LearnerState
from brigade_learner.trainer import Trainer
from brigade_testing.tiny import make_rollout, tiny_model, tiny_spec

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = torch.tensor([[0, 1, 6, 13, 7, 12], [1, 8, 13, 9, 12, 4]])
PROBE = torch.tensor([[1, 5, 13, 6, 12, 7, 8, 2], [1, 9, 13, 9, 12, 10, 8, 2]])

LOADER = textwrap.dedent("""
    import sys, torch
    from peft import PeftModel
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(1)
    base_dir, probe, out = sys.argv[1], sys.argv[2], sys.argv[3]
    from safetensors.torch import load_file
    ids = load_file(probe)["ids"]
    result = {}
    for name, folder in zip(sys.argv[4::2], sys.argv[5::2]):
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, folder).eval()
        with torch.no_grad():
            result[name] = model(input_ids=ids).logits.contiguous()
    save_file(result, out)
""")




@torch.no_grad()
def logits(trainer: Trainer) -> torch.Tensor:
    trainer.model.eval()
    return trainer.model(input_ids=PROBE).logits


async def test_published_adapter_loads_in_a_fresh_process_with_peft(tmp_path, file_bucket_url):
    model_dir = tiny_model(tmp_path / "model", heads=4, tied=True, eos_boost=1.0)
    spec = tiny_spec(model_dir, grpo={"learning_rate": 0.05})
    trainer = Trainer.create(spec)
    base_logits = logits(trainer)
    for i in range(3):
        r = make_rollout(trainer.model, PROMPTS, (PROMPTS != 0).long(), run=spec.run_id, batch_id=f"tiny:0:{i}",
                         attempt=1, version=i, group_size=4, max_new_tokens=6, seed=i)
        trainer.train_step([r])
    learner_logits = logits(trainer)

    async with open_bucket(file_bucket_url) as bucket:
        files, _ = trainer.adapter_files("bf16")
        await adapters.write_version(bucket, spec.run_id, 3, 3, files, "bf16")
        await checkpoint.save(bucket, spec.run_id, 3, checkpoint.encode(trainer, LearnerState(step=3, version=3)))
        # download the version folder as a consumer would, checked against its manifest
        _, published = await adapters.read_version(bucket, spec.run_id, 3)
        ckpt = await checkpoint.load_files(bucket, spec.run_id, 3)
        assert sorted(await bucket.list(keys.adapter_prefix(spec.run_id, 3))) == [
            keys.adapter_prefix(spec.run_id, 3) + n for n in ("adapter_config.json", "adapter_model.safetensors",
                                                               "manifest.pb")]
    bf16_dir = tmp_path / "v3"
    bf16_dir.mkdir()
    for name, data in published.items():
        (bf16_dir / name).write_bytes(data)
    # the checkpoint's full-precision adapter, as a PEFT folder too
    fp32_dir = tmp_path / "ckpt"
    fp32_dir.mkdir()
    (fp32_dir / "adapter_model.safetensors").write_bytes(ckpt[checkpoint.ADAPTER])
    (fp32_dir / "adapter_config.json").write_bytes(ckpt[checkpoint.CONFIG])

    save_file({"ids": PROBE}, tmp_path / "probe.safetensors")
    out = tmp_path / "logits.safetensors"
    subprocess.run([sys.executable, "-c", LOADER, str(model_dir), str(tmp_path / "probe.safetensors"), str(out),
                    "bf16", str(bf16_dir), "fp32", str(fp32_dir)], check=True, timeout=120)
    fresh = load_file(out)

    # full precision: exactly the learner's state
    assert torch.equal(fresh["fp32"], learner_logits)
    # bf16 payload: within bf16 rounding of the learner, while training moved the logits far more
    moved = (learner_logits - base_logits).abs().max().item()
    off = (fresh["bf16"] - learner_logits).abs().max().item()
    assert moved > 0.05 and off < max(2e-2 * moved, 1e-3), (moved, off)
    torch.testing.assert_close(fresh["bf16"], learner_logits, atol=2e-2 * moved, rtol=1e-2)
    # and exactly what the learner computes with the payload's weights applied
    adapters.apply(trainer.model, adapters.decode(published))
    assert torch.allclose(fresh["bf16"], logits(trainer), atol=1e-6, rtol=0)
