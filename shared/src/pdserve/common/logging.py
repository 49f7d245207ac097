"""structlog setup shared by every service: JSON lines on stderr with the service name.

Lines logged inside a span carry its ``trace_id`` and ``span_id``. Events are snake_case
names with key-value context, never sentences:
``log.info("lease_granted", request_id=..., num_blocks=...)``. Context bound with
`structlog.contextvars.bind_contextvars` (for example ``request_id``) is added to every line
logged in that context.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import sys
from collections.abc import MutableMapping
from typing import Any, NoReturn, TextIO

import structlog

from pdserve.common.telemetry import add_trace_ids

LEVELS = ("debug", "info", "warning", "error")


def configure_logging(service: str, level: str = "info", *, json: bool = True) -> None:
    """Configures structlog (and the stdlib root logger) for one process.

    Args:
        service: Value of the ``service`` key on every line, e.g. "decode".
        level: Minimum level: debug, info, warning or error.
        json: JSON lines when true (the default); human-readable console output otherwise.

    Raises:
        ValueError: For an unknown level.
    """
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    numeric_level = logging.getLevelNamesMapping()[level.upper()]

    def add_service(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event.setdefault("service", service)
        return event

    # NOTE: colours only on a terminal: a log read by a program or a file has no escape codes.
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            add_service,
            _add_logger_name,
            add_trace_ids,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        # NOTE: resolve sys.stderr per call, so a replaced stream (tests, daemons) is honoured.
        logger_factory=_stderr_logger,
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric_level, logging.WARNING), stream=sys.stderr, force=True)


class _NamedPrintLogger(structlog.PrintLogger):
    """structlog's PrintLogger on the current stderr, with the logger's name. A line stderr
    cannot take (a pipe whose reader, the supervisor, is gone) does not raise into the code that
    logged it: stderr becomes `_fallback_stream` for every later line, and the line goes there.
    """

    def __init__(self, name: str | None) -> None:
        super().__init__(sys.stderr)
        self.name = name

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except OSError:
            self._file = sys.stderr = _fallback_stream()
            with contextlib.suppress(OSError):
                super().msg(message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


def _fallback_stream() -> TextIO:
    """Where logs go once stderr broke: stdout where it is a file (a supervisor gives a
    service its log file as stdout: the lines land after the ones it copied there), else
    nowhere."""
    with contextlib.suppress(OSError, ValueError):
        if stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            return sys.stdout
    return open(os.devnull, "w")


def _stderr_logger(*args: Any) -> structlog.PrintLogger:
    return _NamedPrintLogger(args[0] if args and isinstance(args[0], str) else None)


def _add_logger_name(
    logger: Any, _: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """The ``logger`` key: the name given to `get_logger`, if any."""
    name = getattr(logger, "name", None)
    if name:
        event.setdefault("logger", name)
    return event


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """Returns a structlog logger; `name` becomes the ``logger`` key when given.

    The logger follows the configuration at each call, so one made at import time (a
    module's ``log``) honours a `configure_logging` that runs later.
    """
    # NOTE: the name goes to the logger factory (`_stderr_logger`), which keeps structlog's
    # proxy lazy; `.bind` would fix the configuration of the moment (before
    # `configure_logging`, the default: stdout).
    return structlog.get_logger(name) if name else structlog.get_logger()


def exit_served_process(status: int) -> NoReturn:
    """Ends a service process that has stopped serving: flushes the log streams, then exits
    without the interpreter's teardown.

    By then the service has drained, stopped its servers and threads, removed its files and
    flushed its traces; what is left is freeing every module's objects one by one (torch's
    above all), which took 0.5 to 2.5 s of CPU per process with nothing to show for it, on
    every stop of every instance (`pdserve up`'s Ctrl-C, a rolling restart, each test
    cluster).
    """
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        # NOTE: a closed or broken pipe: nothing more can be said on it.
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(status)
