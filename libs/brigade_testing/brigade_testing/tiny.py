"""One tiny random Llama and one run spec for it, for the tests and benchmarks (never in an image).

The demo's character tokenizer (no download, no training) with a few-thousand-parameter model, so
generate -> score -> upload and train -> checkpoint -> publish run in milliseconds on a CPU.
`make_rollout` and `scored_rollout` make rollouts without a rollout worker: behaviour log-probs
come from `brigade.model.completion_logprobs`, the function the worker uses, so a rollout made
with the learner's current weights is exactly on-policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from brigade.model import completion_logprobs, position_ids
from brigade.rollout_format import Rollout
from brigade.spec_file import build_spec, merge_spec_data
from brigade.v1 import brigade_pb2 as pb


def tiny_model(out: str | Path, *, seed: int = 0, hidden: int = 32, layers: int = 2, heads: int = 2,
               intermediate: int = 64, max_positions: int = 64, vocab: int | None = None, tied: bool = False,
               eos_boost: float = 4.0, tokenizer=None) -> Path:
    """Save a random LlamaForCausalLM + the demo tokenizer (or `tokenizer`) under `out` (reused if present).
    `vocab` may exceed the tokenizer's (a bigger output layer for benchmarks); `tied` shares the
    input embedding with the output layer; `eos_boost` scales eos's output row, because a random
    init hardly ever emits eos and completions of varied lengths need it (1 = as initialised)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from brigade.demo.build import build_tokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tok = tokenizer or build_tokenizer()
    tok.model_max_length = max_positions
    config = LlamaConfig(
        vocab_size=max(vocab or 0, len(tok)), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=tied,
    )
    with torch.random.fork_rng(devices=[]):  # the same weights for a seed, whatever ran before
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    if eos_boost != 1.0:
        with torch.no_grad():
            model.lm_head.weight[tok.eos_token_id] *= eos_boost
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %} <|{{ m['role'] }}|> {{ m['content'] }} {{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %} <|assistant|>{% endif %}"
)
CHAT_WORDS = ("<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>", "Be", "brief.", "What", "is", "2+2?",
              "3+4?", "4", "7", "The", "answer", "yes", "no")


def chat_tokenizer():
    """A word-level tokenizer with a real Jinja chat template, built here (nothing downloaded). Like
    Llama's, it adds BOS to any text it encodes and its template writes BOS too: tokenizing a
    rendered template the naive way gives two."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", *CHAT_WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", padding_side="left")
    out.chat_template = CHAT_TEMPLATE
    return out


def tiny_spec(model_dir: str | Path, run_id: str = "tiny", **overrides: Any) -> pb.RunSpec:
    """A validated run spec for the tiny model: float32 on CPU, small LoRA, short completions, one
    epoch of prompts, no evaluation. `overrides` are merged into it (nested dicts key by key)."""
    base = {
        "run_id": run_id, "model": str(model_dir), "dtype": "float32", "device": "cpu", "seed": 7,
        "lora": {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["all-linear"]},
        "sampling": {"group_size": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6},
        "grpo": {"learning_rate": 1e-2, "micro_batch_tokens": 4096, "loss_agg": "dapo"},
        "prompts_per_batch": 2, "batches_per_step": 1, "epochs": 1, "eval_every": 0,
    }
    return build_spec(merge_spec_data(base, overrides))


def demo_prompts(n: int) -> list[pb.Prompt]:
    from brigade.demo.task import load_prompts

    rows = load_prompts("train")[:n]
    return [pb.Prompt(id=r["id"], text=r["text"], columns={"answer": r["answer"]}) for r in rows]


def encode_prompts(tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer.padding_side = "left"
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


@torch.no_grad()
def sample(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int, temperature: float,
           eos_id: int, pad_id: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ancestral sampling (no KV cache: tiny models, short completions). Right-padded
    completions with mask 1 up to and including the first eos."""
    was_training = model.training
    model.eval()
    ids, mask = prompt_ids, prompt_mask
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)).logits[:, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=generator)
        out.append(nxt)
        ids = torch.cat([ids, nxt], 1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    model.train(was_training)
    completion = torch.cat(out, 1)
    done_before = torch.cumsum((completion == eos_id).long(), 1) - (completion == eos_id).long()
    cmask = (done_before == 0).long()
    return torch.where(cmask.bool(), completion, torch.full_like(completion, pad_id)), cmask


@torch.no_grad()
def make_rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, run: str, batch_id: str,
                 attempt: int, version: int, group_size: int, max_new_tokens: int, temperature: float = 1.0,
                 seed: int = 0, eos_id: int = 2, pad_id: int = 0, target_token: int = 5) -> Rollout:
    """`group_size` samples per prompt row, behaviour log-probs from `model`, and a reward that
    differs within a group: the fraction of completion tokens equal to `target_token`, plus a
    length part."""
    g = torch.Generator().manual_seed(seed)
    p_ids = prompt_ids.repeat_interleave(group_size, 0)
    p_mask = prompt_mask.repeat_interleave(group_size, 0)
    c_ids, c_mask = sample(model, p_ids, p_mask, max_new_tokens, temperature, eos_id, pad_id, g)
    was_training = model.training
    model.eval()
    logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask, temperature)
    model.train(was_training)
    lengths = c_mask.sum(1).clamp(min=1).float()
    hits = ((c_ids == target_token) & c_mask.bool()).sum(1).float() / lengths
    short = 1.0 - lengths / max_new_tokens
    parts = torch.stack([hits, short], 1)
    return Rollout(
        run_id=run, batch_id=batch_id, attempt=attempt, policy_version=version,
        prompt_ids=p_ids, prompt_mask=p_mask.to(torch.int8), completion_ids=c_ids,
        completion_mask=c_mask.to(torch.int8), logprobs=logprobs.float(), rewards=parts.sum(1),
        reward_parts=parts, group=torch.arange(prompt_ids.shape[0], dtype=torch.int32).repeat_interleave(group_size),
        reward_names=["target", "short"],
    )


@torch.no_grad()
def scored_rollout(model, *, run: str, batch_id: str, version: int, prompts: int, group_size: int,
                   prompt_len: int, completion_len: int, vocab: int, seed: int = 0,
                   logprob_noise: float = 0.05) -> Rollout:
    """Random tokens with real behaviour log-probs from `model` (one forward, no sampling loop:
    cheap enough for benchmark-sized models). Completions end at random lengths; the noise on the
    log-probs makes ratios differ from 1 the way a slightly stale or mismatched engine would."""
    g = torch.Generator().manual_seed(seed)
    n = prompts * group_size
    p_ids = torch.randint(3, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group_size, 0)
    p_mask = torch.ones_like(p_ids)
    c_ids = torch.randint(3, vocab, (n, completion_len), generator=g)
    lengths = torch.randint(completion_len // 2, completion_len + 1, (n, 1), generator=g)
    c_mask = (torch.arange(completion_len).unsqueeze(0) < lengths).long()
    c_ids = c_ids * c_mask
    was_training = model.training
    model.eval()
    logprobs = completion_logprobs(model, p_ids, p_mask, c_ids, c_mask)
    model.train(was_training)
    logprobs = (logprobs + logprob_noise * torch.randn(logprobs.shape, generator=g)) * c_mask
    rewards = torch.rand(n, generator=g).round()
    return Rollout(
        run_id=run, batch_id=batch_id, attempt=1, policy_version=version, prompt_ids=p_ids,
        prompt_mask=p_mask.to(torch.int8), completion_ids=c_ids, completion_mask=c_mask.to(torch.int8),
        logprobs=logprobs.float(), rewards=rewards, reward_parts=rewards.unsqueeze(1).clone(),
        group=torch.arange(prompts, dtype=torch.int32).repeat_interleave(group_size), reward_names=["coin"],
    )
