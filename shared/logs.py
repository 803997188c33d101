"""structlog setup: JSON lines in services, pretty output in a terminal."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import structlog


def setup_logging(*, json: bool | None = None, level: str | None = None, **bound: str) -> structlog.stdlib.BoundLogger:
    """Configure structlog once per process and return a logger with ``bound`` context (run, service, ...)."""
    if json is None:
        json = not sys.stderr.isatty()
    lvl = getattr(logging, (level or os.environ.get("CHORUS_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{k: v for k, v in bound.items() if v is not None})
    return structlog.get_logger()


def append_line(path: Path, line: str) -> None:
    """One write() per line with O_APPEND, so several services (every trainer, the coordinator) share a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
