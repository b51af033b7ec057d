"""Width and height of an inline (base64 data URL) image, read from its header alone.

A dynamic-resolution vision model (Qwen2-VL, Qwen2.5-VL) makes one token of every
28x28 pixels, so an image's cost is its pixel count, and that is in the first bytes of
a PNG, GIF or WebP, and in the frame header of a JPEG (after its metadata segments,
which are skipped by their lengths). Base64 decodes at any multiple of 4 characters, so
only the few bytes needed are decoded, however large the image. Anything unreadable is
None: the caller falls back to a fixed figure.
"""

from __future__ import annotations

import binascii

_MAX_SIDE = 65535  # no format here can say more; a larger reading is garbage
_MAX_SEGMENTS = 64  # JPEG segments to skip before giving up (metadata, tables)
# JPEG start-of-frame markers: C0-CF except DHT (C4), JPG (C8) and DAC (CC).
_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


class _Base64:
    """Random access to the bytes of a base64 text without decoding all of it."""

    def __init__(self, text: str, start: int) -> None:
        self.text = text
        self.start = start

    def read(self, offset: int, size: int) -> bytes:
        first = offset // 3
        last = (offset + size + 2) // 3
        chunk = self.text[self.start + first * 4 : self.start + last * 4]
        try:
            data = binascii.a2b_base64(chunk)
        except (binascii.Error, ValueError):
            return b""
        skip = offset - first * 3
        return data[skip : skip + size]


def data_url_size(url: str) -> tuple[int, int] | None:
    """(width, height) of a `data:image/...;base64,` URL's image, or None."""
    if not url.startswith("data:"):
        return None
    comma = url.find(",", 0, 200)
    if comma < 0 or not url[:comma].endswith(";base64"):
        return None
    data = _Base64(url, comma + 1)
    head = data.read(0, 30)
    size = _png(head) or _gif(head) or _webp(head)
    if size is None and head.startswith(b"\xff\xd8"):
        size = _jpeg(data)
    if size is None or not (0 < size[0] <= _MAX_SIDE and 0 < size[1] <= _MAX_SIDE):
        return None
    return size


def _png(head: bytes) -> tuple[int, int] | None:
    if head[:8] != b"\x89PNG\r\n\x1a\n" or head[12:16] != b"IHDR" or len(head) < 24:
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _gif(head: bytes) -> tuple[int, int] | None:
    if head[:6] not in (b"GIF87a", b"GIF89a") or len(head) < 10:
        return None
    return int.from_bytes(head[6:8], "little"), int.from_bytes(head[8:10], "little")


def _webp(head: bytes) -> tuple[int, int] | None:
    if head[:4] != b"RIFF" or head[8:12] != b"WEBP" or len(head) < 30:
        return None
    kind = head[12:16]
    if kind == b"VP8 ":  # lossy: 14-bit sizes after the frame tag and start code
        width = int.from_bytes(head[26:28], "little") & 0x3FFF
        height = int.from_bytes(head[28:30], "little") & 0x3FFF
        return width, height
    if kind == b"VP8L":  # lossless: two 14-bit fields, each size minus one
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if kind == b"VP8X":  # extended: 24-bit canvas sizes, each minus one
        return int.from_bytes(head[24:27], "little") + 1, int.from_bytes(head[27:30], "little") + 1
    return None


def _jpeg(data: _Base64) -> tuple[int, int] | None:
    offset = 2
    for _ in range(_MAX_SEGMENTS):
        marker = data.read(offset, 9)
        if len(marker) < 4 or marker[0] != 0xFF:
            return None
        if marker[1] == 0xFF:  # fill byte before a marker
            offset += 1
            continue
        if marker[1] in _SOF:
            if len(marker) < 9:
                return None
            height = int.from_bytes(marker[5:7], "big")
            width = int.from_bytes(marker[7:9], "big")
            return width, height
        if marker[1] in (0xD9, 0xDA):  # end of image, or scan data before any frame
            return None
        offset += 2 + int.from_bytes(marker[2:4], "big")
    return None
