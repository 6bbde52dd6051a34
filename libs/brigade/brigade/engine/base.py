"""The interface every generation engine implements, and what it hands back.

    engine.load_adapter(version, state)       # state None = version 0 (the fresh LoRA)
    engine.generate(prompts, sampling, seed, adapter_version, should_stop) -> list[Sample]
    engine.generate_tokens(rows, sampling, max_new_tokens, seed, adapter_version, should_stop)  # episodes

A prompt is a string or a list of chat messages; every engine turns it into token ids with
`brigade.chat.prompt_ids`, so the ids do not depend on the engine.

Its own module so that an engine, the rollout worker and the evaluator depend on this contract
and not on each other (hf needs transformers, vllm needs a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: the interface costs no torch import
    import torch

    from brigade.chat import Prompt
    from brigade.v1 import brigade_pb2 as pb

StopFn = Callable[[], bool]


class Stopped(Exception):
    """Generation was stopped from outside (lease revoked or lost, worker shutting down)."""


class WrongAdapter(RuntimeError):
    """Asked to generate with a version other than the loaded one: never silently serve another."""


@dataclass
class Sample:
    group: int                  # index of the prompt within the batch
    prompt_ids: list[int]       # unpadded
    completion_ids: list[int]   # generated tokens up to and including eos
    logprobs: list[float]       # behaviour log-prob of each completion token
    finished: bool              # ended with eos (else cut at max_new_tokens)
    env_mask: list[int] | None = None  # an episode's: 1 on the environment's tokens (context, not trained)


class Engine(Protocol):
    name: str
    tokenizer: object
    version: int | None

    def load_adapter(self, version: int, state: dict[str, torch.Tensor] | None) -> None: ...

    def generate(self, prompts: list[Prompt], sampling: pb.SamplingSpec, seed: int, adapter_version: int,
                 should_stop: StopFn) -> list[Sample]: ...

    def generate_tokens(self, rows: list[list[int]], sampling: pb.SamplingSpec, max_new_tokens: int, seed: int,
                        adapter_version: int, should_stop: StopFn) -> list[Sample]:
        """One sample per row of token ids, at most max_new_tokens each: an episode's next turn
        (brigade.episodes). Sample.group is the row's index."""
        ...
