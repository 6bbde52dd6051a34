"""Base model, LoRA and log-probs, shared by the learner, the rollout worker and the evaluator.

Both sides compute token log-probs the same way (explicit position ids from the attention mask,
logits divided by the sampling temperature), so an on-policy rollout scores a ratio of 1.
"""

from __future__ import annotations

import functools
import inspect

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from brigade.mirror import is_bucket_uri, mirror
from brigade.pretrained import from_pretrained
from brigade.v1 import brigade_pb2 as pb

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(spec: pb.RunSpec, device: torch.device) -> torch.dtype:
    """The spec's dtype; `auto` (the default) is bfloat16 on CUDA and float32 on CPU, where bf16
    matmuls are slow and a 135M model's float32 copy is small."""
    if (spec.dtype or "auto") == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[spec.dtype]


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("the run spec asks for device 'cuda' but no CUDA device is visible")
    return torch.device(name)


def resolve_model(name: str) -> str:
    """A path or Hugging Face id that `from_pretrained` can load without a network round trip
    where possible: 'demo' builds (once) the project's demo model, bucket URIs are mirrored into
    the local cache, a GGUF file (or an installed package that ships one) is converted once into a
    cached safetensors folder, folders and hub ids pass through."""
    from brigade.gguf_models import ensure_converted

    if name == "demo":
        from brigade.demo.build import build_demo_model, default_model_dir

        return str(build_demo_model(default_model_dir()))
    if is_bucket_uri(name):
        return str(mirror(name, "models"))
    return ensure_converted(name) or name


def pinned(spec: pb.RunSpec) -> dict:
    """`from_pretrained` arguments every service passes, so all of them load the same weights and
    code: the spec's revision (a later push to the repository changes nothing) and its
    trust_remote_code (off unless the spec says so)."""
    return {"revision": spec.revision or None, "trust_remote_code": spec.trust_remote_code}



def load_tokenizer(spec: pb.RunSpec, path: str | None = None) -> PreTrainedTokenizerBase:
    tokenizer = AutoTokenizer.from_pretrained(path or resolve_model(spec.model), **pinned(spec))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(spec: pb.RunSpec, device: torch.device | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    path = resolve_model(spec.model)
    device = device or pick_device(spec.device)
    tokenizer = load_tokenizer(spec, path)
    # safetensors only: a folder holding pytorch_model.bin would otherwise be unpickled by torch.load
    model = from_pretrained(AutoModelForCausalLM, path, dtype=torch_dtype(spec, device), use_safetensors=True,
                            **pinned(spec)).to(device)
    model.requires_grad_(False)
    return model, tokenizer


def lora_config(spec: pb.RunSpec) -> LoraConfig:
    targets = list(spec.lora.target_modules)
    return LoraConfig(
        r=spec.lora.rank,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules="all-linear" if targets == ["all-linear"] else targets,
        task_type="CAUSAL_LM",
    )


def attach_lora(model: PreTrainedModel, spec: pb.RunSpec) -> PeftModel:
    """Adapter version 0: a freshly initialised LoRA (B = 0, so it equals the base model).
    The init is seeded by the run so every process builds the same v0."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        return get_peft_model(model, lora_config(spec))


@functools.cache
def _forward_takes_logits_to_keep(cls: type) -> bool:
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def _keeps_logits(model: torch.nn.Module) -> bool:
    base = model.get_base_model() if isinstance(model, PeftModel) else model
    return _forward_takes_logits_to_keep(type(base))


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding, so a padded row scores like an unpadded one."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_logprobs(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,        # [N, P] left-padded
    prompt_mask: torch.Tensor,       # [N, P]
    completion_ids: torch.Tensor,    # [N, C] right-padded
    completion_mask: torch.Tensor,   # [N, C]
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Log-probs [N, C] of each completion token under `model`, logits scaled by 1/temperature;
    `with_entropy`: and the policy's entropy [N, C] at each position (no gradient)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)
    # the logit at position t predicts token t+1: only the C positions that predict the completion
    # are needed. Where the model can, it computes just those (plus the last): with a 49k vocabulary
    # and prompts longer than completions, the LM head over every position is most of the memory
    c = completion_ids.shape[1]
    keep = {"logits_to_keep": c + 1} if _keeps_logits(model) else {}
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids(mask), **keep).logits
    logits = logits[:, -(c + 1) : -1, :].float() / temperature
    # gather minus logsumexp: no second [N, C, vocab] tensor, which matters for large vocabularies
    picked = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    logp = (picked - lse) * completion_mask
    if not with_entropy:
        return logp
    with torch.no_grad():  # H = logsumexp - E_p[logit], one more softmax over the vocabulary
        entropy = (lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)) * completion_mask
    return logp, entropy
