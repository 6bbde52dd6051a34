"""The learner's crash points: armed only by BRIGADE_LEARNER_DIE_AT, and only at that phase of that step,
where they SIGKILL the process or (`raise:`) raise an error."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from brigade_learner.crash import ENV, PHASES, RAISE, CrashPoints

SCRIPT = """
from brigade_learner.crash import CrashPoints
crash = CrashPoints.from_env()
for step in (1, 2):
    for phase in ("before_train", "after_train", "mid_checkpoint"):
        crash.at(phase, step)
        print(f"passed {phase}@{step}", flush=True)
"""


def test_the_process_dies_exactly_at_the_named_point():
    env = {**os.environ, ENV: "after_train@2"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    passed = [line.split()[1] for line in proc.stdout.splitlines() if line.startswith("passed ")]
    assert passed == ["before_train@1", "after_train@1", "mid_checkpoint@1", "before_train@2"]
    assert "fault_injection_kill" in proc.stdout


def test_the_raise_form_raises_exactly_at_the_named_point():
    crash = CrashPoints.from_env({ENV: f"{RAISE}after_train@2"})
    for phase, step in (("after_train", 1), ("before_train", 2), ("mid_checkpoint", 2)):
        crash.at(phase, step)
    with pytest.raises(RuntimeError, match=f"fault injected at after_train@2 \\({ENV}\\)"):
        crash.at("after_train", 2)


def test_unset_or_elsewhere_is_a_no_op():
    for crash in (CrashPoints.from_env({}), CrashPoints.from_env({ENV: "after_ack@9"})):
        for phase in PHASES:
            crash.at(phase, 1)


def test_an_unknown_phase_is_a_bug_in_the_caller():
    with pytest.raises(AssertionError):
        CrashPoints().at("after_lunch", 1)
