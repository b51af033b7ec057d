"""Applying each named key's limits to its requests, and telling the client where it stands.

`Limiter.admit` asks the core (dispatch/key_limits.py) about a request once its prompt is
estimated, before it is placed: in this process (a `KeyQuota` per key), or with `[shared]`
fleet-wide, in Redis (fleet/shared_limits.py), falling back to this process's counters
whenever Redis does not answer. The request reserves its prompt estimate plus its
`max_tokens`; `settle` charges what it used once it is over (Redis's settlements go out
in the background, off the request's path). A key without limits costs a dictionary
lookup and no Redis round trip.

The answer tells the client where its key stands, as OpenAI's API does: `x-ratelimit-limit-*`,
`x-ratelimit-remaining-*` and `x-ratelimit-reset-*` (a duration such as `1s` or `6m0s`)
for requests and tokens, on successes and refusals alike; on the Messages routes
Anthropic's `anthropic-ratelimit-*` (the reset an RFC 3339 time). A refusal is a 429 in
OpenAI's shape for it (type `requests` or `tokens`, code `rate_limit_exceeded`, a message
such as OpenAI's "Rate limit reached ... Please try again in 1.2s"), with `retry-after-ms`
(which both SDKs read first) and `Retry-After`; Anthropic's `rate_limit_error` on its routes.
"""

from __future__ import annotations

import datetime
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from gateway import errors
from gateway.dispatch.key_limits import (
    Admitted,
    KeyLimits,
    KeyQuota,
    OverLimit,
    Standing,
    Standings,
)
from gateway.errors import Api
from gateway.observe.exchange import Exchange
from gateway.proxy.tenants import Tenant
from gateway.routes import Route


class SharedCounters(Protocol):
    """The limits' counters in Redis (fleet/shared_limits.py's `SharedLimits`)."""

    async def admit(
        self, key: str, limits: KeyLimits, tokens: int, lease: str
    ) -> Admitted | OverLimit | None:
        """The verdict, charged in Redis if admitted; None if Redis did not answer."""
        ...

    def settle(self, key: str, limits: KeyLimits, tokens: int, lease: str) -> None:
        """Charge `tokens` more than reserved and give the lease back, soon."""
        ...

    async def standings(self, key: str, limits: KeyLimits) -> Standings | None:
        """Where the key stands fleet-wide now; None if Redis did not say."""
        ...


@dataclass(frozen=True)
class Grant:
    """An admitted request's claim on its key: to settle once, where it was decided."""

    key: str
    limits: KeyLimits
    reserved: int  # tokens reserved at admission
    lease: str | None  # its place in Redis when Redis decided; None: this process did


class Limiter:
    def __init__(self, clock: Callable[[], float], process: str = "") -> None:
        self.clock = clock
        self.quotas: dict[str, KeyQuota] = {}  # by key name: this process's counters
        self.shared: SharedCounters | None = None  # set by the app with [shared]
        self._leases = (f"{process}:{n}" for n in itertools.count())

    async def admit(
        self, tenant: Tenant, ex: Exchange, route: Route, headers: dict[str, str]
    ) -> Grant | None:
        """Admit the request or raise its 429; either way `headers` (every answer's) get
        where the key stands. None: the key has no limits."""
        limits = tenant.limits
        if not limits.any:
            return None
        tokens = ex.prompt_tokens + ex.max_tokens if route.metered else 0
        verdict: Admitted | OverLimit | None = None
        lease = None
        if self.shared is not None:
            lease = next(self._leases)
            verdict = await self.shared.admit(tenant.name, limits, tokens, lease)
        if verdict is None:  # no Redis, or it did not answer: this process decides
            lease = None
            quota = self.quotas.get(tenant.name)
            if quota is None:
                quota = self.quotas[tenant.name] = KeyQuota()
            verdict = quota.admit(limits, tokens, self.clock())
        headers.update(standing_headers(verdict.standings, route.api))
        if isinstance(verdict, OverLimit):
            ex.refused = verdict.limit
            raise refusal(tenant.name, verdict)
        return Grant(tenant.name, limits, tokens, lease)

    def settle(self, grant: Grant, used: int) -> None:
        """The request is over and used `used` tokens: charge the difference, free its place."""
        extra = used - grant.reserved if grant.limits.tokens_per_minute is not None else 0
        if grant.lease is not None and self.shared is not None:
            self.shared.settle(grant.key, grant.limits, extra, grant.lease)
            return
        quota = self.quotas.get(grant.key)
        if quota is not None:
            quota.settle(grant.limits, extra, self.clock())

    async def standings(self, tenant: Tenant) -> tuple[Standings, str]:
        """Where a key stands now and where that is counted (`redis` or `process`), for
        /admin/usage: fleet-wide when Redis says, else this process's counters."""
        if self.shared is not None:
            shared = await self.shared.standings(tenant.name, tenant.limits)
            if shared is not None:
                return shared, "redis"
        quota = self.quotas.get(tenant.name) or KeyQuota()
        return quota.standings(tenant.limits, self.clock()), "process"

    def __repr__(self) -> str:
        where = "redis" if self.shared is not None else "local"
        return f"<Limiter {where} keys={len(self.quotas)}>"


# ---------------------------------------------------------------- what the client is told


def refusal(key: str, refused: OverLimit) -> errors.KeyRateLimited:
    """The 429 of a refused request, worded as OpenAI words its own."""
    standing = getattr(refused.standings, refused.limit)
    limit = standing.limit if standing is not None else 0
    if refused.limit == "concurrent":
        return errors.RequestsRateLimited(
            f"Too many requests in progress for key {key!r}: Limit {limit}. "
            "Please try again once one of them has finished.",
            retry_after=refused.retry_after,
        )
    per = "requests per min (RPM)" if refused.limit == "requests" else "tokens per min (TPM)"
    kind = errors.RequestsRateLimited if refused.limit == "requests" else errors.TokensRateLimited
    if refused.retry_after is None:
        return kind(
            f"Request too large for key {key!r} on {per}: Limit {limit}, Requested "
            f"{refused.requested}. The input or output tokens must be reduced in order to "
            "run successfully.",
        )
    used = limit - standing.remaining if standing is not None else 0
    return kind(
        f"Rate limit reached for key {key!r} on {per}: Limit {limit}, Used {used}, Requested "
        f"{refused.requested}. Please try again in {duration(refused.retry_after)}.",
        retry_after=refused.retry_after,
    )


def standing_headers(standings: Standings, api: Api) -> dict[str, str]:
    """OpenAI's `x-ratelimit-*` (Anthropic's `anthropic-ratelimit-*` on its routes) for each
    per-minute limit the key has."""
    out: dict[str, str] = {}
    for name, standing in (("requests", standings.requests), ("tokens", standings.tokens)):
        if standing is not None:
            out.update(_headers(name, standing, api))
    return out


def _headers(name: str, standing: Standing, api: Api) -> dict[str, str]:
    if api == "anthropic":
        reset = datetime.datetime.fromtimestamp(time.time() + standing.reset, datetime.UTC)
        prefix = f"anthropic-ratelimit-{name}"
        return {
            f"{prefix}-limit": str(standing.limit),
            f"{prefix}-remaining": str(standing.remaining),
            f"{prefix}-reset": reset.isoformat(timespec="seconds").replace("+00:00", "Z"),
        }
    return {
        f"x-ratelimit-limit-{name}": str(standing.limit),
        f"x-ratelimit-remaining-{name}": str(standing.remaining),
        f"x-ratelimit-reset-{name}": duration(standing.reset),
    }


def duration(seconds: float) -> str:
    """A duration as OpenAI writes its resets (Go's style): `12ms`, `1s`, `1.5s`, `6m0s`."""
    ms = max(0, round(seconds * 1000))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{minutes}m{text}"
    return f"{hours}h{text}" if hours else text
