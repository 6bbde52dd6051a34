"""A learner that crashes the same way on every start stops retrying (brigade.crash_loop): the real
`brigade learner` command against a real redis-server, the real proxy and a real bucket, with the
rollout workers played by test_learner_service's driver, and an error raised at a step
(BRIGADE_LEARNER_DIE_AT=raise:<phase>@<step>).

Four starts: the error at step 2 three times (exit 1, 1, 3), then a start without the fault, which
refuses at once with the same line (exit 3) and loads no model. (That another error or step breaks
the streak is tests/unit/test_crash_loop.py's.)
"""

from __future__ import annotations

import asyncio

import pytest
from proxy_support import new_run_id
from test_learner_service import learner_rig, run_learner

from brigade.crash_loop import CRASH_LOOP_REPEATS, CrashJournal

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.timeout(300)]

INJECTED = "RuntimeError: fault injected at before_train@{} (BRIGADE_LEARNER_DIE_AT)"


async def test_a_learner_crashing_the_same_way_three_times_stops(tmp_path, redis_url, file_bucket_url, monkeypatch):
    state = tmp_path / "state"
    monkeypatch.setenv("BRIGADE_STATE_DIR", str(state))  # run_learner's processes inherit it
    run = new_run_id("crashloop")
    lives = ["raise:before_train@2"] * CRASH_LOOP_REPEATS + [None]
    codes, lasts, loaded = [], [], []
    async with learner_rig(tmp_path, redis_url, file_bucket_url, run) as rig:
        log_path = rig.log_path
        for die_at in lives:
            rc, events = await asyncio.wait_for(
                run_learner(rig.addr, file_bucket_url, run, rig.spec_path, log_path, die_at), 120)
            codes.append(rc)
            lasts.append(events[-1])
            loaded.append(any(e.get("event") == "model_ready" for e in events))
    log = log_path.read_text()[-3000:]
    assert codes == [1, 1, 3, 3], log
    journal = CrashJournal(state, "learner", run).path
    for last in lasts[:2]:
        assert last["event"] == "crashed" and last["level"] == "error", log
        assert last["error"] == INJECTED.format(2) and last["step"] == 2
        assert last["where"].startswith("brigade_learner/crash.py:") and last["journal"] == str(journal)
    looped = lasts[2]
    assert looped["event"] == "crash_loop" and looped["error"] == INJECTED.format(2) and looped["step"] == 2
    assert looped["where"] == lasts[1]["where"] and looped["journal"] == str(journal)
    assert "3 times in a row; not retrying" in looped["note"] and f"remove {journal}" in looped["note"]
    # the next start says the same and goes no further: no model loaded, nothing trained
    assert {k: v for k, v in lasts[3].items() if k != "timestamp"} == {k: v for k, v in looped.items()
                                                                       if k != "timestamp"}
    assert loaded == [True, True, True, False]
    assert len(CrashJournal(state, "learner", run).crashes()) == CRASH_LOOP_REPEATS
