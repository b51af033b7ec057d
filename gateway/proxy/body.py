"""Fields of a request body the gateway acts on, read the way vLLM reads them.

vLLM validates a request with pydantic in lax mode: `stream: bool | None = False` takes
`"true"` or `1` as true. The gateway decides from the same field whether to relay a
stream or a whole answer, so it must read it the same way: a stricter reading buffers a
stream vLLM is sending, a looser one sends vLLM a request it answers 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gateway.proxy import jsoncodec

# pydantic v2's lax `bool` (pydantic-core's `str_as_bool`): these strings, compared
# without regard to case but not stripped ("0" and "1" have no case).
_TRUE = frozenset({"1", "t", "true", "y", "yes", "on"})
_FALSE = frozenset({"0", "f", "false", "n", "no", "off"})


class InvalidField(ValueError):
    """A field vLLM would refuse with 400; `field` names it for the error's `param`."""

    def __init__(self, field: str, value: Any) -> None:
        shown = repr(value)
        super().__init__(
            f"{field} must be a boolean (true or false), got {shown[:60]}"
            f"{'...' if len(shown) > 60 else ''}"
        )
        self.field = field


def lax_bool(value: Any, field: str) -> bool | None:
    """`value` as pydantic's lax `bool | None` reads a parsed JSON value.

    True/False; the numbers 0 and 1 (0.0 and 1.0 too); the strings of `_TRUE` and
    `_FALSE` in any case; None stays None. Anything else raises `InvalidField`.
    """
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int | float):
        if value == 1:
            return True
        if value == 0:  # NaN equals neither
            return False
    elif isinstance(value, str) and value.isascii():  # pydantic folds ASCII case only
        lowered = value.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
    raise InvalidField(field, value)


def wants_stream(payload: Mapping[str, Any]) -> bool:
    """Whether vLLM will answer this generation request as a stream (absent: no)."""
    return bool(lax_bool(payload.get("stream"), "stream"))


def ask_usage(body: bytes, payload: dict[str, Any]) -> tuple[bytes, bool]:
    """A stream's body asking vLLM for its usage chunk if the client did not, and whether
    it did (then the chunk is the gateway's, to keep from the client).

    vLLM sends the chunk when `stream_options` is there and its `include_usage` is not
    false (absent, it defaults to true). A client that asked for continuous usage stats
    without the chunk is left alone: turning it on would put usage in every chunk. So is a
    `stream_options` vLLM would refuse.
    """
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            return body, False
        try:
            if lax_bool(options.get("include_usage", True), "include_usage"):
                return body, False  # asked for
            if lax_bool(options.get("continuous_usage_stats"), "continuous_usage_stats"):
                return body, False
        except InvalidField:
            return body, False  # vLLM answers 400
    asked = {**(options or {}), "include_usage": True}
    body = jsoncodec.with_field(body, payload, "stream_options", asked)
    payload["stream_options"] = asked  # a disaggregated decode hop writes its body from it
    return body, True
