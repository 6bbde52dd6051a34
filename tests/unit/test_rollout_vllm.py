"""The vllm engine's request building, without vLLM or a GPU (tests that need the real classes are
skipped when vllm is not importable)."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from brigade import adapters
from brigade.engine import vllm as ev
from brigade.model import attach_lora, load_base
from brigade_testing.tiny import tiny_model, tiny_spec

HAS_VLLM = importlib.util.find_spec("vllm") is not None


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tiny_model(tmp_path_factory.mktemp("tiny") / "model")
    return tiny_spec(d, run_id="vrun", staleness={"max_staleness": 3}, lora={"target_modules": ["q_proj", "v_proj"]},
                     sampling={"group_size": 6, "temperature": 0.9, "top_p": 0.95, "top_k": 0, "max_new_tokens": 17})


def test_llm_kwargs(spec):
    kw = ev.llm_kwargs(spec, "/models/x")
    assert kw["model"] == "/models/x" and kw["enable_lora"] is True
    assert kw["max_loras"] == 3 + 2            # the staleness window plus one being swapped in
    assert kw["max_lora_rank"] == ev.vllm_lora_rank(spec.lora.rank)
    assert kw["logprobs_mode"] == "processed_logprobs"
    assert kw["dtype"] == "float32"  # the spec says so
    spec.dtype = "auto"  # the default: bf16 on the GPU
    assert ev.llm_kwargs(spec, "/m")["dtype"] == "bfloat16"
    assert "logprobs_mode" not in ev.llm_kwargs(spec, "/m", processed_logprobs=False)


def test_lora_requests_are_fresh_per_version():
    assert ev.lora_request_args("r", 0, "/x") is None   # v0 is the base model (B = 0)
    reqs = [ev.lora_request_args("r", v, f"/a/v{v}") for v in (1, 2, 3)]
    assert [r["lora_name"] for r in reqs] == ["r-v1", "r-v2", "r-v3"]
    assert [r["lora_int_id"] for r in reqs] == [2, 3, 4]
    assert len({r["lora_int_id"] for r in reqs}) == 3 and reqs[0]["lora_path"] == "/a/v1"


def test_sampling_kwargs(spec):
    kws = [ev.sampling_kwargs(spec.sampling, seed=2**63 - 1, index=i) for i in range(3)]
    assert all(k["n"] == 6 and k["max_tokens"] == 17 and k["logprobs"] == 0 for k in kws)
    assert kws[0]["top_k"] == -1 and kws[0]["top_p"] == pytest.approx(0.95)
    assert kws[0]["temperature"] == pytest.approx(0.9)
    seeds = [k["seed"] for k in kws]
    assert len(set(seeds)) == 3 and all(0 <= s < 2**63 for s in seeds)


def test_peft_folder_loads_in_peft(spec, tmp_path):
    """The folder handed to LoRARequest is a PEFT adapter: PeftModel can load it back exactly."""
    from peft import PeftModel

    model, _ = load_base(spec)
    peft_model = attach_lora(model, spec)
    state = {k: torch.randn_like(v) for k, v in adapters.adapter_state(peft_model).items()}
    folder = ev.write_peft_folder(tmp_path / "v00000001", state, ev.peft_config_json(spec))
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == spec.lora.rank and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert set(saved) == set(state) and all(t.dtype == torch.bfloat16 for t in saved.values())
    base, _ = load_base(spec)
    loaded = PeftModel.from_pretrained(base, str(folder))
    got = adapters.adapter_state(loaded)
    assert all(torch.equal(got[k].float(), state[k].to(torch.bfloat16).float()) for k in state)


def test_samples_from_outputs():
    lp = lambda tok, v: {tok: SimpleNamespace(logprob=v)}  # noqa: E731
    outputs = [
        SimpleNamespace(prompt_token_ids=[1, 5, 6], outputs=[
            SimpleNamespace(token_ids=[7, 2], logprobs=[lp(7, -0.5), lp(2, -0.1)]),
            SimpleNamespace(token_ids=[8, 9], logprobs=[lp(8, -1.0), lp(9, -2.0)]),
        ]),
        SimpleNamespace(prompt_token_ids=[1, 4], outputs=[
            SimpleNamespace(token_ids=[2], logprobs=[lp(2, -0.3)]),
            SimpleNamespace(token_ids=[9], logprobs=[lp(9, -0.2)], finish_reason="stop"),    # a stop token
            SimpleNamespace(token_ids=[2], logprobs=[lp(2, -0.2)], finish_reason="length"),
        ]),
    ]
    samples = ev.samples_from_outputs(outputs, eos_token_id=2)
    assert [s.group for s in samples] == [0, 0, 1, 1, 1]
    assert samples[0].prompt_ids == [1, 5, 6] and samples[0].completion_ids == [7, 2]
    assert samples[0].logprobs == [-0.5, -0.1] and samples[0].finished
    assert not samples[1].finished and samples[2].finished
    assert samples[3].finished and not samples[4].finished


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_clear_error_without_vllm(spec):
    with pytest.raises(RuntimeError, match=r"pip install brigade\[vllm\]"):
        ev.VLLMEngine(spec)


@pytest.mark.skipif(not HAS_VLLM, reason="vllm is not installed (pip install brigade[vllm]; needs a CUDA GPU)")
def test_kwargs_build_real_vllm_objects(spec, tmp_path):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(**ev.sampling_kwargs(spec.sampling, 5, 0))
    assert params.n == 6 and params.logprobs == 0
    req = LoRARequest(**ev.lora_request_args("vrun", 4, tmp_path))
    assert req.lora_int_id == 5 and req.lora_name == "vrun-v4"


def test_lora_rank_is_rounded_up_to_one_vllm_serves(spec):
    assert [ev.vllm_lora_rank(r) for r in (1, 2, 8, 9, 12, 16, 17, 64, 200, 300, 320, 321, 512)] == \
        [1, 8, 8, 16, 16, 16, 32, 64, 256, 320, 320, 512, 512]
    spec.lora.rank = 12
    assert ev.llm_kwargs(spec, "/m")["max_lora_rank"] == 16
    with pytest.raises(ValueError, match="above the largest rank vLLM serves"):
        ev.vllm_lora_rank(513)


def test_adapter_folders_outside_the_staleness_window_are_deleted(tmp_path):
    for v in (1, 2, 3, 4, 5):
        ev.version_folder(tmp_path, v).mkdir()
    (tmp_path / "vnotaversion").mkdir()
    assert ev.prune_versions(tmp_path, keep_from=5 - 2) == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v00000003", "v00000004", "v00000005", "vnotaversion"]
    assert ev.prune_versions(tmp_path, keep_from=3) == []
