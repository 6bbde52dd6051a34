"""Prompt token ids: the one function every engine uses, so the ids a worker generates from (and
the learner then scores, from the rollout) do not depend on the engine.

A conversational prompt (a list of messages) is rendered with the model's chat template and
`add_generation_prompt=True`, and tokenized without adding special tokens: the template writes
its own BOS, as TRL's GRPOTrainer does. A plain string is tokenized as TRL does (the tokenizer
adds its BOS), except that a string which already starts with the BOS (a template rendered
beforehand) does not get a second one.
"""

from __future__ import annotations

from typing import Any

Prompt = str | list[dict[str, Any]]


class ChatTemplateError(ValueError):
    pass


def prompt_ids(tokenizer, prompt: Prompt) -> list[int]:
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt)["input_ids"])
    else:
        ids = list(tokenizer(render(tokenizer, prompt), add_special_tokens=False)["input_ids"])
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == bos == ids[1]:
        ids = ids[1:]
    return ids


def render(tokenizer, messages: list[dict[str, Any]]) -> str:
    """The chat template applied to `messages`, ending with the assistant's turn opened."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("the prompts are conversational (lists of messages) but the model's tokenizer has no "
                                "chat_template; use an instruct model, or plain-string prompts")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
