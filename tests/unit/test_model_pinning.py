"""`revision` and `trust_remote_code` reach every `from_pretrained` a service makes: the base model
and tokenizer (learner, hf engine, evaluator: `brigade.model.load_base`), a reward model, and
vLLM's arguments. The revision is checked against a real HF hub cache holding two commits of one
repository, read offline; trust_remote_code against a folder whose model class is its own code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from brigade.engine.vllm import llm_kwargs
from brigade.model import load_base
from brigade_testing.tiny import tiny_model, tiny_spec

MAIN, PINNED = "a" * 40, "b" * 40


def test_revision_picks_the_commit_every_service_loads(tmp_path):
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    for sha, seed in ((MAIN, 0), (PINNED, 1)):
        shutil.copytree(tiny_model(tmp_path / f"src{seed}", seed=seed), repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    # one process loads every revision: the hub cache's variables are read when transformers loads
    script = textwrap.dedent("""
        import sys
        from brigade.model import load_base
        from brigade.reward_model import RewardModel
        from brigade_testing.tiny import tiny_spec
        for revision in sys.argv[1:]:
            model, tok = load_base(tiny_spec("tiny-org/tiny-llama", revision=revision))
            rm = RewardModel.load("tiny-org/tiny-llama", revision=revision)
            print(float(model.lm_head.weight.sum()), float(rm.model.model.embed_tokens.weight.sum()))
    """)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script, "", PINNED, MAIN], env=env, capture_output=True, text=True,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    default, pinned, main = ([float(x) for x in line.split()] for line in out.stdout.strip().splitlines()[-3:])
    assert default == main != pinned  # empty = the default branch; a pin loads its own commit's weights

    spec = tiny_spec(tmp_path / "src0", revision=PINNED, trust_remote_code=True)
    kw = llm_kwargs(spec, "/m")
    assert (kw["revision"], kw["tokenizer_revision"], kw["trust_remote_code"]) == (PINNED, PINNED, True)
    assert llm_kwargs(tiny_spec(tmp_path / "src0"), "/m")["trust_remote_code"] is False


def test_trust_remote_code_is_off_unless_the_spec_turns_it_on(tmp_path):
    folder = tiny_model(tmp_path / "custom")
    (folder / "custom_llama.py").write_text(textwrap.dedent("""
        from transformers import LlamaConfig, LlamaForCausalLM

        class CustomConfig(LlamaConfig):
            model_type = "custom_llama"

        class CustomForCausalLM(LlamaForCausalLM):
            config_class = CustomConfig
    """))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="custom_llama", architectures=["CustomForCausalLM"],
                  auto_map={"AutoConfig": "custom_llama.CustomConfig",
                            "AutoModelForCausalLM": "custom_llama.CustomForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_base(tiny_spec(folder))
    model, _ = load_base(tiny_spec(folder, trust_remote_code=True))
    assert type(model).__name__ == "CustomForCausalLM"


def test_models_loaded_in_threads_at_once_are_whole(tmp_path):
    """transformers swaps process-wide state while it builds a model (tie_weights a no-op, new
    parameters on the meta device): unguarded, two loads at once left a tied lm_head on the meta
    device in 27 of 30 loads here (the learner loading in a thread while a reward model or a test's
    own sampler loads in another). brigade.model holds one lock over every from_pretrained."""
    import threading

    spec = tiny_spec(tiny_model(tmp_path / "tied", heads=4, tied=True))
    meta: list[str] = []
    errors: list[BaseException] = []

    def load(n: int) -> None:
        try:
            for _ in range(n):
                model, _ = load_base(spec)
                meta.extend(name for name, p in model.named_parameters() if p.is_meta)
        except BaseException as e:  # noqa: BLE001 - a meta tensor makes .to(device) raise
            errors.append(e)

    threads = [threading.Thread(target=load, args=(8,)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not meta, (errors[:1], meta[:3])
