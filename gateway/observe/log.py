"""Logging with structlog: JSON lines for machines, readable lines on a terminal.

Configured once by the CLI. Request context (request_id, tag, lane, instance) lives in
contextvars, so every line a request's task logs carries it without passing it around.
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


def _orjson_text(event: dict[str, Any], **options: Any) -> str:
    """A JSON line as orjson writes it (compact, a fraction of json's time per line)."""
    return orjson.dumps(event, option=orjson.OPT_NON_STR_KEYS, **options).decode()


def get(name: str) -> Any:
    return structlog.get_logger(name)
