"""Logging with structlog: JSON lines for machines, readable lines on a terminal.

Configured once by the CLI. Request context (request_id, tag, lane, instance) lives in
contextvars, so every line a request's task logs carries it without passing it around.
What libraries log through the standard `logging` module (OpenTelemetry's exporter, for
one: "Failed to export spans batch ...") goes out the same way, one JSON line each, so a
library's plain text never breaks a log reader's JSON.
"""

from __future__ import annotations

import contextvars
import datetime
import logging
import sys
from collections.abc import Callable
from typing import Any, TextIO

import orjson
import structlog
from structlog.contextvars import STRUCTLOG_KEY_PREFIX, STRUCTLOG_KEY_PREFIX_LEN


def configure(
    level: str = "info", *, stream: TextIO | None = None, json: bool | None = None
) -> None:
    stream = stream or sys.stderr
    as_json = json if json is not None else not stream.isatty()
    min_level = logging.getLevelNamesMapping()[level.upper()]
    renderer: Any = (
        JsonLines(stream, min_level)
        if as_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    processors = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        renderer,
    ]
    if isinstance(renderer, JsonLines):
        renderer.chain = processors
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
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


class JsonLines(structlog.processors.JSONRenderer):
    """The JSON lines' renderer; it can also write a line itself (`line`), which the access
    line of every request does: the chain's work in one call, to the same bytes."""

    def __init__(self, stream: TextIO, min_level: int) -> None:
        super().__init__(serializer=_orjson_text)
        self.stream = stream
        self.min_level = min_level
        self.chain: list[Callable[..., Any]] = []  # the processors it ends, as configured

    def line(self, method: str, event: str, fields: dict[str, Any]) -> None:
        """What `logger.<method>(event, **fields)` writes through the chain configure() set
        up: the fields, the event, the context's fields, level and time; one write."""
        if _LEVEL_NUMBERS[method] < self.min_level:
            return
        fields["event"] = event
        ctx = contextvars.copy_context()  # as merge_contextvars
        for var in ctx:
            if var.name.startswith(STRUCTLOG_KEY_PREFIX) and ctx[var] is not Ellipsis:
                fields.setdefault(var.name[STRUCTLOG_KEY_PREFIX_LEN:], ctx[var])
        fields["level"] = method
        now = datetime.datetime.now(tz=datetime.UTC)  # as TimeStamper(fmt="iso", utc=True)
        fields["timestamp"] = now.isoformat().replace("+00:00", "Z")
        self.stream.write(_orjson_text(fields, default=self._dumps_kw["default"]) + "\n")
        self.stream.flush()


_LEVEL_NUMBERS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def line(method: str, event: str, fields: dict[str, Any]) -> bool:
    """Write a line straight through configure()'s JSON chain if that is the one in use
    (`fields` becomes the line's); False: log it through structlog (another chain is set,
    such as a test's `capture_logs()` or a worker's, or a console)."""
    processors = structlog.get_config()["processors"]
    renderer = processors[-1] if processors else None
    if not isinstance(renderer, JsonLines) or renderer.chain is not processors:
        return False
    renderer.line(method, event, fields)
    return True


def _orjson_text(event: dict[str, Any], **options: Any) -> str:
    """A JSON line as orjson writes it (compact, a fraction of json's time per line)."""
    return orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS, **options).decode()


def get(name: str) -> Any:
    return structlog.get_logger(name)
