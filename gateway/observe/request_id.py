"""Every answer carries an `X-Request-ID`: the client's, if it is sane, else a new one.

One middleware (`middleware()` makes it), outermost, so the id is set before any
handler runs (and bound into the log context) and reaches every answer the gateway
makes: the proxy's, `/v1/models`, `/admin/instances`, the errors other middleware turn
into responses, and those aiohttp's own handler makes (runner.py). A streamed answer
sends its headers itself; the proxy puts the same id in them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Awaitable, Callable
from contextvars import ContextVar

import structlog
from aiohttp import web
from aiohttp.typedefs import Middleware

HEADER = "X-Request-ID"
_SANE = re.compile(r"[A-Za-z0-9._:@+=-]{1,128}")
_current: ContextVar[str] = ContextVar("request_id", default="")


def current() -> str:
    """The id of the request this task is serving ("" outside a request)."""
    return _current.get()


KEY = web.RequestKey("request_id", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def of(request: web.BaseRequest) -> str:
    """The client's id if it is sane, else a new one."""
    request_id = request.headers.get(HEADER, "")
    if not _SANE.fullmatch(request_id):
        request_id = os.urandom(16).hex()  # as unique as uuid4, a fifth of the cost
    return request_id


def middleware() -> Middleware:
    """The outermost middleware: the request's id, in the log context and on its answer.

    An answer aiohttp makes from an `HTTPException` gets the id too; one it makes for an
    exception no middleware turned into an answer (a 500) or for malformed HTTP gets it in
    the runner's error handler (runner.py), which reads the id kept on the request.
    """

    @web.middleware
    async def request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = of(request)
        request[KEY] = request_id
        _current.set(request_id)
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            exc.headers[HEADER] = request_id
            raise
        if not response.prepared:
            response.headers[HEADER] = request_id
        return response

    return request_id


def of_answered(request: web.BaseRequest) -> str:
    """The id the middleware gave the request, or a new one if none ran (malformed HTTP)."""
    return request.get(KEY) or of(request)
