"""What `GET /admin/config` shows of the running configuration: everything but the secrets.

An operator reads it to learn what runs (which Redis, which headers go to the instances),
so only what grants access is masked: keys (`SecretStr`, masked by pydantic's dump), a
URL's user and password, the Redis URL's password (its scheme, host, port and database
show), and the values of headers that carry credentials. A header is taken for one by
its name (`Authorization`, `Proxy-Authorization`, `Cookie`, anything naming a key, token,
secret, password, session or auth: `x-api-key`, `api-key`, `X-Auth-Token`, ...) or by its
value (`Bearer ...`, `Basic ...`): masking a harmless header costs a reader a value,
showing a credential costs the fleet.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gateway.config.load import Config
from gateway.config.urls import without_credentials

MASK = "**********"
_CREDENTIAL_NAME = re.compile(
    r"auth|cookie|key|token|secret|passw|session|credential|signature", re.IGNORECASE
)
_CREDENTIAL_VALUE = re.compile(r"^\s*(bearer|basic|digest|negotiate)\s", re.IGNORECASE)


def is_credential_header(name: str, value: str) -> bool:
    return bool(_CREDENTIAL_NAME.search(name) or _CREDENTIAL_VALUE.match(value))


def masked_headers(headers: dict[str, str]) -> dict[str, str]:
    """Each header with its value, a credential's masked."""
    return {
        k: MASK if is_credential_header(k, v) else without_credentials(v)
        for k, v in headers.items()
    }


def redis_location(url: str) -> str:
    """Which Redis a URL names, without its user, password or other options:
    `redis://:pw@cache:6380/2` -> `redis://cache:6380/2`; a unix socket keeps its path
    and database (`unix:///run/redis.sock?db=1`)."""
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    if parts.scheme == "unix":
        return f"unix://{parts.path}?db={query.get('db', ['0'])[0]}"
    db = parts.path.strip("/") or query.get("db", ["0"])[0]
    host = parts.hostname or "localhost"
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    try:
        port = parts.port or 6379
    except ValueError:  # not a port: show none rather than fail the whole page
        return f"{parts.scheme}://{host}/{db}"
    return f"{parts.scheme}://{host}:{port}/{db}"


def config_dump(config: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """config.toml and settings.json as validated, secrets masked."""
    file = _without_credentials(config.file.model_dump(mode="json"))
    redis = config.file.shared.redis_url
    if redis is not None:
        file["shared"]["redis_url"] = redis_location(redis.get_secret_value())
    settings = _without_credentials(config.settings.model_dump(mode="json"))
    channel = settings.get("channel") or {}
    channel["headers"] = masked_headers(config.settings.channel.headers)
    return file, settings


def _without_credentials(value: Any) -> Any:
    """Every URL in a dumped configuration without its user and password."""
    if isinstance(value, dict):
        return {k: _without_credentials(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_without_credentials(v) for v in value]
    return without_credentials(value) if isinstance(value, str) else value
