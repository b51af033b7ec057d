"""What the rest of the gateway knows of an instance's answer: `UpstreamResponse`, and
`AttemptFailed` for an attempt that got no HTTP answer. Our client (`connection.py`, on
httptools) returns the one and raises the other, and so does the tests' fake, so the relay,
the proxy and the prober never see a transport's own types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

# The most of an answer the gateway reads whole for itself (a prefill hop's, a scrape, a
# probe, /v1/models, /tokenize): vLLM's largest, /metrics with many engines or /tokenize of
# a long prompt, stay within a few MiB; past this an instance is broken or hostile.
MAX_WHOLE_BYTES = 16 * 1024 * 1024


class AttemptFailed(Exception):
    """An attempt got no HTTP answer: kind is "connect", "timeout" or "bad_response"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class UpstreamResponse(Protocol):
    """An instance's answer once its head arrived: what the rest of the gateway reads.

    `read` raises `AttemptFailed` ("connect" when the instance breaks the connection,
    "timeout" when `timeout` runs out, "bad_response" past its size limit); a cancelled
    caller gets `CancelledError` as usual.
    A streamed answer (connection.py's `Response`) also offers `next_chunk()` and
    `splice(sink)`, for the relay.
    """

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def content_type(self) -> str: ...

    async def read(self, timeout: float, limit: int = MAX_WHOLE_BYTES) -> bytes:
        """The whole body, within `timeout` seconds and `limit` bytes (past it, the answer
        is closed and AttemptFailed "bad_response" raised)."""
        ...

    def close(self) -> None:
        """Done with the answer (idempotent): its connection goes back to the pool if the
        answer ended cleanly, else it is dropped and the instance sees its client leave and
        aborts (a stream not read to its end, a cancelled reader)."""
        ...


async def read_whole(response: UpstreamResponse, timeout: float) -> tuple[int, bytes]:
    """A small exchange's status and body read whole, then the answer closed (see `close`)."""
    try:
        return response.status, await response.read(timeout)
    finally:
        response.close()
