"""What one batch's reward calls get, as TRL passes it: `RewardCall` (prompts, completions,
completion ids, dataset columns) and its `TrainerState`. brigade.rewards calls the functions with
it, in process or through brigade.reward_sandbox's rq jobs, which carry it to the rq worker."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class TrainerState:
    """What a reward function gets as `trainer_state`: the fields of transformers' TrainerState a
    reward schedule reads. `global_step` is the learner version the samples were generated for
    (the learner's step count when that adapter was published)."""

    global_step: int = 0
    max_steps: int = 0          # 0 = until stopped
    epoch: float = 0.0          # the prompt set's pass the batch belongs to
    num_train_epochs: int = 0   # 0 = unbounded


@dataclass
class RewardCall:
    """The arguments of one batch's reward calls, as TRL passes them."""

    prompts: list                         # str, or a list of messages, per completion
    completions: list                     # str, or [{"role": "assistant", "content": ...}], per completion
    completion_ids: list[list[int]] | None
    columns: dict[str, list]              # dataset columns, native types, per completion
    trainer_state: TrainerState = field(default_factory=TrainerState)
    # episodes: each completion's environment instance, as TRL passes `environments`; in-process
    # functions only (an instance does not travel to a sandboxed function's process)
    environments: list | None = None

    @classmethod
    def for_samples(cls, prompts: Sequence, samples: Sequence, texts: Sequence[str], trainer_state: TrainerState,
                    ) -> RewardCall:
        """From a batch's Prompt messages and the samples generated for them (each with `.group`,
        the prompt's index, and `.completion_ids`), with their decoded texts."""
        from brigade.datasets import prompt_value, row_columns

        values = [prompt_value(p) for p in prompts]
        rows = [row_columns(p) for p in prompts]
        names = sorted({k for row in rows for k in row})
        chat = [isinstance(values[s.group], list) for s in samples]
        return cls(
            prompts=[values[s.group] for s in samples],
            completions=[[{"role": "assistant", "content": t}] if c else t for t, c in zip(texts, chat, strict=True)],
            completion_ids=[list(s.completion_ids) for s in samples],
            columns={k: [rows[s.group].get(k) for s in samples] for k in names},
            trainer_state=trainer_state,
        )
