"""Reward functions, shared by the rollout worker and the evaluator, with TRL GRPOTrainer's contract.

A reward function is called as TRL 1.x's `GRPOTrainer._calculate_rewards` calls it, with keywords:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], trainer_state=..., log_extra=...,
      log_metric=..., **columns) -> list[float | None]

one entry per completion (prompts x group_size of them). `prompts` are each sample's prompt as the
dataset holds it (a string, or a list of messages); `completions` are strings, or
`[{"role": "assistant", "content": text}]` when the prompt is conversational; `columns` are every
other dataset column with its type (an int stays an int), repeated per completion like `prompts`.
`trainer_state` has `global_step`: the learner version the samples were generated for (see
brigade.reward_call.TrainerState). `log_metric(name, value)` and `log_extra(column, values)` land
in the learner's step metrics (`metric/{name}`, `extra/{column}`, averaged over the step) and in the text sidecar.
`async def` functions are awaited, concurrently with the others.

A run names its functions in `spec.rewards` (function, weight, kwargs, sandboxed, timeout_s):
a built-in name (see BUILTINS), an import path "package.module:function", or a
sequence-classification reward model (a Hub id or a folder, scored on the worker as TRL scores it,
see brigade.reward_model). With `kwargs` (a mapping in the spec) the import path is a factory:
`function(**kwargs)` is the reward function, e.g. `trl.rewards:get_soft_overlong_punishment`.

Aggregation is TRL's: None (NaN) means "does not apply to this sample"; the total is the nansum
of weight x reward over the functions, NaN (None here) for a sample no function scored, which the
learner drops (TRL zeroes its advantage), with a warning naming the sample.

A function's result for a batch is rejected when it is not one finite number or None per
completion, or the function raises or overruns `timeout_s`. A rejected function leaves the whole
batch unscored (every total None) rather than a total silently missing a part: the worker logs
it (one line naming the function and why), the sidecar says so (`rejected`), and the learner
refuses the batch and counts it (`rejected/empty` in its step metrics); the run goes on. Nothing a reward function does may take the worker down:
- in-process functions (sandboxed=false) run in a daemon thread (async ones on a loop of their
  own), bounded by `timeout_s` (brigade.reward_sandbox);
- sandboxed functions (sandboxed=true: slow or unsafe code) run as rq jobs (job_timeout=timeout_s)
  in an rq worker process, on the Redis queue `brigade:<run>:rewards` (on BRIGADE_RQ_REDIS_URL). A
  rollout worker given a Redis URL starts its own rq worker subprocess on that queue (killed with
  it); more can be added on
  any host with `rq worker --url $BRIGADE_RQ_REDIS_URL brigade:<run>:rewards` (they need brigade and
  the reward's package importable). A job that fails, times out, or is not picked up within
  timeout_s + reward_sandbox.QUEUE_GRACE_S is rejected, logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import math
import os
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from brigade import code_policy
from brigade.reward_call import RewardCall
from brigade.reward_sandbox import RqSandbox, as_coroutine, in_daemon_thread, on_async_loop

log = structlog.get_logger()

BUILTINS = code_policy.BUILTINS
ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


class RewardRejected(ValueError):
    """A reward function's result for one batch that cannot be used (wrong count, not finite)."""


def resolve(name: str, kwargs_json: str = "", **model_options) -> Callable[..., list]:
    """The reward function a spec entry names (ValueError, one line, if it cannot be had): a
    built-in, an import path (called with `kwargs` when given: a factory), or a reward model.
    `model_options` (device, trust_remote_code, revision) go to a reward model.
    Nothing this host's code policy (brigade.code_policy) does not allow is imported or loaded."""
    policy = code_policy.current()
    target = policy.check_function(name)  # CodeRefused (a ValueError) before any import
    module, sep, attr = target.partition(":")
    if not sep:
        if kwargs_json:
            raise ValueError(f"reward function {name!r}: kwargs need an import path 'package.module:factory'")
        not_this = (f"reward function {name!r} is not a built-in ({', '.join(BUILTINS)}), not "
                    f"'package.module:function', and not a sequence-classification model")
        if not _could_be_a_model(name):  # a typo must not wait for the Hub to time out
            raise ValueError(f"{not_this} (no folder of that name, and a Hub id is 'owner/name')")
        from brigade.reward_model import RewardModel

        policy.check_source("reward model", name)
        if model_options.get("trust_remote_code") and not policy.remote_code:
            raise code_policy.CodeRefused(f"reward model {name!r}: trust_remote_code is not allowed on this host "
                                          f"({code_policy.ALLOW_REMOTE_CODE_ENV}=1 allows it)")
        try:
            return RewardModel.load(name, **model_options)
        except Exception as e:  # noqa: BLE001 - not a model either: the one line says what it can be
            raise ValueError(f"{not_this}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
    if not module or not attr:
        raise ValueError(f"reward function {name!r}: use a built-in ({', '.join(BUILTINS)}) or 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {name!r} cannot be imported: {e}; install its package, or make its "
                         f"module importable from the working directory or PYTHONPATH") from e
    policy.check_defined(name, fn)  # `os.system` reached through an allowed module is still os.system
    if kwargs_json:
        try:
            fn = fn(**json.loads(kwargs_json))
        except Exception as e:  # noqa: BLE001 - the factory's own error, in one line
            raise ValueError(f"reward function {name!r}: calling the factory with kwargs {kwargs_json} failed: "
                             f"{type(e).__name__}: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable" + ("" if kwargs_json else
                         "; if it is a factory, give its arguments as `kwargs`"))
    return fn


def _could_be_a_model(name: str) -> bool:
    """A folder, a bucket URI or a Hub id ('owner/name'): where a reward model may be loaded from."""
    return os.path.isdir(name) or "://" in name or re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None


def signature_problem(fn: Callable, columns: Sequence[str] | None = None) -> str | None:
    """Why TRL's keyword call (ARGUMENTS + the dataset's columns) would fail on `fn`, or None.
    With `columns` None (not known here) only what holds for any dataset is checked."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or extension: nothing to read
        return None
    params = list(sig.parameters.values())
    names = {p.name for p in params}
    passed = {*ARGUMENTS, *(columns or ())}
    for p in params:
        if p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            return f"parameter {p.name!r} is positional-only, but reward functions are called with keywords"
        if (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty and p.name not in passed
                and columns is not None):
            return (f"it needs {p.name!r}, which is neither a reward argument ({', '.join(ARGUMENTS)}) nor a "
                    f"dataset column ({', '.join(columns) or 'none'})")
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        unexpected = sorted(passed - names) if columns is not None else sorted(set(ARGUMENTS) - names)
        if unexpected:
            return f"it takes no **kwargs, so it would be called with arguments it does not accept: {', '.join(unexpected)}"
    return None


def usable(name: str, kwargs_json: str = "", columns: Sequence[str] | None = None, **model_options) -> Callable:
    """`resolve`, then `signature_problem`: ValueError, one line naming the function, if either fails."""
    fn = resolve(name, kwargs_json, **model_options)
    if problem := signature_problem(fn, columns):
        raise ValueError(f"reward function {name!r} has the wrong signature: {problem}; TRL's is "
                         f"f(prompts, completions, completion_ids, **kwargs)")
    return fn


def is_async(fn: Callable) -> bool:
    """An async function, or an object whose __call__ is one (a factory's product)."""
    return inspect.iscoroutinefunction(fn) or (not inspect.isroutine(fn) and inspect.iscoroutinefunction(type(fn).__call__))


def clean(values: Any, n: int) -> list[float | None]:
    """A reward function's result checked: n entries, each None or a finite number; else
    RewardRejected saying what is wrong."""
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):  # a numpy array or a tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise RewardRejected(f"returned a {type(values).__name__}, expected a list of {n} rewards")
    if len(values) != n:
        raise RewardRejected(f"returned {len(values)} rewards for {n} completions")
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        if isinstance(v, str) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
            raise RewardRejected(f"reward {i} is a {type(v).__name__}, not a number or None")
        f = float(v)
        if not math.isfinite(f):
            raise RewardRejected(f"reward {i} is {f}, not a finite number (return None for 'does not apply')")
        out.append(f)
    return out


class RewardLog:
    """Collects what reward functions pass to `log_metric` and `log_extra` for one batch."""

    def __init__(self):
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = {}
        self._lock = threading.Lock()  # functions run in threads of their own

    def log_metric(self, name: str, value: float) -> None:
        with self._lock:
            self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        with self._lock:
            self.extra.setdefault(str(column), []).extend(values)

    def as_json(self) -> dict:
        return {"metrics": dict(self.metrics), "extra": self.extra}

    def merge(self, doc: dict) -> None:
        for name, values in (doc.get("metrics") or {}).items():
            for v in values:
                self.log_metric(name, v)
        for column, values in (doc.get("extra") or {}).items():
            self.log_extra(column, values)


def call_kwargs(call: RewardCall, rlog: RewardLog) -> dict[str, Any]:
    extra = {} if call.environments is None else {"environments": call.environments}
    return dict(prompts=call.prompts, completions=call.completions, completion_ids=call.completion_ids,
                trainer_state=call.trainer_state, log_extra=rlog.log_extra, log_metric=rlog.log_metric,
                **extra, **call.columns)


def run_reward_job(function: str, call: RewardCall, kwargs_json: str = "") -> dict:
    """What a sandboxed rq job runs (in the rq worker's process): the raw rewards and what the
    function logged; the caller checks them."""
    fn = resolve(function, kwargs_json)
    rlog = RewardLog()
    out = fn(**call_kwargs(call, rlog))
    if inspect.isawaitable(out):
        out = asyncio.run(as_coroutine(out))
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):
        out = out.tolist()
    return {"rewards": list(out) if isinstance(out, (list, tuple)) else out, **rlog.as_json()}


# ---------------------------------------------------------------- the set a run uses


@dataclass
class Scores:
    names: list[str]
    parts: list[list[float | None]]   # [K][N]: each function's rewards
    weights: list[float]
    rejected: dict[str, str] = field(default_factory=dict)  # function -> why its result was refused
    metrics: dict[str, list[float]] = field(default_factory=dict)  # log_metric values, by name
    extra: dict[str, list] = field(default_factory=dict)  # log_extra columns
    episode_metrics: dict[str, list[float]] = field(default_factory=dict)  # episodes: [sum, count] per metric

    @property
    def total(self) -> list[float | None]:
        """TRL's aggregation: the nansum of weight x reward per completion, None where no function
        applied; every entry None when a function's result was rejected."""
        n = len(self.parts[0]) if self.parts else 0
        if self.rejected:
            return [None] * n
        out = []
        for values in zip(*self.parts, strict=True):
            scored = [(w, v) for w, v in zip(self.weights, values, strict=True) if v is not None]
            out.append(sum(w * v for w, v in scored) if scored else None)
        return out

    def add(self, name: str, values: list[float | None], weight: float = 1.0) -> None:
        """One more reward part (an environment's own reward: TRL gives it weight 1)."""
        self.names.append(name)
        self.parts.append(list(values))
        self.weights.append(weight)

    def drop(self, i: int) -> None:
        """Sample i unscored (None in every part): the learner leaves it out (a failed episode)."""
        for part in self.parts:
            part[i] = None

    def step_metrics(self) -> dict[str, list[float]]:
        """[sum, count] per metric, for the learner to average over a step (TRL averages log_metric
        values over each logging step): log_metric values, numeric log_extra values."""
        out = {f"metric/{k}": [sum(v), len(v)] for k, v in self.metrics.items() if v} | self.episode_metrics
        for column, values in self.extra.items():
            nums = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
            if nums:
                out[f"extra/{column}"] = [sum(nums), len(nums)]
        return out


@dataclass
class RewardFn:
    name: str
    weight: float = 1.0
    sandboxed: bool = False
    timeout_s: float = 10.0
    kwargs: str = ""  # JSON: the factory's arguments
    fn: Callable[..., list] | None = field(default=None, repr=False)  # resolved at build time (in-process only)


class RewardSet:
    """The reward functions of a run. `score` never raises for a reward's fault."""

    def __init__(self, functions: Sequence[RewardFn], sandbox: RqSandbox | None = None):
        self.functions, self.sandbox = list(functions), sandbox
        if any(f.sandboxed for f in self.functions) and sandbox is None:
            raise ValueError("sandboxed reward functions need a Redis URL for their rq queue (--redis-url)")
        self.rejected = 0  # batches with a rejected result, since start

    @classmethod
    def from_specs(cls, specs, sandbox: RqSandbox | None = None, columns: Sequence[str] | None = None,
                   **model_options) -> RewardSet:
        """From RewardSpec messages: in-process functions are resolved and their signatures checked
        now (ValueError naming the function), not on the first batch. `model_options` (device,
        trust_remote_code) go to reward models."""
        functions = []
        for s in specs:
            weight = s.weight if not hasattr(s, "HasField") or s.HasField("weight") else 1.0
            f = RewardFn(s.function, weight, s.sandboxed, s.timeout_s or 10.0, getattr(s, "kwargs", ""))
            if not f.sandboxed:
                f.fn = usable(f.name, f.kwargs, columns, **model_options)
            functions.append(f)
        return cls(functions, sandbox)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    async def score(self, call: RewardCall) -> Scores:
        rlog = RewardLog()
        results = await asyncio.gather(*(self._one(f, call, rlog) for f in self.functions))
        rejected = {f.name: why for f, (_, why) in zip(self.functions, results, strict=True) if why}
        scores = Scores(self.names, [values for values, _ in results], [f.weight for f in self.functions],
                        rejected, dict(rlog.metrics), self._extra(rlog, len(call.completions)))
        for name, values in zip(self.names, scores.parts, strict=True):
            if name not in rejected and values and all(v is None for v in values):
                # None means "does not apply": legal, but a function that never applies adds nothing
                log.warning("reward function returned None for every completion of the batch", reward=name,
                            completions=len(values))
        if rejected:
            self.rejected += 1
        elif (i := next((i for i, t in enumerate(scores.total) if t is None), None)) is not None:
            log.warning("all reward functions returned None for a sample; it is dropped",
                        prompt=str(call.prompts[i])[:200], completion=str(call.completions[i])[:200],
                        unscored=sum(t is None for t in scores.total))
        return scores

    @staticmethod
    def _extra(rlog: RewardLog, n: int) -> dict[str, list]:
        for column, values in list(rlog.extra.items()):
            if len(values) != n:
                log.warning("log_extra column ignored: not one value per completion", column=column,
                            values=len(values), completions=n)
                del rlog.extra[column]
        return rlog.extra

    async def _one(self, f: RewardFn, call: RewardCall, rlog: RewardLog) -> tuple[list[float | None], str]:
        """(rewards, "") or ([None] * n, why the result was rejected)."""
        n = len(call.completions)
        try:
            if f.sandboxed:
                doc = await self.sandbox.call(f.name, dataclasses.replace(call, environments=None), f.kwargs,
                                              f.timeout_s)
                raw = doc.get("rewards") if isinstance(doc, dict) else doc
                if isinstance(doc, dict):
                    rlog.merge(doc)
            elif is_async(f.fn):
                raw = await on_async_loop(f.fn(**call_kwargs(call, rlog)), f.timeout_s)
            else:
                raw = await asyncio.wait_for(in_daemon_thread(f.fn, **call_kwargs(call, rlog)), f.timeout_s)
                if inspect.isawaitable(raw):  # a partial of an async function, say
                    raw = await on_async_loop(raw, f.timeout_s)
            return clean(raw, n), ""
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            why = f"timed out after {f.timeout_s}s"
        except RewardRejected as e:
            why = str(e)
        except Exception as e:  # any failure of user code is contained here
            why = f"raised {type(e).__name__}: {str(e)[:300]}"
        log.warning("reward function result rejected; the batch is left unscored", reward=f.name, why=why,
                    sandboxed=f.sandboxed)
        return [None] * n, why

    async def close(self) -> None:
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)
