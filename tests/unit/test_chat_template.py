"""Conversational prompts go through the model's chat template once, in one function both engines
use: with a real tokenizer and a real Jinja template (built locally, Llama-like: it adds BOS to
whatever it encodes, and its template writes BOS too), no BOS is doubled, the ids are TRL's, and
the ids the hf engine generated from are the ones the learner's data path hands its loss."""

from __future__ import annotations

import asyncio

import pytest
import torch

from brigade import keys
from brigade.bucket import open_bucket
from brigade.chat import ChatTemplateError, prompt_ids, render
from brigade.engine.hf import HFEngine
from brigade.engine.vllm import token_prompts
from brigade.model import attach_lora, completion_logprobs, load_base
from brigade.v1 import brigade_pb2 as pb
from brigade_learner.ingest import fetch
from brigade_rollout.worker import build_rollout
from brigade_testing.tiny import chat_tokenizer, tiny_model, tiny_spec

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("chat") / "model", tokenizer=chat_tokenizer())


def test_messages_render_once_with_one_bos_as_trl_tokenizes_them():
    tok = chat_tokenizer()
    ids = prompt_ids(tok, CHAT)
    assert tok(render(tok, CHAT))["input_ids"][:2] == [tok.bos_token_id] * 2  # the naive way: two BOS
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    # what TRL's GRPOTrainer feeds its generator for the same prompt
    trl_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids == list(trl_ids)
    assert tok.convert_ids_to_tokens(ids)[-1] == "<|assistant|>"  # the generation prompt is open


def test_plain_strings_get_the_tokenizers_bos_and_a_pre_rendered_one_is_kept_single():
    tok = chat_tokenizer()
    assert prompt_ids(tok, "What is 2+2?") == tok("What is 2+2?")["input_ids"]  # TRL: the tokenizer's own BOS
    assert prompt_ids(tok, render(tok, CHAT)) == prompt_ids(tok, CHAT)


def test_conversational_prompt_without_a_template_is_one_clear_error():
    tok = chat_tokenizer()
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        prompt_ids(tok, CHAT)


def test_the_ids_a_worker_generated_from_are_the_ones_the_learner_scores(model_dir, tmp_path):
    spec = tiny_spec(model_dir, sampling={"group_size": 2, "max_new_tokens": 4})
    model, tok = load_base(spec)
    engine = HFEngine(attach_lora(model, spec), tok)
    prompts = [CHAT, "What is 3+4?"]
    samples = engine.generate(prompts, spec.sampling, seed=3, adapter_version=0, should_stop=lambda: False)
    expected = [prompt_ids(tok, p) for p in prompts]
    assert [s.prompt_ids for s in samples] == [expected[0]] * 2 + [expected[1]] * 2
    # the vLLM engine hands vLLM the very same ids (its tokenizer is the model's HF tokenizer)
    assert [t["prompt_token_ids"] for t in token_prompts(tok, prompts)] == expected

    # through the rollout object, the bucket and the learner's ingest path
    lease = pb.Lease(run_id=spec.run_id, batch=pb.PromptBatch(batch_id=f"{spec.run_id}:0:0"), attempt=1,
                     adapter_version=0)
    n = len(samples)
    rollout = build_rollout(lease, samples, [1.0] * n, [[1.0] * n], ["r"], tok.pad_token_id)
    data = rollout.to_bytes()
    key = keys.rollout_key(spec.run_id, lease.batch.batch_id, 1)

    async def learner_side():
        async with open_bucket(tmp_path / "bucket") as bucket:
            digest = await bucket.put_new(key, data)
            manifest = pb.RolloutManifest(run_id=spec.run_id, batch_id=lease.batch.batch_id, attempt=1,
                                          policy_version=0, uri=key, sha256=digest, size_bytes=len(data),
                                          num_samples=n, worker_id="w")
            return (await fetch(bucket, pb.PulledRollout(delivery_id="1-0", manifest=manifest), spec.run_id,
                                len(tok))).rollout

    got = asyncio.run(learner_side())
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(got.prompt_ids, got.prompt_mask, strict=True)]
    assert rows == [s.prompt_ids for s in samples]
    assert all(r.count(tok.bos_token_id) == 1 for r in rows)
    # and the learner's log-probs of those tokens are the engine's behaviour log-probs: ratio 1
    with torch.no_grad():
        learner = completion_logprobs(engine.model, got.prompt_ids, got.prompt_mask.long(), got.completion_ids,
                                      got.completion_mask.long(), spec.sampling.temperature)
    assert torch.allclose(learner, got.logprobs, atol=1e-4)


def test_preflight_renders_a_local_folders_template_without_torch_and_reports_a_broken_one(model_dir, tmp_path):
    """`brigade up`'s task check reads a local folder's template from its files (loading the
    tokenizer imports torch: seconds before the first service starts); a template that does not
    render still fails, with the full tokenizer's error."""
    import json
    import subprocess
    import sys

    from brigade.task import template_problems

    spec = tiny_spec(model_dir)
    code = ("import sys; from brigade.task import template_problems; from brigade.v1 import brigade_pb2 as pb; "
            f"print(template_problems(pb.RunSpec(model={str(model_dir)!r})), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "False"]
    assert template_problems(spec) == []

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in model_dir.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "tokenizer_config.json").read_text())
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    config["chat_template"] = "{% for m in messages %}{{ m.content | no_such_filter }}{% endfor %}"
    (broken / "tokenizer_config.json").write_text(json.dumps(config))
    problems = template_problems(tiny_spec(broken))
    assert len(problems) == 1 and "cannot load its tokenizer" in problems[0], problems
