"""What one request did: the record its access-log line and its metrics are made from.

The recording middleware (recorder.py) makes it and records it once the answer is done;
in between, the proxy is its one writer: the relay and each attempt return values that
the proxy copies in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.observe.trace_context import TraceContext

if TYPE_CHECKING:
    from gateway.observe.tracing import Span


@dataclass
class Exchange:
    """What one request did, for its access-log line and metrics."""

    route: str  # a bounded name: the route's, or "other" for a path no route serves
    request_id: str
    started: float
    tag: str = ""
    key: str = ""  # the name of the key the request carried (never the key itself)
    model: str = ""  # as a metric label: a model the fleet serves, else "other"
    lane: str = ""
    priority: str = "interactive"  # its key's class: whose objectives it is counted by
    instance: str = ""
    status: int = 0
    attempts: int = 0
    ttft: float | None = None
    tpot: float | None = None
    tokens: int | None = None  # output tokens: the instance's usage, else those relayed
    prompt_tokens: int = 0  # the gateway's estimate (the lane's, the key's reservation)
    usage_prompt_tokens: int | None = None  # the instance's own count, from its usage
    max_tokens: int = 0
    metered: bool = False  # its route runs the model: its tokens count for its key
    # For the access log only (never labels: unbounded, or chosen by the client).
    requested_model: str = ""  # the model asked for, when `model` folded it into "other"
    method: str = ""
    path: str = ""
    client: str = ""  # the peer, or the client trusted proxies name (client_address.py)
    peer: str = ""  # the connection's peer, when trusted proxies are set
    user_agent: str = ""
    queue_wait: float = 0.0  # seconds in the gateway queue, all attempts together
    bytes_sent: int = 0
    bytes_received: int = 0  # the request body
    protocol: str = ""  # HTTP/1.1, HTTP/1.0
    cut: str | None = None  # a stream cut short by the client, a drain or the instance
    answered: bool = False  # an instance sent a response head (the decode hop's, if two)
    # Disaggregated: where the prompt was prefilled, and how: "two_hop", or "whole" for
    # a prompt not worth the second hop, or the fallback's reason (proxy/disaggregate.py).
    prefill_instance: str = ""
    hop_path: str = ""
    trace: TraceContext | None = None
    span: Span | None = None  # with OpenTelemetry on: the request's span
    forward: dict[str, str] = field(default_factory=dict)  # client headers the instance gets
    # Why it was refused: by its key (model, requests, tokens, concurrent), or by the
    # gateway's scheduler (a Rejected reason: queue_full, predicted_wait, no_instance, ...).
    refused: str = ""
    # The instances a migrated stream went on to after its first, in order (continuation.py).
    migrated_to: list[str] = field(default_factory=list)


def tokens_used(ex: Exchange) -> tuple[int, int]:
    """The prompt and completion tokens a request cost its key: the instance's usage where
    the answer carried it; else the prompt estimate and the output tokens relayed (a stream
    cut short). Nothing for a route that runs no model, for a request no instance took,
    or for an error answer; a client that left after its request was sent pays its prompt.
    """
    if not ex.metered or not ex.instance or (ex.status >= 400 and ex.status != 499):
        return 0, 0
    prompt = ex.prompt_tokens if ex.usage_prompt_tokens is None else ex.usage_prompt_tokens
    return prompt, ex.tokens or 0
