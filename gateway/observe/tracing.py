"""OpenTelemetry spans for each request and each attempt (the `otel` extra), off by default.

The only module that imports OpenTelemetry, and only inside its functions; the proxy
imports this module only when `Config.otlp_traces_url` is set, so a gateway without the
extra, or with tracing off, runs exactly as before. Spans go to their own
`TracerProvider` (never the process-global one) through a batching OTLP/HTTP exporter;
the SDK reads its usual variables (`OTEL_TRACES_SAMPLER`, `OTEL_RESOURCE_ATTRIBUTES`, ...).
The service is named by `OTEL_SERVICE_NAME` (or a `service.name` in
`OTEL_RESOURCE_ATTRIBUTES`), else `SERVICE_NAME`.

A request span (SERVER) continues the client's `traceparent` if it sent one, else starts
a trace; each attempt is a CLIENT span under it, and the instance gets a `traceparent`
naming the attempt span, so vLLM's own spans (`--otlp-traces-endpoint`) hang under the
attempt that reached it. The proxy sees only `Spans` and `Span`, never an OTel type.
"""

from __future__ import annotations

from typing import Any

from gateway.observe.trace_context import TraceContext

# Attribute names: OpenTelemetry's semantic conventions where one fits, ours otherwise.
ROUTE = "http.route"
STATUS = "http.response.status_code"
SERVER = "server.address"  # the instance, by its label
MODEL = "gen_ai.request.model"
LANE = "gateway.lane"
ATTEMPT = "gateway.attempt"
ATTEMPTS = "gateway.attempts"
REQUEST_ID = "gateway.request_id"
ERROR = "error.type"
# The spans' service.name unless the environment names the service (the SDK's own
# fallback, "unknown_service:python", would tell an operator nothing).
SERVICE_NAME = "vllm-gateway"
_NAMES = {
    "lane": LANE,
    "model": MODEL,
    "instance": SERVER,
    "attempts": ATTEMPTS,
    "request_id": REQUEST_ID,
}


class Span:
    """One started span; `end()` records its outcome and closes it."""

    __slots__ = ("_span",)

    def __init__(self, span: Any) -> None:
        self._span = span

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    @property
    def span_id(self) -> str:
        return f"{self._span.get_span_context().span_id:016x}"

    @property
    def flags(self) -> str:
        return f"{int(self._span.get_span_context().trace_flags):02x}"

    def end(self, status: int | str, **attributes: str | int) -> None:
        """Close with the HTTP status (or the failure kind of an attempt that got none).

        `attributes` by short name: lane, model, instance, attempts, request_id.
        """
        from opentelemetry.trace import Status, StatusCode

        span = self._span
        span.set_attributes({_NAMES[k]: v for k, v in attributes.items() if v != ""})
        if isinstance(status, int):
            span.set_attribute(STATUS, status)
            if status >= 500:
                span.set_status(Status(StatusCode.ERROR, f"status {status}"))
        else:
            span.set_attribute(ERROR, status)
            span.set_status(Status(StatusCode.ERROR, status))
        span.end()

    def __repr__(self) -> str:
        return f"<Span {self.trace_id}/{self.span_id}>"


class Spans:
    """Starts the gateway's spans on a tracer of its own provider."""

    def __init__(self, provider: Any) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("gateway")

    def request(self, route: str, method: str, parent: TraceContext | None) -> Span:
        """The span of one client request, under the client's trace if it sent one."""
        from opentelemetry.trace import SpanKind

        name = f"{method} {route}"
        span = self._tracer.start_span(
            name, context=_remote(parent), kind=SpanKind.SERVER, attributes={ROUTE: route}
        )
        return Span(span)

    def attempt(self, request: Span, attempt: int, instance: str) -> Span:
        """The span of one attempt on one instance, under its request's span."""
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self._tracer.start_span(
            "attempt",
            context=set_span_in_context(request._span),
            kind=SpanKind.CLIENT,
            attributes={ATTEMPT: attempt, SERVER: instance},
        )
        return Span(span)

    def shutdown(self) -> None:
        """Export what is batched and stop (the SDK also does this at exit)."""
        self._provider.shutdown()


def _remote(parent: TraceContext | None) -> Any:
    """An OTel context holding the client's span as a remote parent (None: a new trace)."""
    if parent is None:
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context
    from opentelemetry.trace.span import TraceState

    context = SpanContext(
        trace_id=int(parent.trace_id, 16),
        span_id=int(parent.parent_id, 16),
        is_remote=True,
        trace_flags=TraceFlags(int(parent.flags, 16)),
        trace_state=TraceState.from_header([parent.state]) if parent.state else None,
    )
    return set_span_in_context(NonRecordingSpan(context))


def start(traces_url: str, exporter: Any = None) -> Spans:
    """Spans exported to `traces_url` in batches (or to `exporter` at once, for tests)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=_resource())
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url)))
    else:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Spans(provider)


def _resource() -> Any:
    """The SDK's resource, with `SERVICE_NAME` where the environment names no service.

    `Resource.create` reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES itself, but
    attributes passed to it win over both: the default is passed only when neither names
    the service.
    """
    from opentelemetry.sdk.resources import OTELResourceDetector, Resource

    if "service.name" in OTELResourceDetector().detect().attributes:
        return Resource.create()
    return Resource.create({"service.name": SERVICE_NAME})
