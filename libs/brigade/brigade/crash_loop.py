"""Crashes and crash loops: the one line an error that escapes a service ends it with, and the
journal that tells a restart which repeats a crash exactly from one that may get further.

    journal = CrashJournal(state_dir(cfg.state_dir), "learner", cfg.run)
    if (looping := journal.loop()) is not None:     # at start, before loading anything
        return journal.refuse(looping)              # the crash_loop line; exit 3
    return journal.run(main)                        # main() -> its exit status; an error escaping it is a crash

A crash is one `crashed` line (its error as "Type: message", where: the innermost frame in
brigade's own packages, the step the service was at, the journal's path) and a record appended to
the service's journal, `<state dir>/crashes/<service>-<run>.jsonl`, with the full traceback; exit 1,
so a supervisor restarts it. When the newest CRASH_LOOP_REPEATS records are the same error at the
same place and step, another restart would only repeat it: the service says `crash_loop` and exits
3, and every later start refuses with that line at once, until someone removes the journal. An
error that heals by itself (`is_outage`: the network, Redis, the proxy or the bucket away) is
recorded but never counts toward a loop, so a long outage never stops a service for good. A clean
exit (0) removes the journal.

The step is a process-wide value the service sets as it goes (`at_step`): the learner's step, the
aggregator's round; it stays None in services without one.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import structlog

log = structlog.get_logger()

CRASH_LOOP_REPEATS = 3  # the same crash this many times in a row is a crash loop
EXIT_CRASHED = 1
EXIT_CRASH_LOOP = 3
ERROR_CHARS = 300  # of an error's message, in the line and the fingerprint
JOURNAL_KEEP = 20  # records a journal keeps (a long outage restarts a service many times)
OWN_PACKAGE = re.compile(r"brigade(_\w+)?$")  # brigade, brigade_learner, brigade_proxy, ...
# OSErrors of the network, not of the machine: a missing model folder or a full disk is no outage
NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
                  errno.EHOSTUNREACH, errno.EHOSTDOWN, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET}

_step: int | None = None


def at_step(step: int | None) -> None:
    """The step (round, version) this process is working on, for its crash record."""
    global _step
    _step = step


def state_dir(setting: str = "") -> Path:
    """The folder of a service's own state on this machine (--state-dir / BRIGADE_STATE_DIR):
    the setting, else $XDG_STATE_HOME/brigade, else ~/.local/state/brigade."""
    if setting:
        return Path(setting)
    return Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state") / "brigade"


@dataclass(frozen=True)
class Crash:
    service: str
    run: str | None
    error: str  # "Type: message", the message cut to ERROR_CHARS
    where: str  # "pkg/module.py:LINE in function"
    step: int | None
    outage: bool  # recorded, never part of a loop
    time: float
    traceback: str

    def fingerprint(self) -> tuple:
        """What a restart that repeats this crash exactly has in common with it."""
        return self.service, self.run, self.error, self.where, self.step


def one_line(text: str) -> str:
    """`text` on one line, cut to ERROR_CHARS."""
    text = " ".join(text.split())
    return text[:ERROR_CHARS] + "..." if len(text) > ERROR_CHARS else text


def describe(e: BaseException) -> str:
    """The error as `Type: message`, on one line."""
    message = one_line(str(e))
    return f"{type(e).__name__}: {message}" if message else type(e).__name__


def where(tb: TracebackType | None) -> str:
    """The innermost frame of `tb` in brigade's own packages (else the innermost frame), as
    "pkg/module.py:LINE in function"."""
    frames = list(traceback.walk_tb(tb))
    if not frames:
        return "?"
    own = [(f, line) for f, line in frames if OWN_PACKAGE.match(f.f_globals.get("__name__", "").split(".")[0])]
    frame, line = (own or frames)[-1]
    module, filename = frame.f_globals.get("__name__", ""), frame.f_code.co_filename
    # the file's path from its top package: one part per dotted name, two for a package's __init__
    depth = (module.count(".") + 1 + (Path(filename).name == "__init__.py")) if own else 1
    return f"{'/'.join(Path(filename).parts[-depth:])}:{line} in {frame.f_code.co_qualname}"


def is_outage(e: BaseException) -> bool:
    """An error that heals by itself, on `e` or what it was raised from: the network (refused, reset,
    a timeout), Redis away, loading or full, the proxy UNAVAILABLE or slow (brigade.rpc.is_transient),
    the bucket's store unreachable, throttling or failing (5xx). Modules are looked at only when the
    process loaded them: an error of a library never imported cannot have been raised."""
    seen: BaseException | None = e
    while seen is not None:
        if _is_outage_itself(seen):
            return True
        seen = seen.__cause__
    return False


def _is_outage_itself(e: BaseException) -> bool:
    if isinstance(e, ConnectionError | TimeoutError):
        return True
    if isinstance(e, OSError) and e.errno in NETWORK_ERRNOS:
        return True
    if "grpc" in sys.modules:
        from brigade.rpc import is_transient

        if is_transient(e):
            return True
    if (r := sys.modules.get("redis.exceptions")) is not None and isinstance(
            e, r.ConnectionError | r.TimeoutError | r.OutOfMemoryError | r.ClusterDownError | r.TryAgainError):
        return True
    if (b := sys.modules.get("botocore.exceptions")) is not None:
        if isinstance(e, b.ConnectionError | b.HTTPClientError):
            return True
        if isinstance(e, b.ClientError):
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            return status >= 500 or status == 429
    if (a := sys.modules.get("aiohttp")) is not None and isinstance(e, a.ClientConnectionError | a.ClientPayloadError):
        return True
    return False


class CrashJournal:
    """One service's crash records on this machine, oldest first: `<state dir>/crashes/<name>.jsonl`,
    the name `<service>-<run>` ("all" for a service of every run), `-<instance>` added for one of
    several alike on one machine (a worker id an operator gave, a proxy process)."""

    def __init__(self, state_dir: Path, service: str, run: str = "", instance: str = ""):
        self.service, self.run_id = service, run or None
        name = "-".join(p for p in (service, run or "all", instance) if p)
        self.path = Path(state_dir) / "crashes" / f"{re.sub(r'[^A-Za-z0-9._-]', '_', name)}.jsonl"

    def crashes(self) -> list[Crash]:
        """The records, oldest first; a line cut short by a kill mid-write is skipped."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return []
        crashes = []
        for line in lines:
            try:
                crashes.append(Crash(**json.loads(line)))
            except (ValueError, TypeError):
                continue
        return crashes

    def loop(self) -> Crash | None:
        """The newest crash when the newest CRASH_LOOP_REPEATS are one crash repeated (no outage among
        them), else None."""
        newest = self.crashes()[-CRASH_LOOP_REPEATS:]
        if len(newest) < CRASH_LOOP_REPEATS or any(c.outage for c in newest):
            return None
        return newest[-1] if len({c.fingerprint() for c in newest}) == 1 else None

    def record(self, e: BaseException, error: str = "") -> Crash:
        """Append the crash `e` (its error worded as `error`, else `describe(e)`); returns its record."""
        crash = Crash(self.service, self.run_id, error or describe(e), where(e.__traceback__), _step, is_outage(e),
                      time.time(), "".join(traceback.format_exception(e)))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a+") as f:
                f.seek(0)
                before = f.read()
                torn = before and not before.endswith("\n")  # a line cut short by a kill: begin a new one
                f.write(("\n" if torn else "") + json.dumps(asdict(crash)) + "\n")
            kept = self.crashes()
            if len(kept) > JOURNAL_KEEP:
                fresh = self.path.with_name(f".{self.path.name}.{os.getpid()}")
                fresh.write_text("".join(json.dumps(asdict(c)) + "\n" for c in kept[-JOURNAL_KEEP:]))
                fresh.replace(self.path)
        except OSError as write_error:  # the crash line still says what happened; only the count is lost
            log.warning("crash_journal_unwritable", journal=str(self.path), error=describe(write_error))
        return crash

    def crashed(self, e: BaseException, error: str = "") -> int:
        """Record `e`, say so in one line (`crashed`, or `crash_loop` when it makes one); the exit status."""
        crash = self.record(e, error)
        if self.loop() is not None:
            return self.refuse(crash)
        log.error("crashed", error=crash.error, where=crash.where, step=crash.step,
                  **({"outage": True} if crash.outage else {}), journal=str(self.path))
        return EXIT_CRASHED

    def refuse(self, crash: Crash) -> int:
        """The crash loop's line; the exit status."""
        log.error("crash_loop", error=crash.error, where=crash.where, step=crash.step, journal=str(self.path),
                  note=f"the same error at the same step {CRASH_LOOP_REPEATS} times in a row; not retrying "
                       f"(remove {self.path} to start it again)")
        return EXIT_CRASH_LOOP

    def clear(self) -> None:
        """A clean exit: whatever failed before is behind it."""
        try:
            self.path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("crash_journal_unwritable", journal=str(self.path), error=describe(e))

    def run(self, main: Callable[[], int], wording: Callable[[BaseException], str] = describe) -> int:
        """main() under the journal: its exit status (0 clears the journal), or a crash's, with its line
        (`wording` words the error). `main` returns its status rather than exiting: SystemExit and
        KeyboardInterrupt pass through, but a typer.Exit is a RuntimeError and would be a crash."""
        try:
            code = main()
        except Exception as e:
            return self.crashed(e, wording(e))
        if code == 0:
            self.clear()
        return code
