"""The one seam to the network: the only module that uses aiohttp's client.

One pooled `ClientSession` sized by `max_connections` serves every instance. Failures
are mapped here, where they enter, to `AttemptFailed` with a short kind that the retry
policy understands ("connect", "timeout", or "bad_response" for a response head aiohttp
cannot parse); HTTP answers of any status come back as responses for the proxy to judge.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .schema import Timeouts


class AttemptFailed(Exception):
    """An attempt got no HTTP answer: kind is "connect", "timeout" or "bad_response"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Upstream:
    def __init__(self, max_connections: int, timeouts: Timeouts) -> None:
        self.max_connections = max_connections
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            # vLLM (uvicorn) closes idle connections after 5 s; dropping ours sooner avoids
            # sending a request down a socket the instance is closing.
            keepalive_timeout=4.0,
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
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
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
    ) -> aiohttp.ClientResponse:
        """Send a request and return once the response headers arrived (or fail).

        `timeout` bounds the wait for the headers; reading the body is the caller's to
        bound. On timeout or cancellation aiohttp closes the half-open connection, so the
        instance sees its client leave and aborts.
        """
        try:
            async with asyncio.timeout(timeout):
                # Per request: a reload may change the connect timeout.
                connect = aiohttp.ClientTimeout(total=None, connect=self.timeouts.connect)
                return await self.session.request(
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
            async with asyncio.timeout(timeout):
                return response.status, await response.read()
        except TimeoutError:
            raise AttemptFailed("timeout", f"body not read within {timeout:.1f}s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AttemptFailed("connect", f"{type(exc).__name__}: {exc}") from None
        finally:
            response.release()

    def __repr__(self) -> str:
        state = "open" if self._session is not None else "closed"
        return f"<Upstream {state} max_connections={self.max_connections}>"
