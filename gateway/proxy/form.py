"""The few fields of a multipart/form-data body the gateway acts on, read without copying it.

An upload (`/v1/audio/transcriptions`) names its `model` and `stream` in form fields
beside the file. The gateway needs those two to route the request, and must send the
body on byte for byte: so it only looks, finding the parts by their boundary and reading
the headers and value of the small text parts it was asked for. File parts (those with a
`filename`) are skipped by position, never sliced. The framing is RFC 7578's (CRLF line
ends, `--boundary` delimiters); a body that breaks it is an error the client gets as 400.
"""

from __future__ import annotations

import re
from email.message import Message

_NAME = re.compile(rb';\s*name\s*=\s*(?:"([^"]*)"|([^;\s]+))', re.IGNORECASE)
_FILENAME = re.compile(rb";\s*filename\*?\s*=", re.IGNORECASE)
_MAX_HEAD = 8 * 1024  # a part's headers; more is not a form an SDK writes
_MAX_VALUE = 4 * 1024  # a text field we read (a model name, a boolean)


class InvalidForm(ValueError):
    """The body is not the multipart/form-data its Content-Type says it is."""


def boundary_of(content_type: str) -> str:
    """The `boundary` parameter of a multipart Content-Type header."""
    message = Message()
    message["Content-Type"] = content_type
    boundary = message.get_param("boundary")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 70:
        raise InvalidForm("the Content-Type has no usable boundary parameter (RFC 2046: 1-70)")
    return boundary


def text_fields(body: bytes, boundary: str, names: frozenset[str]) -> dict[str, str]:
    """The values of the text parts named in `names` (the first of each), as UTF-8."""
    delimiter = b"--" + boundary.encode("latin-1")
    if not body.startswith(delimiter):
        # RFC 2046 allows a preamble; the delimiter then follows a CRLF.
        at = body.find(b"\r\n" + delimiter)
        if at < 0:
            raise InvalidForm("the body does not contain its boundary")
        start = at + 2
    else:
        start = 0
    found: dict[str, str] = {}
    separator = b"\r\n" + delimiter
    while True:
        start += len(delimiter)
        if body.startswith(b"--", start):
            return found  # the close delimiter
        if not body.startswith(b"\r\n", start):
            raise InvalidForm("a boundary delimiter is not followed by a line end")
        head_start = start + 2
        head_end = body.find(b"\r\n\r\n", head_start, head_start + _MAX_HEAD)
        if head_end < 0:
            raise InvalidForm("a part's headers do not end (or are over 8 KiB)")
        end = body.find(separator, head_end + 4)
        if end < 0:
            raise InvalidForm("the body ends without its closing boundary")
        name = _field_name(body[head_start:head_end])
        if name is not None and name in names and name not in found:
            value = body[head_end + 4 : min(end, head_end + 4 + _MAX_VALUE + 1)]
            if len(value) > _MAX_VALUE:
                raise InvalidForm(f"the form field {name!r} is longer than {_MAX_VALUE} bytes")
            try:
                found[name] = value.decode()
            except UnicodeDecodeError:
                raise InvalidForm(f"the form field {name!r} is not UTF-8") from None
        start = end + 2


def _field_name(head: bytes) -> str | None:
    """The `name` of a text part from its headers; None for a file part or none given."""
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() != b"content-disposition":
            continue
        if _FILENAME.search(value):
            return None
        match = _NAME.search(value)
        if match is None:
            return None
        raw = match.group(1) if match.group(1) is not None else match.group(2)
        return raw.decode("utf-8", "replace")
    return None
