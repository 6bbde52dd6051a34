"""Fault injection for the crash tests: BRIGADE_LEARNER_DIE_AT="<phase>@<step>" makes the learner
SIGKILL itself at that point of that step, so a test can check that a death there loses nothing
and trains nothing twice; "raise:<phase>@<step>" raises a RuntimeError there instead, an error that
escapes the learner the same way on every start (a crash loop, brigade.crash_loop). Unset (always,
outside tests), every crash point is a no-op."""

from __future__ import annotations

import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

log = structlog.get_logger()

ENV = "BRIGADE_LEARNER_DIE_AT"
RAISE = "raise:"  # the prefix of a point that raises rather than kills
# in the order a step passes them; mid_checkpoint: the checkpoint's files written, its manifest not
PHASES = ("before_train", "after_train", "mid_checkpoint", "after_checkpoint", "after_adapter",
          "after_publish", "after_ack")


@dataclass(frozen=True)
class CrashPoints:
    die_at: str = ""  # "<phase>@<step>", "raise:<phase>@<step>", or "" for never

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CrashPoints:
        die_at = environ.get(ENV, "")
        if die_at and die_at.removeprefix(RAISE).partition("@")[0] not in PHASES:
            log.warning("fault_injection_unknown_phase", value=die_at, phases=PHASES)
        return cls(die_at)

    def at(self, phase: str, step: int) -> None:
        assert phase in PHASES, phase
        point = f"{phase}@{step}"
        if self.die_at == point:
            log.warning("fault_injection_kill", phase=phase, step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.die_at == RAISE + point:
            raise RuntimeError(f"fault injected at {point} ({ENV})")
