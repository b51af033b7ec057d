"""`python -m loadtest run`'s progress (loadtest/progress.py) wherever stderr goes: plain
lines into a pipe or a log, a bar on a sized terminal, and lines again on a terminal that
reports no size (a pseudo-terminal nobody sized), where tqdm would print nothing at all."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pty
import struct
import termios
import time
from collections.abc import Iterator
from typing import TextIO

import pytest

from loadtest.loadgen import Result, Run
from loadtest.progress import Progress, make_bar, terminal_width


@contextlib.contextmanager
def terminal(columns: int, rows: int) -> Iterator[tuple[TextIO, int]]:
    """A pseudo-terminal of that size: the stream a program writes to, and the fd that
    reads what it wrote."""
    reader, writer = pty.openpty()
    fcntl.ioctl(writer, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    stream = os.fdopen(writer, "w")
    try:
        yield stream, reader
    finally:
        stream.close()
        os.close(reader)


def read_all(fd: int) -> str:
    """What was written to the other end so far (a pty or a pipe)."""
    os.set_blocking(fd, False)
    chunks = []
    with contextlib.suppress(BlockingIOError, OSError):
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def a_run() -> Run:
    run = Run("demo", started=time.perf_counter())
    run.results = [Result(i, False, run.started, status=200 if i else 500) for i in range(3)]
    return run


def show(p: Progress) -> None:
    """Let the reporter run a few rounds, then cancel it as the runners do."""

    async def rounds() -> None:
        task = asyncio.create_task(p.loop(every=0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    p.sent = 5
    asyncio.run(rounds())
    p.stream.flush()


def test_a_terminal_without_a_size_gets_plain_lines() -> None:
    """A 0x0 terminal: no bar (tqdm would print nothing), one plain line a round."""
    pytest.importorskip("tqdm")
    with terminal(0, 0) as (stream, reader):
        assert stream.isatty()
        assert terminal_width(stream) == 0
        p = Progress(a_run(), 10, stream=stream)
        assert not p.bar
        show(p)
        out = read_all(reader)
    assert "[demo]" in out
    assert "sent 5/10 done 3 errors 1 in-flight 2" in out


def test_a_bar_asked_for_on_a_terminal_without_a_size_still_shows() -> None:
    """Forced on a 0x0 terminal, the bar takes a width of its own and shows the counts."""
    pytest.importorskip("tqdm")
    with terminal(0, 0) as (stream, reader):
        p = Progress(a_run(), 10, stream=stream, bar=True)
        assert p.bar
        show(p)
        out = read_all(reader)
    assert "3/10" in out
    assert "sent 5 errors 1 in-flight 2" in out


def test_a_sized_terminal_gets_the_bar() -> None:
    """An ordinary 100x30 terminal: the tqdm bar, with its ETA."""
    pytest.importorskip("tqdm")
    with terminal(100, 30) as (stream, reader):
        assert terminal_width(stream) == 100
        p = Progress(a_run(), 10, stream=stream)
        assert p.bar
        show(p)
        out = read_all(reader)
    assert "3/10" in out
    assert "<" in out  # tqdm's "elapsed<remaining"


def test_a_pipe_gets_plain_lines() -> None:
    """Not a terminal (a pipe, a log file): plain lines, whatever the terminal around."""
    reader, writer = os.pipe()
    with os.fdopen(writer, "w") as stream:
        p = Progress(a_run(), 10, stream=stream)
        assert not p.bar
        show(p)
        out = read_all(reader)
    os.close(reader)
    assert "sent 5/10 done 3 errors 1 in-flight 2" in out


def test_make_bar_on_a_sizeless_terminal_uses_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bar made for a terminal without a size takes $COLUMNS for its width."""
    pytest.importorskip("tqdm")
    monkeypatch.setenv("COLUMNS", "90")
    with terminal(0, 0) as (stream, _):
        bar = make_bar(10, "[demo]", "req", stream)
        try:
            assert bar.ncols == 90
        finally:
            bar.close()
