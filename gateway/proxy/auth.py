"""The unified key: clients present `Authorization: Bearer <key>` or `x-api-key: <key>`;
we compare in constant time.

The OpenAI SDK sends the Bearer header, and so does Claude Code with ANTHROPIC_AUTH_TOKEN;
the Anthropic SDK, and Claude Code with ANTHROPIC_API_KEY, send `x-api-key`. Either is
accepted on every route, and a request that carries both passes if one holds a key. Keys
are kept only as SHA-256 digests, and every configured key is compared with every
credential presented (no early exit), so neither the answer's timing nor a memory dump
gives a key away. Neither header ever reaches an instance: it gets its own key
(attempt.py). `middleware()` checks the key of every request to a route that takes one,
before any handler reads anything of the request (its tag, its body).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Iterable

from aiohttp import web
from aiohttp.typedefs import Middleware

from gateway import errors

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class KeyChecker:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    @property
    def open(self) -> bool:
        """No key configured: the operator started the gateway with --open."""
        return not self._digests

    def check(self, authorization: str | None, api_key: str | None = None) -> bool:
        """Whether a Bearer token in `authorization`, or `api_key` (`x-api-key`), is a key."""
        if not self._digests:
            return True
        ok = False
        for token in (_bearer(authorization), api_key):
            if token:
                ok |= self._known(token)
        return ok

    def _known(self, token: str) -> bool:
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(known, digest)
        return ok

    def __repr__(self) -> str:
        return f"<KeyChecker keys={len(self._digests)}>"


def _bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if it is one."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def authorize(keys: KeyChecker, request: web.BaseRequest) -> None:
    """Raise 401 unless the request carries one of the keys."""
    headers = request.headers
    if not keys.check(headers.get("Authorization"), headers.get("x-api-key")):
        raise errors.Unauthorized(
            "missing or invalid API key: send the gateway's key as "
            "'Authorization: Bearer <key>' or as 'x-api-key: <key>'"
        )


def middleware(keys: Callable[[web.Request], KeyChecker], open_paths: Iterable[str]) -> Middleware:
    """The middleware that checks the key, where `keys` gives the keys in force (a reload
    changes them). Routes in `open_paths` (the probes, /metrics) take none; a request that
    matched no route passes on to its 404 or 405, which says nothing a key would protect."""
    unkeyed = frozenset(open_paths)

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        info = request.match_info
        resource = info.route.resource
        if info.http_exception is None and (resource is None or resource.canonical not in unkeyed):
            authorize(keys(request), request)
        return await handler(request)

    return auth
