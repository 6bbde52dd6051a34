"""structlog setup shared by every service: JSON lines when stderr is not a terminal (containers,
log shippers), readable console output when it is."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str = "info", json: bool | None = None) -> structlog.stdlib.BoundLogger:
    if json is None:
        forced = os.environ.get("BRIGADE_LOG_FORMAT", "")
        json = forced == "json" or (forced != "console" and not sys.stderr.isatty())
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    return structlog.get_logger()
