"""The keys: clients present `Authorization: Bearer <key>` or `x-api-key: <key>`; we compare
in constant time and say whose key it is.

The OpenAI SDK sends the Bearer header, and so does Claude Code with ANTHROPIC_AUTH_TOKEN;
the Anthropic SDK, and Claude Code with ANTHROPIC_API_KEY, send `x-api-key`. Either is
accepted on every route, and a request that carries both passes if one holds a key (the
Bearer one names it when both do). Keys are kept only as SHA-256 digests, and every
configured key is compared with every credential presented (no early exit), so neither
the answer's timing nor a memory dump gives a key away: the work is one digest per
credential and one constant-time compare per configured key, whichever key matches.
Neither header ever reaches an instance: it gets its own key (attempt.py). `middleware()`
checks the key of every request to a route that takes one, before any handler reads
anything of the request (its tag, its body), and hands on whose key it was.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable
from typing import Generic, TypeVar

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import errors

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Holder = TypeVar("Holder")


class KeyChecker(Generic[Holder]):
    """The configured keys, as digests, each with its owner (who a request with it is)."""

    def __init__(self, keys: Iterable[tuple[str, Holder]], anonymous: Holder | None = None) -> None:
        entries = list(keys)
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k, _ in entries)
        self._owners = tuple(owner for _, owner in entries)
        self.anonymous = anonymous  # who a request is when no key is configured (--open)

    @property
    def open(self) -> bool:
        """No key configured: the operator started the gateway with --open."""
        return not self._digests

    def identify(self, authorization: str | None, api_key: str | None = None) -> Holder | None:
        """The owner of the key in a Bearer `authorization` or in `api_key` (`x-api-key`),
        None if neither holds one; with no key configured, `anonymous`."""
        if not self._digests:
            return self.anonymous
        found: Holder | None = None
        for token in (_bearer(authorization), api_key):
            if token:
                owner = self._owner(token)
                found = owner if found is None else found
        return found

    def check(self, authorization: str | None, api_key: str | None = None) -> bool:
        """Whether a Bearer token in `authorization`, or `api_key` (`x-api-key`), is a key."""
        return self.open or self.identify(authorization, api_key) is not None

    def _owner(self, token: str) -> Holder | None:
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        index = -1
        for position, known in enumerate(self._digests):
            if hmac.compare_digest(known, digest):
                index = position
        return self._owners[index] if index >= 0 else None

    def __repr__(self) -> str:
        return f"<KeyChecker keys={len(self._digests)}>"


def _bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if it is one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def authorize(keys: KeyChecker[Holder], request: web.BaseRequest) -> Holder | None:
    """Whose key the request carries (None only when the gateway is --open without an
    anonymous owner); 401 unless it carries one of the keys."""
    headers = request.headers
    owner = keys.identify(headers.get("Authorization"), headers.get("x-api-key"))
    if owner is None and not keys.open:
        raise errors.Unauthorized(
            "missing or invalid API key: send the gateway's key as "
            "'Authorization: Bearer <key>' or as 'x-api-key: <key>'"
        )
    return owner


def middleware(
    keys: Callable[[web.Request], KeyChecker[Holder]],
    open_paths: Iterable[str],
    identified: Callable[[web.Request, Holder], None],
) -> Middleware:
    """The middleware that checks the key, where `keys` gives the keys in force (a reload
    changes them) and `identified` is told whose key a request carries. Routes in
    `open_paths` (the probes, /metrics) take none; a request that matched no route passes
    on to its 404 or 405, which says nothing a key would protect."""
    unkeyed = frozenset(open_paths)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request.match_info
        resource = info.route.resource
        if info.http_exception is None and (resource is None or resource.canonical not in unkeyed):
            owner = authorize(keys(request), request)
            if owner is not None:
                identified(request, owner)
        return await handler(request)

    return auth
