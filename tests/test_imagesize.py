"""Reading an inline image's width and height from its header, without decoding it all."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.proxy.imagesize import data_url_size

# Headers written by real encoders for a 301 x 203 picture (cjpeg 9 and cwebp 1.2): each
# JPEG up to the end of its start-of-frame segment, each WebP its first 40 bytes.
JPEG_BASELINE = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDABALDA4MChAODQ4SERATGCgaGBYWGDEjJR0oOjM9PDkzODdASFxOQERX"
    "RTc4UG1RV19iZ2hnPk1xeXBkeFxlZ2P/2wBDARESEhgVGC8aGi9jQjhCY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2Nj"
    "Y2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2P/wAARCADLAS0DASIAAhEBAxEB"
)
JPEG_PROGRESSIVE = (
    "/9j/4AAQSkZJRgABAQAAAQABAAD/2wBDAAgGBgcGBQgHBwcJCQgKDBQNDAsLDBkSEw8UHRofHh0aHBwgJC4nICIs"
    "IxwcKDcpLDAxNDQ0Hyc5PTgyPC4zNDL/2wBDAQkJCQwLDBgNDRgyIRwhMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIy"
    "MjIyMjIyMjIyMjIyMjIyMjIyMjIyMjIyMjL/wgARCADLAS0DASIAAhEBAxEB"
)
WEBP_LOSSY = "UklGRr4AAABXRUJQVlA4ILIAAACwEACdASotAcsAPpFIoU0lpCMiIA=="
WEBP_LOSSLESS = "UklGRiQAAABXRUJQVlA4TBgAAAAvLIEyAAdQsiJXpv8BAEX6/58i+g=="
WEBP_EXTENDED = "UklGRuIAAABXRUJQVlA4WAoAAAAQAAAALAEAygAAQUxQSAoAAAABBw=="


def url(data: bytes | str, mime: str = "image/jpeg") -> str:
    text = data if isinstance(data, str) else base64.b64encode(data).decode()
    return f"data:{mime};base64,{text}"


def png(width: int, height: int, padding: int = 0) -> bytes:
    """A valid PNG of a black picture, with an optional private chunk of filler bytes."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body)
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    rows = zlib.compress(b"\0" * ((width * 3 + 1) * height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    filler = chunk(b"prVt", bytes(range(256)) * (padding // 256)) if padding else b""
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + filler
        + chunk(b"IDAT", rows)
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    "encoded", [JPEG_BASELINE, JPEG_PROGRESSIVE, WEBP_LOSSY, WEBP_LOSSLESS, WEBP_EXTENDED]
)
def test_real_encoders_headers(encoded: str) -> None:
    """JPEG (baseline, progressive) and WebP (lossy, lossless, extended) headers give 301 x 203."""
    assert data_url_size(url(encoded)) == (301, 203)


def test_png_and_gif() -> None:
    """PNG's IHDR and GIF's logical screen give the size."""
    assert data_url_size(url(png(1280, 720), "image/png")) == (1280, 720)
    gif = b"GIF89a" + struct.pack("<HH", 640, 480) + b"\xf7\0\0" + b"\0" * 30
    assert data_url_size(url(gif, "image/gif")) == (640, 480)


def test_jpeg_metadata_is_skipped_by_its_length() -> None:
    """A 60 KB EXIF segment before the frame header is jumped over, not decoded."""
    jpeg = base64.b64decode(JPEG_BASELINE)
    exif = b"\xff\xe1" + struct.pack(">H", 60_002) + b"Exif\0\0" + b"\x11" * 59_994
    assert data_url_size(url(jpeg[:2] + exif + jpeg[2:] + b"\0" * 1000)) == (301, 203)


@pytest.mark.parametrize(
    "value",
    [
        "https://example.com/cat.jpg",
        "data:image/png,rawbytes",  # not base64
        "data:image/png;base64,",
        "data:image/png;base64,!!!!not base64!!!!",
        url(b"\x89PNG\r\n\x1a\n" + b"\0" * 40),  # no IHDR
        url(b"\xff\xd8\xff\xd9"),  # JPEG that ends before any frame
        url(b"\xff\xd8" + (b"\xff\xfe\0\x02") * 200),  # only empty comments: gives up
        url(b"RIFF\0\0\0\0WEBPVP8Z" + b"\0" * 30),
        url(png(0, 10), "image/png"),
    ],
)
def test_unreadable_images_give_none(value: str) -> None:
    """What cannot be read (a URL, no base64, truncated, unknown, zero-sized) is None."""
    assert data_url_size(value) is None


@given(st.binary(max_size=200))
def test_any_bytes_give_none_or_a_plausible_size(data: bytes) -> None:
    """Arbitrary image bytes never raise, and any size read is within 1..65535 each way."""
    size = data_url_size(url(data))
    assert size is None or all(1 <= side <= 65535 for side in size)


@given(st.text(max_size=300))
def test_any_text_never_raises(text: str) -> None:
    """Arbitrary text after the data URL prefix never raises."""
    size = data_url_size("data:image/jpeg;base64," + text)
    assert size is None or all(1 <= side <= 65535 for side in size)
