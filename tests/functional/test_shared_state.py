"""Several gateway processes share one view of the fleet through a real Redis on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
import redis.asyncio as aioredis
import structlog
from fakes import KEY, Gateway, fleet, gateway_with
from redis_server import RedisServer, redis_server

from gateway.dispatch import InstanceState, Lane
from gateway.dispatch.affinity import prompt_blocks, prompt_text
from gateway.fleet import shared as shared_module
from gateway.fleet import shared_leases
from gateway.fleet.shared_codec import parse_placements
from gateway.server.resources import SHARED
from gateway.sim.sim_vllm import SimConfig, SimInstance

ONE_SLOT = SimConfig(max_num_seqs=1, decode_s_per_token=0.01, prefill_tokens_per_s=1e6)


# Fast instances with vLLM's prefix cache: the tests of where prompts were placed.
CACHING_SIM = SimConfig(
    max_num_seqs=8, decode_s_per_token=0.001, prefill_tokens_per_s=1e6, prefix_cache_blocks=4000
)
LEAST_TIME_8 = {"strategy": "least_time", "max_num_seqs": 8}


def sections(redis: RedisServer) -> dict[str, dict[str, object]]:
    return {
        "dispatch": {"max_num_seqs": 1, "max_queue_per_instance": 0, "max_queue_wait": 30},
        "shared": {"redis_url": redis.url, "publish_interval": 0.05, "ttl": 0.5},
    }


def slow_rounds(redis: RedisServer, **shared: object) -> dict[str, dict[str, object]]:
    """Rounds 5 s apart (TTL 10 s), so whatever arrives sooner came by a push."""
    settings = sections(redis)
    settings["shared"] = {"redis_url": redis.url, "publish_interval": 5.0, "ttl": 10.0, **shared}
    return settings


async def place_through(
    a: Gateway, b: Gateway, document: str
) -> tuple[str, InstanceState, tuple[int, ...]]:
    """A serves `document` + a question: where it went, B's state of that instance, and the
    block hashes of the same document with another question."""
    status, placed_on = await chat(a, document + "question one")
    assert status == 200
    state = b.dispatcher.scheduler.state(placed_on)
    blocks = prompt_blocks(prompt_text({"messages": [user(document + "question two")]}))
    return placed_on, state, blocks


async def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.02)


async def stream(gw: Gateway, max_tokens: int) -> tuple[int, str]:
    """One streamed completion read to its end: status and the instance that served it."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            gw.url + "/v1/completions",
            json={"prompt": "hi", "max_tokens": max_tokens, "stream": True},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers.get("X-Gateway-Instance", "")


@contextlib.asynccontextmanager
async def two_gateways(
    redis: RedisServer, sims: list[SimInstance]
) -> AsyncIterator[tuple[Gateway, Gateway]]:
    async with (
        gateway_with(sims, sections=sections(redis)) as a,
        gateway_with(sims, sections=sections(redis)) as b,
    ):
        await until(lambda: a.app[SHARED].peers == 1 and b.app[SHARED].peers == 1)
        yield a, b


def pushing_settings(redis: RedisServer) -> dict[str, dict[str, object]]:
    """least_time over caching instances, rounds 5 s apart: what arrives sooner was pushed."""
    settings = slow_rounds(redis)
    settings["dispatch"] = dict(LEAST_TIME_8)
    return settings


@contextlib.asynccontextmanager
async def pushing_pair(redis: RedisServer) -> AsyncIterator[tuple[Gateway, Gateway]]:
    """Two such gateways over two caching instances, each listening for the other's pushes."""
    settings = pushing_settings(redis)
    async with (
        fleet(CACHING_SIM, CACHING_SIM) as sims,
        gateway_with(sims, sections=settings) as a,
        gateway_with(sims, sections=settings) as b,
    ):
        await until(lambda: b.app[SHARED].peers == 1 and b.app[SHARED].listening)
        await until(lambda: a.app[SHARED].listening)
        yield a, b


async def test_the_per_instance_limit_holds_across_gateways() -> None:
    """One slot, two gateways: while A's stream holds it, B's request waits in B's queue."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            name = a.names()[0]
            held = asyncio.create_task(stream(a, max_tokens=150))
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 1)
            waiting = asyncio.create_task(stream(b, max_tokens=2))
            await until(lambda: b.dispatcher.snapshot().queues[Lane.SHORT] == 1)
            assert not held.done()
            assert sims[0].stats.waiting == 0  # the instance never queued a second request
            assert (await held)[0] == 200
            assert (await waiting)[0] == 200


async def test_gateways_spread_over_the_fleet_by_each_others_load() -> None:
    """B sends its request to the instance A is not using, though B itself holds nothing."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT, ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            held = asyncio.create_task(stream(a, max_tokens=150))
            await until(
                lambda: sum(s.peers.inflight for s in b.dispatcher.scheduler.instances.states) == 1
            )
            busy = next(s.name for s in b.dispatcher.scheduler.instances.states if s.peers.inflight)
            status, served_by = await stream(b, max_tokens=2)
            assert status == 200
            assert served_by != busy
            await held


async def test_redis_away_fails_no_request_and_the_view_returns_with_it() -> None:
    """Redis killed mid-run: every request still succeeds on the local view; back, it rejoins."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT, ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            redis.stop()
            await until(lambda: a.app[SHARED].up is False and b.app[SHARED].up is False)
            await until(lambda: a.app[SHARED].peers == 0)  # the next round fails too
            results = await asyncio.gather(*(stream(gw, 3) for gw in (a, b, a, b)))
            assert [status for status, _ in results] == [200] * 4
            text = await metrics_text(a)
            assert "gateway_shared_state_up 0.0" in text
            redis.start()
            await until(lambda: a.app[SHARED].peers == 1 and b.app[SHARED].peers == 1, 15)
            # Up again once the listener has its subscription back too, which may come a
            # round after the peers do (a round-trip race the test lost 2 runs in 5).
            await until(lambda: a.app[SHARED].up is True, 15)
            assert "gateway_shared_state_up 1.0" in await metrics_text(a)


async def test_a_process_that_stops_publishing_leaves_the_view_within_the_ttl() -> None:
    """A process that dies (stops writing, no goodbye) has its load gone from the others' view."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            name = a.names()[0]
            held = asyncio.create_task(stream(a, max_tokens=300))
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 1)
            for task in asyncio.all_tasks():  # A's publisher dies as in a SIGKILL
                if task.get_name() == "shared-state" and _belongs_to(task, a):
                    task.cancel()
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 0, 3)
            assert b.app[SHARED].peers == 0
            held.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await held


async def test_a_changed_load_reaches_the_others_between_rounds() -> None:
    """With rounds 5 s apart, A's new stream and its end reach B's view within a second (push)."""
    with redis_server() as redis:
        rounds = slow_rounds(redis, push_interval=0.02)
        async with (
            fleet(ONE_SLOT) as sims,
            gateway_with(sims, sections=rounds) as a,
            gateway_with(sims, sections=rounds) as b,
        ):
            name = a.names()[0]
            await until(lambda: b.app[SHARED].peers == 1 and b.app[SHARED].listening)
            held = asyncio.create_task(stream(a, max_tokens=100))  # about a second
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 1, 1.0)
            assert (await held)[0] == 200
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 0, 1.0)
            assert b.app[SHARED].pushes_heard >= 2


async def test_a_queued_request_placed_on_a_peers_push_is_pushed_too() -> None:
    """B's waiting request takes the slot A's push freed; A sees B's request there at once."""
    with redis_server() as redis:
        rounds = slow_rounds(redis)
        async with (
            # A slow prefill: B's first token comes long after it is placed, so only the
            # placement itself can tell A in time.
            fleet(dataclasses.replace(ONE_SLOT, prefill_tokens_per_s=2)) as sims,
            gateway_with(sims, sections=rounds) as a,
            gateway_with(sims, sections=rounds) as b,
        ):
            name = a.names()[0]
            await until(lambda: b.app[SHARED].peers == 1 and b.app[SHARED].listening)
            await until(lambda: a.app[SHARED].listening)
            held = asyncio.create_task(stream(a, max_tokens=3))
            await until(lambda: b.dispatcher.scheduler.state(name).peers.inflight == 1, 1.0)
            waiting = asyncio.create_task(stream(b, max_tokens=3))
            await until(lambda: b.dispatcher.snapshot().queues[Lane.SHORT] == 1)
            assert (await held)[0] == 200
            await until(lambda: a.dispatcher.scheduler.state(name).peers.inflight == 1, 0.5)
            assert (await waiting)[0] == 200


async def test_a_change_after_a_quiet_spell_is_pushed_at_once_later_ones_coalesce() -> None:
    """With a 2 s push interval, A's first change reaches B at once; its next waits the interval."""
    with redis_server() as redis:
        settings = slow_rounds(redis, push_interval=2.0)
        async with (
            fleet(ONE_SLOT) as sims,
            gateway_with(sims, sections=settings) as a,
            gateway_with(sims, sections=settings) as b,
        ):
            name = a.names()[0]
            peers = b.dispatcher.scheduler.state(name)
            await until(lambda: b.app[SHARED].peers == 1 and b.app[SHARED].listening)
            held = asyncio.create_task(stream(a, max_tokens=30))  # about 0.3 s
            await until(lambda: peers.peers.inflight == 1, 0.3)  # the leading edge
            assert (await held)[0] == 200
            assert peers.peers.inflight == 1  # its end waits for the interval to pass
            await until(lambda: peers.peers.inflight == 0, 3.0)


async def test_learned_speeds_are_shared() -> None:
    """What A learned of an instance's speed reaches B's view, blended with B's own."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            name = a.names()[0]
            for _ in range(3):
                assert (await stream(a, max_tokens=5))[0] == 200
            own = a.dispatcher.scheduler.state(name).speed
            assert own.tpot.value is not None
            learned = own.tpot.value
            peer_view = b.dispatcher.scheduler.state(name).speed
            await until(  # within a publish interval or two
                lambda: (
                    peer_view.tpot_value is not None
                    and math.isclose(peer_view.tpot_value, learned, rel_tol=1e-9)
                )
            )
            assert peer_view.tpot.value is None  # B itself saw no streamed answer there


async def metrics_text(gw: Gateway) -> str:
    async with aiohttp.ClientSession() as session:
        return await (await session.get(gw.url + "/metrics")).text()


def _belongs_to(task: asyncio.Task[object], gw: Gateway) -> bool:
    coro = task.get_coro()
    frame_self = getattr(coro, "cr_frame", None)
    owner = frame_self.f_locals.get("self") if frame_self is not None else None
    return owner is gw.app[SHARED]


async def test_replicas_agree_where_a_prefix_lives() -> None:
    """A prompt A placed is in B's prefix index within a round, so B sends the prefix there too."""
    with redis_server() as redis:
        fast = CACHING_SIM
        sections_ = sections(redis)
        sections_["dispatch"] = dict(LEAST_TIME_8)
        async with (
            fleet(fast, fast) as sims,
            gateway_with(sims, sections=sections_) as a,
            gateway_with(sims, sections=sections_) as b,
        ):
            document = "shared system prompt and document " * 400  # about 3,400 tokens
            placed_on, state, blocks = await place_through(a, b, document)
            await until(lambda: state.cache.match(blocks) > 40)
            for question in ("two", "three", "four"):
                status, served_by = await chat(b, document + f"question {question}")
                assert status == 200
                assert served_by == placed_on


async def test_a_placement_reaches_the_others_with_the_push_not_the_next_round() -> None:
    """With rounds 5 s apart, B's prefix index holds A's new placement within half a second."""
    with redis_server() as redis:
        async with pushing_pair(redis) as (a, b):
            document = "another shared document " * 500
            _placed_on, state, blocks = await place_through(a, b, document)
            await until(lambda: state.cache.match(blocks) > 40, 0.5)


async def test_a_prefix_a_computed_is_settled_in_bs_index_with_the_push() -> None:
    """Once A's request has its first token, B counts its prefix as computed there (a long
    prompt with it needs no long-prefill place), within half a second, rounds 5 s apart."""
    with redis_server() as redis:
        async with pushing_pair(redis) as (a, b):
            document = "a third shared document " * 500
            _placed_on, state, blocks = await place_through(a, b, document)
            await until(lambda: state.cache.match(blocks, settled=True) > 40, 0.5)


async def test_pushed_placements_reach_the_stream_with_the_next_round_in_one_entry() -> None:
    """A push carries a placement to B but writes nothing to the stream (one PUBLISH, the
    cost of a push); A's next round appends what its pushes carried, in one entry."""
    with redis_server() as redis:
        store = aioredis.Redis.from_url(redis.url)
        async with pushing_pair(redis) as (a, b):
            document = "a document placed between rounds " * 500
            placed_on, state, blocks = await place_through(a, b, document)
            await until(lambda: state.cache.match(blocks) > 40, 0.5)
            assert await store.xlen("gateway:placements") == 0
            assert await a.app[SHARED].run_round()
            entries = await store.xrange("gateway:placements")
            assert len(entries) == 1
            placed = parse_placements(entries[0][1][b"d"])
            assert any(name == placed_on and len(hashes) > 40 for name, hashes in placed)
        await store.aclose()


async def test_a_process_that_joins_later_learns_the_placements_pushed_before() -> None:
    """A places a prompt between rounds (a push); C, started after A's next round, reads it
    from the stream and sends the prefix to the same instance."""
    with redis_server() as redis:
        settings = pushing_settings(redis)
        async with (
            fleet(CACHING_SIM, CACHING_SIM) as sims,
            gateway_with(sims, sections=settings) as a,
        ):
            await until(lambda: a.app[SHARED].listening)
            document = "a document a late joiner needs " * 500
            status, placed_on = await chat(a, document + "question one")
            assert status == 200
            await until(lambda: a.app[SHARED].pushes_sent > 0)
            assert await a.app[SHARED].run_round()
            async with gateway_with(sims, sections=settings) as c:
                state = c.dispatcher.scheduler.state(placed_on)
                text = prompt_text({"messages": [user(document + "question two")]})
                assert state.cache.match(prompt_blocks(text)) > 40


def user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


async def chat(gw: Gateway, content: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            gw.url + "/v1/chat/completions",
            json={"messages": [user(content)], "max_tokens": 2},
            headers={"Authorization": f"Bearer {KEY}"},
        ) as resp,
    ):
        await resp.read()
        return resp.status, resp.headers.get("X-Gateway-Instance", "")


POISON = {
    "infinity": b'{"loads":{"NAME":[Infinity,0,0,0]},"speeds":{},"queued":{},"budget":[0,0]}',
    "billion": b'{"loads":{"NAME":[1e9,0,0,0]},"speeds":{},"queued":{},"budget":[0,0]}',
    "negative": b'{"loads":{"NAME":[-3,0,0,0]},"speeds":{},"queued":{},"budget":[0,0]}',
    "huge": b'{"pad":"' + b"x" * (5 * 1024 * 1024) + b'"}',
}


async def test_no_entry_written_to_redis_stops_sharing_or_refuses_a_request() -> None:
    """Non-finite, absurd, negative and 5 MB entries (no TTL) and 300 bad pushes: both
    gateways keep sharing, say so truthfully, count and log each reason at a bounded rate,
    and serve at once what the instance can take."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT, ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            name = a.names()[0]
            client = aioredis.Redis.from_url(redis.url)
            try:
                with structlog.testing.capture_logs() as events:
                    for evil, body in POISON.items():
                        await client.set(
                            f"gateway:process:{evil}", body.replace(b"NAME", name.encode())
                        )
                        await client.sadd("gateway:processes", evil)
                    for i in range(300):
                        await client.publish("gateway:pushes", b"evil-%d {not json" % i)
                    await until(lambda: a.app[SHARED].errors.get("malformed", 0) >= 300)
                    await until(lambda: b.app[SHARED].errors.get("too_large", 0) >= 2)
                    results = await asyncio.gather(*(stream(gw, 3) for gw in (a, b)))
            finally:
                await client.aclose()
            assert [status for status, _ in results] == [200, 200]
            for gw in (a, b):
                shared = gw.app[SHARED]
                assert (shared.up, shared.peers, shared.listening) == (True, 1, True)
                assert {"out_of_bounds", "too_large", "malformed"} <= set(shared.errors)
            text = await metrics_text(a)
            assert "gateway_shared_state_up 1.0" in text
            assert 'gateway_shared_state_errors_total{reason="too_large"}' in text
            logged = [e for e in events if e["event"] == "shared_state_error"]
            assert len(logged) <= 2 * 3  # per gateway, once per reason in the minute


async def test_names_that_sort_first_do_not_crowd_the_live_peers_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More processes listed than a round reads (here 40 fakes with entries, over a bound
    of 8), all sorting before the real ones: each gateway still reads the other, and says
    it is crowded."""
    monkeypatch.setattr(shared_module, "MAX_PEERS", 8)
    with redis_server() as redis:
        async with fleet(ONE_SLOT, ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            client = aioredis.Redis.from_url(redis.url)
            try:
                for i in range(40):
                    await client.set(f"gateway:process:!fake-{i:03d}", b"{not json")
                    await client.sadd("gateway:processes", f"!fake-{i:03d}")
                await until(lambda: a.app[SHARED].errors.get("too_many_peers", 0) >= 3)
                await until(lambda: b.app[SHARED].errors.get("too_many_peers", 0) >= 3)
            finally:
                await client.aclose()
            assert (a.app[SHARED].peers, b.app[SHARED].peers) == (1, 1)


async def test_a_peer_whose_entry_stops_moving_leaves_even_without_a_ttl() -> None:
    """A well-formed entry written once, with no expiry, leaves the view after `ttl`."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT) as sims, two_gateways(redis, sims) as (a, _):
            name = a.names()[0]
            ghost = encode_ghost(name)
            client = aioredis.Redis.from_url(redis.url)
            try:
                await client.set("gateway:process:ghost", ghost)  # no TTL
                await client.sadd("gateway:processes", "ghost")
                await until(lambda: a.app[SHARED].peers == 2)
                await until(lambda: a.app[SHARED].peers == 1, 3)  # ttl is 0.5 s
                assert a.dispatcher.scheduler.state(name).peers.inflight == 0
            finally:
                await client.aclose()


def encode_ghost(name: str) -> bytes:
    return (
        b'{"loads":{"%s":[1,0,0,0]},"speeds":{},"queued":{},"budget":[0,0],"seq":7}' % name.encode()
    )


async def test_sharing_is_back_within_a_second_of_redis() -> None:
    """Redis restarted: both gateways share again within a push interval and a second (on a
    fresh connection, not one pooled from before the restart)."""
    with redis_server() as redis:
        async with fleet(ONE_SLOT) as sims, two_gateways(redis, sims) as (a, b):
            redis.stop()
            await until(lambda: a.app[SHARED].up is False and b.app[SHARED].up is False)
            await asyncio.sleep(2.0)  # long enough for any backoff to reach its cap
            redis.start()
            started = asyncio.get_running_loop().time()
            await until(lambda: a.app[SHARED].peers == 1 and b.app[SHARED].peers == 1, 10)
            took = asyncio.get_running_loop().time() - started
            assert a.app[SHARED].up
            assert b.app[SHARED].up
            assert took < 2.5, took  # 1.02 s is the target; a loaded CI machine gets slack


async def _burst(redis: RedisServer, strict: bool) -> list[int]:
    """30 streams at once into 3 cold gateways over 2 one-slot instances (cap 1 each, no
    queue): the most requests each instance ever held."""
    settings = sections(redis)
    settings["shared"] = {**settings["shared"], "strict_caps": strict}
    async with (
        fleet(ONE_SLOT, ONE_SLOT) as sims,
        gateway_with(sims, sections=settings) as a,
        gateway_with(sims, sections=settings) as b,
        gateway_with(sims, sections=settings) as c,
    ):
        await until(lambda: all(gw.app[SHARED].peers == 2 for gw in (a, b, c)))
        results = await asyncio.gather(*(stream(gw, 20) for gw in (a, b, c) * 10))
        assert [status for status, _ in results] == [200] * 30
        return [sim.stats.peak_held for sim in sims]


async def test_strict_caps_hold_exactly_across_replicas_in_a_cold_burst() -> None:
    """With strict caps no instance ever holds more than its cap, cold burst included."""
    with redis_server() as redis:
        assert await _burst(redis, strict=True) == [1, 1]


async def test_without_strict_caps_a_cold_burst_overshoots_by_one_place_per_replica() -> None:
    """The documented bound of the default: each of 3 cold replicas may take the one free
    place before hearing the others, so a cap of 1 may see 3 at once, no more."""
    with redis_server() as redis:
        assert max(await _burst(redis, strict=False)) <= 3


async def test_a_claim_while_redis_is_away_waits_for_nothing() -> None:
    """Strict caps with the view down: the claim is decided locally at once (None)."""
    with redis_server() as redis:
        shared = shared_module.SharedState(redis.url, _Clock(), None, strict_caps=True)  # type: ignore[arg-type]
        shared.up = False
        try:
            assert await asyncio.wait_for(shared.claim("x", 1, cap=1), 0.05) is None
        finally:
            await shared.close()


async def test_a_lease_comes_back_when_its_process_stops_renewing_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A place claimed by a process that died (no give-back, no renewal) is free again after
    its lease expires; one renewed by its live holder is not."""
    monkeypatch.setattr(shared_leases, "LEASE_S", 0.3)
    with redis_server() as redis:
        holder, other = (
            shared_module.SharedState(redis.url, _Clock(), None, strict_caps=True)  # type: ignore[arg-type]
            for _ in range(2)
        )
        holder.up = other.up = True  # as after a first round: claims go to Redis
        try:
            assert await holder.claim("x", 1, cap=1) is True
            assert await other.claim("x", 2, cap=1) is False
            await asyncio.sleep(0.2)
            await holder._renew()  # alive: its place lives on
            await asyncio.sleep(0.2)
            assert await other.claim("x", 3, cap=1) is False
            await asyncio.sleep(0.4)  # the holder died: nobody renews
            assert await other.claim("x", 4, cap=1) is True
        finally:
            await holder.close()
            await other.close()


async def test_a_forged_lease_far_in_the_future_is_dropped_and_counted() -> None:
    """A member written straight into an instance's lease set with a far-future score would
    hold the one place for good: the claim drops it (no lease lives past its time from
    now), takes the place, and counts the forgery."""
    with redis_server() as redis:
        shared = shared_module.SharedState(redis.url, _Clock(), None, strict_caps=True)  # type: ignore[arg-type]
        shared.up = True
        client = aioredis.Redis.from_url(redis.url)
        try:
            await client.zadd("gateway:leases:x", {"evil": 99999999999999})
            assert await shared.claim("x", 1, cap=1) is True
            assert shared.errors["forged_lease"] == 1
            assert await client.zscore("gateway:leases:x", "evil") is None
            assert await shared.claim("x", 2, cap=1) is False  # the place is ours, really
        finally:
            await client.aclose()
            await shared.close()


class _Clock:
    """All that SharedState reads of a dispatcher when it only claims places."""

    clock = staticmethod(time.monotonic)
