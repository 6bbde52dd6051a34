"""Running a service's main coroutine: stopped by SIGTERM or SIGINT, and its exit status.

    def learner(...):                       # a typer command
        ...
        exit_with(lambda: serve(cfg), log, proxy)

    async def serve(cfg):
        ...
        return await until_signal(Learner(...).run())

Exit status, one convention for the learner, the aggregator and the local trainer: 0 done; 1 the
proxy refused (one line naming what to check); 2 a bad configuration (ConfigError: one line); 128 + N
stopped by signal N before it was done, so a supervisor that restarts on failure starts it again.
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


def exit_with(main: Callable[[], Awaitable[signal.Signals | None]], service_log, proxy: str,
              signal_is_failure: bool = True) -> None:
    """asyncio.run(main()) and the exit status above (typer.Exit unless it is 0). A service whose
    SIGTERM is a clean hand-over (the local trainer: its leases go back) passes signal_is_failure=False."""
    import grpc
    import typer

    from brigade.config import ConfigError
    from brigade.rpc import describe_rpc_error

    try:
        stopped_by = asyncio.run(main())
    except grpc.aio.AioRpcError as e:
        service_log.error("proxy_error", error=describe_rpc_error(e, proxy))
        raise typer.Exit(1) from None
    except ConfigError as e:
        service_log.error("config_error", error=str(e))
        raise typer.Exit(2) from None
    if stopped_by is not None and signal_is_failure:
        raise typer.Exit(128 + stopped_by)
