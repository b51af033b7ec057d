"""The link to the shared store (Redis) that the view, the placements stream, the leases
and the named keys' limits all go through: one connection with bounded timeouts, this
process's name in the store, whether the view is up, and every failure of any of them
counted and logged at a bounded rate (`gateway_shared_state_errors_total{reason}`).

May import: redis, `gateway.observe`, `gateway.fleet.shared_codec`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

import redis.asyncio as aioredis

from gateway.fleet.shared_codec import redacted
from gateway.observe import log

_log = log.get("gateway.shared")

LOG_EVERY_S = 60.0  # the same failure is logged at most this often (with a count)


class SharedLink:
    """One process's connection to the store, and what has gone wrong with it."""

    def __init__(
        self,
        url: str,
        clock: Callable[[], float],
        *,
        interval: float = 0.25,
        process_id: str | None = None,
    ) -> None:
        self.url = url
        self.clock = clock
        self.process_id = (
            process_id or f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        )
        # Every call is bounded: a slow Redis costs a round, never a request.
        self.redis = aioredis.Redis.from_url(
            url, socket_timeout=max(0.5, interval * 2), socket_connect_timeout=1.0
        )
        self.up: bool | None = None  # None until the first round
        self.errors: dict[str, int] = {}  # failures by reason, for the counter
        self._logged: dict[str, tuple[float, int]] = {}  # reason -> (last logged, since)

    def failed(self, reason: str, error: BaseException | str) -> None:
        """Count a failure and log it, at most once a minute per reason."""
        self.errors[reason] = self.errors.get(reason, 0) + 1
        now = self.clock()
        last, since = self._logged.get(reason, (-LOG_EVERY_S, 0))
        if now - last < LOG_EVERY_S:
            self._logged[reason] = (last, since + 1)
            return
        self._logged[reason] = (now, 0)
        detail = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        _log.warning(
            "shared_state_error",
            reason=reason,
            detail=str(detail)[:200],
            suppressed=since,
            redis=redacted(self.url),
        )

    def set_up(self, up: bool) -> None:
        if up == self.up:
            return
        if up:
            _log.info("shared_state_up", redis=redacted(self.url), process=self.process_id)
        else:  # once per outage; its cause is the shared_state_error line
            _log.warning("shared_state_down", redis=redacted(self.url), process=self.process_id)
        self.up = up

    async def reconnect(self) -> None:
        """The next command on a fresh connection: one pooled from before a Redis restart
        would fail too."""
        with contextlib.suppress(Exception):
            await self.redis.connection_pool.disconnect()

    def __repr__(self) -> str:
        state = {None: "starting", True: "up", False: "down"}[self.up]
        return f"<SharedLink {redacted(self.url)} {state} errors={sum(self.errors.values())}>"


def honour_cancel() -> None:
    """redis-py (8.1) can swallow a cancellation that lands inside a command: the command
    returns as if nothing happened. Honour the request, or shutdown would wait forever."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
