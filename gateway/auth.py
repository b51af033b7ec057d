"""The unified key: clients present `Authorization: Bearer <key>`; we compare in constant time.

Keys are kept only as SHA-256 digests, and every configured key is compared on every
request (no early exit), so neither the answer's timing nor a memory dump gives a key away.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable


class KeyChecker:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    @property
    def open(self) -> bool:
        """No key configured: the operator started the gateway with --open."""
        return not self._digests

    def check(self, authorization: str | None) -> bool:
        if not self._digests:
            return True
        if not authorization:
            return False
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        digest = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        ok = False
        for known in self._digests:
            ok |= hmac.compare_digest(known, digest)
        return ok

    def __repr__(self) -> str:
        return f"<KeyChecker keys={len(self._digests)}>"
