"""The crash journal (brigade.crash_loop) on real errors raised by real code: the learner's fault
injection, a Redis that is not there, a gRPC server that is not there, a file that is not there. A
crash loop is the same error at the same place and step CRASH_LOOP_REPEATS times in a row; outages are
recorded and never make one; a clean exit clears the journal."""

from __future__ import annotations

import json

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.backoff import NoBackoff
from redis.retry import Retry
from structlog.testing import capture_logs

from brigade import crash_loop
from brigade.crash_loop import CRASH_LOOP_REPEATS, JOURNAL_KEEP, CrashJournal
from brigade_harness.devservers import free_port
from brigade_learner.crash import CrashPoints


@pytest.fixture(autouse=True)
def no_step():
    """The step is process-wide: each test starts without one and leaves none behind."""
    crash_loop.at_step(None)
    yield
    crash_loop.at_step(None)


def injected(phase: str = "before_train", step: int = 2) -> RuntimeError:
    """The error the learner's fault injection raises at `phase@step`, with its traceback."""
    try:
        CrashPoints(f"raise:{phase}@{step}").at(phase, step)
    except RuntimeError as e:
        return e
    raise AssertionError("the crash point did not raise")


def redis_away() -> Exception:
    try:  # (no retries: redis-py's own would take seconds to give up)
        redis.Redis(port=free_port(), retry=Retry(NoBackoff(), 0)).ping()
    except redis.exceptions.ConnectionError as e:
        return e
    raise AssertionError("a Redis answered on a free port")


def proxy_away() -> Exception:
    with grpc.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            return e
    raise AssertionError("a server answered on a free port")


def missing_file(tmp_path) -> Exception:
    try:
        (tmp_path / "no-model" / "config.json").read_text()
    except OSError as e:
        return e
    raise AssertionError("the file exists")


def test_the_same_crash_three_times_is_a_loop(tmp_path):
    journal = CrashJournal(tmp_path, "learner", "run-a")
    crash_loop.at_step(2)
    with capture_logs() as lines:
        codes = [journal.crashed(injected()) for _ in range(CRASH_LOOP_REPEATS)]
    assert codes == [1] * (CRASH_LOOP_REPEATS - 1) + [3]
    assert [line["event"] for line in lines] == ["crashed"] * (CRASH_LOOP_REPEATS - 1) + ["crash_loop"]
    crashed, looped = lines[0], lines[-1]
    assert crashed["error"] == "RuntimeError: fault injected at before_train@2 (BRIGADE_LEARNER_DIE_AT)"
    assert crashed["where"].startswith("brigade_learner/crash.py:") and crashed["where"].endswith(" in CrashPoints.at")
    assert crashed["step"] == 2 and crashed["journal"] == str(tmp_path / "crashes" / "learner-run-a.jsonl")
    assert "traceback" not in crashed  # kept in the journal, not logged
    assert {k: looped[k] for k in ("error", "where", "step")} == {k: crashed[k] for k in ("error", "where", "step")}
    assert f"{CRASH_LOOP_REPEATS} times in a row; not retrying" in looped["note"] and str(journal.path) in looped["note"]

    records = [json.loads(line) for line in journal.path.read_text().splitlines()]
    assert len(records) == CRASH_LOOP_REPEATS and all(r["service"] == "learner" and r["run"] == "run-a" for r in records)
    assert "Traceback (most recent call last)" in records[0]["traceback"] and "crash.py" in records[0]["traceback"]
    assert journal.loop() is not None  # the next start refuses (brigade.service.crash_journal)


def test_another_step_or_error_breaks_the_streak(tmp_path):
    journal = CrashJournal(tmp_path, "learner", "run-b")
    for step in (2, 2, 3, 3):  # the same error, where and message at another step
        crash_loop.at_step(step)
        assert journal.crashed(injected("after_train", 1)) == 1
    assert journal.crashed(injected("after_ack", 1)) == 1  # another error at the same step
    assert journal.loop() is None
    crash_loop.at_step(4)
    assert [journal.crashed(injected("after_train", 1)) for _ in range(CRASH_LOOP_REPEATS)] == [1, 1, 3]


def test_outages_are_recorded_and_never_loop(tmp_path):
    journal = CrashJournal(tmp_path, "janitor")
    assert journal.path.name == "janitor-all.jsonl"
    for error in (redis_away, proxy_away, lambda: ConnectionRefusedError(111, "Connection refused")):
        with capture_logs() as lines:
            codes = [journal.crashed(error()) for _ in range(CRASH_LOOP_REPEATS + 1)]
        assert codes == [1] * (CRASH_LOOP_REPEATS + 1)
        assert all(line["event"] == "crashed" and line["outage"] for line in lines)
    assert journal.loop() is None and all(c.outage for c in journal.crashes())
    # a missing file is no outage: restarting will not make it appear
    assert [journal.crashed(missing_file(tmp_path)) for _ in range(CRASH_LOOP_REPEATS)] == [1, 1, 3]


def test_an_outage_wrapped_in_another_error_is_still_one(tmp_path):
    try:
        try:
            raise redis_away()
        except redis.exceptions.ConnectionError as e:
            raise RuntimeError("sweep failed") from e
    except RuntimeError as e:
        wrapped = e
    assert crash_loop.is_outage(wrapped) and not crash_loop.is_outage(injected())


def test_run_clears_on_a_clean_exit_and_keeps_the_rest(tmp_path):
    journal = CrashJournal(tmp_path, "rollout", "run-c", "gpu-0")
    assert journal.path.name == "rollout-run-c-gpu-0.jsonl"

    def crash() -> int:
        raise injected()

    assert journal.run(crash) == 1 and len(journal.crashes()) == 1
    assert journal.run(lambda: 2) == 2 and len(journal.crashes()) == 1  # a bad configuration is no crash
    assert journal.run(lambda: 143) == 143 and len(journal.crashes()) == 1  # nor a signal
    assert journal.run(lambda: 0) == 0 and not journal.path.exists()  # done: whatever failed is behind it

    def interrupted() -> int:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # an exit of the process, not a crash
        journal.run(interrupted)
    assert not journal.path.exists()


def test_the_journal_stays_small_and_survives_a_torn_line(tmp_path):
    journal = CrashJournal(tmp_path, "proxy", "", "1")
    for _ in range(JOURNAL_KEEP + 5):
        journal.record(redis_away())
    assert len(journal.crashes()) == JOURNAL_KEEP
    with journal.path.open("a") as f:
        f.write('{"service": "proxy", "run": nu')  # a kill in the middle of a write
    crash_loop.at_step(7)
    journal.record(injected())
    assert len(journal.crashes()) == JOURNAL_KEEP and journal.crashes()[-1].step == 7
