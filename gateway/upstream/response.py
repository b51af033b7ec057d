"""What the rest of the gateway knows of an instance's answer: `UpstreamResponse`, and
`AttemptFailed` for an attempt that got no HTTP answer. Our client (`connection.py`, on
httptools) returns the one and raises the other, and so does the tests' fake, so the relay,
the proxy and the prober never see a transport's own types.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, Protocol

# The most of an answer the gateway reads whole for itself (a prefill hop's, a scrape, a
# probe, /v1/models, /tokenize): vLLM's largest, /metrics with many engines or /tokenize of
# a long prompt, stay within a few MiB; past this an instance is broken or hostile.
MAX_WHOLE_BYTES = 16 * 1024 * 1024


AttemptKind = Literal["connect", "stale", "timeout", "bad_response", "unsendable", "shutting_down"]
# What metrics (gateway_instance_errors_total's `kind`, gateway_retries_total's and
# gateway_instance_check_failures_total's `reason`), logs, retry reasons and an instance's
# recent errors call a kind: the three words the dashboards and alerts know. A kind that
# only says more about a connection that could not be used is the "connect" it always was.
Reported = Literal["connect", "timeout", "bad_response"]
REPORTED: Mapping[AttemptKind, Reported] = {
    "connect": "connect",
    "stale": "connect",
    "timeout": "timeout",
    "bad_response": "bad_response",
    "unsendable": "connect",
    "shutting_down": "connect",
}


_GATEWAYS_OWN: frozenset[AttemptKind] = frozenset({"unsendable", "shutting_down"})


class AttemptFailed(Exception):
    """An attempt got no usable HTTP answer. `kind` says why, one of:

    - "connect": no connection to the instance (refused, unreachable, none within the
      connect timeout, closed as it opened), or the instance closed it before or while it
      answered;
    - "stale": a kept-alive connection that the instance had closed as we reused it, before
      a byte of the answer came: no fault of the instance. The pool sends the request again
      on a new connection, so no caller of `Pool.request` sees this kind;
    - "timeout": no head, or no more of the body, within the time allowed;
    - "bad_response": an answer that is not HTTP we can pass on (a malformed or oversized
      head, a protocol switch, a body past its size limit);
    - "unsendable": the request cannot be written: a header holding a line break, or an
      instance URL that is not http(s)://;
    - "shutting_down": the gateway is closing its connections (the app's cleanup).

    `reported` is the kind as metrics and logs name it (`REPORTED`).
    """

    def __init__(self, kind: AttemptKind, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind: AttemptKind = kind
        self.detail = detail

    @property
    def reported(self) -> Reported:
        """The kind as metrics, logs and retry reasons name it."""
        return REPORTED[self.kind]

    @property
    def gateways_own(self) -> bool:
        """Whether the gateway's own state failed it ("unsendable", "shutting_down"), not
        the instance: every instance would fail alike, so it is neither retried elsewhere
        nor held against the instance."""
        return self.kind in _GATEWAYS_OWN


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
