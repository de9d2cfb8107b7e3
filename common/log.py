"""Structured logging: JSON lines, one event name per thing that happens.

Call `setup()` once per process (CLI entry points do). Every event carries `event`, `ts`,
`level`, and whatever context the caller binds (task id, phase, ...).
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog
from structlog.typing import Processor

_configured = False


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
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    if component:
        structlog.contextvars.bind_contextvars(component=component)
    _configured = True


def get(name: str | None = None, **context) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to `context`. Works before `setup()` (then structlog's defaults apply)."""
    logger = structlog.get_logger(name) if name else structlog.get_logger()
    return logger.bind(**context) if context else logger
