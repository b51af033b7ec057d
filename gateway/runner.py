"""The aiohttp runner the gateway serves with, and its answers to malformed HTTP.

aiohttp answers protocol errors (a broken request line, an 8 KiB header, a bad chunk
size) itself, in plain text, before any middleware runs. A client of an OpenAI API
expects `{"error": {...}}` even then, so the connection handler is swapped for one whose
`handle_error` writes that shape. The statuses stay aiohttp's.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from . import errors


class _OpenAIErrorsHandler(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # The parent logs the error and refuses if a response already started.
        super().handle_error(request, status, exc, message)
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        response = web.Response(
            status=status,
            body=errors.error_body(
                f"{phrase}: {message}" if status < 500 and message else phrase,
                "invalid_request_error" if status < 500 else "internal_error",
                phrase.lower().replace(" ", "_"),
            ),
            content_type="application/json",
        )
        response.force_close()
        return response


class _OpenAIErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose connections answer protocol errors in OpenAI's error shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server inside Application; adopting it keeps every setting
        # and swaps only how a connection's handler is made.
        server.__class__ = _OpenAIErrorsServer
        return server


def make_runner(app: web.Application, shutdown_timeout: float) -> GatewayRunner:
    return GatewayRunner(
        app,
        handler_cancellation=True,  # a client that leaves cancels its upstream request
        access_log=None,  # we write our own access line per request
        shutdown_timeout=shutdown_timeout,
    )
