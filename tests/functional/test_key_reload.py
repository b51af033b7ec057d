"""A reload adds, changes and revokes named keys in place: a key rotated in its key_file, a
limit changed, a key revoked (refused from the next request, its stream in flight left to
finish) and a key added, all without a restart."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
from aiohttp import web
from fakes import fleet, write_config

from gateway.config.load import load
from gateway.process.reload import reload
from gateway.server.app import build_app
from gateway.server.runner import make_runner
from gateway.sim.sim_vllm import SimConfig

OLD_TEAM_KEY, NEW_TEAM_KEY = "sk-team-a-old-0123456789", "sk-team-a-new-9876543210"
CI_KEY, ADDED_KEY = "sk-ci-key-0123456789abcd", "sk-added-key-0123456789ab"
SIM = SimConfig(decode_s_per_token=0.02, prefill_tokens_per_s=1e6)
HI = [{"role": "user", "content": "hi"}]
BEFORE = [
    {"name": "team-a", "key_file": "team-a.key", "requests_per_minute": 2},
    {"name": "ci", "key": CI_KEY},
]
AFTER = [
    {"name": "team-a", "key_file": "team-a.key", "requests_per_minute": 5},
    {"name": "added", "key": ADDED_KEY},
]


@contextlib.asynccontextmanager
async def serving(path: Path) -> AsyncIterator[tuple[str, web.Application]]:
    """A gateway of the files at `path`, which stay there for its reloads to read."""
    app = build_app(load(path))
    runner = make_runner(app, shutdown_timeout=2)
    await runner.setup()
    try:
        host, port = await runner.listen("127.0.0.1", 0)
        yield f"http://{host}:{port}", app
    finally:
        await runner.cleanup()


async def status(url: str, key: str) -> tuple[int, dict[str, str]]:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0) as c:
        try:
            raw = await c.chat.completions.with_raw_response.create(
                model="sim-model", messages=HI, max_tokens=2
            )
        except openai.APIStatusError as exc:
            return exc.status_code, dict(exc.response.headers)
        return raw.status_code, dict(raw.headers)


async def test_keys_are_rotated_changed_revoked_and_added_by_a_reload(tmp_path: Path) -> None:
    """After SIGHUP's reload the old team-a key is refused and the new one (same name, a new
    limit) served; ci is refused though its stream in flight finishes; `added` is served."""
    (tmp_path / "team-a.key").write_text(OLD_TEAM_KEY + "\n")
    async with fleet(SIM) as sims:
        urls = [s.url for s in sims]
        path = write_config(tmp_path, urls, channel={"keys": BEFORE})
        async with serving(path) as (url, app), aiohttp.ClientSession() as session:
            first = await status(url, OLD_TEAM_KEY)
            body = {"model": "sim-model", "messages": HI, "max_tokens": 40, "stream": True}
            stream = await session.post(
                url + "/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {CI_KEY}"},
            )
            await stream.content.readany()
            (tmp_path / "team-a.key").write_text(NEW_TEAM_KEY)
            write_config(tmp_path, urls, channel={"keys": AFTER})
            assert reload(app)  # what SIGHUP runs: both files read again
            finished = await stream.read()
            old, new, ci, added = [
                await status(url, key) for key in (OLD_TEAM_KEY, NEW_TEAM_KEY, CI_KEY, ADDED_KEY)
            ]
    assert first[0] == 200
    assert first[1]["x-ratelimit-limit-requests"] == "2"
    assert finished.endswith(b"data: [DONE]\n\n")
    assert (old[0], ci[0], added[0]) == (401, 401, 200)
    assert new[0] == 200
    assert new[1]["x-ratelimit-limit-requests"] == "5"
