"""The fork server `brigade up` starts its torch services from: a child behaves as a process that
`LocalSystem` started itself (own session, its log, its environment, Popen's interface for
poll/wait/signals, the exit status reported back), and `up` sees the same thing either way."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from brigade_cli.forkserver import ForkServer
from brigade_harness.system import Service, process_env


@pytest.fixture(scope="module")
def server():
    s = ForkServer(process_env(dict(os.environ)))
    yield s
    s.close()
    assert not s.alive()


def test_a_forked_command_writes_its_log_and_reports_its_exit(server, tmp_path):
    log = tmp_path / "help.log"
    proc = server.spawn(["rollout", "--help"], dict(os.environ, COLUMNS="200"), log)
    assert proc.wait(60) == 0
    assert "--engine" in log.read_text()  # the rollout command ran in the child, its output in its log
    bad = server.spawn(["rollout", "--engine", "nope"], dict(os.environ), tmp_path / "bad.log")
    assert bad.wait(60) == 2  # typer's usage error, as from a fresh process


def test_a_forked_service_can_be_frozen_thawed_and_killed_like_a_process(server, tmp_path):
    env = dict(os.environ, BRIGADE_PROXY="127.0.0.1:9")
    svc = Service("janitor", "brigade_cli.main", ["janitor", "--redis-url", "redis://127.0.0.1:9/0"],
                  tmp_path / "janitor.log", env, forker=server)
    svc.start()
    try:
        _freeze_thaw_kill(svc)
    finally:  # a failed assertion must not leave a (frozen) janitor behind
        svc.proc.send_signal(signal.SIGCONT)
        svc.proc.kill()


def _freeze_thaw_kill(svc: Service) -> None:
    pid = svc.proc.pid
    deadline = time.monotonic() + 10  # the child sets itself up right after the fork returned its pid
    while open(f"/proc/{pid}/comm").read().strip() != "brigade-janitor" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert svc.alive() and os.getpgid(pid) == pid and os.getsid(pid) == pid  # its own session and group
    svc.signal(signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while open(f"/proc/{pid}/stat").read().split()[2] != "T" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert open(f"/proc/{pid}/stat").read().split()[2] == "T"
    svc.signal(signal.SIGCONT)
    with pytest.raises(subprocess.TimeoutExpired):
        svc.proc.wait(0.1)
    svc.proc.kill()
    assert svc.proc.wait(10) == -signal.SIGKILL and svc.crashed() and not svc.alive()
