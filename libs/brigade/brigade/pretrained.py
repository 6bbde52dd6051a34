"""`from_pretrained`, one at a time: every model brigade loads goes through it (brigade.model's base
model and tokenizer, the GGUF conversion of brigade.gguf_models, brigade.reward_model). No torch
import here: brigade.gguf_models needs it without loading brigade.model."""

from __future__ import annotations

import threading

# transformers swaps process-wide state while from_pretrained builds a model (PreTrainedModel.tie_weights
# and init_weights become no-ops, torch.linspace is patched, new parameters go to the meta device): two
# loads at once in threads of one process left a tied lm_head on the meta device in 27 of 30 loads here.
_FROM_PRETRAINED = threading.RLock()


def from_pretrained(cls: type, *args, **kwargs):
    """`cls.from_pretrained(*args, **kwargs)`, one at a time in this process (every model brigade loads)."""
    with _FROM_PRETRAINED:
        return cls.from_pretrained(*args, **kwargs)
