"""A slower device around a real engine, for benchmarks and tests that need slow rollout workers.

`SlowEngine` lets the real engine generate (the real tokens, log-probs and rewards), then sleeps
until the simulated device would have finished: `factor` x the real generation time, or, with a
`DelayModel`, per_token_s x factor x the batch's longest completion (a deterministic draw from
its prompts, so the same batch takes the same time in every run and on a retry). The sleep checks
`should_stop` every 20 ms, so revocation and SIGTERM behave as on a slow device.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

SLEEP_SLICE_S = 0.02


@dataclass(frozen=True)
class DelayModel:
    """Simulated generation time of a batch: per_token_s x factor x decode_tokens(batch)."""

    per_token_s: float = 0.03
    median_tokens: float = 24.0
    sigma: float = 0.6          # lognormal shape: the tail of completion lengths
    cap_tokens: int = 96        # max_new_tokens of the simulated model

    def tokens(self, key: str) -> int:
        """The batch's longest completion in tokens, a deterministic draw from `key`."""
        h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
        u = (h + 0.5) / 2**64
        z = statistics.NormalDist().inv_cdf(u)
        return int(min(self.cap_tokens, max(1, round(self.median_tokens * math.exp(self.sigma * z)))))

    def seconds(self, key: str, factor: float = 1.0) -> float:
        return self.per_token_s * factor * self.tokens(key)

    def mean_tokens(self, n: int = 4000) -> float:
        return statistics.fmean(self.tokens(f"mean-{i}") for i in range(n))


def batch_key(prompts: Sequence[str]) -> str:
    """What identifies a batch to the delay model: its prompts (a batch id depends on the run id;
    the prompts of global batch n are the same in every run with the same seed)."""
    return "\x1f".join(prompts)


class SlowEngine:
    """An engine on a simulated device `factor` times slower (see the module docstring). With
    `log_path`, one JSON line per batch (real and simulated seconds, whether the real generation
    overran the simulated time)."""

    def __init__(self, inner, factor: float = 1.0, model: DelayModel | None = None, log_path: Path | None = None,
                 run: str = "", sleep: Callable[[float], None] = time.sleep):
        self.inner, self.factor, self.model = inner, factor, model
        self.log_path, self.run, self._sleep = log_path, run, sleep
        self._log_lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def tokenizer(self):
        return self.inner.tokenizer

    @property
    def version(self):
        return self.inner.version

    def load_adapter(self, version, state) -> None:
        self.inner.load_adapter(version, state)

    def generate(self, prompts, sampling, seed, adapter_version, should_stop):
        from brigade.engine.base import Stopped

        t0 = time.time()
        out = self.inner.generate(prompts, sampling, seed, adapter_version, should_stop)
        real = time.time() - t0
        key = batch_key(prompts)
        target = self.model.seconds(key, self.factor) if self.model is not None else self.factor * real
        while (left := t0 + target - time.time()) > 0:
            if should_stop():
                raise Stopped()
            self._sleep(min(left, SLEEP_SLICE_S))
        if self.log_path is not None:
            row = {"run": self.run, "t0": t0, "t1": time.time(), "real_s": real, "target_s": target,
                   "factor": self.factor, "overrun": real > target}
            if self.model is not None:
                row["tokens"] = self.model.tokens(key)
            with self._log_lock, self.log_path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        return out
