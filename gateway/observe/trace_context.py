"""W3C Trace Context (`traceparent`, `tracestate`): read from a client, passed to an instance.

Every request gets a trace id, logged as `trace_id` beside the gateway's `request_id`,
so a line of ours finds the instance's spans (vLLM's `--otlp-traces-endpoint`) and the
client's. A valid `traceparent` from the client is continued; without one, or with one
that breaks the format, the gateway starts a trace: a fresh trace id, sampled (`01`),
as vLLM would start a root span of its own anyway, only now under an id we logged.
`tracestate` travels only beside a valid `traceparent` and only if it is short and
printable (the spec's 512 characters, which every vendor must pass on).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_TRACESTATE = re.compile(r"[\x20-\x7e]{1,512}")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16


@dataclass(frozen=True)
class TraceContext:
    trace_id: str  # 32 hex digits
    parent_id: str  # 16 hex digits: the span the next hop is a child of
    flags: str = "01"  # 2 hex digits; 01: sampled
    state: str | None = None  # tracestate, passed on unchanged
    from_client: bool = False

    def traceparent(self, parent_id: str | None = None) -> str:
        """The header for the next hop, version 00, whose parent is `parent_id` if given."""
        return f"00-{self.trace_id}-{parent_id or self.parent_id}-{self.flags}"

    @property
    def sampled(self) -> bool:
        return bool(int(self.flags, 16) & 1)


def fresh() -> TraceContext:
    """A new trace, sampled, whose parent is the gateway's own (unrecorded) span."""
    ids = os.urandom(24).hex()  # one system call for both ids: every request pays it
    return TraceContext(ids[:32], ids[32:])


def from_headers(headers: Mapping[str, str]) -> TraceContext | None:
    """The client's trace context, or None if it sent no valid `traceparent`.

    As the spec says: version ff is invalid; a later version than 00 is read by its first
    four fields and passed on as 00; an all-zero trace or parent id is invalid.
    """
    value = headers.get("traceparent", "").strip()
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    state = headers.get("tracestate")
    if state is not None and not _TRACESTATE.fullmatch(state.strip()):
        state = None
    return TraceContext(
        trace_id,
        parent_id,
        flags,
        state.strip() if state is not None else None,
        from_client=True,
    )
