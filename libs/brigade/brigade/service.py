"""Running a service's main coroutine: stopped by SIGTERM or SIGINT, and its exit status.

    def learner(...):                       # a typer command
        journal = crash_journal("learner", cfg.run, cfg.state_dir)   # exits 3 at once in a crash loop
        ...
        exit_with(lambda: serve(cfg), log, proxy, journal)

    async def serve(cfg):
        ...
        return await until_signal(Learner(...).run())

Exit status, one convention for every service: 0 done; 1 crashed: an error escaped (the proxy's
refusal included), one `crashed` line saying what, where and at which step (brigade.crash_loop),
and a supervisor should start it again; 2 a bad configuration (ConfigError: one line), which a
restart would repeat; 3 a crash loop: the same error at the same step 3 times in a row, not retried,
and refused at once on every start until its journal is removed; 128 + N stopped by signal N before
it was done, so a supervisor that restarts on failure starts it again.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger()
SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def until_signal(work: Awaitable[object], on_signal: Callable[[signal.Signals], None] = lambda sig: None
                       ) -> signal.Signals | None:
    """Await `work` in this task; SIGTERM or SIGINT cancels it at once (every point of the services
    is crash-safe) after `on_signal`. Returns the signal that stopped it, or None when it finished."""
    main, loop, signalled = asyncio.current_task(), asyncio.get_running_loop(), []

    def stop(sig: signal.Signals) -> None:
        signalled.append(sig)
        on_signal(sig)
        main.cancel()

    for sig in SIGNALS:
        loop.add_signal_handler(sig, stop, sig)
    try:
        await work
    except asyncio.CancelledError:
        if not signalled:
            raise
        log.info("stopped_by_signal", signal=signalled[0].name)
        return signalled[0]
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)
    return None


def use_torch_threads(n: int) -> None:
    """torch's intra-op threads for this process (the TORCH_THREADS setting; 0 leaves torch's
    choice). Called in the service's own process, after a fork server forked it: the server
    itself must stay single-threaded (OMP_NUM_THREADS=1) to fork safely."""
    if n > 0:
        import torch

        torch.set_num_threads(n)


def crash_journal(service: str, run: str, state_dir_setting: str, instance: str = ""):
    """The service's crash journal (brigade.crash_loop), looked at first: when it ends in a crash loop
    the service stops here, with the crash_loop line and exit 3, before it loads anything."""
    import typer

    from brigade.crash_loop import CrashJournal, state_dir

    journal = CrashJournal(state_dir(state_dir_setting), service, run, instance)
    if (looping := journal.loop()) is not None:
        raise typer.Exit(journal.refuse(looping))
    return journal


def exit_with(main: Callable[[], Awaitable[signal.Signals | None]], service_log, proxy: str, journal,
              signal_is_failure: bool = True) -> None:
    """asyncio.run(main()) under the crash journal and the exit status above (typer.Exit unless it is
    0). A service whose SIGTERM is a clean hand-over (the local trainer: its leases go back) passes
    signal_is_failure=False."""
    import grpc
    import typer

    from brigade.config import ConfigError
    from brigade.crash_loop import describe, one_line
    from brigade.rpc import describe_rpc_error

    def run() -> int:
        try:
            stopped_by = asyncio.run(main())
        except ConfigError as e:  # not a crash: a restart would only say it again
            service_log.error("config_error", error=str(e))
            return 2
        return 128 + stopped_by if stopped_by is not None and signal_is_failure else 0

    def wording(e: BaseException) -> str:  # the proxy's refusals name what to check
        return one_line(describe_rpc_error(e, proxy)) if isinstance(e, grpc.aio.AioRpcError) else describe(e)

    code = journal.run(run, wording)
    if code:
        raise typer.Exit(code)
