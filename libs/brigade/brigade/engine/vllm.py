"""The `vllm` engine: the production rollout engine on a CUDA GPU (`pip install brigade[vllm]`).

How it maps brigade onto vLLM:

- one `LLM(model, enable_lora=True, max_loras=adapter_slots(spec), max_lora_rank=..., ...)` per
  worker: enough adapter slots for every version still inside the staleness window plus the one
  being swapped in, so a swap never evicts a version a queued request still needs. vLLM accepts
  only some ranks (`VLLM_LORA_RANKS`), so the spec's rank is rounded up to the next one (a rank-12
  adapter fits a rank-16 slot); `dtype: auto` is bfloat16;
- every adapter version gets a fresh `LoRARequest(f"{run}-v{version}", version + 1, path)`: vLLM
  caches adapters by integer id and keys its prefix cache by name, so a reused name or id would
  serve stale weights. Version 0 is the base model (a fresh LoRA has B = 0), so it needs none;
- the adapter is written to a local folder in PEFT format (adapter_model.safetensors +
  adapter_config.json), which is what `LoRARequest`'s path expects, whichever payload (bf16 or
  int8) it arrived in; folders of versions older than the staleness window are deleted as each
  new version is written (no lease can name them any more), so a long run does not fill the disk;
- `SamplingParams(n=G, seed=..., temperature, top_p, top_k, max_tokens, logprobs=0)` per prompt,
  with `logprobs_mode="processed_logprobs"` on the engine where vLLM has it, so the returned
  log-probs are of the distribution actually sampled (after temperature, top-k, top-p), as the
  learner's ratio expects. Older vLLM returns raw log-probs; that is logged at start;
- prompts go in as token ids (`token_prompts`), from `brigade.chat.prompt_ids` like the hf
  engine's: one chat template rendering, one BOS;
- the spec's `revision` pins weights and tokenizer, `trust_remote_code` is passed as given.

Generation stops cooperatively between chunks of prompts (`chunk_prompts`), not per token.
The request-building functions are pure and unit-tested without vLLM or a GPU.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import save_file

from brigade.chat import Prompt as ChatPrompt
from brigade.chat import prompt_ids
from brigade.engine.base import Sample, StopFn, Stopped, WrongAdapter
from brigade.model import resolve_model
from brigade.spec import adapter_slots
from brigade.v1 import brigade_pb2 as pb

INSTALL_HINT = "the vllm engine needs `pip install brigade[vllm]` and a CUDA GPU"
log = structlog.get_logger()


# the max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts that holds a rank-`rank` adapter."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"lora.rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def llm_kwargs(spec: pb.RunSpec, model_path: str, gpu_memory_utilization: float = 0.85,
               processed_logprobs: bool = True) -> dict[str, Any]:
    dtype = {"auto": "bfloat16", "float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[spec.dtype or "auto"]
    kw: dict[str, Any] = dict(
        model=model_path, dtype=dtype, seed=int(spec.seed) & 0x7FFFFFFF, enable_lora=True,
        max_loras=adapter_slots(spec), max_lora_rank=vllm_lora_rank(spec.lora.rank),
        gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
        revision=spec.revision or None, tokenizer_revision=spec.revision or None,
        trust_remote_code=spec.trust_remote_code,
    )
    if processed_logprobs:
        kw["logprobs_mode"] = "processed_logprobs"
    return kw


def lora_request_args(run: str, version: int, path: str | Path) -> dict[str, Any] | None:
    """Keyword arguments of LoRARequest for one adapter version; None for v0 (the base model)."""
    if version == 0:
        return None
    return dict(lora_name=f"{run}-v{version}", lora_int_id=version + 1, lora_path=str(path))


def token_prompts(tokenizer, prompts: list[ChatPrompt]) -> list[dict[str, list[int]]]:
    """vLLM TokensPrompts: the ids `brigade.chat.prompt_ids` makes (the hf engine's, the learner's),
    so vLLM never tokenizes or templates a prompt its own way."""
    return [{"prompt_token_ids": prompt_ids(tokenizer, p)} for p in prompts]


def sampling_kwargs(sampling: pb.SamplingSpec, seed: int, index: int, n: int | None = None,
                    max_tokens: int | None = None) -> dict[str, Any]:
    """SamplingParams for prompt `index` of a batch: its own seed, so prompts do not share noise.
    An episode's turn asks for one sample (n=1) of at most what its budget has left."""
    return dict(
        n=n or sampling.group_size, seed=(seed + index) & (2**63 - 1), temperature=sampling.temperature,
        top_p=sampling.top_p or 1.0, top_k=sampling.top_k if sampling.top_k > 0 else -1,
        max_tokens=max_tokens or sampling.max_new_tokens, logprobs=0,
    )


def peft_config_json(spec: pb.RunSpec) -> bytes:
    from brigade.model import lora_config

    config = lora_config(spec).to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    return json.dumps(config, default=str).encode()


def write_peft_folder(folder: Path, state: dict[str, torch.Tensor], config_json: bytes, dtype=torch.bfloat16) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(dtype).contiguous() for k, v in state.items()}, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_bytes(config_json)
    return folder


def version_folder(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def prune_versions(root: Path, keep_from: int) -> list[int]:
    """Delete the adapter folders of versions below `keep_from`; returns the versions deleted."""
    gone = []
    for folder in root.glob("v*"):
        try:
            version = int(folder.name[1:])
        except ValueError:
            continue
        if version < keep_from:
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(version)
    return sorted(gone)


def samples_from_outputs(outputs: list[Any], eos_token_id: int) -> list[Sample]:
    """RequestOutputs (one per prompt, in order) to Samples; each completion's `logprobs` is a list
    of {token_id: Logprob} with the sampled token present (logprobs=0 returns just that one)."""
    samples = []
    for group, out in enumerate(outputs):
        prompt = list(out.prompt_token_ids)
        for c in out.outputs:
            ids = list(c.token_ids)
            lps = [float(step[tok].logprob) for tok, step in zip(ids, c.logprobs, strict=True)]
            reason = getattr(c, "finish_reason", None)  # "stop" (eos or a stop token) or "length"
            finished = reason == "stop" if reason else bool(ids) and ids[-1] == eos_token_id
            samples.append(Sample(group, prompt, ids, lps, finished))
    return samples


class VLLMEngine:
    name = "vllm"

    def __init__(self, spec: pb.RunSpec, chunk_prompts: int = 64, **llm_overrides: Any):
        try:
            from vllm import LLM
        except ImportError as e:
            raise RuntimeError(INSTALL_HINT) from e
        if not torch.cuda.is_available():
            raise RuntimeError(INSTALL_HINT)
        self.spec, self.chunk_prompts = spec, chunk_prompts
        path = resolve_model(spec.model)
        kw = llm_kwargs(spec, path) | llm_overrides
        try:
            self.llm = LLM(**kw)
        except TypeError:  # vLLM without logprobs_mode: raw log-probs, the learner's TIS must absorb it
            log.warning("vllm has no logprobs_mode; behaviour log-probs are raw, not processed")
            self.llm = LLM(**llm_kwargs(spec, path, processed_logprobs=False) | llm_overrides)
        self.tokenizer = self.llm.get_tokenizer()
        self._dir = Path(tempfile.mkdtemp(prefix="brigade-vllm-"))
        self._config_json = peft_config_json(spec)
        self._request = None
        self.version: int | None = 0

    @classmethod
    def from_spec(cls, spec: pb.RunSpec, device: str | None = None, **kw) -> VLLMEngine:
        return cls(spec, **kw)

    def load_adapter(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        from vllm.lora.request import LoRARequest

        if version == self.version:
            return
        args = None
        if version != 0:
            folder = write_peft_folder(version_folder(self._dir, version), state, self._config_json)
            args = lora_request_args(self.spec.run_id, version, folder)
            # a lease names at most max_staleness versions back: older folders serve no request
            prune_versions(self._dir, version - self.spec.staleness.max_staleness)
        self._request = LoRARequest(**args) if args else None
        self.version = version

    def generate(self, prompts: list[ChatPrompt], sampling: pb.SamplingSpec, seed: int, adapter_version: int,
                 should_stop: StopFn) -> list[Sample]:
        return self._generate(token_prompts(self.tokenizer, prompts), sampling_kwargs(sampling, seed, 0), adapter_version,
                              should_stop)

    def generate_tokens(self, rows: list[list[int]], sampling: pb.SamplingSpec, max_new_tokens: int, seed: int,
                        adapter_version: int, should_stop: StopFn) -> list[Sample]:
        """An episode turn per row (brigade.episodes): each row is its episode's whole history, and
        the prefix cache (enable_prefix_caching) keeps the earlier turns' KV, so a turn costs its new
        tokens, not the history's."""
        return self._generate([{"prompt_token_ids": list(r)} for r in rows],
                              sampling_kwargs(sampling, seed, 0, n=1, max_tokens=max_new_tokens), adapter_version,
                              should_stop)

    def _generate(self, prompts: list[dict], params: dict[str, Any], adapter_version: int,
                  should_stop: StopFn) -> list[Sample]:
        """Token prompts in chunks; prompt i of the batch gets its own seed (params' seed + i)."""
        from vllm import SamplingParams

        if adapter_version != self.version:
            raise WrongAdapter(f"asked for adapter v{adapter_version}, v{self.version} is loaded")
        out: list[Sample] = []
        for start in range(0, len(prompts), self.chunk_prompts):
            if should_stop():
                raise Stopped()
            chunk = prompts[start : start + self.chunk_prompts]
            seeded = [SamplingParams(**params | {"seed": (params["seed"] + start + i) & (2**63 - 1)})
                      for i in range(len(chunk))]
            results = self.llm.generate(chunk, seeded, lora_request=self._request, use_tqdm=False)
            for s in samples_from_outputs(results, self.tokenizer.eos_token_id):
                s.group += start
                out.append(s)
        return out
