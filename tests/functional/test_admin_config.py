"""`GET /admin/config` masks only secrets: which Redis the gateway uses shows (scheme,
host, port, db) without its password, and the headers sent to instances show their values
except credentials'."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import aiohttp
from fakes import KEY, fleet, write_config

from gateway.config import load as gateway_config
from gateway.server.app import build_app
from gateway.server.runner import make_runner
from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


async def test_admin_config_shows_which_redis_and_plain_headers(tmp_path: Path) -> None:
    """The Redis URL as scheme://host:port/db, a plain header's value, an Authorization
    header and the password masked (Redis is only named: nothing listens there)."""
    port = _closed_port()
    redis_url = f"redis://:redis-pw-123@127.0.0.1:{port}/3"
    headers = {"Authorization": "Bearer instance-secret", "X-Request-Tag": "bench"}
    async with fleet(SimConfig(instant=True)) as sims:
        sections = {"gateway": {"admin_port": 0}, "shared": {"redis_url": redis_url}}
        path = write_config(
            tmp_path, [s.url for s in sims], sections=sections, channel={"headers": headers}
        )
        app = build_app(gateway_config.load(path))
        runner = make_runner(app, shutdown_timeout=2)
        await runner.setup()
        try:
            await runner.listen("127.0.0.1", 0)
            host, admin_port = await runner.listen_admin("127.0.0.1", 0)
            url = f"http://{host}:{admin_port}/admin/config"
            async with aiohttp.ClientSession() as session, session.get(url, headers=AUTH) as r:
                assert r.status == 200
                body = await r.json()
        finally:
            await runner.cleanup()
    assert body["config"]["shared"]["redis_url"] == f"redis://127.0.0.1:{port}/3"
    assert body["settings"]["channel"]["headers"] == {
        "Authorization": "**********",
        "X-Request-Tag": "bench",
    }
    text = json.dumps(body)
    assert "redis-pw-123" not in text
    assert "instance-secret" not in text
