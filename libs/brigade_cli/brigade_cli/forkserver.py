"""A fork server for `brigade up`: one process imports torch, transformers and the services once,
then forks the learner, the rollout workers and the evaluator on request, so none of them pays
the import (seconds each, and several at once on a few cores) before its first step.

    server = ForkServer(env)                       # starts importing at once, in its own process
    proc = server.spawn(["learner", ...], env, log)  # a child: Popen's interface (poll, wait, signals)

Fork-safety, which is why this is a process of its own and not `up` itself:
- the server never runs a torch op, opens a socket to Redis or the proxy, or starts a thread
  before it forks (OMP_NUM_THREADS=1 keeps OpenMP from starting a pool at import; the server
  checks that it is single-threaded before each fork and refuses otherwise); `up` has gRPC threads;
- each child starts a new session (its own process group, as `start_new_session=True`), gets the
  default signal dispositions back, SIGTERM when the server dies (so when `up` dies), its own stdout/stderr (the service's log), environment and
  working directory, and fresh seeds for `random`, numpy and torch;
- a child runs the `brigade` command as `python -m brigade_cli.main` would and leaves with
  `os._exit` after the atexit handlers, so nothing of the server's state is torn down twice.

The server reaps its children and writes each exit status to `exits/<pid>` (as Popen.returncode:
negative for a signal), which is how `ForkedProcess.poll` learns it; a child whose server is gone
is reported as killed once its pid no longer exists.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the `brigade` commands that need torch; the proxy and the janitor start as plain processes
FORKED = {"learner", "rollout", "evaluator", "trainer", "aggregator"}
PRELOAD = [
    "torch", "transformers", "peft", "safetensors.torch", "transformers.models.llama.modeling_llama",
    "brigade.model", "brigade.engine.hf", "brigade.rewards", "brigade_learner.learner", "brigade_learner.trainer",
    "brigade_rollout.worker", "brigade_evaluator.cli", "brigade_evaluator.evaluate", "brigade_learner.local",
    "brigade_aggregator.aggregator", "brigade_cli.main",
]


class ForkedProcess:
    """The part of `subprocess.Popen` that `brigade_harness.system.Service` uses, for a fork server's
    child."""

    def __init__(self, pid: int, server: ForkServer):
        self.pid, self.server = pid, server
        self.returncode: int | None = None
        self.args = ["<forked>", str(pid)]

    def poll(self) -> int | None:
        if self.returncode is None:
            status = self.server.exits / str(self.pid)
            if status.exists():
                self.returncode = int(status.read_text())
            elif not self.server.alive():  # nobody reaps it any more: gone means killed
                try:
                    os.kill(self.pid, 0)
                except ProcessLookupError:
                    self.returncode = -signal.SIGKILL
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """Start the server process (`python -m brigade_cli.forkserver`) in `env`; `spawn` waits until
    it has imported everything and forks a child per call. A `brigade_harness.system.LocalSystem`
    given it as its forker starts the commands it `forks` from it."""

    def __init__(self, env: dict[str, str]):
        self.dir = Path(tempfile.mkdtemp(prefix="brigade-fork-"))  # short: a unix socket path is <= 107 bytes
        self.sock, self.exits, self.log = self.dir / "sock", self.dir / "exits", self.dir / "server.log"
        self.exits.mkdir()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "brigade_cli.forkserver", str(self.sock),
                                          str(self.exits)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    @staticmethod
    def forks(module: str, args: list[str]) -> bool:
        """Whether `python -m module *args` is a command this server forks: a `brigade` command that
        needs torch."""
        return module == "brigade_cli.main" and bool(args) and args[0] in FORKED

    def spawn(self, args: list[str], env: dict[str, str], log: Path, timeout: float = 120.0) -> ForkedProcess:
        request = json.dumps({"args": args, "env": env, "log": str(log), "cwd": os.getcwd()}).encode() + b"\n"
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
                raise RuntimeError(f"the fork server exited with {self.proc.returncode}: {tail}")
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                    s.connect(str(self.sock))
                    s.sendall(request)
                    reply = json.loads(_read_line(s))
                break
            except (FileNotFoundError, ConnectionRefusedError):  # still importing
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the fork server did not answer within {timeout:.0f}s") from None
                time.sleep(0.02)
        if "error" in reply:
            raise RuntimeError(f"the fork server refused to fork: {reply['error']}")
        return ForkedProcess(int(reply["pid"]), self)

    def close(self) -> None:
        """Stop the server (its children are in their own sessions and are not touched)."""
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read_line(s: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = s.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf


# ---------------------------------------------------------------- the server process


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _child(request: dict) -> None:
    """In the forked child: become the service, then leave without running the server's teardown."""
    code = 1
    try:
        os.setsid()
        _term_with_parent()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        with contextlib.suppress(OSError):  # `ps -o comm` and psutil's name() tell the services apart
            Path("/proc/self/comm").write_text(f"brigade-{request['args'][0]}"[:15])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _reseed()
        sys.argv = ["brigade", *request["args"]]
        from brigade_cli.main import app

        try:
            app(args=request["args"], prog_name="brigade")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the child's last word goes to its log
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _term_with_parent() -> None:
    """SIGTERM (a clean stop: leases handed back) when the fork server dies, which it does when `up`
    dies, even by SIGKILL: no service outlives the `up` that started it."""
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _reseed() -> None:
    """Every child draws its own random numbers (random reseeds itself at fork; numpy and torch do not)."""
    seed = int.from_bytes(os.urandom(8), "little") & (2**63 - 1)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(seed % 2**32)
    with contextlib.suppress(ImportError):
        import torch

        torch.manual_seed(seed)


def _reap(exits: Path) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = exits / f".{pid}"
        tmp.write_text(str(os.waitstatus_to_exitcode(status)))
        tmp.rename(exits / str(pid))


def serve(sock_path: str, exits: str) -> None:
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a service not installed here: its command says so when it is run
            print(f"fork server: not preloaded: {name}: {e}", file=sys.stderr, flush=True)
    exit_dir = Path(exits)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = sock_path + ".tmp"
    server.bind(tmp)
    server.listen(16)
    os.rename(tmp, sock_path)  # connectable only once everything is imported
    parent = os.getppid()
    while os.getppid() == parent:  # `up` gone (even SIGKILLed): so are we; the children stop on their own
        _reap(exit_dir)
        ready, _, _ = select.select([server], [], [], 0.05)
        if not ready:
            continue
        conn, _ = server.accept()
        with conn:
            try:
                request = json.loads(_read_line(conn))
                if (n := _threads()) > 1:  # a fork would copy locks held by threads that do not follow
                    raise RuntimeError(f"the fork server has {n} threads; set OMP_NUM_THREADS=1")
                pid = os.fork()
                if pid == 0:
                    server.close()
                    conn.close()
                    _child(request)
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            except Exception as e:  # noqa: BLE001 - a bad request costs that request
                conn.sendall(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode() + b"\n")


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
