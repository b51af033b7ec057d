"""The access line's figures mean one thing whatever answered: `bytes_sent` is the body as
the client's HTTP parser hands it on (no head, no chunk framing) for streams and whole
answers alike, and a request the gateway turned away itself says why, and counts for its
key as `refused`."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import structlog
from fakes import KEY, fleet, gateway_with

from gateway.sim.sim_vllm import SimConfig

AUTH = {"Authorization": f"Bearer {KEY}"}


def access_lines(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["event"] == "request"]


async def test_bytes_sent_is_the_body_the_client_read_for_streams_and_whole_answers() -> None:
    """A chunked stream (its later events spliced below aiohttp) and a whole answer each log
    exactly the bytes of the body the client read: not the head, not the chunk framing."""
    sim = SimConfig(decode_s_per_token=0.005, prefill_tokens_per_s=1e6)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}
    bodies: dict[str, bytes] = {}
    async with (
        fleet(sim) as sims,
        gateway_with(sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        with structlog.testing.capture_logs() as events:
            for name, body in (("stream", {**chat, "stream": True}), ("whole", chat)):
                url = gw.url + "/v1/chat/completions"
                async with session.post(url, json=body, headers=AUTH) as resp:
                    assert resp.status == 200
                    bodies[name] = await resp.read()
                    if name == "stream":
                        assert resp.headers["Transfer-Encoding"] == "chunked"
                        assert bodies[name].count(b"data: ") > 12  # one event a token
                    else:
                        assert int(resp.headers["Content-Length"]) == len(bodies[name])
    stream, whole = access_lines(events)
    assert stream["bytes_sent"] == len(bodies["stream"])
    assert whole["bytes_sent"] == len(bodies["whole"])


async def test_an_admission_refusal_says_why_and_counts_as_refused_for_its_key() -> None:
    """One slot, one place in the gateway queue: of five at once, two are served and three
    refused with 429. Each refusal's access line says the scheduler's reason, and the key's
    counts (/metrics, /admin/usage) show them as refused, not as errors."""
    sim = SimConfig(max_num_seqs=1, decode_s_per_token=0.02, prefill_tokens_per_s=1e6)
    dispatch = {"max_num_seqs": 1, "max_queue_per_instance": 0, "gateway_queue_size": 1}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}

    async def stream(session: aiohttp.ClientSession, url: str) -> int:
        async with session.post(url + "/v1/chat/completions", json=body, headers=AUTH) as r:
            await r.read()
            return r.status

    async with (
        fleet(sim) as sims,
        gateway_with(sims, sections={"dispatch": dispatch}) as gw,
        aiohttp.ClientSession() as session,
    ):
        with structlog.testing.capture_logs() as events:
            statuses = await asyncio.gather(*(stream(session, gw.url) for _ in range(5)))
        async with session.get(gw.url + "/admin/usage", headers=AUTH) as resp:
            page = await resp.json()
    assert sorted(statuses) == [200, 200, 429, 429, 429]
    lines = access_lines(events)
    refused = [line for line in lines if line["status"] == 429]
    assert [line["refused"] for line in refused] == ["queue_full"] * 3
    assert [line["refused"] for line in lines if line["status"] == 200] == [None, None]
    (default,) = [k for k in page["keys"] if k["name"] == "default"]
    assert default["usage"]["sim-model"]["requests"] == {"ok": 2, "refused": 3}
