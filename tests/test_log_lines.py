"""Each log line reaches the stream in one write, its newline included.

The workers of `gateway --workers N` share one stderr: a line written as two writes (the
JSON, then the newline, as print() does) let two workers' lines interleave into one
unparseable line, `{...}{...}` then two newlines (seen when both logged a SIGHUP reload).
"""

from __future__ import annotations

import io

import orjson
import structlog

from gateway.observe import log


class Writes(io.StringIO):
    """A text stream that keeps each write() call apart."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return super().write(text)

    def isatty(self) -> bool:
        return False


def test_a_json_line_is_one_write_with_its_newline() -> None:
    """Two events give two write calls, each a whole JSON object ending in a newline."""
    stream = Writes()
    saved = structlog.get_config()
    log.configure("info", stream=stream)
    try:
        logger = log.get("test")
        logger.info("reloaded", instances=2)
        logger.info("draining")
    finally:
        structlog.configure(**saved)
    assert len(stream.calls) == 2
    for call, event in zip(stream.calls, ("reloaded", "draining"), strict=True):
        assert call.endswith("\n")
        assert call.count("\n") == 1
        assert orjson.loads(call)["event"] == event
