"""Logging with structlog: JSON lines for machines, readable lines on a terminal.

Configured once by the CLI. Request context (request_id, tag, lane, instance) lives in
contextvars, so every line a request's task logs carries it without passing it around.
What libraries log through the standard `logging` module (OpenTelemetry's exporter, for
one: "Failed to export spans batch ...") goes out the same way, one JSON line each, so a
library's plain text never breaks a log reader's JSON.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import orjson
import structlog


def configure(
    level: str = "info", *, stream: TextIO | None = None, json: bool | None = None
) -> None:
    stream = stream or sys.stderr
    as_json = json if json is not None else not stream.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer(serializer=_orjson_text)
        if as_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        # One write per line, newline included: the workers of `--workers N` share one
        # stderr, and print()'s two writes (the line, then "\n") let their lines interleave.
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    handler = _StructlogHandler()
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not isinstance(h, _StructlogHandler)]
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)  # libraries' warnings and errors, not their chatter


class _StructlogHandler(logging.Handler):
    """A standard-library record, logged as one structlog event (`library_log`)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level = record.levelname.lower()
            log = structlog.get_logger(record.name)
            method = getattr(log, level if level in _LEVELS else "warning")
            method("library_log", logger=record.name, message=record.getMessage()[:1000])
        except Exception:  # a log line must never take the process down
            self.handleError(record)


_LEVELS = frozenset({"debug", "info", "warning", "error", "critical"})


def _orjson_text(event: dict[str, Any], **options: Any) -> str:
    """A JSON line as orjson writes it (compact, a fraction of json's time per line)."""
    return orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS, **options).decode()


def get(name: str) -> Any:
    return structlog.get_logger(name)
