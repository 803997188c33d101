"""structlog setup: JSON lines in services, pretty output in a terminal."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any

import structlog

PROGRESS_BAR_VARIABLES = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS", "TRANSFORMERS_NO_ADVISORY_WARNINGS")


def quiet_progress_bars(*, always: bool = False) -> None:
    """Turn library progress bars off when stderr is not a terminal (where the logs are JSON lines), or ``always``.
    tqdm reads ``TQDM_DISABLE`` once, when it is imported, so this runs before any import that may bring it in
    (``services/__init__.py``)."""
    if always or not sys.stderr.isatty():
        for var in PROGRESS_BAR_VARIABLES:
            os.environ.setdefault(var, "1")


def setup_logging(*, json: bool | None = None, level: str | None = None, **bound: str) -> structlog.stdlib.BoundLogger:
    """Configure structlog once per process and return a logger with ``bound`` context (run, service, ...)."""
    if json is None:
        json = not sys.stderr.isatty()
    lvl = getattr(logging, (level or os.environ.get("CHORUS_LOG_LEVEL", "INFO")).upper(), logging.INFO)
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    if json:
        # progress bars of libraries (tqdm: hub downloads, weight loading) are lines no log reader can parse
        quiet_progress_bars(always=True)
    _route_stdlib_logging(renderer, max(lvl, logging.WARNING) if json else lvl)
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


_HANDLER = "chorus-structlog"


def _route_stdlib_logging(renderer: structlog.typing.Processor, level: int) -> None:
    """``warnings`` and stdlib ``logging`` (nats, torch, transformers) through the same renderer as our own lines,
    so JSON logs hold nothing but JSON."""
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, structlog.processors.format_exc_info,
                    renderer],
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    handler.set_name(_HANDLER)
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == _HANDLER]:  # ours from an earlier call
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger -> the handler above
    route_library_logs()


def route_library_logs() -> None:
    """transformers keeps a handler of its own that writes plain text: send its records to the root logger
    instead. Services import transformers lazily (where a model is loaded): then :class:`_AfterImport` calls this."""
    hf_logging = sys.modules.get(_HF_LOGGING)
    if hf_logging is None:
        if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
            sys.meta_path.insert(0, _AfterImport())
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()


_HF_LOGGING = "transformers.utils.logging"


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls :func:`route_library_logs` right after transformers' logging module is imported."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _HF_LOGGING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None:
            return spec
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            route_library_logs()

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def append_line(path: Path, line: str) -> None:
    """One write() per line with O_APPEND, so several services (every trainer, the coordinator) share a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
