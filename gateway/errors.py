"""Every error the gateway makes itself, each knowing its HTTP status and OpenAI code.

    GatewayError                      500 internal_error
    ├── BadRequest                    400 invalid_request_error
    │   ├── InvalidJSON               400 invalid_json
    │   ├── UnsupportedContentType    400 unsupported_content_type
    │   └── InvalidHeader             400 invalid_header
    ├── Unauthorized                  401 invalid_api_key
    ├── NotFound                      404 not_found
    │   └── ModelNotFound             404 model_not_found
    ├── MethodNotAllowed              405 method_not_allowed
    ├── RequestTimeout                408 request_timeout       (closes the connection)
    ├── PayloadTooLarge               413 request_too_large
    ├── ExpectationFailed             417 expectation_failed
    ├── Overloaded                    429 overloaded            (+ Retry-After)
    ├── UpstreamError                 502 upstream_error
    ├── NoInstanceAvailable           503 no_instance_available (+ Retry-After)
    ├── ShuttingDown                  503 shutting_down         (+ Retry-After)
    ├── QueueTimeout                  503 queue_timeout         (+ Retry-After)
    ├── TooManyConnections            503 too_many_connections  (+ Retry-After)
    └── UpstreamTimeout               504 upstream_timeout

The body is always OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`,
so the SDK raises the matching exception class with our message. Messages quote the bad
value (never a key) and say what was expected. "+ Retry-After" is whole seconds, with
`retry-after-ms` beside it (the exact delay, which the SDK reads first), except on the
503 for a connection too many, which is written before any request exists.
"""

from __future__ import annotations

import json
import math
from typing import ClassVar

from aiohttp import web


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        out = dict(headers or {})
        if self.retry_after is not None:
            # Whole seconds for HTTP clients at large; exactly for the OpenAI SDK, which
            # reads `retry-after-ms` first (admission's excess is often well under 1 s).
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
            out["retry-after-ms"] = str(max(1, round(self.retry_after * 1000)))
        return web.Response(
            status=self.status, body=self.body(), content_type="application/json", headers=out
        )


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class UnsupportedContentType(BadRequest):
    code = "unsupported_content_type"


class InvalidHeader(BadRequest):
    code = "invalid_header"


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def response(self, headers: dict[str, str] | None = None) -> web.Response:
        response = super().response(headers)
        # The rest of the request never arrived: the connection cannot carry another one.
        response.force_close()
        return response


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class ExpectationFailed(GatewayError):
    status = 417
    type = "invalid_request_error"
    code = "expectation_failed"


class Overloaded(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "overloaded"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class NoInstanceAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_instance_available"


class ShuttingDown(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "shutting_down"


class QueueTimeout(GatewayError):
    """Queued until its time ran out without reaching an instance (504 is for instances)."""

    status = 503
    type = "service_unavailable"
    code = "queue_timeout"


class TooManyConnections(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "too_many_connections"


class UpstreamTimeout(GatewayError):
    status = 504
    type = "timeout"
    code = "upstream_timeout"


def error_body(message: str, type: str, code: str | int | None, param: str | None = None) -> bytes:
    """OpenAI's error object: the one shape of every error the gateway writes."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


def sse_error_event(message: str, code: int = 502) -> bytes:
    """An in-band SSE error the OpenAI SDK raises as `APIError`, then the end of the stream."""
    return b"data: " + error_body(message, "upstream_error", code) + b"\n\ndata: [DONE]\n\n"
