"""LocalSystem on real processes: its own redis-server or a given one, and kill, freeze, thaw,
restart, supervision and the ordered stop, on stand-in services (`python -m timeit` running a
statement: a real process that sleeps or exits with an error, or refusing a flag: exit 2)."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from brigade_harness.system import LocalSystem, redis_answers

SLEEP = ["-n", "1", "import time; time.sleep(120)"]
FAIL = ["-n", "1", "raise SystemExit(3)"]
BAD_FLAG = ["--bogus"]  # timeit exits 2, as a service does on a bad configuration


def state(pid: int) -> str:
    """The kernel's process state letter (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, stopped: bool, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while (state(pid) == "T") != stopped:
        assert time.monotonic() < deadline, f"process {pid} state {state(pid)}"
        time.sleep(0.02)


def test_kill_freeze_restart_and_supervise(tmp_path):
    with LocalSystem(tmp_path) as system:
        system.start_servers()
        assert system.redis is not None and redis_answers(system.redis_url)
        with LocalSystem(tmp_path / "second", redis_url=system.redis_url) as second:
            second.start_servers()
            assert second.redis is None and second.redis_url == system.redis_url  # the given one answered

        worker = system.spawn("rollout-0", SLEEP, module="timeit")
        assert worker.env["BRIGADE_REDIS_URL"] == system.redis_url and worker.env["BRIGADE_PROXY"] == system.proxy
        system.freeze(["rollout-0"])
        wait_state(worker.proc.pid, stopped=True)
        system.thaw(["rollout-0"])
        wait_state(worker.proc.pid, stopped=False)
        system.freeze(["rollout-0"])
        system.kill("rollout-0")  # a frozen process is killed too
        assert worker.proc.returncode == -signal.SIGKILL and worker.kills == 1 and worker.crashed()
        first_pid = worker.proc.pid
        system.restart("rollout-0")
        assert worker.alive() and worker.proc.pid != first_pid and worker.starts == 2

        learner = system.spawn("learner", FAIL, module="timeit")
        learner.proc.wait(30)
        assert learner.crashed()
        assert system.restart_crashed(max_restarts=1) is None and learner.starts == 2
        learner.proc.wait(30)
        assert system.restart_crashed(max_restarts=1) == \
            f"learner exited with 1 2 times; its log: {learner.log}"
        assert "SystemExit: 3" in learner.tail()
    assert not worker.alive() and worker.proc.returncode == -signal.SIGTERM   # stopped by close()
    assert system.redis.proc.poll() is not None


def test_supervision_does_not_restart_what_a_restart_would_repeat(tmp_path):
    """Exit 2 (a bad configuration) and 3 (a crash loop) end the supervision with the service's last line."""
    with LocalSystem(tmp_path) as system:
        refused = system.spawn("janitor", BAD_FLAG, module="timeit")
        assert refused.env["BRIGADE_STATE_DIR"] == str(tmp_path / "state")  # the run's own crash journals
        refused.proc.wait(30)
        assert system.restart_crashed(max_restarts=3) == \
            "janitor exited with 2 (a bad configuration), not restarted: use -h/--help for command line help"
        assert refused.starts == 1
