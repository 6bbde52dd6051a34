"""The task a run spec names, checked before any service starts: the prompt sets read, the reward
functions resolved and their signatures checked against the dataset's columns, and, for
conversational prompts, the model's chat template rendered (from a local folder's files where
they suffice, else by loading its tokenizer). Each problem is
one line naming the dataset, column or function and what to do (`brigade up` prints them and
exits before starting anything)."""

from __future__ import annotations

from brigade.datasets import DatasetError, eval_prompts, row_columns, train_prompts
from brigade.spec import refuse
from brigade.v1 import brigade_pb2 as pb


def check_task(spec: pb.RunSpec) -> list[pb.Prompt]:
    """The training prompts, or ConfigError listing every problem of the task."""
    problems: list[str] = []
    prompts: list[pb.Prompt] = []
    try:
        prompts = train_prompts(spec)
    except DatasetError as e:
        problems.append(str(e))
    evaluated = not spec.HasField("eval_every") or spec.eval_every > 0
    if evaluated and (spec.eval_dataset or spec.eval_split):
        try:
            eval_prompts(spec)
        except DatasetError as e:
            problems.append(f"eval: {e}")
    columns = sorted({k for p in prompts for k in row_columns(p)}) if prompts else None
    problems += reward_problems(spec, columns)
    if prompts and not problems:
        problems += reward_call_problems(spec, prompts[:SMOKE_ROWS])
    if any(p.messages_json for p in prompts):
        problems += template_problems(spec)
    refuse(problems)
    return prompts


def reward_problems(spec: pb.RunSpec, columns: list[str] | None) -> list[str]:
    from brigade.rewards import usable

    out = []
    for i, r in enumerate(spec.rewards):
        try:
            usable(r.function, r.kwargs, columns, device="cpu", trust_remote_code=spec.trust_remote_code)
        except ValueError as e:
            out.append(f"rewards[{i}]: {e}")
    return out


# rows of the dataset each reward function is called on before a run starts
SMOKE_ROWS = 2


def reward_call_problems(spec: pb.RunSpec, prompts: list[pb.Prompt]) -> list[str]:
    """Each reward function called once, as TRL calls it, on the first rows of the dataset with an
    empty completion (which any batch may hold: a model may stop at once). One that raises or
    returns something unusable would have every batch it scores left unscored, so it is refused
    now, in seconds, with its own error. One that returns None for every completion is a warning
    (printed, and `reward/<fn>/none_frac` in the learner's metrics), since None means "does not
    apply". Reward models and sandboxed functions are not called here (they load on the workers)."""
    import asyncio
    import sys
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from brigade.code_policy import BUILTINS
    from brigade.reward_call import RewardCall, TrainerState
    from brigade.rewards import RewardSet
    from brigade.spec import episodic

    plain = [r for r in spec.rewards if not r.sandboxed and (":" in r.function or r.function in BUILTINS)]
    if not plain or episodic(spec):  # an episode's rewards may read its environments, which only a worker has
        return []
    rewards = RewardSet.from_specs(plain, None, device="cpu", trust_remote_code=spec.trust_remote_code)
    samples = [SimpleNamespace(group=i, completion_ids=[]) for i in range(len(prompts))]
    call = RewardCall.for_samples(prompts, samples, [""] * len(samples), TrainerState(max_steps=spec.max_steps))
    with capture_logs():  # the rejection is reported below, in the check's words, not as a batch's
        scores = asyncio.run(rewards.score(call))
    out = [f"rewards: reward function {name!r} {why} when called on dataset row(s) 1-{len(prompts)} with an "
           "empty completion; a reward function must score any completion (None skips one)"
           for name, why in scores.rejected.items()]
    for name, values in zip(scores.names, scores.parts, strict=True):
        if name not in scores.rejected and all(v is None for v in values):
            print(f"warning: reward function {name!r} returned None for every completion of the check; if it "
                  "does so in training, it adds nothing (reward/<fn>/none_frac in the metrics counts it)",
                  file=sys.stderr, flush=True)
    return out


def template_problems(spec: pb.RunSpec) -> list[str]:
    if _renders_without_torch(spec):
        return []
    from brigade.chat import ChatTemplateError, render
    from brigade.model import load_tokenizer

    try:
        render(load_tokenizer(spec), [{"role": "user", "content": "hi"}])
    except ChatTemplateError as e:
        return [f"model {spec.model!r}: {e}"]
    except Exception as e:  # noqa: BLE001 - not cached offline, no such folder, a broken template...
        return [f"model {spec.model!r}: cannot load its tokenizer: {type(e).__name__}: {str(e).splitlines()[0]}"]
    return []


def _renders_without_torch(spec: pb.RunSpec) -> bool:
    """Whether the model's local folder (a converted GGUF, a model folder) has a chat template that
    renders, read from its files with transformers' jinja renderer alone. Loading the tokenizer
    imports torch and transformers' models: 5-20 s of `brigade up` before its first service
    starts, while the fork server imports the same. False (the tokenizer is then loaded) when
    this cannot tell: a Hub id, a tokenizer with code of its own, no template, a render error."""
    import json
    from pathlib import Path

    try:
        from brigade.gguf_models import converted_dir, gguf_source

        gguf = gguf_source(spec.model)
        folder = converted_dir(gguf) if gguf else Path(spec.model)
        config_path = folder / "tokenizer_config.json"
        if not config_path.is_file():
            return False
        config = json.loads(config_path.read_text())
        jinja = folder / "chat_template.jinja"
        template = jinja.read_text() if jinja.is_file() else config.get("chat_template")
        if config.get("auto_map") or not isinstance(template, str):
            return False
        from transformers.utils.chat_template_utils import render_jinja_template

        special = {k: (v.get("content") if isinstance(v, dict) else v) for k, v in config.items()
                   if k.endswith("_token") and isinstance(v, str | dict)}
        render_jinja_template([[{"role": "user", "content": "hi"}]], chat_template=template,
                              add_generation_prompt=True, **special)
        return True
    except Exception:  # noqa: BLE001 - undecided here: the full check says what is wrong
        return False
