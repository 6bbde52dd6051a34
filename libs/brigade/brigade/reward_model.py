"""A sequence-classification reward model as a reward function, scored as TRL's GRPOTrainer
scores one: prompt + completion (a conversational pair through the reward tokenizer's chat
template), right-padded, no special tokens added, reward = logits[:, 0] of the last real token."""

from __future__ import annotations

import threading

import torch


class RewardModel:
    def __init__(self, name: str, model, tokenizer, batch_size: int = 16):
        self.name, self.model, self.tokenizer, self.batch_size = name, model, tokenizer, batch_size
        self.__name__ = name.rstrip("/").split("/")[-1]  # what logs call it, as TRL names one
        self._lock = threading.Lock()  # one forward at a time: the worker and a timed-out call may overlap

    @classmethod
    def load(cls, name: str, device: str = "cpu", trust_remote_code: bool = False, revision: str = "") -> RewardModel:
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from brigade.model import pick_device, resolve_model
        from brigade.pretrained import from_pretrained

        path = resolve_model(name)
        pinned = {"revision": revision or None, "trust_remote_code": trust_remote_code}
        tokenizer = AutoTokenizer.from_pretrained(path, **pinned)
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = from_pretrained(AutoModelForSequenceClassification, path, num_labels=1, use_safetensors=True,
                                **pinned)
        # the model scores the last token that is not padding: it must know which id pads
        model.config.pad_token_id = tokenizer.pad_token_id
        return cls(name, model.to(pick_device(device)).eval(), tokenizer)

    def texts(self, prompts: list, completions: list) -> list[str]:
        if isinstance(prompts[0], list):
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions,
                                                                                              strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    @torch.inference_mode()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = self.texts(prompts, completions)
        device = next(self.model.parameters()).device
        out: list[float] = []
        with self._lock:
            for i in range(0, len(texts), self.batch_size):
                enc = self.tokenizer(texts[i : i + self.batch_size], return_tensors="pt", padding=True,
                                     padding_side="right", add_special_tokens=False).to(device)
                out += self.model(**enc).logits[:, 0].float().tolist()
        return out
