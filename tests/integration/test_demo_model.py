"""The demo's base model, task and reward: built once into the shared cache (the folder every service
of the system tests loads it from, so the ~30 s build is paid once per session, by whichever test
comes first), loaded back like every service loads it, partly competent, cached, LoRA-ready, and
able to climb under GRPO."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from brigade.demo import build
from brigade.demo.task import (
    DEMO_LORA,
    DEMO_LR,
    DEMO_SAMPLING,
    SPLITS,
    demo_reward,
    load_prompts,
    make_splits,
)

# the tiny model runs faster on one thread, and much faster on a busy machine (conftest's fixture)
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir():
    return build.build_demo_model()


@pytest.fixture(scope="module")
def loaded(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)


def test_loads_from_disk(model_dir, loaded):
    model, tok = loaded
    assert model.config.model_type == "llama"
    assert tok("3+5=")["input_ids"] == [tok.bos_token_id, *tok.convert_tokens_to_ids(list("3+5="))]
    assert tok.decode(tok("12+7=")["input_ids"], skip_special_tokens=True) == "12+7="
    assert (tok.eos_token_id, tok.pad_token_id, tok.padding_side) == (model.config.eos_token_id, 0, "left")
    assert build.read_marker(model_dir)["sha256"] == build.files_sha256(model_dir)


def test_build_is_cached(model_dir):
    before = build.files_sha256(model_dir), (model_dir / build.MARKER).stat().st_mtime_ns
    t0 = time.monotonic()
    assert build.build_demo_model(model_dir) == model_dir
    assert time.monotonic() - t0 < 2
    assert (build.files_sha256(model_dir), (model_dir / build.MARKER).stat().st_mtime_ns) == before


def test_default_model_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("BRIGADE_CACHE", str(tmp_path))
    assert build.default_model_dir() == tmp_path / "demo-model"


def test_base_model_is_partly_right(loaded):
    model, tok = loaded
    heldout = load_prompts("heldout")
    sampled = build.measure_accuracy(model, tok, heldout, samples=32, seed=0)
    assert 0.15 <= sampled <= 0.6, sampled
    # the skill is in the weights: with the pre-training tag it answers right
    tagged = [dict(p, text=build.TAG + p["text"]) for p in heldout]
    assert build.measure_accuracy(model, tok, tagged, samples=8, seed=0) >= 0.9


def test_lora_grpo_climbs(loaded):
    """A bare on-policy GRPO loop with the demo's LoRA settings must lift the sampled reward."""
    base, tok = loaded
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(**DEMO_LORA))  # injects LoRA into the shared model in place
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=DEMO_LR, weight_decay=0.0)
    train, G = load_prompts("train"), DEMO_SAMPLING["group_size"]
    rewards = []
    try:
        _grpo_steps(model, tok, opt, train, G, rewards)
    finally:
        model.unload()  # leave the shared fixture model as it was
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last >= 0.75 and last - first >= 0.25, (first, last)


def _grpo_steps(model, tok, opt, train, G, rewards, steps=40):
    for step in range(steps):
        batch = [train[(step * 8 + i) % len(train)] for i in range(8)]
        texts = [p["text"] for p in batch for _ in range(G)]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=None, top_k=None,
                                 max_new_tokens=DEMO_SAMPLING["max_new_tokens"], pad_token_id=tok.pad_token_id)
        plen, comp = enc["input_ids"].shape[1], out[:, enc["input_ids"].shape[1]:]
        is_eos = comp == tok.eos_token_id
        mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).float()  # up to and including the first eos
        r = torch.tensor(demo_reward(texts, tok.batch_decode(comp, skip_special_tokens=True),
                                     answer=[p["answer"] for p in batch for _ in range(G)])).view(-1, G)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        attn = torch.cat([enc["attention_mask"], mask.long()], 1)
        logits = model(input_ids=out, attention_mask=attn).logits[:, plen - 1:-1]
        logp = torch.log_softmax(logits, -1).gather(-1, comp[..., None]).squeeze(-1)
        loss = -(logp * adv * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        rewards.append(r.mean().item())


def test_reward():
    prompts = ["3+5="] * 7
    completions = ["8", " 8\n", "8<eos><pad><pad>", "<bos>8<eos>9", "9", "", "08"]
    assert demo_reward(prompts, completions, answer=["8"] * 7) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert demo_reward(["1+1=", "9+9="], ["2", "18"], [[7, 2], [4, 11, 2]], answer=["2", None]) == [1.0, None]
    assert demo_reward(["1+1="], ["2"]) == [None]  # no answer column: nothing to score
    with pytest.raises(ValueError):
        demo_reward(["1+1=", "1+1="], ["2", "2"], answer=["2"])


def test_prompt_splits():
    splits = {s: load_prompts(s) for s in SPLITS}
    texts = {s: {p["text"] for p in rows} for s, rows in splits.items()}
    assert not texts["train"] & texts["heldout"]
    assert splits == make_splits()  # the shipped files are exactly what make_splits() writes
    assert len(texts["train"]) == len(splits["train"]) == 80 and len(texts["heldout"]) == 20
    for row in splits["train"] + splits["heldout"]:
        a, b = row["text"].rstrip("=").split("+")
        assert row["answer"] == str(int(a) + int(b)) and row["id"] == f"add-{a}-{b}"
    load_prompts("train")[0]["text"] = "changed"
    assert load_prompts("train") == splits["train"]  # callers get copies
    with pytest.raises(ValueError):
        load_prompts("test")


def test_task_is_torch_free():
    code = "import sys, brigade.demo; brigade.demo.load_prompts(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
