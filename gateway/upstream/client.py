"""The one seam to the network, `Upstream`: every call to an instance goes through it.

Streamed and whole answers go through one pool of our HTTP/1.1 client (connection.py, on
httptools) sized by `max_connections`, and health probes, metric scrapes and model lists
(`fetch`) through a small one of their own (`CONTROL_CONNECTIONS`), so a fleet saturated
with requests is still probed on time: one client, one set of rules for every upstream
call (a message is a boundary; a stale kept-alive socket is retried once on a new one). `open()`
returns the answer once its head arrived: a `Response` whose body is read whole
(`read`), pulled (`next_chunk`) or, once a stream is committed, spliced to the client
(`splice`, see relay/splice.py). Every failure is mapped where it enters to
`AttemptFailed` with a kind that says why (response.py lists them; metrics and the
retry policy see "connect", "timeout" or "bad_response"). HTTP answers
of any status come back as responses for the proxy to judge. Bodies are passed on as
sent: nothing is decompressed here. `tests/fake_upstream.py` replays scripted responses
through the same interface.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.config.schema import Timeouts
from gateway.upstream.connection import Response
from gateway.upstream.pool import KEEPALIVE_S, Pool
from gateway.upstream.response import AttemptFailed, read_whole

if TYPE_CHECKING:
    from gateway.config.load import Config

# Probes and scrapes: a round sends three calls to each instance at once; eight is plenty
# for a fleet checked every few seconds, and small next to max_connections.
CONTROL_CONNECTIONS = 8


class Upstream:
    def __init__(self, max_connections: int, timeouts: Timeouts, *, pooled: bool = True) -> None:
        self.max_connections = max_connections
        self.timeouts = timeouts
        self.pooled = pooled  # False: one connection per request, closed after it
        self._pool: Pool | None = None
        self._control: Pool | None = None

    async def start(self) -> None:
        keepalive = KEEPALIVE_S if self.pooled else 0.0
        self._pool = Pool(self.max_connections, self.timeouts.connect, keepalive)
        self._control = Pool(CONTROL_CONNECTIONS, self.timeouts.connect, keepalive)

    def apply(self, config: Config) -> None:
        """A (reloaded) configuration: its channel timeouts, which both pools take (the
        connect timeout is the one a pool reads; `max_connections` is fixed at start)."""
        self.timeouts = config.channel.timeout
        for pool in (self._pool, self._control):
            if pool is not None:
                pool.apply(config)

    async def close(self) -> None:
        for pool in (self._pool, self._control):
            if pool is not None:
                pool.close()
        self._pool = self._control = None

    @property
    def pool(self) -> Pool | None:
        """The connections to every instance (None until started)."""
        return self._pool

    async def open(
        self,
        method: str,
        url: str,
        *,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> Response:
        """Send a request; return once its answer's head arrived (AttemptFailed if none).

        `timeout` bounds the wait for the head; reading the body is the caller's to bound.
        On timeout or cancellation the connection is closed, so the instance sees its
        client leave and aborts.
        """
        return await self._send(self._pool, method, url, body, headers, timeout)

    async def _send(
        self,
        pool: Pool | None,
        method: str,
        url: str,
        body: bytes | None,
        headers: dict[str, str],
        timeout: float,
    ) -> Response:
        if pool is None:
            raise RuntimeError("Upstream.start() was not awaited")
        try:
            return await pool.request(method, url, body=body, headers=headers, timeout=timeout)
        except ValueError as exc:  # a header that cannot be sent
            raise AttemptFailed("unsendable", str(exc)) from None

    async def fetch(
        self,
        url: str,
        *,
        method: str = "GET",
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float,
        for_request: bool = False,
    ) -> tuple[int, bytes]:
        """A small exchange (health, metrics, models, tokenize): status and whole body, on
        the control pool; `for_request`: one a client's request waits on (its /tokenize),
        on the requests' pool, so it never queues behind a health round's calls."""
        pool = self._pool if for_request else self._control
        response = await self._send(pool, method, url, body, headers or {}, timeout)
        return await read_whole(response, timeout)

    def __repr__(self) -> str:
        return f"<Upstream {self._pool!r}>"
