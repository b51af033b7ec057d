"""A named key's limits, decided purely: requests and tokens per minute, requests at once.

Each per-minute limit is a GCRA (the generic cell rate algorithm of ATM networks, as
redis-cell and most API gateways run it): a bucket that holds one minute's worth of the
limit and refills continuously at the limit per minute, kept as one number, its
theoretical arrival time (TAT): when the bucket will be full again. A request that costs
`c` is admitted at `now` iff

    max(TAT, now) + c * 60 / limit - now <= 60

and that sum is the new TAT. A key that was idle may spend its whole minute at once, as
OpenAI's limits allow, and a key that keeps sending gets exactly its limit per minute;
over a window of W seconds from a full bucket it gets the limit plus the limit x W / 60.
A request whose cost alone is over a minute's worth is never admitted (OpenAI's "Request
too large": no wait would help, `OverLimit.retry_after` is None).

Requests cost 1. Tokens are reserved at admission (the prompt estimate plus `max_tokens`)
and settled when the answer ends: `settle` moves the TAT by what the instance reported
less what was reserved, so the bucket is charged with what was used, refunds included,
and a key whose answers ran past their reservation waits the longer for it. Requests at
once (`max_concurrent`) are a count, taken at admission and given back at the end.

A request is admitted only if every limit admits it, and then charged against each; a
refused one changes nothing. `KeyQuota` is one key's state in one process;
fleet/shared_limits.py runs the same arithmetic in Redis (a Lua script, in microseconds
of Redis's clock) so that every replica charges one bucket. Times here are seconds of
the caller's clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

MINUTE = 60.0
# Float sums of 60 / limit drift by far less than this; without it the 600th request of
# a 600-a-minute key could be refused for a rounding error.
_SLACK = 1e-6
# A place frees when one of the key's requests ends, which nothing here can foresee: a
# refused client is told to come back after this.
CONCURRENT_RETRY_S = 1.0

Limit = Literal["requests", "tokens", "concurrent"]
LIMITS: tuple[Limit, ...] = ("requests", "tokens", "concurrent")


@dataclass(frozen=True)
class KeyLimits:
    """What one key may do; None: no such limit."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None

    @property
    def any(self) -> bool:
        return (
            self.requests_per_minute is not None
            or self.tokens_per_minute is not None
            or self.max_concurrent is not None
        )


@dataclass(frozen=True)
class Standing:
    """Where a key stands with one limit: the limit, what is left of it now, and the
    seconds until it is whole again (OpenAI's `x-ratelimit-reset-*`)."""

    limit: int
    remaining: int
    reset: float


@dataclass(frozen=True)
class Standings:
    """The key's standing with each limit it has (None: it has no such limit)."""

    requests: Standing | None = None
    tokens: Standing | None = None
    concurrent: Standing | None = None


@dataclass(frozen=True)
class Admitted:
    """The request may go: what the key has left after it."""

    standings: Standings


@dataclass(frozen=True)
class OverLimit:
    """The request may not go: the limit that refused it and when to come back."""

    limit: Limit
    # Seconds until this limit would admit it; None: it never will (its tokens alone are
    # more than the limit), so a client should not retry it as it is.
    retry_after: float | None
    requested: int  # what it asked of that limit: 1 request, its tokens, 1 place
    standings: Standings  # unchanged by the refusal


# ---------------------------------------------------------------- one GCRA


def admit_gcra(tat: float, now: float, cost: float, per_minute: int) -> float | None:
    """The new TAT if a request of `cost` fits the bucket at `now`, else None."""
    new = max(tat, now) + cost * MINUTE / per_minute
    return new if new - now <= MINUTE + _SLACK else None


def wait_gcra(tat: float, now: float, cost: float, per_minute: int) -> float | None:
    """Seconds until a request of `cost` would fit (0 if it fits now); None if it never
    will, being more than a minute's worth on its own."""
    need = cost * MINUTE / per_minute
    if need > MINUTE + _SLACK:
        return None
    return max(0.0, max(tat, now) + need - now - MINUTE)


def standing_gcra(tat: float, now: float, per_minute: int) -> Standing:
    """What is left of the bucket at `now`, and how long until it is full again."""
    ahead = max(0.0, tat - now)
    left = math.floor((MINUTE - ahead) * per_minute / MINUTE + _SLACK)
    return Standing(per_minute, max(0, min(per_minute, left)), ahead)


def settle_gcra(tat: float, now: float, tokens: float, per_minute: int) -> float:
    """The TAT once `tokens` more (fewer, if negative) are charged: a refund never fills
    the bucket past full."""
    return max(now, tat + tokens * MINUTE / per_minute)


# ---------------------------------------------------------------- a key's decision


def decide(
    limits: KeyLimits,
    requests_tat: float,
    tokens_tat: float,
    inflight: int,
    tokens: int,
    now: float,
) -> tuple[Admitted | OverLimit, float, float]:
    """Admit a request reserving `tokens`, or refuse it: the verdict and the new TATs.

    Every limit is asked; a refusal names the one that makes the client wait longest (one
    that never admits it first), and leaves both TATs as they were.
    """
    refusals: list[OverLimit] = []
    new_requests, new_tokens = requests_tat, tokens_tat
    rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    before = standings_of(limits, requests_tat, tokens_tat, inflight, now)
    if rpm is not None:
        admitted = admit_gcra(requests_tat, now, 1, rpm)
        if admitted is None:
            refusals.append(OverLimit("requests", wait_gcra(requests_tat, now, 1, rpm), 1, before))
        else:
            new_requests = admitted
    if tpm is not None:
        admitted = admit_gcra(tokens_tat, now, tokens, tpm)
        if admitted is None:
            wait = wait_gcra(tokens_tat, now, tokens, tpm)
            refusals.append(OverLimit("tokens", wait, tokens, before))
        else:
            new_tokens = admitted
    if most is not None and inflight >= most:
        refusals.append(OverLimit("concurrent", CONCURRENT_RETRY_S, 1, before))
    if refusals:
        worst = max(refusals, key=lambda r: math.inf if r.retry_after is None else r.retry_after)
        return worst, requests_tat, tokens_tat
    after = standings_of(limits, new_requests, new_tokens, inflight + 1, now)
    return Admitted(after), new_requests, new_tokens


def standings_of(
    limits: KeyLimits, requests_tat: float, tokens_tat: float, inflight: int, now: float
) -> Standings:
    """The key's standing with each of its limits, given its state at `now`."""
    rpm, tpm, most = limits.requests_per_minute, limits.tokens_per_minute, limits.max_concurrent
    return Standings(
        requests=None if rpm is None else standing_gcra(requests_tat, now, rpm),
        tokens=None if tpm is None else standing_gcra(tokens_tat, now, tpm),
        concurrent=None if most is None else Standing(most, max(0, most - inflight), 0.0),
    )


class KeyQuota:
    """One key's counters in this process: both TATs and its requests in progress."""

    __slots__ = ("inflight", "requests_tat", "tokens_tat")

    def __init__(self) -> None:
        self.requests_tat = -math.inf  # a full bucket, whatever the clock's origin
        self.tokens_tat = -math.inf
        self.inflight = 0

    def admit(self, limits: KeyLimits, tokens: int, now: float) -> Admitted | OverLimit:
        """Decide, and charge the key if admitted (one place taken until `release`)."""
        verdict, self.requests_tat, self.tokens_tat = decide(
            limits, self.requests_tat, self.tokens_tat, self.inflight, tokens, now
        )
        if isinstance(verdict, Admitted):
            self.inflight += 1
        return verdict

    def settle(self, limits: KeyLimits, tokens: int, now: float) -> None:
        """Charge `tokens` more than were reserved (a refund if negative); give back the
        request's place."""
        if limits.tokens_per_minute is not None and tokens:
            self.tokens_tat = settle_gcra(self.tokens_tat, now, tokens, limits.tokens_per_minute)
        self.inflight = max(0, self.inflight - 1)

    def standings(self, limits: KeyLimits, now: float) -> Standings:
        return standings_of(limits, self.requests_tat, self.tokens_tat, self.inflight, now)

    def __repr__(self) -> str:
        return (
            f"<KeyQuota requests_tat={self.requests_tat:g} tokens_tat={self.tokens_tat:g} "
            f"inflight={self.inflight}>"
        )
