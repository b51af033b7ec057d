"""The one seam to the network, `Upstream`: the only module that uses aiohttp's client.

Two ways out, by what the caller will do with the answer. `open_stream()` sends a streamed
request on connection.py's pool (our HTTP/1.1 client on httptools) and returns its
`Response`, whose body the relay pulls until the first event and then splices to the
client (splice.py). `open()` sends everything else (whole answers, health probes, metric
scrapes, model lists) through one pooled aiohttp `ClientSession` sized by
`max_connections`, and returns our own `UpstreamResponse` (status, headers, the whole
body, close), never aiohttp's. Every failure is mapped where it enters to `AttemptFailed`
with a short kind that the retry policy understands ("connect", "timeout", or
"bad_response" for a response head that cannot be parsed). HTTP answers of any status
come back as responses for the proxy to judge. `tests/dispatch/test_purity.py` checks
that no other module of the gateway imports aiohttp's client, and
`tests/fake_upstream.py` replays scripted responses through the same interface.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import aiohttp

from gateway.config.schema import Timeouts
from gateway.upstream.connection import Response
from gateway.upstream.pool import Pool
from gateway.upstream.response import AttemptFailed, UpstreamResponse


class _ClientResponse:
    """`UpstreamResponse` over aiohttp's `ClientResponse`: its errors mapped as they enter."""

    __slots__ = ("_response", "headers", "status")

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.headers: Mapping[str, str] = response.headers

    @property
    def content_type(self) -> str:
        return self._response.content_type

    async def read(self, timeout: float) -> bytes:
        try:
            async with asyncio.timeout(timeout):
                return await self._response.read()
        except TimeoutError:
            raise AttemptFailed("timeout", f"body not read within {timeout:.1f}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AttemptFailed("connect", f"{type(exc).__name__}: {exc}") from None

    def close(self) -> None:
        self._response.close()

    def release(self) -> None:
        self._response.release()

    def __repr__(self) -> str:
        return f"<UpstreamResponse status={self.status} {self._response.url}>"


class Upstream:
    def __init__(self, max_connections: int, timeouts: Timeouts, *, pooled: bool = True) -> None:
        self.max_connections = max_connections
        self.timeouts = timeouts
        self.pooled = pooled  # False: one connection per request, closed after it
        self._session: aiohttp.ClientSession | None = None
        self._streams: Pool | None = None  # connection.py's pool, for open_stream()

    async def start(self) -> None:
        keepalive = 4.0 if self.pooled else 0.0  # the same expiry as the session's, below
        self._streams = Pool(self.max_connections, self.timeouts.connect, keepalive)
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            force_close=not self.pooled,
            # vLLM (uvicorn) closes idle connections after 5 s; dropping ours sooner avoids
            # sending a request down a socket the instance is closing.
            keepalive_timeout=4.0 if self.pooled else None,
        )
        # No total timeout and no per-read one: a stream may run for minutes, and the relay
        # bounds the silence between data events itself (a per-read timer would be reset by
        # any byte, a keep-alive comment included). The proxy bounds each attempt's wait.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=timeout,
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )

    async def close(self) -> None:
        if self._streams is not None:
            self._streams.close()
            self._streams = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.start() was not awaited")
        return self._session

    async def open(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> UpstreamResponse:
        """Send a request whose answer is read whole; return once its headers arrived.

        `timeout` bounds the wait for the headers; reading the body is the caller's to
        bound. On timeout or cancellation the half-open connection is closed, so the
        instance sees its client leave and aborts.
        """
        try:
            async with asyncio.timeout(timeout):
                # Per request: a reload may change the connect timeout.
                connect = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect)
                response = await self._client.request(
                    method, url, data=body, headers=headers, timeout=connect
                )
        except TimeoutError:
            raise AttemptFailed("timeout", f"no response headers within {timeout:.1f}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise AttemptFailed("connect", f"cannot connect: {exc.os_error}") from None
        except aiohttp.ClientResponseError as exc:
            # Raised while parsing the response head (a header over aiohttp's 8190-byte
            # line limit, a malformed line): the instance answered, but not in HTTP we can
            # pass on. The parser's message quotes header bytes; only its gist goes on.
            gist = exc.message.split(":", 1)[0].strip()[:120]
            raise AttemptFailed("bad_response", gist) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AttemptFailed("connect", f"{type(exc).__name__}: {exc}") from None
        return _ClientResponse(response)

    @property
    def streams(self) -> Pool | None:
        """connection.py's pool of the spliced streams' connections (None until started)."""
        return self._streams

    async def open_stream(
        self,
        url: str,
        *,
        body: bytes,
        headers: dict[str, str],
        timeout: float,
    ) -> Response:
        """POST a streamed request on connection.py's pool: its answer's body can be spliced.

        Same contract as `open` (AttemptFailed on no answer); the answer also offers
        `next_chunk()`, and `splice(sink)`, which hands each body chunk on as it arrives
        (splice.py).
        """
        if self._streams is None:
            raise RuntimeError("Upstream.start() was not awaited")
        self._streams.connect_timeout = self.timeouts.connect  # a reload may change it
        try:
            return await self._streams.request(
                "POST", url, body=body, headers=headers, timeout=timeout
            )
        except ValueError as exc:  # a header that cannot be sent (aiohttp refuses it too)
            raise AttemptFailed("connect", str(exc)) from None

    async def fetch(
        self,
        url: str,
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
    ) -> tuple[int, bytes]:
        """A small exchange (health, metrics, models, tokenize): status and whole body."""
        response = await self.open(method, url, body=body, headers=headers or {}, timeout=timeout)
        try:
            return response.status, await response.read(timeout)
        finally:
            response.release()

    def __repr__(self) -> str:
        state = "open" if self._session is not None else "closed"
        return f"<Upstream {state} max_connections={self.max_connections}>"
