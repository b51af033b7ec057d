"""Strict caps' leases (`[shared] strict_caps`): every place on an instance also a lease in
Redis, so that replicas together never hold more than its cap.

The shared view (shared.py) counts the others' load as last heard, so while pushes are in
flight a few more requests than an instance's cap can land on it. With strict caps every
place is also a lease in Redis, taken atomically by a Lua script: a sorted set per instance
of `process:ticket` members scored by their expiry (Redis's own clock), trimmed of expired
leases and checked against the cap in one step. A request whose lease is refused is placed
again elsewhere (dispatcher.py). Leases are renewed every round and given back when the
attempt ends; a dead process's expire after `LEASE_S`. The price is one Redis round trip
per request; if Redis does not answer in `CLAIM_TIMEOUT_S`, the local view decides, as
without strict caps. The named keys' places (shared_limits.py) are leases of the same kind.

    <namespace>:leases:<instance>   a sorted set of held places, scored by expiry (ms)

May import: redis, `gateway.fleet.shared_link`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from redis.exceptions import RedisError

from gateway.fleet.shared_link import SharedLink, honour_cancel

LEASE_S = 10.0  # a strict-caps lease lives this long unless renewed (a round renews it)
CLAIM_TIMEOUT_S = 0.5  # a claim Redis does not answer in this long is decided locally

# KEYS[1]: the instance's leases; ARGV: member, cap, lease ms. {1 if the place is ours,
# forged leases dropped}: a lease lives at most its time from now, so one scored later was
# not written by a gateway (it would hold a place for good).
_CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local latest = string.format('(%.0f', now + tonumber(ARGV[3]))
local forged = redis.call('ZREMRANGEBYSCORE', KEYS[1], latest, '+inf')
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[2]) then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
  return {1, forged}
end
return {0, forged}
"""
# KEYS: lease sets; ARGV[1]: lease ms, then one member per key: renew if held (the strict
# caps' places, and the named keys' places, shared_limits.py).
RENEW_LEASES = """
local t = redis.call('TIME')
local until_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, 'XX', until_ms, ARGV[i + 1])
end
return #KEYS
"""


class Leases:
    """This process's strict-caps leases: claimed per request, renewed each round, given
    back in batches off the request's path."""

    def __init__(self, link: SharedLink, namespace: str = "gateway", ttl: float = 3.0) -> None:
        self.link = link
        self.ttl = ttl
        self._leases = f"{namespace}:leases:"  # + instance: a sorted set of held places
        self._held: dict[int, str] = {}  # ticket -> instance, the leases we hold
        self._unheld: list[tuple[str, int]] = []  # leases to give back
        self._give_back = asyncio.Event()
        self._claim_script = link.redis.register_script(_CLAIM)
        self._renew_script = link.redis.register_script(RENEW_LEASES)

    async def claim(self, instance: str, ticket: int, cap: int) -> bool | None:
        """Take one of `cap` places on `instance` in Redis: True if ours, False if all are
        taken, None if Redis did not answer in time (the local view decides)."""
        if self.link.up is not True:
            return None  # Redis is away: no request waits for it (the local view decides)
        member = f"{self.link.process_id}:{ticket}"
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                got = await self._claim_script(
                    keys=[self._leases + instance], args=[member, cap, int(LEASE_S * 1000)]
                )
        except asyncio.CancelledError:
            self._give_back_lease(instance, ticket)  # it may have gone through
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            self._give_back_lease(instance, ticket)  # a timed-out script may have taken it
            self.link.failed("redis", exc)
            return None
        ours, forged = _claim_answer(got)
        if forged:
            self.link.failed("forged_lease", f"{forged} of {instance}'s leases past a lease's time")
        if ours:
            self._held[ticket] = instance
        return ours

    def unclaim(self, ticket: int) -> None:
        """Give back the lease `ticket` holds, if it holds one."""
        instance = self._held.pop(ticket, None)
        if instance is not None:
            self._give_back_lease(instance, ticket)

    def _give_back_lease(self, instance: str, ticket: int) -> None:
        """Soon, in one pipeline with the others given back meanwhile."""
        self._held.pop(ticket, None)
        self._unheld.append((instance, ticket))
        self._give_back.set()

    async def give_back_forever(self) -> None:
        while True:
            await self._give_back.wait()
            self._give_back.clear()
            batch, self._unheld = self._unheld, []
            try:
                async with asyncio.timeout(max(1.0, self.ttl / 2)):
                    async with self.link.redis.pipeline(transaction=False) as pipe:
                        for instance, ticket in batch:
                            pipe.zrem(self._leases + instance, f"{self.link.process_id}:{ticket}")
                        await pipe.execute()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # they expire after LEASE_S in any case
                self.link.failed("redis", exc)
            honour_cancel()

    async def renew(self) -> None:
        """Our leases live another LEASE_S: a stream may hold its place for minutes."""
        held = list(self._held.items())
        if not held:
            return
        await self._renew_script(
            keys=[self._leases + instance for _, instance in held],
            args=[int(LEASE_S * 1000), *(f"{self.link.process_id}:{t}" for t, _ in held)],
        )

    def __repr__(self) -> str:
        return f"<Leases held={len(self._held)} giving_back={len(self._unheld)}>"


def _claim_answer(answer: Any) -> tuple[bool, int]:
    """The claim script's answer: whether the place is ours, and the forged leases it
    dropped (an answer of another shape takes no place)."""
    if isinstance(answer, list | tuple) and len(answer) == 2:
        ours, forged = answer
        if isinstance(ours, int) and isinstance(forged, int):
            return ours == 1, max(0, forged)
    return False, 0
