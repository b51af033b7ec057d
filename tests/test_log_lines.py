"""Each log line reaches the stream in one write, its newline included.

The workers of `gateway --workers N` share one stderr: a line written as two writes (the
JSON, then the newline, as print() does) let two workers' lines interleave into one
unparseable line, `{...}{...}` then two newlines (seen when both logged a SIGHUP reload).
"""

from __future__ import annotations

import io
import json
import logging

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


def test_a_library_logging_through_the_standard_module_writes_json_too() -> None:
    """OpenTelemetry's "Failed to export spans" (stdlib logging) is one JSON line, not text."""
    stream = io.StringIO()
    log.configure("info", stream=stream, json=True)
    try:
        logging.getLogger("opentelemetry.sdk.trace.export").error("Failed to export %s", "x")
        logging.getLogger("chatty.library").info("below warning: not written")
    finally:
        logging.getLogger().handlers = [
            h for h in logging.getLogger().handlers if type(h).__name__ != "_StructlogHandler"
        ]
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    event = json.loads(lines[0])
    assert (event["event"], event["level"], event["message"]) == (
        "library_log",
        "error",
        "Failed to export x",
    )


def test_a_line_written_directly_is_the_line_the_chain_writes() -> None:
    """`log.line` writes, in one write, the bytes structlog's configured chain writes for the
    same call (context fields, level and key order included; only the time differs), keeps
    to the level, and declines when another chain is set."""
    fields = {"client": "127.0.0.1", "peer": None, "status": 200, "ttft_ms": 1.5, "server": "a"}
    saved = structlog.get_config()
    stream = Writes()
    log.configure("info", stream=stream, json=True)
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id="r1", trace_id="t1", server="bound")
    try:
        log.get("test").info("request", **fields)
        assert log.line("info", "request", dict(fields))
        assert log.line("debug", "request", dict(fields))  # below the level: nothing
        with structlog.testing.capture_logs() as captured:
            assert not log.line("info", "request", dict(fields))
        assert captured == []
    finally:
        structlog.contextvars.clear_contextvars()
        structlog.configure(**saved)
    assert len(stream.calls) == 2
    through_chain, direct = (orjson.loads(call) for call in stream.calls)
    assert list(through_chain) == list(direct)
    assert (direct["server"], direct["trace_id"]) == ("a", "t1")
    assert through_chain.pop("timestamp").endswith("Z")
    assert direct.pop("timestamp").endswith("Z")
    assert through_chain == direct
    chain_text, direct_text = (call.split('"timestamp"')[0] for call in stream.calls)
    assert chain_text == direct_text
