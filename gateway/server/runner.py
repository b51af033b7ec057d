"""How the gateway serves client connections: the listener, the bounds, malformed HTTP.

`GatewayRunner` is aiohttp's `AppRunner` (the app's start-up and shutdown) with its own
listener instead of a `TCPSite`, so each connection's protocol can be made here, from
public pieces only:

- `_OpenAIErrorsHandler` is aiohttp's public `web.RequestHandler` with `handle_error`
  overridden: aiohttp answers protocol errors (a broken request line, an 8 KiB header, a
  bad chunk size) itself, before any middleware, and a client of an OpenAI API expects
  `{"error": {...}}` even then. The statuses stay aiohttp's.
- `ClientConnections` (connections.py) wraps each handler in the header and idle timers
  and refuses connections over the cap; it learns when a request's head was parsed by
  wrapping the public `web.Server.request_handler`.

`RequestHandler`'s constructor and `handle_error` are public but not documented as an
extension point, so pyproject.toml pins the aiohttp versions this was tested with, and
tests (test_hostile_input.py's malformed-HTTP cases, test_connections.py) fail if an
upgrade changes them.
"""

from __future__ import annotations

import asyncio
import socket
from http import HTTPStatus

from aiohttp import web

from gateway import errors
from gateway.observe import log, request_id
from gateway.relay.client_stream import ANSWER_STARTED
from gateway.server.connections import ClientConnections, ConnectionLimits
from gateway.server.resources import ADMIN, CONFIG, METRICS

_log = log.get("gateway.runner")


class _OpenAIErrorsHandler(web.RequestHandler):
    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        # The parent logs the error and refuses if a response already started through
        # aiohttp's writer; a stream's answer is written by the relay's own (ClientStream).
        super().handle_error(request, status, exc, message)
        if request.get(ANSWER_STARTED):
            raise ConnectionError("the answer began already: no second one on this connection")
        phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else "Error"
        response = web.Response(
            status=status,
            body=errors.error_body(
                f"{phrase}: {message}" if status < 500 and message else phrase,
                "invalid_request_error" if status < 500 else "internal_error",
                phrase.lower().replace(" ", "_"),
            ),
            content_type="application/json",
            headers={request_id.HEADER: request_id.of_answered(request)},
        )
        response.force_close()
        return response


# Connections the admin listener may open when the API's clients hold every one of
# `max_client_connections`: probes and scrapes still get in during an overload.
ADMIN_CONNECTIONS = 16


class GatewayRunner(web.AppRunner):
    """An AppRunner that listens itself, with bounded connections answering in OpenAI's shape."""

    def __init__(self, app: web.Application, shutdown_timeout: float) -> None:
        super().__init__(
            app,
            handler_cancellation=True,  # a client that leaves cancels its upstream request
            shutdown_timeout=shutdown_timeout,
        )
        self.connections: ClientConnections | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._admin: asyncio.AbstractServer | None = None  # the admin listener, if any

    async def setup(self) -> None:
        await super().setup()  # runs the app's start-up: its config and metrics exist now
        server = self.server
        assert server is not None
        gateway = self.app[CONFIG].gateway
        limits = ConnectionLimits(
            header_timeout=gateway.header_timeout,
            idle_timeout=gateway.idle_timeout,
            max_open=gateway.max_client_connections,
        )
        self.connections = ClientConnections(limits, self.app[METRICS])
        # Every connection's handler reads this when it is made, i.e. after this line.
        server.request_handler = self.connections.wrap_handler(server.request_handler)

    async def listen(self, host: str, port: int, *, reuse_port: bool = False) -> tuple[str, int]:
        """Start accepting connections; returns the bound address (port 0 picks one).

        `reuse_port` sets SO_REUSEPORT, so the workers of `gateway --workers N` each bind the
        same port and the kernel spreads new connections among them (workers.py).
        """
        self._listener = await self._serve(host, port, reuse_port)
        assert self.connections is not None
        _warn_if_file_limit_is_low(self.connections.limits.max_open)
        return _bound(self._listener)

    async def listen_admin(
        self, host: str, port: int, *, reuse_port: bool = False
    ) -> tuple[str, int]:
        """The admin listener (`[gateway] admin_port`): the same app and connection limits;
        it stays open through the drain, so probes and scrapes still see the gateway."""
        self._admin = await self._serve(host, port, reuse_port, beyond_limit=ADMIN_CONNECTIONS)
        bound = _bound(self._admin)
        self.app[ADMIN].port = bound[1]
        return bound

    async def _serve(
        self, host: str, port: int, reuse_port: bool, beyond_limit: int | None = None
    ) -> asyncio.AbstractServer:
        server, connections = self.server, self.connections
        assert server is not None, "call setup() first"
        assert connections is not None
        loop = asyncio.get_running_loop()
        # aiohttp's own idle close is silent and uncounted: a backstop ours always beat.
        backstop = connections.limits.header_timeout + connections.limits.idle_timeout

        def make_handler() -> asyncio.Protocol:
            return _OpenAIErrorsHandler(
                server,
                loop=loop,
                # We write our own access line per request. None is aiohttp's documented
                # way to turn its own off, though the constructor's type says Logger.
                access_log=None,  # type: ignore[arg-type]
                keepalive_timeout=backstop,
            )

        listener = await loop.create_server(
            connections.protocol_factory(make_handler, limit=beyond_limit),
            host,
            port,
            backlog=128,
            reuse_port=reuse_port or None,
        )
        return listener

    @property
    def sockets(self) -> list[socket.socket]:
        """The sockets it listens on (none before `listen` or after `stop_listening`)."""
        return list(getattr(self._listener, "sockets", None) or [])

    def stop_listening(self) -> None:
        """No new connections; the open ones finish their requests."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def cleanup(self) -> None:
        self.stop_listening()
        if self._admin is not None:
            self._admin.close()
            self._admin = None
        if self.connections is not None:
            self.connections.close()
        await super().cleanup()


def _warn_if_file_limit_is_low(max_open: int) -> None:
    try:
        import resource
    except ImportError:  # not on Unix: nothing to compare with
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Upstream connections, probes, logs and the listener need descriptors too.
    if soft != resource.RLIM_INFINITY and soft < max_open + 100:
        _log.warning(
            "file_limit_below_connection_cap",
            nofile=soft,
            max_client_connections=max_open,
            hint="raise `ulimit -n` or lower [gateway].max_client_connections",
        )


def make_runner(app: web.Application, shutdown_timeout: float) -> GatewayRunner:
    return GatewayRunner(app, shutdown_timeout)


def _bound(listener: asyncio.AbstractServer) -> tuple[str, int]:
    sockets = getattr(listener, "sockets", None) or []
    address = sockets[0].getsockname()
    return str(address[0]), int(address[1])
