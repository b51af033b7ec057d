"""The gateway listening to its instances' KV cache events, against the simulator's
publisher in vLLM's format (ZMQ PUB, replay ROUTER, msgpack): the index knows what the
caches hold, from traffic it never saw too, through lost messages, and falls back when the
events stop."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import tempfile
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from fakes import KEY, Gateway, fleet, gateway_with, until_available, write_config

from gateway.config import load as gateway_config
from gateway.process.serve import start_simulated
from gateway.sim.sim_fleet import stop_fleet
from gateway.sim.sim_vllm import SimConfig, SimInstance

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {KEY}"}
INSTANCE = "X-Gateway-Instance"
BS = 16
LONG = " ".join(f"word{i:04d}" for i in range(300))  # ~750 tokens: 46 full blocks


def events_config(seed: int, **kv: Any) -> SimConfig:
    fields: dict[str, Any] = {
        "seed": seed,
        "prefix_cache_blocks": 4000,
        "block_size": BS,
        "kv_events_endpoint": "tcp://*:0",
        "kv_events_replay_endpoint": "tcp://*:0",
        **kv,
    }
    return SimConfig(**fields)


def entry(sim: SimInstance, **extra: Any) -> dict[str, Any]:
    """The instance entry a gateway gets for `sim`: its URL and where it publishes."""
    assert sim.kv_events is not None
    events = {"endpoint": sim.kv_events.endpoint, "topic": "kv-events"}
    if sim.kv_events.replay_endpoint is not None:
        events["replay_endpoint"] = sim.kv_events.replay_endpoint
    return {"url": sim.url, "kv_events": events, **extra}


@contextlib.asynccontextmanager
async def listening_to(
    sims: Sequence[SimInstance], instances: Sequence[dict[str, Any]]
) -> AsyncIterator[Gateway]:
    sections = {"dispatch": {"strategy": "least_time", "health_check_interval": 0.2}}
    async with gateway_with(sims, instances=instances, sections=sections) as gw:
        await until_available(gw)
        yield gw


def listening(*sims: SimInstance) -> contextlib.AbstractAsyncContextManager[Gateway]:
    return listening_to(sims, [entry(s) for s in sims])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def kv_views(session: aiohttp.ClientSession, gw: Gateway) -> dict[str, dict[str, Any]]:
    async with session.get(gw.url + "/admin/instances", headers=AUTH) as resp:
        assert resp.status == 200
        return {i["name"]: i["kv_events"] for i in (await resp.json())["instances"]}


async def until(check: Any, what: str, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.02)):
        if await check():
            return
        await asyncio.sleep(0.02)
    pytest.fail(f"never: {what}")


async def chat(session: aiohttp.ClientSession, url: str, text: str, **extra: Any) -> str:
    """One chat request to `url` (the gateway's /v1 or an instance's); the instance that
    answered, if the gateway says."""
    body = {"model": "sim-model", "messages": [{"role": "user", "content": text}]}
    body |= {"max_tokens": 2, **extra}
    async with session.post(url + "/chat/completions", json=body, headers=AUTH) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers.get(INSTANCE, "")


def held_blocks(sim: SimInstance) -> int:
    cache = sim.engine.prefix_cache
    assert cache is not None
    return len(cache)


async def test_a_prompt_sent_around_the_gateway_is_found_where_it_is_cached() -> None:
    """Traffic that reached an instance from elsewhere is in its cache, and the gateway
    knows it from the events: the same prompt through the gateway goes there."""
    async with (
        fleet(events_config(1), events_config(2)) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        a, b = gw.names()[0], gw.names()[1]
        await chat(session, sims[1].url + "/v1", LONG)  # straight to the second instance

        async def indexed() -> bool:
            views = await kv_views(session, gw)
            return views[b]["blocks"] == held_blocks(sims[1]) > 0

        await until(indexed, "the second instance's events indexed")
        views = await kv_views(session, gw)
        assert views[b]["index"] == "whole"
        assert views[a]["blocks"] == 0
        for _ in range(4):
            assert await chat(session, gw.base_url, LONG) == b
        # vLLM's own count agrees: every prompt after the first found its blocks cached.
        assert sims[1].stats.prefix_cache_hits >= 4 * (len(LONG) // 4 // BS) * BS


async def test_an_evicted_prefix_no_longer_attracts() -> None:
    """The cache drops what it held (here all of it, vLLM's /reset_prefix_cache): the index
    says so at once, and the gateway estimates no hit there."""
    async with (
        fleet(events_config(1), events_config(2)) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        home = await chat(session, gw.base_url, LONG)
        sim = sims[gw.names().index(home)]

        async def stored() -> bool:
            return (await kv_views(session, gw))[home]["blocks"] == held_blocks(sim) > 0

        await until(stored, "the prompt's blocks indexed")
        async with session.post(sim.url + "/reset_prefix_cache") as resp:
            assert resp.status == 200

        async def cleared() -> bool:
            return (await kv_views(session, gw))[home]["blocks"] == 0

        await until(cleared, "AllBlocksCleared applied")
        state = gw.dispatcher.scheduler.instances.state(home)
        before = state.prefix_hit_tokens
        await chat(session, gw.base_url, LONG + " again")
        assert state.prefix_hit_tokens == before  # the gateway sent it knowing it is cold
        assert (await kv_views(session, gw))[home]["index"] == "whole"


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_lost_messages_are_replayed_and_the_index_stays_whole(encoding: str) -> None:
    """Every third batch never reaches the gateway (kept for replay, as one lost on the
    wire): each gap is replayed, the index holds exactly what the cache holds; in the
    current wire form and the older array_like one."""
    config = events_config(1, kv_events_drop_every=3, kv_events_encoding=encoding)
    async with (
        fleet(config) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        (name,) = gw.names()
        for i in range(8):
            await chat(session, gw.base_url, f"{i} {LONG}")

        async def caught_up() -> bool:
            view = (await kv_views(session, gw))[name]
            assert sims[0].kv_events is not None
            return view["next_seq"] == sims[0].kv_events.next_seq

        await until(caught_up, "the last batch applied")
        view = (await kv_views(session, gw))[name]
        assert view["index"] == "whole"
        assert view["gaps_total"] >= 2
        assert view["replays_failed_total"] == 0
        assert view["blocks"] == held_blocks(sims[0])
        assert view["malformed_total"] == 0


async def test_without_replay_a_gap_leaves_the_index_partial_and_counted() -> None:
    config = dataclasses.replace(
        events_config(1, kv_events_drop_every=2), kv_events_replay_endpoint=None
    )
    async with (
        fleet(config) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        (name,) = gw.names()
        for i in range(6):
            await chat(session, gw.base_url, f"{i} {LONG}")

        async def lost() -> bool:
            return (await kv_views(session, gw))[name]["replays_failed_total"] > 0

        await until(lost, "a gap that could not be replayed")
        view = (await kv_views(session, gw))[name]
        assert view["index"] == "partial"
        assert view["replays_total"] == 0  # nothing to ask
        async with session.get(gw.url + "/metrics", headers=AUTH) as resp:
            text = await resp.text()
        assert f'gateway_kv_index_state{{server="{name}",state="partial"}} 1.0' in text
        assert f'gateway_kv_event_replay_failures_total{{server="{name}"}}' in text


async def test_events_that_stop_fall_back_within_a_health_interval() -> None:
    """The publisher hangs: the next prompt computed there owes events that never come;
    within one health interval the index is stale (the inferred index decides), counted."""
    async with (
        fleet(events_config(1)) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        (name,) = gw.names()
        await chat(session, gw.base_url, LONG)

        async def whole() -> bool:
            view = (await kv_views(session, gw))[name]
            return view["index"] == "whole" and view["blocks"] > 0

        await until(whole, "the first prompt indexed")
        assert sims[0].kv_events is not None
        sims[0].kv_events.silence()
        await chat(session, gw.base_url, "another " + LONG)
        started = asyncio.get_running_loop().time()

        async def stale() -> bool:
            return (await kv_views(session, gw))[name]["index"] == "stale"

        await until(stale, "the index stale")
        # One health interval (0.2 s) of grace, and the listener's wake-ups (0.25 s).
        assert asyncio.get_running_loop().time() - started < 1.5
        view = (await kv_views(session, gw))[name]
        assert view["stale_total"] == 1
        assert not gw.dispatcher.kv_blocks("sim-model")  # no ids asked while none is usable
        async with session.get(gw.url + "/metrics", headers=AUTH) as resp:
            text = await resp.text()
        assert f'gateway_kv_index_stale_total{{server="{name}"}} 1.0' in text


async def test_a_gateway_that_joins_late_replays_the_engines_events_from_the_start() -> None:
    async with fleet(events_config(1)) as sims, aiohttp.ClientSession() as session:
        for i in range(3):
            await chat(session, sims[0].url + "/v1", f"{i} {LONG}")
        async with listening(*sims) as gw:
            (name,) = gw.names()

            async def whole() -> bool:
                view = (await kv_views(session, gw))[name]
                return view["index"] == "whole" and view["blocks"] == held_blocks(sims[0])

            # The first batch it hears is a later one: it replays from 0 and is whole.
            await chat(session, gw.base_url, "one more " + LONG)
            await until(whole, "the replay from 0 applied")
            assert (await kv_views(session, gw))[name]["replays_total"] >= 1


async def test_token_id_prompts_and_cache_salts_are_looked_up_as_the_engine_keys_them() -> None:
    """A completions prompt of token ids needs no /tokenize; a cache_salt keeps a tenant's
    blocks apart (the same prompt under another salt is not found cached)."""
    async with (
        fleet(events_config(1), events_config(2)) as sims,
        listening(*sims) as gw,
        aiohttp.ClientSession() as session,
    ):
        ids = list(range(1000, 1400))
        body = {"model": "sim-model", "prompt": ids, "max_tokens": 2}
        async with session.post(gw.base_url + "/completions", json=body, headers=AUTH) as resp:
            assert resp.status == 200
            home = resp.headers[INSTANCE]
        sim = sims[gw.names().index(home)]

        async def stored() -> bool:
            return (await kv_views(session, gw))[home]["blocks"] == held_blocks(sim) > 0

        await until(stored, "the token-id prompt indexed")
        state = gw.dispatcher.scheduler.instances.state(home)
        for salt, hit in ((None, True), ("tenant-b", False)):
            before = state.prefix_hit_tokens
            extra = {} if salt is None else {"cache_salt": salt}
            async with session.post(
                gw.base_url + "/completions", json=body | extra, headers=AUTH
            ) as resp:
                assert resp.status == 200
                placed = resp.headers[INSTANCE]
            gained = state.prefix_hit_tokens - before if placed == home else 0
            assert (gained >= 384) is hit, (salt, placed, gained)


async def test_simulate_starts_instances_that_publish_where_the_entries_listen() -> None:
    """`gateway --simulate` before entries with kv_events: each simulated instance publishes
    (with a prefix cache) on the entry's endpoint, `*` its own loopback address, and the
    gateway's index is whole from what it hears."""
    ports = [free_port() for _ in range(3)]
    instances = [
        {
            "url": f"http://127.0.0.1:{ports[0]}",
            "kv_events": {
                "endpoint": f"tcp://*:{ports[1]}",
                "replay_endpoint": f"tcp://*:{ports[2]}",
                "topic": "kv-events",
            },
        }
    ]
    with tempfile.TemporaryDirectory() as folder:
        config = gateway_config.load(write_config(Path(folder), instances))
    sims = [s for s in await start_simulated(config) if isinstance(s, SimInstance)]
    try:
        assert sims[0].config.prefix_caching
        async with (
            listening_to(sims, instances) as gw,
            aiohttp.ClientSession() as session,
        ):
            (name,) = gw.names()
            await chat(session, gw.base_url, LONG)

            async def whole() -> bool:
                view = (await kv_views(session, gw))[name]
                return view["index"] == "whole" and view["blocks"] == held_blocks(sims[0]) > 0

            await until(whole, "the simulated instance's events indexed")
    finally:
        await stop_fleet(sims)
