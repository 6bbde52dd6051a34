"""A tiny random Llama and a run spec for it: what the rollout tests and benchmark run on.

The demo's character tokenizer (no download, no training) with a few-thousand-parameter model, so
the whole generate -> score -> upload path runs in milliseconds on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from brigade.spec_file import build_spec
from brigade.v1 import brigade_pb2 as pb

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=2, max_position_embeddings=64)


def tiny_model(out: str | Path, seed: int = 0, **config: Any) -> Path:
    """Save a random LlamaForCausalLM + the demo tokenizer under `out` (reused if present)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from brigade.demo.build import build_tokenizer

    out = Path(out)
    if (out / "config.json").exists():
        return out
    tok = build_tokenizer()
    tok.model_max_length = 64
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **(TINY | config))
    model = LlamaForCausalLM(cfg)
    # a random init hardly ever emits eos; raise its logit so completions have varied lengths
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] *= 4
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_spec(model_dir: str | Path, run_id: str = "tiny", **overrides: Any) -> pb.RunSpec:
    base = {
        "run_id": run_id, "model": str(model_dir), "device": "cpu", "dtype": "float32",
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "sampling": {"group_size": 4, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 6},
        "prompts_per_batch": 2, "epochs": 1, "eval_every": 0,
    }
    return build_spec(_merge(base, overrides))


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
    return out


def demo_prompts(n: int) -> list[pb.Prompt]:
    from brigade.demo.task import load_prompts

    rows = load_prompts("train")[:n]
    return [pb.Prompt(id=r["id"], text=r["text"], columns={"answer": r["answer"]}) for r in rows]
