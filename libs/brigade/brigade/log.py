"""structlog setup shared by every service: JSON lines when stderr is not a terminal (containers,
log shippers), readable console output when it is.

In JSON mode every line a service writes is one JSON object, whoever writes it: stdlib logging
(redis, botocore, rq, transformers once routed) goes through structlog's ProcessorFormatter,
Python warnings through logging (captureWarnings), an uncaught exception becomes one `uncaught`
line with the traceback as a field, and the sources that write to stderr themselves are silenced
at the source: tqdm bars (HF_HUB_DISABLE_PROGRESS_BARS, TQDM_DISABLE) and grpc-core's C logger
(GRPC_VERBOSITY, GRPC_TRACE). Those are environment variables read when grpc or the library is
first imported, so `configure_logging` must run before a service imports grpc; a launcher that
starts services (`brigade up`) sets `json_env()` in their environment as well.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

# read by grpc-core, huggingface_hub / transformers and tqdm at import: set before they load
_QUIET_ENV = {"GRPC_VERBOSITY": "NONE", "GRPC_TRACE": "", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1",
              "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
_ML_SERVICES = ("learner", "rollout", "evaluator")  # the ones that load transformers


def json_env() -> dict[str, str]:
    """What a service's environment needs for its JSON logs to hold nothing but JSON."""
    return dict(_QUIET_ENV, BRIGADE_LOG_FORMAT="json")


def configure_logging(service: str, level: str = "info", json: bool | None = None) -> structlog.stdlib.BoundLogger:
    if json is None:
        forced = os.environ.get("BRIGADE_LOG_FORMAT", "")
        json = forced == "json" or (forced != "console" and not sys.stderr.isatty())
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.bind_contextvars(service=service)
    # libraries' own info lines (botocore's credentials, httpx's requests) stay out, as before they
    # were routed; --log-level debug lets everything through
    _route_stdlib(renderer, shared, numeric if numeric <= logging.DEBUG else max(numeric, logging.WARNING))
    if json:
        for k, v in _QUIET_ENV.items():
            os.environ.setdefault(k, v)
        sys.excepthook = _log_uncaught
        if service in _ML_SERVICES:
            _route_transformers()
    return structlog.get_logger()


def _route_stdlib(renderer, shared: list, level: int) -> None:
    """Every stdlib logger (and every warning) through the same renderer, to stderr."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder(),
                           structlog.processors.format_exc_info]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.captureWarnings(True)


def _route_transformers() -> None:
    """transformers logs through a handler of its own, to stderr, not propagating: hand it to root."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


def _log_uncaught(kind, value, tb) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    structlog.get_logger().critical("uncaught", error=f"{kind.__name__}: {value}", exc_info=(kind, value, tb))
