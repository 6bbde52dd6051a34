"""Episodes: a rollout worker's multi-turn loop, with TRL's `tools` and `environment_factory`.

An episode is one completion that the environment takes part in: the model's turn, the
environment's reply (tool results, or a user turn from a reset/step environment), the model's next
turn, until the model answers without calling a tool, the environment ends it, `max_turns`, or the
token budget (`sampling.max_new_tokens` bounds the whole completion, the environment's tokens
included, as TRL's max_completion_length does). The completion's tokens are one sequence: the
model's tokens carry the log-probabilities they were sampled with and train; the environment's are
context (`env_mask` 1, log-prob 0) and never train.

The contract is TRL's (GRPOTrainer's docstring, 1.16), so a TRL user's code runs unmodified:
- a tool is a function with type hints and a Google-style docstring (its schema comes from
  transformers' `get_json_schema`, as the chat template's `tools` wants it); it may be async;
- an environment class is built with no arguments, one instance per episode; `reset(**row)` gets
  the prompt's dataset row (`prompt` and every column; with several environments, all but the
  `environment` column) and returns None or text appended to the last user message; its public
  methods are tools; an optional `get_reward()` returns the episode's reward (a reward part named
  after the class, weight 1);
- besides TRL's: a class with a `step(text)` method is a reset/step environment (Gymnasium,
  OpenEnv, SkyRL-gym): each model turn is its action, and it returns the next observation (a user
  turn), None to end, or Gymnasium's (observation, reward, terminated, truncated, info) (also
  (observation, reward, done)); its rewards add up to the episode's reward unless it has
  `get_reward`.

Tool calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes convention of
Qwen2.5/3, Hermes and SmolLM3 templates). `tool_format` says how the model learns of its tools:
`template` passes the schemas to the chat template's `tools`; `json` (for templates without tool
support, SmolLM2's) writes them into the system message with the call syntax; `auto` picks
`template` when the template renders tools. A malformed call, an unknown tool, bad arguments or a
tool that raises is answered with `{"error": ...}` as the tool's reply (the model sees its
mistake); a call that takes longer than `tool_timeout_s`, or an environment whose reset, step or
get_reward raises or hangs, ends that episode and marks it failed (its sample is dropped): it never
takes the worker down.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from brigade import code_policy

if TYPE_CHECKING:  # annotations only
    from brigade.engine.base import Engine, Sample, StopFn
    from brigade.v1 import brigade_pb2 as pb

ENVIRONMENT_COLUMN = "environment"  # with several environments: the column that picks one per prompt
RESERVED = ("reset", "step", "get_reward")  # an environment's methods that are not tools
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
JSON_FORMAT_HEADER = (
    "You can call these tools. To call one, write <tool_call>{\"name\": \"<tool name>\", \"arguments\": "
    "{<its arguments>}}</tool_call> and stop; its result comes back to you in the next message.")
_PROBE_TOOL = "brigade_probe_tool"


class EnvironmentError_(RuntimeError):
    """An environment (or a tool) broke its episode: raised, hung, or returned what it may not."""


# ---------------------------------------------------------------- what a spec names


@dataclass
class EnvironmentCode:
    """The tools and environment classes of a run, imported under this host's code policy."""

    tools: list[Callable] = field(default_factory=list)
    factories: dict[str | None, Callable[[], Any]] = field(default_factory=dict)  # None: the one environment
    max_turns: int = 8
    timeout_s: float = 10.0
    tool_format: str = "auto"
    max_turn_tokens: int = 0  # 0: a turn may take what is left of the budget

    @property
    def multi(self) -> bool:
        return None not in self.factories and bool(self.factories)

    @property
    def active(self) -> bool:
        return bool(self.tools or self.factories)

    def reward_classes(self) -> list[type]:
        """Environment classes that own a reward (get_reward or step), in spec order, once each."""
        out: list[type] = []
        for factory in self.factories.values():
            cls = factory if inspect.isclass(factory) else None
            if cls is not None and (hasattr(cls, "get_reward") or hasattr(cls, "step")) and cls not in out:
                out.append(cls)
        return out

    @classmethod
    def from_spec(cls, spec: pb.RunSpec) -> EnvironmentCode:
        """ValueError (one line naming the spec path) if a tool or class cannot be had."""
        env = spec.environment
        named = json.loads(env.factories) if env.factories else {}
        factories: dict[str | None, Callable] = {None: load(env.factory, "environment.factory")} if env.factory else {}
        for name, target in named.items():
            factories[str(name)] = load(str(target), f"environment.factories.{name}")
        for name, factory in factories.items():
            where = "environment.factory" if name is None else f"environment.factories.{name}"
            if not callable(getattr(factory, "reset", None)):
                raise ValueError(f"{where}: {factory.__name__} has no reset method (TRL's environment contract)")
        tools = [load(t, f"environment.tools[{i}]") for i, t in enumerate(env.tools)]
        for i, t in enumerate(tools):
            if not callable(t) or inspect.isclass(t):
                raise ValueError(f"environment.tools[{i}]: {env.tools[i]!r} is not a function")
            schema_of(t, f"environment.tools[{i}]")  # a tool without a usable docstring fails here, not mid-run
        code = cls(tools, factories, max(1, env.max_turns or 8), env.tool_timeout_s or 10.0, env.tool_format or "auto",
                   env.max_turn_tokens)
        if not spec.rewards and not code.reward_classes():
            raise ValueError("no reward source: name reward functions, or an environment with get_reward or step")
        return code


def load(target: str, path: str) -> Any:
    """The object at "package.module:name", if this host's code policy allows its module."""
    import importlib

    policy = code_policy.current()
    target = policy.check_function(target, kind=path)
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise ValueError(f"{path}: {target!r} is not 'package.module:name'")
    try:
        obj = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{path}: {target!r} cannot be imported: {e}") from e
    policy.check_defined(target, obj, kind=path)
    return obj


def schema_of(fn: Callable, path: str = "tool") -> dict:
    """The JSON schema a chat template's `tools` takes, from the function's hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:  # noqa: BLE001 - transformers raises several kinds; the message is what matters
        raise ValueError(f"{path}: {getattr(fn, '__name__', fn)!r} needs type hints and a Google-style docstring "
                         f"(TRL's tool contract): {e}") from e


def environment_tools(instance: Any) -> list[Callable]:
    """An environment's tools: its public methods but reset, step and get_reward (TRL's rule, read
    from the class so that properties are not evaluated)."""
    return [getattr(instance, name) for name, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
            if not name.startswith("_") and name not in RESERVED]


# ---------------------------------------------------------------- rendering and parsing


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template shows `tools` to the model (SmolLM2's ignores them)."""
    def brigade_probe_tool(x: int) -> int:
        """Probe.

        Args:
            x: a number.
        """
        return x

    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[schema_of(brigade_probe_tool)],
                                             add_generation_prompt=True, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on tools does not support them
        return False
    return _PROBE_TOOL in text


def json_tool_block(schemas: list[dict]) -> str:
    return JSON_FORMAT_HEADER + "\n" + "\n".join(json.dumps(s["function"] if "function" in s else s) for s in schemas)


def with_tools(messages: list[dict], schemas: list[dict], native: bool) -> tuple[list[dict], dict]:
    """(messages, apply_chat_template kwargs) that show `schemas` to the model."""
    if not schemas:
        return messages, {}
    if native:
        return messages, {"tools": schemas}
    block = json_tool_block(schemas)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{block}"}
        return [first, *messages[1:]], {}
    return [{"role": "system", "content": block}, *messages], {}


@dataclass
class ToolCall:
    name: str
    arguments: dict
    error: str = ""  # why it could not be read: answered as the tool's error, not run


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` in a model turn (an unclosed last one too); a malformed one comes back
    with `error` set, so the model is told, and the worker carries on."""
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            doc = json.loads(body)
        except ValueError as e:
            calls.append(ToolCall("", {}, f"the tool call is not JSON: {e}"))
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
            calls.append(ToolCall("", {}, 'a tool call is {"name": "<tool>", "arguments": {...}}'))
            continue
        args = doc.get("arguments", doc.get("parameters", {}))
        if isinstance(args, str):  # OpenAI's wire form: the arguments as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(args, dict):
            calls.append(ToolCall(doc["name"], {}, "the tool call's arguments are not a JSON object"))
            continue
        calls.append(ToolCall(doc["name"], args))
    return calls


class Renderer:
    """Token ids of prompts and of the environment's replies, from the model's own chat template."""

    def __init__(self, tokenizer, tool_format: str = "auto"):
        self.tokenizer = tokenizer
        renders = template_renders_tools(tokenizer)
        if tool_format == "template" and not renders:
            raise ValueError("environment.tool_format: template, but this model's chat template does not render "
                             "tools; use `json` (or `auto`)")
        self.native = renders if tool_format == "auto" else tool_format == "template"
        self.eos = tokenizer.eos_token_id

    def prompt_ids(self, messages: list[dict], schemas: list[dict]) -> list[int]:
        from brigade.chat import prompt_ids

        messages, kwargs = with_tools(messages, schemas, self.native)
        if not kwargs:
            return prompt_ids(self.tokenizer, messages)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def reply_ids(self, replies: list[dict], call_names: list[str]) -> list[int]:
        """The tokens between the end of a model turn (its eos) and the start of the next: the
        replies as the template renders them, then the assistant's header. TRL's way: render a short
        conversation with and without the replies and keep the difference, so the model's own turn
        is never re-tokenized."""
        assistant: dict[str, Any] = {"role": "assistant", "content": ""}
        if self.native and call_names:
            assistant["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in call_names]
        head = [{"role": "user", "content": "x"}, assistant]
        render = self.tokenizer.apply_chat_template
        prefix = list(render(head, add_generation_prompt=False, tokenize=True, return_dict=False))
        full = list(render(head + replies, add_generation_prompt=True, tokenize=True, return_dict=False))
        ends = [i for i, t in enumerate(prefix) if t == self.eos]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template renders a conversation's start differently once replies follow; "
                             "multi-turn episodes need a prefix-preserving template")
        return full[len(prefix) :]


# ---------------------------------------------------------------- running user code


def call_with_timeout(fn: Callable, timeout_s: float, *args, **kwargs) -> Any:
    """fn(*args, **kwargs) in a daemon thread (an async fn on an event loop of its own there); TimeoutError
    after timeout_s, the thread abandoned (it cannot hold up the worker's exit)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                async def wait(aw=out):
                    return await aw
                out = asyncio.run(wait())
            box["out"] = out
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, name="environment-call", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise TimeoutError(f"{getattr(fn, '__name__', 'call')} took longer than {timeout_s}s")
    if "error" in box:
        raise box["error"]
    return box.get("out")


def gym_step(out: Any) -> tuple[str | None, float, bool]:
    """(observation, reward, done) from what a reset/step environment's step returned."""
    if out is None:
        return None, 0.0, True
    if isinstance(out, str):
        return out, 0.0, False
    if isinstance(out, tuple) and len(out) in (3, 4, 5):
        observation, reward = out[0], float(out[1] or 0.0)
        done = bool(out[2]) or (len(out) >= 4 and isinstance(out[3], bool) and bool(out[3]))
        return (None if observation is None else str(observation)), reward, done
    raise EnvironmentError_(f"step returned a {type(out).__name__}: expected text, None, or "
                            "(observation, reward, terminated, truncated, info)")


# ---------------------------------------------------------------- one episode


@dataclass
class Episode:
    """One rollout of an episode: what the worker uploads and the reward functions read."""

    group: int
    environment: Any = None
    tools: dict[str, Callable] = field(default_factory=dict)
    prompt: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the prompt as the model saw it (reset's text included)
    ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    completion: list[dict] = field(default_factory=list)  # assistant and tool/user messages, as TRL's rewards get
    finished: bool = False  # the last model turn ended with eos
    done: bool = False
    end: str = ""            # answered | environment | turns | length | failed
    error: str = ""
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    env_s: float = 0.0
    step_reward: float = 0.0
    env_reward: float | None = None  # the environment's reward part (get_reward, or step's sum)

    def finish(self, end: str, error: str = "") -> None:
        self.done, self.end, self.error = True, end, error


def _observation_appended(messages: list[dict], observation: Any) -> list[dict]:
    if observation is None:
        return messages
    if isinstance(observation, tuple) and len(observation) == 2:  # Gymnasium's (observation, info)
        observation = observation[0]
    last = messages[-1]
    return [*messages[:-1], {**last, "content": f"{last.get('content', '')}{observation}"}]


class EpisodeRunner:
    """Runs one batch's episodes on an engine, turn by turn, every live episode's turn in one
    generate call (a batch of rows, each with its own history)."""

    def __init__(self, code: EnvironmentCode, tokenizer):
        self.code = code
        self.tokenizer = tokenizer
        self.renderer = Renderer(tokenizer, code.tool_format)
        self.budget = 0  # sampling.max_new_tokens of the batch being run
        self._schemas: dict[Callable, dict] = {}

    def _schema(self, tool: Callable) -> dict:
        """A tool's schema, made once per function (an environment's bound methods share theirs)."""
        key = getattr(tool, "__func__", tool)
        if key not in self._schemas:
            self._schemas[key] = schema_of(tool)
        return self._schemas[key]

    def _timed(self, e: Episode, fn: Callable, *args, **kwargs) -> Any:
        t0 = time.perf_counter()
        try:
            return call_with_timeout(fn, self.code.timeout_s, *args, **kwargs)
        finally:
            e.env_s += time.perf_counter() - t0

    def start(self, group: int, messages: list[dict] | str, row: dict) -> Episode:
        """An episode of the prompt `messages` with its dataset `row`: its environment built and
        reset, its prompt rendered with its tools."""
        e = Episode(group)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        e.messages = list(messages)
        factory = None
        if self.code.factories:
            name = row.get(ENVIRONMENT_COLUMN) if self.code.multi else None
            factory = self.code.factories.get(name)
            if factory is None:
                e.finish("failed", f"the prompt's {ENVIRONMENT_COLUMN!r} column is {name!r}, not one of "
                                   f"{sorted(k for k in self.code.factories if k)}")
        tools = list(self.code.tools)
        if factory is not None:
            try:
                e.environment = self._timed(e, factory)
                kwargs = {k: v for k, v in row.items() if k != ENVIRONMENT_COLUMN} if self.code.multi else row
                e.messages = _observation_appended(e.messages, self._timed(e, e.environment.reset, **kwargs))
                tools += environment_tools(e.environment)
            except Exception as ex:  # noqa: BLE001 - costs this episode only
                e.finish("failed", f"environment: {type(ex).__name__}: {str(ex)[:300]}")
        e.tools = {t.__name__: t for t in tools}
        schemas = [self._schema(t) for t in tools]
        e.prompt = self.renderer.prompt_ids(e.messages, schemas)
        return e

    def run(self, engine: Engine, episodes: list[Episode], sampling: pb.SamplingSpec, seed: int,
            adapter_version: int, should_stop: StopFn) -> list[Episode]:
        self.budget = sampling.max_new_tokens
        turn = 0
        while live := [e for e in episodes if not e.done]:
            rows = [e.prompt + e.ids for e in live]
            room = [min(self.budget - len(e.ids), self.code.max_turn_tokens or self.budget) for e in live]
            samples = engine.generate_tokens(rows, sampling, max(room), seed + 7919 * turn, adapter_version,
                                             should_stop)
            for e, s, left in zip(live, samples, room, strict=True):
                self._model_turn(e, s, left)
            turn += 1
        for e in episodes:
            self._score(e)
        return episodes

    def _model_turn(self, e: Episode, s: Sample, room: int) -> None:
        ids, logprobs = list(s.completion_ids[:room]), list(s.logprobs[:room])
        e.finished = s.finished and len(ids) == len(s.completion_ids)
        e.ids += ids
        e.env_mask += [0] * len(ids)
        e.logprobs += logprobs
        e.turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        e.completion.append({"role": "assistant", "content": text})
        if len(e.ids) >= self.budget or (not e.finished and not self.code.max_turn_tokens):
            return e.finish("length")  # a turn cut by max_turn_tokens still goes to the environment
        calls = parse_tool_calls(text) if e.tools else []
        replies: list[dict] = []
        if calls:
            for call in calls:
                replies.append(self._tool_reply(e, call))
                if e.done:  # a tool hung: the episode ends here, its other calls unrun
                    return None
        elif e.environment is not None and callable(getattr(e.environment, "step", None)):
            try:
                observation, reward, done = gym_step(self._timed(e, e.environment.step, text))
            except Exception as ex:  # noqa: BLE001
                return e.finish("failed", f"environment step: {type(ex).__name__}: {str(ex)[:300]}")
            e.step_reward += reward
            if done or observation is None:
                return e.finish("environment")
            replies = [{"role": "user", "content": observation}]
        else:
            return e.finish("answered")
        if e.turns >= self.code.max_turns:
            return e.finish("turns")
        try:
            suffix = self.renderer.reply_ids(replies, [c.name for c in calls if not c.error])
        except Exception as ex:  # noqa: BLE001 - the template could not render this reply
            return e.finish("failed", f"rendering the reply: {type(ex).__name__}: {str(ex)[:300]}")
        if not e.finished and self.renderer.eos is not None:
            suffix = [self.renderer.eos, *suffix]  # a turn cut at max_turn_tokens: closed for it, as context
        if len(e.ids) + len(suffix) >= self.budget:  # no room left for the model's next turn
            return e.finish("length")
        e.completion += replies
        e.ids += suffix
        e.env_mask += [1] * len(suffix)
        e.logprobs += [0.0] * len(suffix)
        return None

    def _tool_reply(self, e: Episode, call: ToolCall) -> dict:
        e.tool_calls += 1
        content: Any
        if call.error:
            e.tool_errors += 1
            content = {"error": call.error}
        elif call.name not in e.tools:
            e.tool_errors += 1
            content = {"error": f"no tool named {call.name!r}; the tools are {', '.join(sorted(e.tools))}"}
        else:
            try:
                content = self._timed(e, e.tools[call.name], **call.arguments)
            except TimeoutError as ex:
                e.tool_errors += 1
                e.finish("failed", f"tool {call.name}: {ex}")
                content = {"error": str(ex)}
            except Exception as ex:  # noqa: BLE001 - the model sees the error, as TRL shows it
                e.tool_errors += 1
                content = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
        return {"role": "tool", "name": call.name or "unknown", "content": content if isinstance(content, str)
                else str(content)}

    def _score(self, e: Episode) -> None:
        """The environment's own reward, while its instance still holds the episode's state."""
        env = e.environment
        if env is None or e.end == "failed":
            return
        try:
            if callable(getattr(env, "get_reward", None)):
                e.env_reward = float(self._timed(e, env.get_reward))
            elif callable(getattr(env, "step", None)):  # a reset/step environment: its step rewards
                e.env_reward = e.step_reward
        except Exception as ex:  # noqa: BLE001
            e.finish("failed", f"get_reward: {type(ex).__name__}: {str(ex)[:300]}")
