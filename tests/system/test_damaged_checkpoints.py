"""A damaged checkpoint costs the steps since the one before it, never the run.

A real run (every service a process, as in test_chaos). Four times, once the learner has acked a
few more steps, it is SIGKILLed and one file of its newest checkpoint (state.json, the optimizer
state, the adapter, the manifest itself, in turn) is cut in half behind its back. Each restart must
resume from the checkpoint before the damaged one, train that step again, save it beside the damaged
folder as its next attempt (nothing is overwritten), and the run must finish with a clean audit:
nothing trained twice in the lineage, every batch accounted for, versions contiguous.
"""

from __future__ import annotations

import json
import time
import uuid

import pytest
from chaos_support import chaos_spec, show_report

from brigade_learner import checkpoint
from brigade_testing.audited_system import AuditedSystem

MAX_STEPS = 12
DAMAGES = ((2, checkpoint.STATE), (4, checkpoint.OPTIMIZER), (6, checkpoint.ADAPTER), (8, checkpoint.MANIFEST))
WORKER_SPEED = 200.0
TIMEOUT_S = 300

pytestmark = pytest.mark.timeout(TIMEOUT_S + 120)


def wait_for_event(system: AuditedSystem, service: str, event: str, timeout: float = 120) -> dict:
    """The first `event` a service logs from now on."""
    seen: list[dict] = []

    def logged() -> bool:
        seen.extend(e for e in system.log_events(service) if e.get("event") == event)
        return bool(seen)

    system.wait_until(logged, timeout, f"{service} to log {event}")
    return seen[0]


def test_a_damaged_newest_checkpoint_costs_one_step(tmp_path, one_torch_thread, capsys):
    t0 = time.monotonic()
    spec = chaos_spec(f"damaged-{uuid.uuid4().hex[:8]}", MAX_STEPS, staleness={"lease_seconds": 5})
    speeds = {i: ["--speed-factor", str(WORKER_SPEED)] for i in range(2)}
    damaged = []
    with AuditedSystem(tmp_path, spec, workers=2, worker_args=speeds) as system:
        system.start()
        for at_step, name in DAMAGES:
            system.wait_until(lambda at=at_step: system.learner_step() >= at, TIMEOUT_S, f"learner step {at_step}")
            system.kill("learner")
            step, attempt = system.damage_newest_checkpoint(name)
            system.log_events("learner")  # what the dead learner wrote is not the restart's
            system.restart("learner")
            resumed = wait_for_event(system, "learner", "resumed")
            damaged.append({"file": name, "step": step, "attempt": attempt, "resumed_at": resumed["step"]})
        system.finish(timeout=TIMEOUT_S)
        report = system.audit()
        set_aside = [e for e in system.log_events("learner", new_only=False) if e.get("event") == "checkpoint_set_aside"]
    problems = report.pop("problems")
    report.pop("rejection_reasons")
    report.update(mode="damaged-checkpoints", damaged=damaged, wall_s=round(time.monotonic() - t0, 1))
    show_report(capsys, "DAMAGED " + json.dumps(report))
    assert not problems, "\n".join(problems)
    # each damage cost exactly the steps since the checkpoint before it (one: checkpoint_every 1)
    assert [d["resumed_at"] for d in damaged] == [d["step"] - 1 for d in damaged], damaged
    # and each damaged step was saved again beside its damaged folder, which stays as it was
    assert {(e["step"], e["attempt"]) for e in set_aside} == {(d["step"], d["attempt"]) for d in damaged}
    assert sorted(report["retrained_steps"]) == sorted(d["step"] for d in damaged)
    assert report["steps"] == MAX_STEPS and report["checkpoints_loaded"] == MAX_STEPS
    assert report["duplicates"] == 0 and report["vanished"] == 0 and report["overwritten"] == 0
