"""Every error the gateway makes itself, each knowing its HTTP status and OpenAI code.

    GatewayError                      500 internal_error
    ├── BadRequest                    400 invalid_request_error
    │   ├── InvalidJSON               400 invalid_json
    │   ├── UnsupportedContentType    400 unsupported_content_type
    │   └── InvalidHeader             400 invalid_header
    ├── Unauthorized                  401 invalid_api_key
    ├── ModelNotAllowed               403 model_not_found       (a key without the model)
    ├── AdminOnly                     403 admin_only            (/admin/* with a client's key)
    ├── NotFound                      404 not_found
    │   └── ModelNotFound             404 model_not_found
    ├── MethodNotAllowed              405 method_not_allowed
    ├── RequestTimeout                408 request_timeout       (closes the connection)
    ├── PayloadTooLarge               413 request_too_large
    ├── ExpectationFailed             417 expectation_failed
    ├── Overloaded                    429 overloaded            (+ Retry-After)
    ├── KeyRateLimited                429 rate_limit_exceeded   (+ Retry-After; a named key's)
    │   ├── RequestsRateLimited           type "requests"
    │   └── TokensRateLimited             type "tokens"
    ├── UpstreamError                 502 upstream_error
    ├── NoInstanceAvailable           503 no_instance_available (+ Retry-After)
    ├── ShuttingDown                  503 shutting_down         (+ Retry-After)
    ├── QueueTimeout                  503 queue_timeout         (+ Retry-After)
    ├── TooManyConnections            503 too_many_connections  (+ Retry-After)
    └── UpstreamTimeout               504 upstream_timeout

The route decides the body's shape (its `api`). On the OpenAI routes it is OpenAI's,
`{"error": {"message", "type", "param", "code"}}`, so the SDK raises the matching
exception class with our message. On Anthropic's Messages routes it is Anthropic's,
`{"type": "error", "error": {"type", "message"}}`, its type named by the status as
Anthropic's API names it (400 invalid_request_error, also for the other 4xx; 401
authentication_error, 403 permission_error, 404 not_found_error, 413 request_too_large,
429 rate_limit_error, 500 and 502 api_error, 503 overloaded_error, 504 timeout_error).

The status is the same on every route: the SDKs pick the exception class, and whether to
retry, from it (both retry 429 and 5xx after Retry-After), and one status per condition
keeps metrics, alerts and load balancers agreeing across routes. So an overloaded gateway
answers 503 overloaded_error, not Anthropic's 529, which is not a registered HTTP status
(the Anthropic SDK raises 503 as ServiceUnavailableError and 529 as OverloadedError, both
InternalServerErrors it retries alike). Messages quote the bad value (never a key) and
say what was expected. "+ Retry-After" is whole seconds, with `retry-after-ms` beside it
(the exact delay, which both SDKs read first), except on the 503 for a connection too
many, which is written before any request (and so any route) exists.

A stream already committed ends in-band, in the route's shape too (`stream_error`).
"""

from __future__ import annotations

import json
import math
from typing import ClassVar, Literal

from aiohttp import web

# Whose API a route speaks: how the gateway's own errors on it are written.
Api = Literal["openai", "anthropic"]
# The gateway's own answers that no retry of the same request can change (a bad body, a
# wrong key, a model or route it does not serve, a body too large): they say
# `x-should-retry: false`, which the OpenAI and Anthropic SDKs obey before their own
# status rules (Claude Code retried a wrong key's 401 for two minutes without it).
NO_RETRY_FIXES = frozenset({400, 401, 403, 404, 405, 413, 417})


class GatewayError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"
    # Why the scheduler turned the request away unplaced (its `Rejected.reason`), for the
    # access line and the key's counts; "" for every other error.
    rejection: str = ""

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self, api: Api = "openai") -> bytes:
        if api == "anthropic":
            return anthropic_error_body(self.message, anthropic_type(self.status))
        return error_body(self.message, self.type, self.code, self.param)

    def response(self, headers: dict[str, str] | None = None, api: Api = "openai") -> web.Response:
        out = dict(headers or {})
        if self.status in NO_RETRY_FIXES:
            out["x-should-retry"] = "false"
        if self.retry_after is not None:
            # Whole seconds for HTTP clients at large; exactly for the OpenAI SDK, which
            # reads `retry-after-ms` first (admission's excess is often well under 1 s).
            out["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
            out["retry-after-ms"] = str(max(1, round(self.retry_after * 1000)))
        return web.Response(
            status=self.status, body=self.body(api), content_type="application/json", headers=out
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


class ModelNotAllowed(GatewayError):
    """A named key asked for a model it may not use: OpenAI's answer to a project key
    without access to a model (403, `invalid_request_error`, `model_not_found`), which the
    OpenAI SDK raises as PermissionDeniedError."""

    status = 403
    type = "invalid_request_error"
    code = "model_not_found"


class AdminOnly(GatewayError):
    """A named key without `admin` asked for an /admin route: the fleet's config and every
    key's usage are the operator's, not one client's to read."""

    status = 403
    type = "permission_error"
    code = "admin_only"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class InstanceNotFound(NotFound):
    """An /admin route named an instance the fleet does not hold."""

    code = "instance_not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def response(self, headers: dict[str, str] | None = None, api: Api = "openai") -> web.Response:
        response = super().response(headers, api)
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


class KeyRateLimited(GatewayError):
    """A named key over one of its limits, in OpenAI's shape for it: 429, code
    `rate_limit_exceeded`, the type naming the limit (`requests` or `tokens`). Without a
    `retry_after` no wait would help (the request alone is over the limit): the answer says
    `x-should-retry: false`, which both SDKs obey."""

    status = 429
    code = "rate_limit_exceeded"

    def response(self, headers: dict[str, str] | None = None, api: Api = "openai") -> web.Response:
        response = super().response(headers, api)
        if self.retry_after is None:
            response.headers["x-should-retry"] = "false"
        return response


class RequestsRateLimited(KeyRateLimited):
    type = "requests"


class TokensRateLimited(KeyRateLimited):
    type = "tokens"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class NoInstanceAvailable(GatewayError):
    status = 503
    type = "service_unavailable"
    code = "no_instance_available"


class SharedStoreUnavailable(GatewayError):
    """An order that must reach every replica (a drain) could not be written to Redis."""

    status = 503
    type = "service_unavailable"
    code = "shared_store_unavailable"


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
    """OpenAI's error object: the shape of the gateway's errors on the OpenAI routes."""
    error = {"message": message, "type": type, "param": param, "code": code}
    return json.dumps({"error": error}).encode()


# Anthropic's error types by HTTP status (its API reference, "Errors"); any other 4xx is an
# invalid_request_error and any other 5xx an api_error, as Anthropic says it does.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    # Every 503 of ours means "no place for it now, come back after Retry-After": what
    # Anthropic calls overloaded (it sends that as 529; ours stay 503, see above).
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_type(status: int) -> str:
    """The Anthropic error type of an HTTP status."""
    named = _ANTHROPIC_TYPES.get(status)
    if named is not None:
        return named
    return "invalid_request_error" if status < 500 else "api_error"


def anthropic_error_body(message: str, type: str) -> bytes:
    """Anthropic's error object: the shape of the gateway's errors on the Messages routes."""
    return json.dumps({"type": "error", "error": {"type": type, "message": message}}).encode()


def stream_error(message: str, status: int = 502, api: Api = "openai") -> bytes:
    """The in-band error that ends a stream already committed, in the route's API's shape.

    OpenAI's: a data event the OpenAI SDK raises as `APIError`, then `data: [DONE]`.
    Anthropic's: an `error` event, as Anthropic's API sends mid-stream (the Anthropic SDK
    raises it; it skips events without a name), and nothing after it.
    """
    if api == "anthropic":
        body = anthropic_error_body(message, anthropic_type(status))
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + error_body(message, "upstream_error", status) + b"\n\ndata: [DONE]\n\n"
