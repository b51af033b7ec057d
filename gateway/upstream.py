"""The one seam to the network: the only module that uses aiohttp's client.

One pooled `ClientSession` sized by `max_connections` serves every instance. Failures
are mapped here, where they enter, to `AttemptFailed` with a short kind that the retry
policy understands ("connect" or "timeout"); HTTP answers of any status come back as
responses for the proxy to judge.
"""

from __future__ import annotations

import asyncio

import aiohttp

from .schema import Timeouts


class AttemptFailed(Exception):
    """An attempt got no HTTP answer: kind is "connect" or "timeout"."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


class Upstream:
    def __init__(self, max_connections: int, timeouts: Timeouts) -> None:
        self.max_connections = max_connections
        self.timeouts = timeouts
        self._session: aiohttp.ClientSession | None = None
        self._read_timeouts: dict[float | None, aiohttp.ClientTimeout] = {}

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(
            limit=self.max_connections,
            limit_per_host=0,
            # vLLM (uvicorn) closes idle connections after 5 s; dropping ours sooner avoids
            # sending a request down a socket the instance is closing.
            keepalive_timeout=4.0,
        )
        # No total timeout: a stream may run for minutes. The proxy bounds each attempt's
        # wait for an answer and passes the silence allowed between chunks per request.
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
        idle: float | None = None,
    ) -> aiohttp.ClientResponse:
        """Send a request and return once the response headers arrived (or fail).

        `timeout` bounds the wait for the headers; `idle`, if given, the silence between
        reads of the body afterwards. On timeout or cancellation aiohttp closes the
        half-open connection, so the instance sees its client leave and aborts.
        """
        client_timeout = self._read_timeouts.get(idle)
        if client_timeout is None:
            client_timeout = aiohttp.ClientTimeout(
                total=None, connect=self.timeouts.connect, sock_read=idle
            )
            self._read_timeouts[idle] = client_timeout
        try:
            async with asyncio.timeout(timeout):
                return await self.session.request(
                    method, url, data=body, headers=headers, timeout=client_timeout
                )
        except TimeoutError:
            raise AttemptFailed("timeout", f"no response headers within {timeout:.1f}s") from None
        except aiohttp.ClientConnectorError as exc:
            raise AttemptFailed("connect", f"cannot connect: {exc.os_error}") from None
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
