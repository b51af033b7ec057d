"""Reading an upload's text fields from its multipart body without touching the file."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.proxy.form import InvalidForm, boundary_of, text_fields

NAMES = frozenset({"model", "stream"})


def encode(fields: list[tuple[str, bytes, str | None]]) -> tuple[bytes, str]:
    """The body and Content-Type aiohttp's client writes for these (name, value, filename)."""
    form = aiohttp.FormData()
    for name, value, filename in fields:
        if filename is None:
            form.add_field(name, value.decode())
        else:
            form.add_field(name, value, filename=filename, content_type="audio/wav")
    writer = form()
    chunks: list[bytes] = []

    class Sink:
        async def write(self, data: bytes) -> None:
            chunks.append(bytes(data))

    asyncio.run(writer.write(Sink()))  # type: ignore[arg-type]
    return b"".join(chunks), writer.content_type


def test_model_and_stream_are_read_beside_a_file() -> None:
    """The text fields come back; the file part, even one named `model`, is skipped."""
    body, content_type = encode(
        [
            ("model", b"whisper-large", "model.wav"),
            ("file", b"\x00\x01RIFF" * 1000, "a.wav"),
            ("model", b"whisper-large-v3", None),
            ("stream", b"true", None),
            ("language", b"en", None),
        ]
    )
    fields = text_fields(body, boundary_of(content_type), NAMES)
    assert fields == {"model": "whisper-large-v3", "stream": "true"}


def test_a_file_holding_a_fake_part_does_not_fool_the_reader() -> None:
    """Bytes in a file that look like a part (but lack the boundary) stay file bytes."""
    trap = b'\r\n--other\r\nContent-Disposition: form-data; name="model"\r\n\r\nevil'
    body, content_type = encode([("file", trap, "a.wav"), ("model", b"good", None)])
    assert text_fields(body, boundary_of(content_type), NAMES) == {"model": "good"}


@given(st.text(min_size=1, max_size=60), st.binary(max_size=2000))
def test_any_model_name_and_file_round_trip(model: str, audio: bytes) -> None:
    """Whatever the model name and file bytes, the name read is the one written."""
    body, content_type = encode([("file", audio, "a.wav"), ("model", model.encode(), None)])
    assert text_fields(body, boundary_of(content_type), NAMES) == {"model": model}


def test_a_preamble_before_the_first_boundary_is_skipped() -> None:
    """RFC 2046 allows text before the first delimiter."""
    body = (
        b"this is a preamble\r\n--b1\r\nContent-Disposition: form-data; name=model\r\n\r\n"
        b"m1\r\n--b1--\r\n"
    )
    assert text_fields(body, "b1", NAMES) == {"model": "m1"}


@pytest.mark.parametrize(
    "body",
    [
        b"no boundary here",
        b"--b1\r\nContent-Disposition: form-data; name=model\r\n\r\nm1",  # no close
        b"--b1\r\nContent-Disposition: form-data; name=model",  # headers never end
        b"--b1junk",
    ],
)
def test_torn_bodies_are_invalid(body: bytes) -> None:
    """A body that breaks the multipart framing raises InvalidForm (the client's 400)."""
    with pytest.raises(InvalidForm):
        text_fields(body, "b1", NAMES)


def test_an_overlong_field_is_invalid() -> None:
    """A `model` field over 4 KiB is refused, not read whole."""
    body = b"--b\r\nContent-Disposition: form-data; name=model\r\n\r\n" + b"m" * 5000 + b"\r\n--b--"
    with pytest.raises(InvalidForm, match="longer than"):
        text_fields(body, "b", NAMES)


@pytest.mark.parametrize(
    "content_type", ["multipart/form-data", "multipart/form-data; boundary=", "text/plain"]
)
def test_a_content_type_without_a_boundary_is_invalid(content_type: str) -> None:
    """No usable boundary parameter raises InvalidForm."""
    with pytest.raises(InvalidForm):
        boundary_of(content_type)


def test_a_quoted_boundary_is_unquoted() -> None:
    """`boundary="a b"` is the boundary `a b`."""
    assert boundary_of('multipart/form-data; boundary="a b"') == "a b"
