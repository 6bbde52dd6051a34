"""Reward functions, shared by the rollout worker and the evaluator.

A reward function has TRL's signature, called with keywords:

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns) -> list[float | None]

one entry per completion; `columns` are the dataset columns (Prompt.columns, e.g. "answer"), each
repeated per completion like `prompts`. None means "not scored"; the learner drops such samples.

A run names its functions in `spec.rewards` (function, weight, sandboxed, timeout_s): a built-in
name (see BUILTINS) or an import path "package.module:function". The combined reward is the
weighted sum, None if any part is None; each part is kept (NaN for None) in the rollout.

Containment: nothing a reward function does may take the worker down.
- In-process functions (sandboxed=false) run in a thread with `timeout_s`; an exception, a timeout,
  a wrong-length result gives None for the whole call, logged; NaN/inf entries become None.
- Sandboxed functions (sandboxed=true: slow or unsafe code) run as rq jobs (job_timeout=timeout_s)
  in an rq worker process, on the Redis queue `brigade:{run}:rewards`. A rollout worker given a
  Redis URL starts its own rq worker subprocess on that queue (killed with it); more can be added on
  any host with `rq worker --url $BRIGADE_REDIS_URL brigade:{run}:rewards` (they need brigade and
  the reward's package importable). A job that fails, times out, or is not picked up within
  timeout_s + QUEUE_GRACE_S gives None, logged.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import structlog

from brigade.proc import die_with_parent

log = structlog.get_logger()

BUILTINS = {
    "demo_sum": "brigade.demo.task:demo_reward",
    "math": "brigade.rewards:math_reward",
    "code_exec": "brigade.rewards:code_exec_reward",
}
QUEUE_GRACE_S = 10.0  # how long a sandboxed job may wait in the queue before its own timeout starts


def reward_queue(run: str) -> str:
    return f"brigade:{run}:rewards"


def resolve(name: str) -> Callable[..., list]:
    """A built-in name or "package.module:function" -> the function (ValueError if unknown)."""
    target = BUILTINS.get(name, name)
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"reward function {name!r}: use a built-in ({', '.join(BUILTINS)}) or 'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward function {name!r} cannot be imported: {e}") from e
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is not callable")
    return fn


def clean(values: Any, n: int) -> list[float | None]:
    """Check a reward function's result: a list of n numbers or None; NaN/inf become None."""
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise ValueError(f"expected a list of {n} rewards, got {got}")
    out: list[float | None] = []
    for v in values:
        try:
            f = None if v is None else float(v)
        except (TypeError, ValueError):
            f = None
        out.append(f if f is not None and math.isfinite(f) else None)
    return out


def run_reward_job(function: str, prompts: list[str], completions: list[str], completion_ids: list[list[int]] | None,
                   columns: dict[str, list]) -> list[float | None]:
    """What a sandboxed rq job runs (in the rq worker's process)."""
    fn = resolve(function)
    return clean(fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns), len(completions))


# ---------------------------------------------------------------- built-in: math

_BOXED = re.compile(r"\\boxed\s*\{")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_FRAC = re.compile(r"^\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}$")


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def to_number(text: str) -> float | None:
    s = text.strip().strip("$").strip().rstrip(".").replace("\\!", "").replace("\\,", "").replace(" ", "")
    s = s.removeprefix("\\left").removesuffix("\\right")
    if m := _FRAC.match(s):
        num, den = to_number(m.group(1)), to_number(m.group(2))
        return None if num is None or not den else num / den
    s = s.removesuffix("\\%").removesuffix("%").replace(",", "")  # "50%" reads as 50, like "50 percent"
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            value = float(num) / float(den)
        else:
            value = float(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def extract_answer(completion: str) -> str | None:
    """The \\boxed{} answer if any, else the last number in the text."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def answers_match(predicted: str, reference: str, rel_tol: float = 1e-6) -> bool:
    a, b = to_number(predicted), to_number(reference)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)
    norm = lambda s: re.sub(r"[\s$]", "", s).lower()  # noqa: E731 - symbolic answers: compare text
    return norm(predicted) == norm(reference)


def math_reward(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
    """1.0 when the final answer (\\boxed{} or last number) equals columns["answer"] numerically
    ("1,000", "1000.0", "$1000$", "\\frac{1}{2}" vs "0.5" all match), else 0.0; None without an answer."""
    answers = columns.get("answer") or [None] * len(completions)
    out: list[float | None] = []
    for text, ref in zip(completions, answers, strict=True):
        if ref is None or str(ref).strip() == "":
            out.append(None)
            continue
        got = extract_answer(text)
        out.append(float(got is not None and answers_match(got, str(ref))))
    return out


# ---------------------------------------------------------------- built-in: code execution

CODE_CPU_S = 2             # RLIMIT_CPU per program
CODE_WALL_S = 5.0          # wall-clock limit per program (sleeping does not use CPU)
CODE_MEMORY = 512 << 20    # RLIMIT_AS
CODE_OUTPUT = 1 << 20      # RLIMIT_FSIZE: files it may write
_CODE_BLOCK = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.S)


def extract_code(completion: str) -> str:
    blocks = _CODE_BLOCK.findall(completion)
    return blocks[-1] if blocks else completion


def _limit_child() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_CPU, (CODE_CPU_S, CODE_CPU_S))
    resource.setrlimit(resource.RLIMIT_AS, (CODE_MEMORY, CODE_MEMORY))
    resource.setrlimit(resource.RLIMIT_FSIZE, (CODE_OUTPUT, CODE_OUTPUT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_python(code: str, timeout_s: float = CODE_WALL_S) -> tuple[int | None, str]:
    """Run `code` with `python -I` in a scratch folder under resource limits: (exit code or None on
    timeout, stdout). The process group is killed on timeout, so forks die too."""
    with tempfile.TemporaryDirectory(prefix="brigade-code-") as tmp:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", code], cwd=tmp, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin", "HOME": tmp}, preexec_fn=_limit_child,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return None, ""
    return proc.returncode, out[:CODE_OUTPUT].decode(errors="replace")


def code_exec_reward(prompts, completions, completion_ids=None, **columns) -> list[float | None]:
    """1.0 when the completion's code (last ```python block, or the whole text) exits 0 and prints
    columns["answer"] (surrounding whitespace ignored), else 0.0; None without an answer. Meant to
    run sandboxed (an rq job); each program also gets its own CPU, memory and wall-clock limits."""
    answers = columns.get("answer") or [None] * len(completions)

    def one(text: str, ref) -> float | None:
        if ref is None:
            return None
        code, out = run_python(extract_code(text))
        return float(code == 0 and out.strip() == str(ref).strip())

    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, completions, answers))


# ---------------------------------------------------------------- the set a run uses


@dataclass
class Scores:
    names: list[str]
    parts: list[list[float | None]]   # [K][N]: each function's rewards
    weights: list[float]

    @property
    def total(self) -> list[float | None]:
        """Weighted sum per completion; None where any part is None."""
        out = []
        for values in zip(*self.parts, strict=True):
            out.append(None if any(v is None for v in values) else sum(w * v for w, v in zip(self.weights, values, strict=True)))
        return out


@dataclass
class RewardFn:
    name: str
    weight: float = 1.0
    sandboxed: bool = False
    timeout_s: float = 10.0
    fn: Callable[..., list] | None = field(default=None, repr=False)  # resolved at build time (in-process only)


class RewardSet:
    """The reward functions of a run. `score` never raises for a reward's fault."""

    def __init__(self, functions: Sequence[RewardFn], sandbox: RqSandbox | None = None):
        self.functions, self.sandbox = list(functions), sandbox
        if any(f.sandboxed for f in self.functions) and sandbox is None:
            raise ValueError("sandboxed reward functions need a Redis URL for their rq queue (--redis-url)")

    @classmethod
    def from_specs(cls, specs, sandbox: RqSandbox | None = None) -> RewardSet:
        """From RewardSpec messages (or anything with function/weight/sandboxed/timeout_s)."""
        functions = []
        for s in specs:
            f = RewardFn(s.function, s.weight, s.sandboxed, s.timeout_s or 10.0)
            if not f.sandboxed:
                f.fn = resolve(f.name)  # fail at start, not on the first batch
            functions.append(f)
        return cls(functions, sandbox)

    @property
    def names(self) -> list[str]:
        return [f.name for f in self.functions]

    async def score(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]] | None,
                    columns: dict[str, list]) -> Scores:
        parts = await asyncio.gather(*(self._one(f, prompts, completions, completion_ids, columns) for f in self.functions))
        return Scores(self.names, list(parts), [f.weight for f in self.functions])

    async def _one(self, f: RewardFn, prompts, completions, completion_ids, columns) -> list[float | None]:
        n = len(completions)
        try:
            if f.sandboxed:
                raw = await self.sandbox.call(f.name, prompts, completions, completion_ids, columns, f.timeout_s)
            else:
                raw = await asyncio.wait_for(_in_daemon_thread(
                    f.fn, prompts=prompts, completions=completions, completion_ids=completion_ids, **columns), f.timeout_s)
            values = clean(raw, n)
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            log.warning("reward function timed out", reward=f.name, timeout_s=f.timeout_s, sandboxed=f.sandboxed)
            return [None] * n
        except Exception as e:  # any failure of user code is contained here
            log.warning("reward function failed", reward=f.name, error=f"{type(e).__name__}: {e}", sandboxed=f.sandboxed)
            return [None] * n
        return values

    async def close(self) -> None:
        if self.sandbox is not None:
            await asyncio.to_thread(self.sandbox.close)


def _in_daemon_thread(fn: Callable, **kwargs) -> asyncio.Future:
    """Run fn in its own daemon thread: the event loop (heartbeats) keeps going, and a hung function
    is abandoned after its timeout without holding up the process's exit, which the default
    executor's threads would (asyncio.run joins them)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(**kwargs), None
        except BaseException as e:  # handed to the awaiting task, which contains it
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut


# ---------------------------------------------------------------- rq sandbox


class RqSandbox:
    """Runs reward calls as rq jobs on `queue`; optionally owns an rq worker subprocess for it."""

    def __init__(self, redis_url: str, queue: str, start_worker: bool = True, poll_s: float = 0.05):
        from redis import Redis
        from rq import Queue

        self.redis_url, self.queue_name, self.poll_s = redis_url, queue, poll_s
        self.redis = Redis.from_url(redis_url)
        self.queue = Queue(queue, connection=self.redis)
        self.worker: subprocess.Popen | None = None
        if start_worker:
            self.start_worker()

    def start_worker(self) -> None:
        # the rq worker dies with us (PDEATHSIG), so a SIGKILLed rollout worker leaves no orphan
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "brigade.rq_worker", "--url", self.redis_url, "--quiet", "--service", "rewards",
             "--name", f"{self.queue_name}:{os.uname().nodename}:{os.getpid()}", self.queue_name],
            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )

    async def call(self, function: str, prompts, completions, completion_ids, columns, timeout_s: float) -> list:
        from rq.job import JobStatus

        if self.worker is not None and self.worker.poll() is not None:
            log.warning("rq reward worker exited; restarting it", code=self.worker.returncode)
            self.start_worker()
        job = await asyncio.to_thread(
            self.queue.enqueue, "brigade.rewards.run_reward_job",
            kwargs=dict(function=function, prompts=list(prompts), completions=list(completions),
                        completion_ids=completion_ids, columns=columns),
            job_timeout=max(1, math.ceil(timeout_s)), result_ttl=300, failure_ttl=3600,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s + QUEUE_GRACE_S
        try:
            while loop.time() < deadline:
                status = await asyncio.to_thread(job.get_status)
                if status == JobStatus.FINISHED:
                    return await asyncio.to_thread(job.return_value)
                if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                    result = await asyncio.to_thread(job.latest_result)
                    reason = (getattr(result, "exc_string", "") or str(status)).strip().splitlines()[-1:]
                    raise RuntimeError(f"rq job {job.id} {status}: {' '.join(reason)}")
                await asyncio.sleep(self.poll_s)
            raise TimeoutError()
        finally:
            if job.get_status(refresh=False) not in (JobStatus.FINISHED, JobStatus.FAILED):
                await asyncio.to_thread(_cancel, job, self.redis)

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(3)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        self.redis.close()


def _cancel(job, redis) -> None:
    """Best effort: drop a queued job, stop a running one (the worker kills its work horse)."""
    from rq.command import send_stop_job_command

    for action in (job.cancel, lambda: send_stop_job_command(redis, job.id)):
        try:
            action()
        except Exception:  # already finished, gone, or not running: nothing to stop
            pass
