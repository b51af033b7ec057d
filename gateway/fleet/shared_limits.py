"""The named keys' limits fleet-wide: their counters in Redis, beside the shared view.

Without `[shared]` each process keeps its own counters (proxy/limiter.py), so N workers or
replicas each allow a key its whole limit. With it, every process charges the same
counters, kept in Redis and changed by one Lua script per request (`_ADMIT`), so that
together they never admit more than the key's limit: the script reads the key's two GCRA
times (requests, tokens; dispatch/key_limits.py has the arithmetic) and its places in
use, admits only if every limit does, and writes the new times back in the same step, on
Redis's clock (microseconds of `TIME`), whatever the replicas' clocks say.

    <namespace>:limit:<key>:requests   the requests bucket's TAT, microseconds (PX: until full)
    <namespace>:limit:<key>:tokens     the tokens bucket's TAT
    <namespace>:limit:<key>:inflight   a sorted set of places in use, scored by expiry (ms)

A key whose bucket is full has no key at all (it expires once full). A place is a lease,
as strict caps' are (shared_leases.py): renewed every `LEASE_S` / 3 while its request runs and
given back when it ends, so a process that dies frees its places within `LEASE_S`.
Settlements (the tokens used less those reserved, and the place given back) go out in
one pipeline, off the request's path.

The script's answer is read like anything else from Redis (untrusted: shared_codec.py): five
integers within bounds, else it is counted (`malformed`) and this process decides on its
own counters. So it does whenever Redis is away or slow (more than `CLAIM_TIMEOUT_S`):
counted and logged as a `redis` failure of the shared state, at most once a minute. No
request waits longer on Redis, nor fails because of it.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from redis.exceptions import RedisError

from gateway.dispatch.key_limits import (
    Admitted,
    KeyLimits,
    Limit,
    OverLimit,
    Standings,
    decide,
    standings_of,
)
from gateway.fleet.shared_leases import CLAIM_TIMEOUT_S, LEASE_S, RENEW_LEASES
from gateway.fleet.shared_link import SharedLink, honour_cancel

_US = 1_000_000
# A TAT or a clock further than this from Redis's own now is nobody's honest state.
_MAX_AHEAD_US = 7 * 24 * 3600 * _US
# Redis refused what our arithmetic, rounded otherwise, admits: the bucket is a rounding
# error from having room, which it will have within this.
_HAIR_S = 0.001

# KEYS: the key's requests TAT, tokens TAT, places (sorted set). ARGV: requests per minute,
# tokens per minute, tokens reserved, most places (0: no such limit), the place's member,
# the lease's ms. Admits only if every limit does. Returns {admitted, now µs, requests
# TAT, tokens TAT, places in use, forged places dropped}: the TATs after an admission, as
# they were if refused.
_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local MINUTE, SLACK = 60000000, 1
local rpm, tpm = tonumber(ARGV[1]), tonumber(ARGV[2])
local cost, most = tonumber(ARGV[3]), tonumber(ARGV[4])
local function tat_of(key)
  local v = tonumber(redis.call('GET', key))
  if v == nil or v ~= v or v == math.huge or v == -math.huge then return now end
  return v
end
local function keep(key, tat)  -- until the bucket is full again (then it may vanish)
  redis.call('SET', key, string.format('%.0f', tat), 'PX', math.ceil((tat - now) / 1000) + 1000)
end
local r_tat, t_tat, r_new, t_new, places = now, now, now, now, 0
local ok = true
if rpm > 0 then
  r_tat = tat_of(KEYS[1])
  r_new = math.max(r_tat, now) + MINUTE / rpm
  if r_new - now > MINUTE + SLACK then ok = false end
end
if tpm > 0 then
  t_tat = tat_of(KEYS[2])
  t_new = math.max(t_tat, now) + cost * MINUTE / tpm
  if t_new - now > MINUTE + SLACK then ok = false end
end
local forged = 0
if most > 0 then
  local now_ms = math.floor(now / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
  -- A place lives at most a lease from now: one scored later was not written by a gateway.
  local latest = string.format('(%.0f', now_ms + tonumber(ARGV[6]))
  forged = redis.call('ZREMRANGEBYSCORE', KEYS[3], latest, '+inf')
  places = redis.call('ZCARD', KEYS[3])
  if places >= most then ok = false end
end
if not ok then
  return {0, now, r_tat, t_tat, places, forged}
end
if rpm > 0 then keep(KEYS[1], r_new) end
if tpm > 0 then keep(KEYS[2], t_new) end
if most > 0 then
  redis.call('ZADD', KEYS[3], math.floor(now / 1000) + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]) + 1000)
end
return {1, now, r_new, t_new, places, forged}
"""
# KEYS: the key's tokens TAT, its places. ARGV: tokens per minute (0: none), the tokens used
# past the reservation (fewer: a refund), the place's member ('': none). A refund never
# fills the bucket past full.
_SETTLE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tpm, extra = tonumber(ARGV[1]), tonumber(ARGV[2])
if tpm > 0 and extra ~= 0 then
  local tat = tonumber(redis.call('GET', KEYS[1]))
  if tat == nil or tat ~= tat or tat == math.huge or tat == -math.huge then tat = now end
  local new = math.max(now, tat + extra * 60000000 / tpm)
  if new > now then
    local ttl = math.ceil((new - now) / 1000) + 1000
    redis.call('SET', KEYS[1], string.format('%.0f', new), 'PX', ttl)
  else
    redis.call('DEL', KEYS[1])
  end
end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
return 1
"""


class SharedLimits:
    """The keys' counters in Redis, through the shared view's link (shared_link.py)."""

    def __init__(self, link: SharedLink, namespace: str = "gateway") -> None:
        self.link = link
        self._prefix = f"{namespace}:limit:"
        self._admit_script = link.redis.register_script(_ADMIT)
        self._settle_script = link.redis.register_script(_SETTLE)
        self._renew_script = link.redis.register_script(RENEW_LEASES)
        self._held: dict[str, str] = {}  # our places in use: member -> key
        self._settlements: list[tuple[str, int, int, str]] = []  # key, tpm, extra, member
        self._wake = asyncio.Event()
        self.admitted = self.refused = 0  # decided in Redis, for /admin/usage and tests

    def _keys(self, key: str) -> list[str]:
        prefix = self._prefix + key
        return [f"{prefix}:requests", f"{prefix}:tokens", f"{prefix}:inflight"]

    def _member(self, lease: str) -> str:
        return f"{self.link.process_id}:{lease}"

    async def admit(
        self, key: str, limits: KeyLimits, tokens: int, lease: str
    ) -> Admitted | OverLimit | None:
        """Admit a request of `key` reserving `tokens` in Redis, or refuse it; None if Redis
        did not answer in time or answered nonsense (this process decides instead)."""
        if self.link.up is not True:
            return None  # Redis is away: no request waits for it
        most = limits.max_concurrent or 0
        member = self._member(lease)
        args: list[int | str] = [
            limits.requests_per_minute or 0,
            limits.tokens_per_minute or 0,
            tokens,
            most,
            member,
            int(LEASE_S * 1000),
        ]
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                answer = await self._admit_script(keys=self._keys(key), args=args)
        except asyncio.CancelledError:
            if most:
                self._queue(key, 0, 0, member)  # it may have gone through: free the place
            raise
        except (RedisError, OSError, TimeoutError) as exc:
            if most:
                self._queue(key, 0, 0, member)
            self.link.failed("redis", exc)
            return None
        try:
            admitted, now, requests_tat, tokens_tat, places, forged = _bounded(answer)
        except ValueError as exc:
            self.link.failed("malformed", f"the key limits' script answered {exc}")
            return None
        if forged:
            self.link.failed("forged_lease", f"{forged} of key {key}'s places past a lease")
        seconds = now / _US
        if admitted:
            self.admitted += 1
            if most:
                self._held[member] = key
            standings = standings_of(
                limits, requests_tat / _US, tokens_tat / _US, places + 1, seconds
            )
            return Admitted(standings)
        self.refused += 1
        verdict, _, _ = decide(
            limits, requests_tat / _US, tokens_tat / _US, places, tokens, seconds
        )
        if isinstance(verdict, OverLimit):
            return verdict
        # Redis's arithmetic refused what ours, rounded otherwise, would admit: its word stands.
        standings = standings_of(limits, requests_tat / _US, tokens_tat / _US, places, seconds)
        limit: Limit = "requests" if limits.requests_per_minute else "tokens"
        return OverLimit(limit, _HAIR_S, 1, standings)

    def settle(self, key: str, limits: KeyLimits, tokens: int, lease: str) -> None:
        """Charge `tokens` more than reserved (a refund if fewer) and give the place back,
        with the next pipeline."""
        member = self._member(lease)
        held = self._held.pop(member, None) is not None
        tpm = limits.tokens_per_minute or 0
        if (tokens and tpm) or held:
            self._queue(key, tpm, tokens, member if held else "")

    def _queue(self, key: str, tpm: int, tokens: int, member: str) -> None:
        self._settlements.append((key, tpm, tokens, member))
        self._wake.set()

    async def standings(self, key: str, limits: KeyLimits) -> Standings | None:
        """Where `key` stands fleet-wide now (None: Redis did not say), for /admin/usage."""
        requests_key, tokens_key, places_key = self._keys(key)
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                async with self.link.redis.pipeline(transaction=False) as pipe:
                    pipe.time()
                    pipe.get(requests_key)
                    pipe.get(tokens_key)
                    pipe.zcard(places_key)
                    (seconds, micros), requests_tat, tokens_tat, places = await pipe.execute()
            now = int(seconds) * _US + int(micros)
            values = [now, int(requests_tat or now), int(tokens_tat or now), int(places)]
            _, _, requests_at, tokens_at, held, _ = _bounded([1, *values, 0])
        except (RedisError, OSError, TimeoutError, ValueError, TypeError) as exc:
            self.link.failed("redis", exc)
            return None
        return standings_of(limits, requests_at / _US, tokens_at / _US, held, now / _US)

    async def run_forever(self) -> None:
        """Send the settlements as they come, and renew our places every LEASE_S / 3."""
        renew_every = LEASE_S / 3
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(renew_every):
                    await self._wake.wait()
            self._wake.clear()
            batch, self._settlements = self._settlements, []
            renew = loop.time() - renewed >= renew_every and bool(self._held)
            if renew:
                renewed = loop.time()
            if batch or renew:
                await self._send(batch, renew)
            honour_cancel()

    async def _send(self, batch: list[tuple[str, int, int, str]], renew: bool) -> None:
        try:
            async with asyncio.timeout(max(1.0, CLAIM_TIMEOUT_S * 2)):
                async with self.link.redis.pipeline(transaction=False) as pipe:
                    for key, tpm, tokens, member in batch:
                        _, tokens_key, places_key = self._keys(key)
                        await self._settle_script(
                            keys=[tokens_key, places_key], args=[tpm, tokens, member], client=pipe
                        )
                    if renew:
                        held = list(self._held.items())
                        await self._renew_script(
                            keys=[self._keys(key)[2] for _, key in held],
                            args=[int(LEASE_S * 1000), *(member for member, _ in held)],
                            client=pipe,
                        )
                    await pipe.execute()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # places expire after LEASE_S; a lost settlement stays charged
            self.link.failed("redis", exc)

    def __repr__(self) -> str:
        return (
            f"<SharedLimits held={len(self._held)} pending={len(self._settlements)} "
            f"admitted={self.admitted} refused={self.refused}>"
        )


def _bounded(answer: Any) -> tuple[int, int, int, int, int, int]:
    """The admission script's answer as six integers within bounds; ValueError otherwise."""
    if not isinstance(answer, list | tuple) or len(answer) != 6:
        raise ValueError(f"{str(answer)[:80]!r}, not six values")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in answer):
        raise ValueError(f"{str(answer)[:80]!r}, not integers")
    admitted, now, requests_tat, tokens_tat, places, forged = answer
    if admitted not in (0, 1) or now <= 0 or not 0 <= places <= 1_000_000 or forged < 0:
        raise ValueError(f"{str(answer)[:80]!r}, out of bounds")
    for tat in (requests_tat, tokens_tat):
        if abs(tat - now) > _MAX_AHEAD_US:
            raise ValueError(f"a time {tat} µs, too far from Redis's clock {now} µs")
    return admitted, now, requests_tat, tokens_tat, places, forged
