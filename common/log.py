"""Structured logging: JSON lines, one event name per thing that happens.

Call `setup()` once per process (CLI entry points do). Every event carries `event`, `ts`,
`level`, and whatever context the caller binds (task id, phase, ...).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO, cast

import structlog
from structlog.typing import Processor

_configured = False


class TolerantStream:
    """A log stream that a full or failing disk cannot turn into an exception in the caller: a
    line the stream refuses is dropped and counted (`dropped`), and the process goes on. The
    payload's and the bus's output is a file on a disk that may fill up (docs/flight.md
    "Storage"); a log call must never be what stops them."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.dropped = 0

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except (OSError, ValueError):  # ENOSPC, EIO, EPIPE; ValueError: the stream was closed
            self.dropped += 1
            return 0

    def flush(self) -> None:
        try:
            self.stream.flush()
        except (OSError, ValueError):
            self.dropped += 1


def setup(level: str = "info", stream: TextIO | None = None, component: str | None = None) -> None:
    """Configure structlog to write JSON lines to `stream` (stderr by default)."""
    global _configured
    stream = stream or sys.stderr
    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        structlog.processors.JSONRenderer(sort_keys=False),
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.WriteLoggerFactory(file=cast(TextIO, TolerantStream(stream))),
        cache_logger_on_first_use=False,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)
    _configured = True


def get(name: str | None = None, **context) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to `context`. Works before `setup()` (then structlog's defaults apply)."""
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger.bind(**context) if context else logger
