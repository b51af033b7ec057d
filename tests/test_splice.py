"""splice.py without sockets: a fake instance answer, a fake client stream (how the client
stream frames and writes what it is handed is test_client_stream.py's)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from gateway.relay import splice, sse


class Source:
    """The instance's answer: counts the pauses, keeps the sink."""

    def __init__(self) -> None:
        self.sink: splice.Splice | None = None
        self.paused = 0
        self.resumed = 0

    def splice(self, sink: splice.Splice) -> None:
        self.sink = sink

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1


class Client:
    """The client's stream: keeps what it is handed; once `gone`, refuses it."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.gone = False

    def send(self, data: bytes) -> bool:
        if self.gone:
            return False
        self.sent.append(data)
        return True

    @property
    def written(self) -> bytes:
        return b"".join(self.sent)


class Watch:
    def __init__(self, behind: bool = False) -> None:
        self.listener: Callable[[bool], None] | None = None
        self.behind = behind

    def watch_writing(self, listener: Callable[[bool], None] | None) -> bool:
        self.listener = listener
        return self.behind


def start(
    *, silence: float = 10.0, write_timeout: float = 10.0
) -> tuple[splice.Splice, Source, Client, Watch]:
    source, client, watch = Source(), Client(), Watch()
    run = splice.Splice(source, client, sse.Framer(), silence=silence, write_timeout=write_timeout)
    run.start(watch)
    assert source.sink is run
    return run, source, client, watch


async def test_whole_events_go_out_at_once_and_a_half_event_is_held() -> None:
    """Each whole event is handed to the client at once; a half one waits for its end."""
    run, _, client, _ = start()
    run.body(b"data: 1\n\n")
    assert client.sent == [b"data: 1\n\n"]
    run.body(b"data: 2")
    assert client.sent == [b"data: 1\n\n"]
    run.body(b"\n\n")
    assert client.sent == [b"data: 1\n\n", b"data: 2\n\n"]
    assert run.framer.events == 2
    run.ended(None)
    assert (await run.done) == splice.End(splice.Why.ENDED)


async def test_the_events_of_one_read_go_out_in_one_write() -> None:
    """The whole events of one read of the instance's socket are handed on together."""
    run, _, client, _ = start()
    run.body(b"data: 1\n\ndata: [DONE]\n\n")
    assert client.sent == [b"data: 1\n\ndata: [DONE]\n\n"]
    assert run.framer.done


async def test_a_client_behind_pauses_the_instance_and_catching_up_resumes_it() -> None:
    """Over the client's high-water mark the instance's socket stops being read; back
    under the low one it is read again."""
    run, source, _, watch = start()
    assert watch.listener is not None
    watch.listener(False)
    assert (source.paused, source.resumed) == (1, 0)
    assert "behind=True" in repr(run)
    watch.listener(True)
    assert (source.paused, source.resumed) == (1, 1)
    run.stop(watch)
    assert watch.listener is None


async def test_a_client_already_behind_at_the_start_pauses_at_once() -> None:
    """A client whose buffer is over the mark when the splice starts pauses the instance."""
    source, client, watch = Source(), Client(), Watch(behind=True)
    run = splice.Splice(source, client, sse.Framer(), silence=5, write_timeout=5)
    run.start(watch)
    assert source.paused == 1
    assert run.behind
    run.stop(watch)


async def test_a_client_behind_for_the_write_timeout_is_let_go() -> None:
    """A client that stays behind for `write_timeout` ends the stream as the client's doing."""
    run, _, _, watch = start(write_timeout=0.05, silence=0.01)
    assert watch.listener is not None
    watch.listener(False)
    end = await asyncio.wait_for(run.done, 2)
    assert end.why is splice.Why.CLIENT  # not QUIET: the silence clock stopped meanwhile


async def test_silence_ends_the_stream_and_only_data_events_reset_it() -> None:
    """No data event for `silence` seconds ends the stream, keep-alive comments or not."""
    run, _, client, _ = start(silence=0.1)
    await asyncio.sleep(0.06)
    run.body(b"data: 1\n\n")  # moves the clock on
    await asyncio.sleep(0.06)
    assert not run.done.done()
    run.body(b": keep-alive\n\n")  # passed on, but does not
    end = await asyncio.wait_for(run.done, 2)
    assert end.why is splice.Why.QUIET
    assert client.written.endswith(b": keep-alive\n\n")


async def test_a_client_gone_ends_the_stream() -> None:
    """An event the client's stream refuses (the client is gone) ends the stream as the
    client's."""
    run, _, client, _ = start()
    client.gone = True
    run.body(b"data: 1\n\n")
    assert (await run.done).why is splice.Why.CLIENT
    assert client.written == b""


async def test_a_broken_answer_and_undecodable_bytes_say_why() -> None:
    """The instance breaking the stream, or bytes that do not decode, end it with a reason."""
    run, _, _, _ = start()
    run.ended("broke the stream after it started (reset)")
    assert (await run.done) == splice.End(
        splice.Why.ENDED, "broke the stream after it started (reset)"
    )

    source, client, watch = Source(), Client(), Watch()

    def bad(data: bytes) -> bytes:
        import zlib

        return zlib.decompressobj().decompress(data)

    gz = splice.Splice(source, client, sse.Framer(), silence=5, write_timeout=5, decode=bad)
    gz.start(watch)
    gz.body(b"not zlib")
    assert (await gz.done).broken == "sent stream bytes that do not decode"
    gz.body(b"data: 1\n\n")  # after the end nothing more is written
    assert client.written == b""
