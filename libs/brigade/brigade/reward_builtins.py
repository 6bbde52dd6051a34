"""The built-in reward functions a run spec names without an import path: `math` (the last
\\boxed{} or number of a completion against the dataset's `answer`) and `code_exec` (a completion's
Python program, run under resource limits, its output against `answer`). Both follow TRL's reward
contract, like any user function (brigade.rewards)."""

from __future__ import annotations

import math
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

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
