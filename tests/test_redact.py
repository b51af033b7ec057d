"""What /admin/config shows (server/redact.py): which Redis without its password, the
headers sent to instances with their values, and only credentials masked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _config_helpers import URLS, load_ok

from gateway.server.redact import MASK, config_dump, masked_headers, redis_location


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@cache.internal:6380/2", "redis://cache.internal:6380/2"),
        ("rediss://gateway:s3cret@cache.internal/1", "rediss://cache.internal:6379/1"),
        ("redis://cache", "redis://cache:6379/0"),
        ("redis://cache:6379?password=s3cret&db=4", "redis://cache:6379/4"),
        ("redis://:s3cret@[fd00::7]:6379/0", "redis://[fd00::7]:6379/0"),
        ("unix://:s3cret@/run/redis.sock?db=3&password=s3cret", "unix:///run/redis.sock?db=3"),
    ],
)
def test_the_redis_url_shows_where_not_the_password(url: str, shown: str) -> None:
    """Scheme, host, port and database; no user, password or other options."""
    assert redis_location(url) == shown


def test_only_credential_headers_are_masked() -> None:
    """Authorization, Proxy-Authorization, Cookie and api-key style names are masked, and
    so is a Bearer value under any name; the rest show their values."""
    headers = {
        "Authorization": "Bearer sk-instance",
        "Proxy-Authorization": "Basic dXNlcjpwdw==",
        "x-api-key": "sk-1",
        "api-key": "sk-2",
        "X-Auth-Token": "t",
        "Cookie": "session=abc",
        "X-Upstream-Credential": "c",
        "X-Forward-To": "bearer sk-hidden-in-a-custom-header",
        "X-Request-Tag": "prefill-bench",
        "X-Tenant": "team-a",
        "X-Origin": "http://user:pw@origin.internal/",
    }
    assert masked_headers(headers) == {
        "Authorization": MASK,
        "Proxy-Authorization": MASK,
        "x-api-key": MASK,
        "api-key": MASK,
        "X-Auth-Token": MASK,
        "Cookie": MASK,
        "X-Upstream-Credential": MASK,
        "X-Forward-To": MASK,
        "X-Request-Tag": "prefill-bench",
        "X-Tenant": "team-a",
        "X-Origin": "http://***@origin.internal/",
    }


def test_the_dump_masks_secrets_and_shows_the_rest(tmp_path: Path) -> None:
    """A whole configuration: the Redis location and plain headers show; the Redis
    password, the header credentials and the keys appear nowhere in the dump."""
    toml = '[shared]\nredis_url = "redis://:redis-pw-123@cache.internal:6380/2"\n'
    settings = {
        "channel": {
            "api_key": "sk-unified-key-0123456789",
            "headers": {"X-Request-Tag": "bench", "x-api-key": "sk-header-secret"},
            "keys": [{"name": "team", "key": "sk-team-key-0123456789"}],
        },
        "vllm": {"instances": [*URLS, "http://admin:instance-pw@127.0.0.1:8002"]},
    }
    config = load_ok(tmp_path, toml, settings)
    file, shown = config_dump(config)
    assert file["shared"]["redis_url"] == "redis://cache.internal:6380/2"
    assert shown["channel"]["headers"] == {"X-Request-Tag": "bench", "x-api-key": MASK}
    assert shown["vllm"]["instances"][2]["url"] == "http://***@127.0.0.1:8002"
    text = json.dumps([file, shown])
    for secret in ("redis-pw-123", "sk-header-secret", "sk-unified-key", "sk-team-key", "pw@"):
        assert secret not in text, secret
