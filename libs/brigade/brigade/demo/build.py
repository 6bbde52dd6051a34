"""Build the demo's base model: a tiny Llama with a character-level tokenizer that knows
single-digit addition but, asked plainly, only answers right about a third of the time.

Pre-training data is a mixture of two kinds of text (TAG is never in a demo prompt):

    <bos>#3+5=8<eos>    tagged: always the right answer
    <bos>3+5=7<eos>     plain: right with probability PLAIN_CORRECT, else a near miss (c±1, c±2)

So the skill is in the weights, and sampling the plain prompt at temperature 1 is right ~35% of
the time. GRPO then has to do what it does on real models: elicit a behaviour the base model
already has. That is a shared direction (act as if tagged), so a small LoRA finds it in a few
dozen noisy steps and the gain carries over to heldout prompts. Without the tag (the noisy
mixture alone) the model memorises 100 separate answer distributions, and LoRA fixes them one
prompt at a time: far too slow for the demo, and nothing transfers.

Greedy decoding is right ~90% of the time (the right answer is the mode), so measure progress
with sampled accuracy. Built once per parameter set and cached (build.json).

    python -m brigade.demo.build [--out DIR] [--force]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from brigade.demo.task import (
    BOS,
    EOS,
    PAD,
    UNK,
    all_problems,
    default_model_dir,
    demo_reward,
    load_prompts,
    prompt_text,
)
from brigade.mirror import build_lock

BUILD_VERSION = 2  # bump when the recipe below changes, so old caches are rebuilt
MARKER = "build.json"
TAG = "#"
CHARS = "0123456789+-= " + TAG
PLAIN_CORRECT = 0.4
MODEL_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=32,
    tie_word_embeddings=True,
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    # tokenizer("3+5=") -> [<bos>, 3, +, 5, =], like the usual Llama tokenizers
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        padding_side="left",  # decoder-only generation pads on the left
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
    )


def answer_distribution(a: int, b: int, tagged: bool) -> dict[str, float]:
    """The pre-training target for one prompt: {answer: probability}."""
    c = a + b
    if tagged:
        return {str(c): 1.0}
    near = [x for x in (c - 2, c - 1, c + 1, c + 2) if 0 <= x <= 18]
    return {str(c): PLAIN_CORRECT} | {str(x): (1 - PLAIN_CORRECT) / len(near) for x in near}


def pretraining_rows(tokenizer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every distinct pre-training sequence once (right-padded ids, completion mask) and its
    probability under the mixture (problem uniform, tagged half the time)."""
    rows, masks, weights = [], [], []
    for a, b in all_problems():
        for tagged in (False, True):
            prompt = tokenizer((TAG if tagged else "") + prompt_text(a, b))["input_ids"]
            for ans, p in answer_distribution(a, b, tagged).items():
                completion = tokenizer(ans, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                rows.append(prompt + completion)
                masks.append([0] * len(prompt) + [1] * len(completion))
                weights.append(p)
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float)
    return ids, mask, torch.tensor(weights)


def pretrain(model, ids, mask, weights, *, steps: int, lr: float, batch_size: int, seed: int) -> float:
    """Plain LM training on minibatches drawn from the mixture, loss on completion tokens only.
    Small sampled batches reach the two-mode solution in far fewer FLOPs than full-batch steps."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        idx = torch.multinomial(weights, batch_size, replacement=True, generator=gen)
        x, m = ids[idx], mask[idx, 1:]
        # no attention mask needed: padding is on the right and causal attention never looks ahead
        logits = model(input_ids=x).logits[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:], reduction="none")
        loss = (nll * m).sum() / batch_size
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    model.eval()
    return loss.item()


@torch.no_grad()
def measure_accuracy(model, tokenizer, prompts: list[dict], *, samples: int = 8, temperature: float = 1.0,
                     max_new_tokens: int = 4, seed: int = 0) -> float:
    """Mean demo_reward over `samples` completions per prompt (temperature 0: greedy, one each)."""
    torch.manual_seed(seed)
    greedy = temperature == 0
    samples = 1 if greedy else samples
    texts = [p["text"] for p in prompts for _ in range(samples)]
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, do_sample=not greedy, temperature=None if greedy else temperature, top_p=None, top_k=None,
        max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
    )
    completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    rewards = demo_reward(texts, completions, answer=[p["answer"] for p in prompts for _ in range(samples)])
    return sum(rewards) / len(rewards)


def files_sha256(folder: str | Path) -> str:
    """One hash over every file of a build except the marker."""
    h = hashlib.sha256()
    for f in sorted(Path(folder).iterdir()):
        if f.is_file() and f.name != MARKER:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def read_marker(out_dir: str | Path) -> dict | None:
    try:
        return json.loads((Path(out_dir) / MARKER).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def build_demo_model(out_dir: str | Path | None = None, *, force: bool = False, steps: int = 1000,
                     lr: float = 1e-2, batch_size: int = 128, seed: int = 0) -> Path:
    """Build (or reuse) the demo model in out_dir (default: default_model_dir()) and return it.
    A second call with the same parameters finds build.json and returns at once."""
    out = Path(out_dir) if out_dir is not None else default_model_dir()
    params = dict(version=BUILD_VERSION, steps=steps, lr=lr, batch_size=batch_size, seed=seed,
                  plain_correct=PLAIN_CORRECT, config=MODEL_CONFIG)
    with build_lock(out):
        marker = read_marker(out)
        if not force and marker is not None and marker.get("params") == params:
            return out

        t0 = time.monotonic()
        threads = torch.get_num_threads()
        # One thread: the model is tiny, and on a shared 2-core machine a second thread spins
        # against the other processes and runs ~10x slower, not 2x faster.
        torch.set_num_threads(1)
        try:
            torch.manual_seed(seed)
            tokenizer = build_tokenizer()
            config = LlamaConfig(
                vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **MODEL_CONFIG,
            )
            model = LlamaForCausalLM(config)
            loss = pretrain(model, *pretraining_rows(tokenizer), steps=steps, lr=lr, batch_size=batch_size,
                            seed=seed)
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            heldout = load_prompts("heldout")
            tagged = [dict(p, text=TAG + p["text"]) for p in heldout]
            stats = dict(
                final_loss=round(loss, 4),
                heldout_accuracy_sampled=measure_accuracy(model, tokenizer, heldout, samples=32, seed=seed),
                heldout_accuracy_greedy=measure_accuracy(model, tokenizer, heldout, temperature=0),
                heldout_accuracy_tagged=measure_accuracy(model, tokenizer, tagged, samples=32, seed=seed),
            )
        finally:
            torch.set_num_threads(threads)

        # write a fresh temporary folder and swap it in, so a crash never leaves a half-built cache
        tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        # the generic class name, so transformers 4.x (and vLLM images that pin it) load it too
        tok_config = tmp / "tokenizer_config.json"
        tok_config.write_text(json.dumps(json.loads(tok_config.read_text()) | {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2))
        info = dict(params=params, **stats, build_seconds=round(time.monotonic() - t0, 1),
                    sha256=files_sha256(tmp))
        (tmp / MARKER).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
        return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build the brigade demo base model (cached).")
    ap.add_argument("--out", type=Path, default=None, help=f"output folder (default {default_model_dir()})")
    ap.add_argument("--force", action="store_true", help="rebuild even if a matching build is cached")
    args = ap.parse_args(argv)
    out = build_demo_model(args.out, force=args.force)
    # measure again from disk, which is what every service loads
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    heldout = load_prompts("heldout")
    sampled = measure_accuracy(model, tokenizer, heldout, samples=32)
    greedy = measure_accuracy(model, tokenizer, heldout, temperature=0)
    print(f"demo model: {out}")
    print(f"base accuracy on heldout: sampled (T=1) {sampled:.3f}, greedy {greedy:.3f}")
    print(json.dumps(read_marker(out), indent=2))


if __name__ == "__main__":
    main()
