"""What the gateway tells about itself: logs, metrics, the access record, traces.

`log` (structlog, configured once), `metrics` (the registry and every series),
`saturation` (fleet saturation by model, the autoscaling signal), `metrics_merge` and
`peer_metrics` (one `/metrics` for all worker processes), `exchange` (the record of one
request, written by the proxy and read here), `recorder` (the access line and the request
metrics, after the fact), `client_address` (who the client is behind trusted proxies),
`request_id`, `trace_context` (W3C headers), `tracing` (OpenTelemetry, loaded only when
configured).
May import: the vocabulary, `gateway.dispatch`, `gateway.config`, `gateway.upstream`.
"""
