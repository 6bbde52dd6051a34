"""The hf engine: behaviour log-probs agree with the learner's numerics, sampling is reproducible,
generation stops cooperatively, and the adapter served is the one asked for; and the slow-device
wrapper that benchmarks and tests put around it."""

from __future__ import annotations

import time

import pytest
import torch

from brigade import adapters
from brigade.engine.base import Stopped, WrongAdapter
from brigade.engine.hf import HFEngine
from brigade.model import attach_lora, completion_logprobs, load_base, position_ids
from brigade_testing.slow_engine import SlowEngine
from brigade_testing.tiny import tiny_model, tiny_spec

PROMPTS = ["1+2=", "13+4=", "9=", "0+0+0+0+1="]  # different lengths: left padding matters


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def make_engine(model_dir, **sampling):
    spec = tiny_spec(model_dir, sampling={"max_new_tokens": 8, **sampling})
    model, tokenizer = load_base(spec)
    # sampling settings in the checkpoint's generation config must not leak into generation
    model.generation_config.top_k = 2
    model.generation_config.repetition_penalty = 3.0
    model.generation_config.min_new_tokens = 4
    return HFEngine(attach_lora(model, spec), tokenizer), spec


def perturbed_state(engine, seed=1, scale=0.3):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) * scale for k, v in adapters.adapter_state(engine.model).items()}


def pack(samples, pad):
    p = max(len(s.prompt_ids) for s in samples)
    c = max(len(s.completion_ids) for s in samples)
    pi = torch.tensor([[pad] * (p - len(s.prompt_ids)) + s.prompt_ids for s in samples])
    pm = torch.tensor([[0] * (p - len(s.prompt_ids)) + [1] * len(s.prompt_ids) for s in samples])
    ci = torch.tensor([s.completion_ids + [pad] * (c - len(s.completion_ids)) for s in samples])
    cm = torch.tensor([[1] * len(s.completion_ids) + [0] * (c - len(s.completion_ids)) for s in samples])
    lp = torch.tensor([s.logprobs + [0.0] * (c - len(s.logprobs)) for s in samples])
    return pi, pm, ci, cm, lp


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_learner_numerics(model_dir, temperature):
    engine, spec = make_engine(model_dir, temperature=temperature)
    engine.load_adapter(1, perturbed_state(engine))  # a non-trivial adapter, not just the base model
    samples = engine.generate(PROMPTS, spec.sampling, seed=7, adapter_version=1, should_stop=lambda: False)
    assert len(samples) == len(PROMPTS) * spec.sampling.group_size
    assert [s.group for s in samples] == [g for g in range(len(PROMPTS)) for _ in range(spec.sampling.group_size)]
    pi, pm, ci, cm, lp = pack(samples, engine.tokenizer.pad_token_id)
    assert pm.sum(1).min() < pm.sum(1).max()  # some rows really are padded
    with torch.no_grad():
        ref = completion_logprobs(engine.model, pi, pm, ci, cm, temperature)
    assert torch.allclose(lp, ref, atol=1e-4), (lp - ref).abs().max()
    for s in samples:  # completions end at eos or at max_new_tokens, never beyond
        eos = engine.tokenizer.eos_token_id
        assert (s.completion_ids[-1] == eos) == s.finished
        assert eos not in s.completion_ids[:-1] and len(s.completion_ids) <= spec.sampling.max_new_tokens


def test_logprobs_are_of_the_processed_distribution(model_dir):
    """With top-k and top-p, the log-prob is under the renormalised distribution actually sampled."""
    temperature, top_k, top_p = 0.8, 6, 0.9
    engine, spec = make_engine(model_dir, temperature=temperature, top_k=top_k, top_p=top_p)
    samples = engine.generate(PROMPTS, spec.sampling, seed=3, adapter_version=0, should_stop=lambda: False)
    pi, pm, ci, cm, lp = pack(samples, engine.tokenizer.pad_token_id)
    ids, mask = torch.cat([pi, ci], 1), torch.cat([pm, cm], 1)
    with torch.no_grad():
        logits = engine.model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits
    logits = logits[:, pi.shape[1] - 1 : -1].float() / temperature
    kth = logits.topk(top_k, -1).values[..., -1:]
    logits = logits.masked_fill(logits < kth, float("-inf"))
    # top-p: drop the tail whose cumulative probability (ascending) is <= 1 - top_p, as HF does
    sorted_logits, order = logits.sort(-1)
    tail = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
    tail[..., -1] = False
    logits = logits.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    ref = logits.log_softmax(-1).gather(-1, ci.unsqueeze(-1)).squeeze(-1)
    ref = torch.where(cm.bool(), ref, 0.0)  # padding may sit outside the top-k: -inf there
    assert torch.allclose(lp, ref, atol=1e-4), (lp - ref).abs().max()
    assert torch.isfinite(lp).all()


def test_checkpoint_stop_tokens_are_kept(model_dir):
    """Chat checkpoints list several eos ids in generation_config.json: each one ends a completion."""
    spec = tiny_spec(model_dir, sampling={"max_new_tokens": 12})
    model, tok = load_base(spec)
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")]
    model.generation_config.eos_token_id = stops
    engine = HFEngine(attach_lora(model, spec), tok)
    samples = engine.generate(PROMPTS, spec.sampling, 0, 0, lambda: False)
    assert any(s.completion_ids[-1] != tok.eos_token_id and s.finished for s in samples)
    for s in samples:
        assert not set(s.completion_ids[:-1]) & set(stops)
        assert s.finished == (s.completion_ids[-1] in stops)


def test_same_seed_same_completions(model_dir):
    engine, spec = make_engine(model_dir)
    run = lambda seed: engine.generate(PROMPTS, spec.sampling, seed, 0, lambda: False)  # noqa: E731
    a, b, c = run(11), run(11), run(12)
    assert [s.completion_ids for s in a] == [s.completion_ids for s in b]
    assert [s.logprobs for s in a] == [s.logprobs for s in b]
    assert [s.completion_ids for s in a] != [s.completion_ids for s in c]
    # a fresh engine (another process, another attempt at the same batch) samples the same
    fresh, _ = make_engine(model_dir)
    assert [s.completion_ids for s in fresh.generate(PROMPTS, spec.sampling, 11, 0, lambda: False)] == \
        [s.completion_ids for s in a]
    # chunking rows (memory bound) keeps groups in order
    fresh.max_rows = 3
    chunked = fresh.generate(PROMPTS, spec.sampling, 11, 0, lambda: False)
    assert [s.group for s in chunked] == [s.group for s in a]


def test_should_stop_ends_generation_within_a_token(model_dir):
    engine, spec = make_engine(model_dir, max_new_tokens=40)
    calls = []

    def should_stop():
        calls.append(1)
        return len(calls) >= 3   # one check before the chunk, then one per generated token

    with pytest.raises(Stopped):
        engine.generate(PROMPTS, spec.sampling, 0, 0, should_stop)
    assert len(calls) == 3       # 2 tokens generated, not 40


def test_adapter_versions_are_never_mixed(model_dir):
    engine, spec = make_engine(model_dir)
    base = engine.generate(PROMPTS, spec.sampling, 5, 0, lambda: False)
    engine.load_adapter(3, perturbed_state(engine, scale=2.0))
    with pytest.raises(WrongAdapter):
        engine.generate(PROMPTS, spec.sampling, 5, 0, lambda: False)
    v3 = engine.generate(PROMPTS, spec.sampling, 5, 3, lambda: False)
    assert [s.logprobs for s in v3] != [s.logprobs for s in base]
    engine.load_adapter(0, None)  # back to the fresh LoRA: exactly the v0 samples again
    assert [s.logprobs for s in engine.generate(PROMPTS, spec.sampling, 5, 0, lambda: False)] == \
        [s.logprobs for s in base]
    bad = {k: v[:1] for k, v in perturbed_state(engine).items()}
    with pytest.raises(adapters.InvalidAdapter):
        engine.load_adapter(4, bad)
    with pytest.raises(WrongAdapter):  # a failed load claims no version at all
        engine.generate(PROMPTS, spec.sampling, 5, 0, lambda: False)


class _SlowStub:
    name, tokenizer, version = "stub", None, 0

    def generate(self, prompts, sampling, seed, adapter_version, should_stop):
        time.sleep(0.1)
        return ["done"]


def test_slow_engine_is_slower_and_still_stoppable():
    sleeps = []
    slow = SlowEngine(_SlowStub(), factor=4.0, sleep=lambda s: (sleeps.append(s), time.sleep(s)))
    t0 = time.monotonic()
    assert slow.generate([], None, 0, 0, lambda: False) == ["done"]
    assert time.monotonic() - t0 >= 0.39 and sum(sleeps) >= 0.28  # ~3 x the real 0.1 s on top
    assert max(sleeps) <= 0.05                                     # in slices: stop is checked often
    flag = {"stop": False}
    slow.factor = 1000.0                                           # would sleep 100 s
    slow._sleep = lambda s: (time.sleep(s), flag.update(stop=True))
    t0 = time.monotonic()
    with pytest.raises(Stopped):
        slow.generate([], None, 0, 0, lambda: flag["stop"])
    assert time.monotonic() - t0 < 2
    assert slow.name == "stub" and slow.version == 0
