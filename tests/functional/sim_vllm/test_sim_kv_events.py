"""The simulated vLLM's KV cache events on real sockets on 127.0.0.1: a ZMQ SUB reads them as
vLLM's publisher sends them, a DEALER asks for replays; the simulator's own ports are free
ones (port 0), every socket closed at the end (a socket left to the collector warns)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from _sim_helpers import CHAT_URL, MakeSim, chat_body

from gateway.sim.sim_kv_events import END_SEQ
from gateway.sim.sim_vllm import SimInstance

BS = 4
TOPIC = b"kv-events"
EVENTS = {
    "prefix_cache_blocks": 8,
    "block_size": BS,
    "kv_events_endpoint": "tcp://*:0",
    "kv_events_replay_endpoint": "tcp://*:0",
}


Sockets = Callable[[int], zmq.asyncio.Socket]


class Subscriber:
    """A SUB socket on one simulator's events, caught up with all it published so far."""

    def __init__(self, sim: SimInstance, sockets: Sockets) -> None:
        assert sim.kv_events is not None
        assert sim.kv_events.endpoint is not None
        self.sim = sim
        self.publisher = sim.kv_events
        self.socket = sockets(zmq.SUB)
        self.socket.subscribe(TOPIC)
        self.socket.connect(sim.kv_events.endpoint)
        self.last = -1  # the last seq received

    async def join(self, http: aiohttp.ClientSession) -> None:
        """A SUB misses what is sent before its subscription reaches the PUB: reset the
        cache (one batch each) until one arrives, then read up to the last one sent."""
        for _ in range(100):
            async with http.post(self.sim.url + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            if await self.socket.poll(100):
                break
        else:
            pytest.fail("the subscription never reached the publisher")
        while self.last < self.publisher.next_seq - 1 and await self.socket.poll(500):
            await self.receive()

    async def receive(self, timeout_s: float = 5.0) -> tuple[int, Any]:
        """The next batch: (seq, payload decoded as plain msgpack)."""
        assert await self.socket.poll(int(timeout_s * 1000)), "no KV event batch came"
        frames = await self.socket.recv_multipart()
        assert len(frames) == 3
        topic, seq_bytes, payload = frames
        assert topic == TOPIC
        assert len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        assert seq > self.last
        self.last = seq
        return seq, msgspec.msgpack.decode(payload)


@pytest.fixture
async def sockets() -> AsyncIterator[Sockets]:
    """Factory of ZMQ sockets, all closed after the test, and their context ended."""
    context = zmq.asyncio.Context()
    opened: list[zmq.asyncio.Socket] = []

    def open_socket(kind: int) -> zmq.asyncio.Socket:
        opened.append(context.socket(kind))
        return opened[-1]

    yield open_socket
    for socket in opened:
        socket.close(linger=0)
    context.term()


async def subscribe(sim: SimInstance, sockets: Sockets, http: aiohttp.ClientSession) -> Subscriber:
    subscriber = Subscriber(sim, sockets)
    await subscriber.join(http)
    return subscriber


async def complete(
    http: aiohttp.ClientSession, sim: SimInstance, ids: list[int], **extra: Any
) -> None:
    """A completion of a prompt of token ids; its prefill is one engine step."""
    body = {"model": "sim-model", "prompt": ids, "max_tokens": 1, **extra}
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def replay(sockets: Sockets, sim: SimInstance, start: int) -> list[list[bytes]]:
    """Ask the replay socket from seq `start`, as a DEALER: every answer up to the end marker."""
    assert sim.kv_events is not None
    assert sim.kv_events.replay_endpoint is not None
    dealer = sockets(zmq.DEALER)
    dealer.connect(sim.kv_events.replay_endpoint)
    await dealer.send_multipart([b"", start.to_bytes(8, "big")])
    answers = []
    while True:
        assert await dealer.poll(5000), "the replay did not answer"
        frames = await dealer.recv_multipart()
        answers.append(frames)
        if frames[1] == END_SEQ:
            return answers


def stored(batch: Any) -> list[dict[str, Any]]:
    return [e for e in batch["events"] if e["type"] == "BlockStored"]


async def test_batches_come_in_seq_order_in_vllms_map_form(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """Each step's batch is (topic, seq, payload), seqs consecutive; the payload a map with
    ts, events tagged by "type" first, and rank 0."""
    sim = await make_sim(**EVENTS)
    sub = await subscribe(sim, sockets, http)
    first = sub.last
    await complete(http, sim, list(range(9)))
    await complete(http, sim, list(range(100, 109)))
    (seq_a, a), (seq_b, b) = await sub.receive(), await sub.receive()
    assert (seq_a, seq_b) == (first + 1, first + 2)
    assert isinstance(a["ts"], float)
    assert a["data_parallel_rank"] == 0
    (event,) = a["events"]
    assert next(iter(event)) == "type"
    assert event == {
        "type": "BlockStored",
        "block_hashes": event["block_hashes"],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None, None],
    }
    assert len(event["block_hashes"]) == 2
    assert all(0 <= h < 2**64 for h in event["block_hashes"])
    assert stored(b)[0]["token_ids"] == list(range(100, 108))


async def test_the_replay_starts_at_seq_0_and_ends_with_the_marker(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """From seq 0 the replay returns every batch since the start, then (-1, b"")."""
    sim = await make_sim(**EVENTS)
    await subscribe(sim, sockets, http)
    assert sim.kv_events is not None
    answers = await replay(sockets, sim, 0)
    seqs = [int.from_bytes(frames[1], "big") for frames in answers[:-1]]
    assert seqs == list(range(sim.kv_events.next_seq))
    assert answers[-1] == [b"", END_SEQ, b""]
    assert all(len(frames) == 3 and frames[0] == b"" for frames in answers)


async def test_a_longer_prompt_stores_the_next_blocks_of_the_chain(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """The second batch's first block has the first batch's last block as parent, and only
    the blocks not cached before are stored."""
    sim = await make_sim(**EVENTS)
    sub = await subscribe(sim, sockets, http)
    prompt = list(range(200, 213))
    await complete(http, sim, prompt[:9])
    await complete(http, sim, prompt)
    (_, first), (_, second) = await sub.receive(), await sub.receive()
    (head,), (tail,) = stored(first), stored(second)
    assert tail["parent_block_hash"] == head["block_hashes"][-1]
    assert tail["token_ids"] == prompt[8:12]
    assert len(tail["block_hashes"]) == 1


async def test_eviction_publishes_block_removed(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """A full cache evicts the least recently used blocks, each as its own BlockRemoved."""
    sim = await make_sim(**{**EVENTS, "prefix_cache_blocks": 2})
    sub = await subscribe(sim, sockets, http)
    await complete(http, sim, list(range(9)))
    await complete(http, sim, list(range(50, 59)))
    (_, old), (_, new) = await sub.receive(), await sub.receive()
    (old_blocks,) = stored(old)
    removed = [e for e in new["events"] if e["type"] == "BlockRemoved"]
    assert removed == [
        {"type": "BlockRemoved", "block_hashes": [h], "medium": "GPU"}
        for h in reversed(old_blocks["block_hashes"])
    ]


async def test_the_array_form_over_the_wire(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """With encoding "array" a batch is [ts, events, rank] and an event
    [tag, hashes, parent, tokens, block_size, lora_id, medium]."""
    sim = await make_sim(**EVENTS, kv_events_encoding="array")
    sub = await subscribe(sim, sockets, http)
    await complete(http, sim, list(range(9)))
    _, batch = await sub.receive()
    ts, (event,), rank = batch
    assert isinstance(ts, float)
    assert rank == 0
    assert event[0] == "BlockStored"
    assert event[2:] == [None, list(range(8)), BS, None, "GPU"]


async def test_a_batch_lost_on_the_wire_is_replayed(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """With drop_every 2 every second batch never reaches the SUB (a seq gap); the replay
    from the gap returns the missing batch, the later ones, then the end marker."""
    sim = await make_sim(**EVENTS, kv_events_drop_every=2)
    assert sim.kv_events is not None
    sub = await subscribe(sim, sockets, http)
    start = sub.last
    await complete(http, sim, list(range(9)))
    await complete(http, sim, list(range(50, 59)))
    async with http.post(sim.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    published = sim.kv_events.next_seq
    lost = [seq for seq in range(start + 1, published) if (seq + 1) % 2 == 0]
    sent = [seq for seq in range(start + 1, published) if (seq + 1) % 2 != 0]
    received = [(await sub.receive())[0] for _ in sent]
    assert received == sent
    assert lost
    answers = await replay(sockets, sim, lost[0])
    seqs = [int.from_bytes(frames[1], "big") for frames in answers[:-1]]
    assert seqs == list(range(lost[0], published))
    assert msgspec.msgpack.decode(answers[0][2])["events"]
    assert answers[-1][1:] == [END_SEQ, b""]


async def test_cache_salt_separates_prompts(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """The same prompt under two salts (and none) shares no block; the salt is the first
    block's extra key; chat takes cache_salt too."""
    sim = await make_sim(**EVENTS)
    sub = await subscribe(sim, sockets, http)
    ids = list(range(300, 309))
    chains = []
    for extra in ({"cache_salt": "alpha"}, {"cache_salt": "beta"}, {}):
        await complete(http, sim, ids, **extra)
        (event,) = stored((await sub.receive())[1])
        assert event["parent_block_hash"] is None
        chains.append(event)
    assert [c["extra_keys"] for c in chains] == [[["alpha"], None], [["beta"], None], [None, None]]
    assert len({h for c in chains for h in c["block_hashes"]}) == 6
    async with http.post(sim.url + CHAT_URL, json=chat_body(1, cache_salt="gamma")) as resp:
        assert resp.status == 200
    (chat,) = stored((await sub.receive())[1])
    assert chat["extra_keys"][0] == ["gamma"]
    async with http.post(sim.url + CHAT_URL, json=chat_body(1, cache_salt="")) as resp:
        assert resp.status == 400


async def test_reset_publishes_all_blocks_cleared(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """POST /reset_prefix_cache answers 200 and publishes AllBlocksCleared at once; the same
    prompt afterwards is stored again."""
    sim = await make_sim(**EVENTS)
    sub = await subscribe(sim, sockets, http)
    await complete(http, sim, list(range(9)))
    (first,) = stored((await sub.receive())[1])
    async with http.post(sim.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    assert (await sub.receive())[1]["events"] == [{"type": "AllBlocksCleared"}]
    await complete(http, sim, list(range(9)))
    (again,) = stored((await sub.receive())[1])
    assert again["block_hashes"] == first["block_hashes"]


async def test_a_silenced_publisher_sends_nothing_more(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """After silence() the cache still changes but no batch is sent or numbered."""
    sim = await make_sim(**EVENTS)
    assert sim.kv_events is not None
    sub = await subscribe(sim, sockets, http)
    published = sim.kv_events.next_seq
    sim.kv_events.silence()
    await complete(http, sim, list(range(9)))
    assert not await sub.socket.poll(300)
    assert sim.kv_events.next_seq == published
    assert "silent=True" in repr(sim.kv_events)


async def test_without_replay_only_the_pub_socket_is_bound(
    make_sim: MakeSim, http: aiohttp.ClientSession, sockets: Sockets
) -> None:
    """No replay endpoint: events still flow, and there is no replay address."""
    sim = await make_sim(**{**EVENTS, "kv_events_replay_endpoint": None})
    assert sim.kv_events is not None
    sub = await subscribe(sim, sockets, http)
    assert sim.kv_events.replay_endpoint is None
    await complete(http, sim, list(range(9)))
    assert stored((await sub.receive())[1])


async def test_a_restart_numbers_from_zero_again(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    """stop() closes the sockets; start() opens them again for a fresh engine (seq from 0)."""
    sim = await make_sim(**EVENTS)
    assert sim.kv_events is not None
    async with http.post(sim.url + "/reset_prefix_cache") as resp:
        assert resp.status == 200
    assert sim.kv_events.next_seq == 1
    await sim.stop()
    assert not sim.kv_events.is_open
    await sim.start()
    assert sim.kv_events.is_open
    assert sim.kv_events.next_seq == 0
