"""The `hf` engine (its interface is `brigade.engine.base`).

`hf` is transformers' `generate` on the PEFT model (CPU or GPU). Its behaviour log-probs are those
of the distribution actually sampled: temperature, top-k and top-p run in our own logits processor
(HF's built-in warpers are switched off), which keeps the processed scores, and a stopping
criterion gathers the sampled token's log-prob from them once per token. That costs O(rows) memory
per step instead of `output_scores`' O(rows x vocab), and the same per-token hook checks the stop
flag, so a revoked lease stops within one token. Position ids are passed explicitly from the
attention mask, exactly as `brigade.model.completion_logprobs` computes them, so left padding never
shifts positions whatever the model class does on its own.

`vllm` (engine/vllm.py) is the GPU production engine.
"""

from __future__ import annotations

import threading

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from brigade.adapters import adapter_state, apply
from brigade.chat import Prompt as ChatPrompt
from brigade.chat import prompt_ids
from brigade.engine.base import Sample, StopFn, Stopped, WrongAdapter
from brigade.model import attach_lora, load_base, pick_device, position_ids
from brigade.v1 import brigade_pb2 as pb

# ---------------------------------------------------------------- hf


class _Warp(LogitsProcessor):
    """The run's temperature, top-k and top-p in one processor, keeping a reference to the processed
    scores the sampler is about to use. One, not one each plus a recorder: transformers reads every
    processor's signature on every token (`inspect.signature`, tens of microseconds each)."""

    scores: torch.Tensor | None = None

    def __init__(self, sampling: pb.SamplingSpec):
        self.warpers = sampling_processors(sampling)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        self.scores = scores
        return scores


class _Tap(StoppingCriteria):
    """Called once per generated token, after sampling: logs the sampled token's log-prob under the
    recorded distribution, and stops every row when `should_stop` says so."""

    def __init__(self, warp: _Warp, should_stop: StopFn):
        self.warp, self.should_stop = warp, should_stop
        self.logprobs: list[torch.Tensor] = []
        self.stopped = False
        self._answer: dict[bool, torch.Tensor] = {}  # generate only reads it: allocate once, not per token

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.BoolTensor:
        s = self.warp.scores
        tok = input_ids[:, -1:]
        self.logprobs.append((s.gather(-1, tok) - torch.logsumexp(s, -1, keepdim=True)).squeeze(-1))
        self.stopped = self.should_stop()
        if self.stopped not in self._answer:
            self._answer[self.stopped] = torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool,
                                                    device=input_ids.device)
        return self._answer[self.stopped]


def sampling_processors(sampling: pb.SamplingSpec) -> list[LogitsProcessor]:
    """Temperature, then top-k, then top-p: the order HF (and vLLM) apply them."""
    out: list[LogitsProcessor] = []
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k > 0:
        out.append(TopKLogitsWarper(top_k=sampling.top_k))
    if 0 < sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p))
    return out


def left_padded(rows: list[list[int]], pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    return {"input_ids": ids, "attention_mask": mask}


class HFEngine:
    name = "hf"

    def __init__(self, model: torch.nn.Module, tokenizer, max_rows: int = 256):
        self.model, self.tokenizer, self.max_rows = model, tokenizer, max_rows
        self.model.eval()
        # transformers fills every generation setting we leave unset from the checkpoint's
        # generation_config.json (repetition penalties, suppressed tokens, min lengths...), which
        # would sample from a distribution other than the one we log. The run spec is the only
        # source of sampling settings, so start from a blank config.
        # Stop tokens are kept: chat checkpoints often list several (e.g. <|eot_id|> and <|end_of_text|>).
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        eos = getattr(base.generation_config, "eos_token_id", None)
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        base.generation_config = GenerationConfig(
            pad_token_id=tokenizer.pad_token_id, eos_token_id=self.eos_ids, bos_token_id=tokenizer.bos_token_id)
        # v0 is the seeded fresh LoRA the model was built with; keep it to swap back to
        self._v0 = {k: v.clone() for k, v in adapter_state(model).items()}
        self.version: int | None = 0
        self._lock = threading.Lock()  # load_adapter and generate never interleave

    @classmethod
    def from_spec(cls, spec: pb.RunSpec, device: str | None = None, **kw) -> HFEngine:
        model, tokenizer = load_base(spec, pick_device(device or spec.device))
        return cls(attach_lora(model, spec), tokenizer, **kw)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def load_adapter(self, version: int, state: dict[str, torch.Tensor] | None) -> None:
        with self._lock:
            if version == self.version:
                return
            self.version = None  # a failed apply leaves no version claimed
            apply(self.model, self._v0 if state is None else state)
            self.version = version

    def generate(self, prompts: list[ChatPrompt], sampling: pb.SamplingSpec, seed: int, adapter_version: int,
                 should_stop: StopFn) -> list[Sample]:
        ids = [prompt_ids(self.tokenizer, p) for p in prompts]
        rows = [(g, p) for g, p in enumerate(ids) for _ in range(sampling.group_size)]
        return self._generate(rows, sampling, seed, adapter_version, should_stop)

    def generate_tokens(self, rows: list[list[int]], sampling: pb.SamplingSpec, max_new_tokens: int, seed: int,
                        adapter_version: int, should_stop: StopFn) -> list[Sample]:
        """One sample per row of token ids (an episode's history); Sample.group is the row's index."""
        return self._generate(list(enumerate(rows)), sampling, seed, adapter_version, should_stop, max_new_tokens)

    @torch.inference_mode()
    def _generate(self, rows: list[tuple[int, list[int]]], sampling: pb.SamplingSpec, seed: int, adapter_version: int,
                  should_stop: StopFn, max_new_tokens: int | None = None) -> list[Sample]:
        with self._lock:
            if adapter_version != self.version:
                raise WrongAdapter(f"asked for adapter v{adapter_version}, v{self.version} is loaded")
            out: list[Sample] = []
            # chunks bound activation memory; each chunk's seed is derived so a batch stays reproducible
            for i in range(0, len(rows), self.max_rows):
                if should_stop():
                    raise Stopped()
                out += self._generate_rows(rows[i : i + self.max_rows], sampling, seed + i, should_stop,
                                           max_new_tokens)
            return out

    def _generate_rows(self, rows: list[tuple[int, list[int]]], sampling: pb.SamplingSpec, seed: int,
                       should_stop: StopFn, max_new_tokens: int | None = None) -> list[Sample]:
        tok = self.tokenizer
        enc = left_padded([p for _, p in rows], tok.pad_token_id, self.device)
        mask = enc["attention_mask"]
        warp = _Warp(sampling)
        tap = _Tap(warp, should_stop)
        # temperature/top-k/top-p are off here and applied by our processor instead
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
            max_new_tokens=max_new_tokens or sampling.max_new_tokens,
            pad_token_id=tok.pad_token_id, eos_token_id=self.eos_ids, bos_token_id=tok.bos_token_id,
        )
        dev = self.device
        devices = [dev.index if dev.index is not None else torch.cuda.current_device()] if dev.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed & (2**63 - 1))
            seqs = self.model.generate(
                input_ids=enc["input_ids"], attention_mask=mask, position_ids=position_ids(mask),
                generation_config=config,
                logits_processor=LogitsProcessorList([warp]),
                stopping_criteria=[tap],
            )
        if tap.stopped:
            raise Stopped()
        completions = seqs[:, enc["input_ids"].shape[1] :].tolist()
        logprobs = torch.stack(tap.logprobs, 1).float().tolist()
        samples = []
        for (group, _), ids, p_ids, p_mask, lps in zip(rows, completions, enc["input_ids"].tolist(), mask.tolist(),
                                                       logprobs, strict=True):
            n = next((j + 1 for j, t in enumerate(ids) if t in self.eos_ids), len(ids))  # after eos: padding
            finished = bool(ids) and ids[n - 1] in self.eos_ids
            prompt = [t for t, m in zip(p_ids, p_mask, strict=True) if m]
            samples.append(Sample(group, prompt, ids[:n], lps[:n], finished))
        return samples


