"""Pure tests of the simulator's KV cache events: what the prefix cache reports, the two wire
forms (decoded as vLLM's subscribers decode them), the outbox's numbering, drops and replay,
and the engine's one batch per step. The sockets are tested in
functional/sim_vllm/test_sim_kv_events.py."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sim.sim_batching import Engine
from gateway.sim.sim_engine import SimConfig, SimStats, parse_cache_salt, parse_endpoint
from gateway.sim.sim_fleet import _build_parser, kv_endpoints
from gateway.sim.sim_kv_events import Outbox, encode_batch, replay_request
from gateway.sim.sim_prefix_cache import (
    BlockKeys,
    CacheEvent,
    Cleared,
    PrefixCache,
    Removed,
    Stored,
    block_hashes,
)

BS = 4
MASK = 2**64 - 1


def test_insert_reports_only_the_blocks_it_newly_stores() -> None:
    """A first insert stores the chain from its root; a longer one stores only its new tail,
    its parent the last block already cached; a repeat stores nothing."""
    cache = PrefixCache(16, BS, events=True)
    ids = list(range(12))
    hashes = block_hashes(ids, BS)
    first = cache.insert(hashes[:2], ids)
    assert first == [
        Stored(tuple(hashes[:2]), None, tuple(ids[:8]), BS, (None, None)),
    ]
    assert cache.insert(hashes, ids) == [
        Stored((hashes[2],), hashes[1], tuple(ids[8:]), BS, (None,))
    ]
    assert cache.insert(hashes, ids) == []
    assert cache.lookup(hashes, 13) == 12  # a hit only touches


def test_eviction_reports_each_block_removed_tail_first() -> None:
    """Beyond capacity each evicted block is its own Removed, the old chain's tail first."""
    cache = PrefixCache(2, BS, events=True)
    old, new = block_hashes(range(8), BS), block_hashes(range(100, 108), BS)
    cache.insert(old, range(8))
    events = cache.insert(new, range(100, 108))
    assert events[1:] == [Removed(old[1]), Removed(old[0])]
    assert isinstance(events[0], Stored)
    assert events[0].parent is None


def test_clear_empties_the_cache_and_reports_it() -> None:
    """clear() is AllBlocksCleared; the same chain is stored again afterwards."""
    cache = PrefixCache(8, BS, events=True)
    hashes = block_hashes(range(8), BS)
    cache.insert(hashes, range(8))
    assert cache.clear() == [Cleared()]
    assert len(cache) == 0
    assert [type(e) for e in cache.insert(hashes, range(8))] == [Stored]


def test_without_events_the_cache_reports_nothing() -> None:
    """A cache made without events (no publisher) returns no event from insert or clear."""
    cache = PrefixCache(1, BS)
    assert cache.insert(block_hashes(range(8), BS), range(8)) == []
    assert len(cache) == 1
    assert cache.clear() == []


prompts = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), max_size=12)


@given(prompts, st.integers(1, 8), st.data())
def test_the_events_replayed_are_the_cache(
    history: list[list[int]], capacity: int, data: st.DataObject
) -> None:
    """Applying the events in order (store, remove, clear) gives exactly what the cache
    holds, each Stored's parent is held when it comes, and its tokens are its blocks'."""
    cache = PrefixCache(capacity, BS, events=True)
    mirror: set[int] = set()
    for ids in history:
        hashes = block_hashes(ids, BS)
        cut = data.draw(st.integers(0, len(hashes)))  # a chunked prefill's blocks so far
        events = cache.clear() if data.draw(st.booleans()) and not ids else []
        events += cache.insert(hashes[:cut], ids)
        for event in events:
            if isinstance(event, Stored):
                assert event.parent is None or event.parent in mirror
                assert len(event.token_ids) == len(event.block_hashes) * BS
                mirror |= set(event.block_hashes)
            elif isinstance(event, Removed):
                mirror.remove(event.block_hash)
            else:
                mirror.clear()
        assert len(mirror) == len(cache)
        assert all(h in cache for h in mirror)


def test_a_salt_or_an_adapter_shares_no_block() -> None:
    """cache_salt keys the first block (so the whole chain), an adapter every block; the
    extra keys say so per block as vLLM's do."""
    ids = list(range(12))
    plain = block_hashes(ids, BS)
    salted = [block_hashes(ids, BS, BlockKeys(cache_salt=s)) for s in ("a", "b")]
    lora = block_hashes(ids, BS, BlockKeys(lora_name="ad"))
    chains = [plain, *salted, lora]
    assert len({h for chain in chains for h in chain}) == 4 * len(plain)
    both = BlockKeys(lora_name="ad", cache_salt="a")
    assert [both.of_block(i) for i in range(3)] == [("ad", "a"), ("ad",), ("ad",)]
    assert [BlockKeys(cache_salt="a").of_block(i) for i in range(2)] == [("a",), None]


def test_hashes_with_keys_are_the_same_in_every_process() -> None:
    """Strings are hashed by digest, not by Python's salted hash: another PYTHONHASHSEED
    gives the same chain."""
    code = (
        "from gateway.sim.sim_prefix_cache import BlockKeys, block_hashes;"
        "print(block_hashes(range(8), 4, BlockKeys('ad', 'salt')))"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(runs) == 1


def test_parse_cache_salt_is_vllms() -> None:
    """cache_salt is absent, null or a non-empty string; anything else is a 400."""
    assert parse_cache_salt({}) is None
    assert parse_cache_salt({"cache_salt": None}) is None
    assert parse_cache_salt({"cache_salt": "s"}) == "s"
    for bad in ("", 3, ["s"]):
        with pytest.raises(Exception, match="non-empty string"):
            parse_cache_salt({"cache_salt": bad})


def _events() -> list[CacheEvent]:
    hashes = block_hashes(range(8), BS, BlockKeys(lora_name="ad", cache_salt="s"))
    return [
        Stored(tuple(hashes), None, tuple(range(8)), BS, (("ad", "s"), ("ad",)), lora_name="ad"),
        Stored((hashes[1],), hashes[0], tuple(range(4, 8)), BS, (None,)),
        Removed(hashes[1]),
        Cleared(),
    ]


def test_the_map_form_is_current_vllms() -> None:
    """Maps with "type" first, defaults left out, hashes as unsigned 64-bit ints, rank 0."""
    events = _events()
    hashes = block_hashes(range(8), BS, BlockKeys(lora_name="ad", cache_salt="s"))
    batch = msgspec.msgpack.decode(encode_batch(events, 1.5, "map", {"ad": 1}))
    assert batch == {"ts": 1.5, "events": batch["events"], "data_parallel_rank": 0}
    stored, child, removed, cleared = batch["events"]
    assert next(iter(stored)) == "type"
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [h & MASK for h in hashes],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": BS,
        "lora_id": 1,
        "medium": "GPU",
        "lora_name": "ad",
        "extra_keys": [["ad", "s"], ["ad"]],
    }
    assert child["parent_block_hash"] == stored["block_hashes"][0]
    assert child["extra_keys"] == [None]
    assert child["lora_id"] is None
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [child["block_hashes"][0]],
        "medium": "GPU",
    }
    assert cleared == {"type": "AllBlocksCleared"}
    assert all(0 <= h <= MASK for h in stored["block_hashes"])


def test_the_array_form_is_older_vllms() -> None:
    """Arrays, tag first, fields in declaration order; the batch [ts, events, rank]."""
    batch = msgspec.msgpack.decode(encode_batch(_events(), 2.0, "array", {"ad": 1}))
    ts, (stored, child, removed, cleared), rank = batch
    assert (ts, rank) == (2.0, 0)
    assert stored[0] == "BlockStored"
    assert stored[2:] == [None, list(range(8)), BS, 1, "GPU"]
    assert child[:3] == ["BlockStored", [stored[1][1]], stored[1][0]]
    assert removed == ["BlockRemoved", [stored[1][1]], "GPU"]
    assert cleared == ["AllBlocksCleared"]


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class BlockStored(_OldEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_OldEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(_OldEvent):
    pass


class _OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_vllms_example_subscriber_decodes_the_array_form() -> None:
    """The structs of vLLM's example subscriber (a batch without the rank) decode it."""
    batch = msgspec.msgpack.Decoder(_OldBatch).decode(encode_batch(_events(), 3.0, "array"))
    assert [type(e).__name__ for e in batch.events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]


def test_outbox_numbers_drops_and_replays() -> None:
    """seq counts from 0; every 3rd batch is lost but kept; replay gives seq >= start."""
    outbox = Outbox(buffer_steps=4, drop_every=3)
    sent = [outbox.add(bytes([i])) for i in range(6)]
    assert sent == [0, 1, None, 3, 4, None]
    assert outbox.since(3) == [(3, b"\x03"), (4, b"\x04"), (5, b"\x05")]
    assert [seq for seq, _ in outbox.since(0)] == [2, 3, 4, 5]  # the last 4 only
    assert "next_seq=6, buffered=4, dropped=2" in repr(outbox)


def test_a_silent_outbox_keeps_nothing() -> None:
    """Silenced, batches are neither numbered, kept nor sent."""
    outbox = Outbox()
    assert outbox.add(b"a") == 0
    outbox.silent = True
    assert outbox.add(b"b") is None
    assert outbox.next_seq == 1
    assert outbox.since(0) == [(0, b"a")]


def test_replay_requests_are_parsed_strictly() -> None:
    """A ROUTER request is (id, b"", start of 1..8 bytes); anything else is refused."""
    assert replay_request([b"id", b"", (7).to_bytes(8, "big")]) == (b"id", 7)
    for bad in ([b"id", (7).to_bytes(8, "big")], [b"id", b"x", b"\x01"], [b"id", b"", b""]):
        assert replay_request(bad) is None
    assert replay_request([b"id", b"", bytes(9)]) is None


def test_endpoints_bind_loopback_only() -> None:
    """tcp://HOST:PORT with * or a loopback host, port 0 or * for any; others are refused."""
    assert parse_endpoint("tcp://*:5557") == ("*", 5557)
    assert parse_endpoint("tcp://127.0.0.1:*") == ("127.0.0.1", 0)
    assert parse_endpoint("tcp://[::1]:0") == ("::1", 0)
    for bad in ("tcp://10.0.0.1:5557", "ipc:///tmp/x", "tcp://*:x", "tcp://*:70000", "*:5"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            parse_endpoint(bad)


def test_config_refuses_events_without_a_cache() -> None:
    """KV events need the prefix cache; encoding, buffer and drops are checked."""
    on = SimConfig(kv_events_endpoint="tcp://*:0", prefix_cache_blocks=8)
    assert on.kv_events_topic == "kv-events"
    with pytest.raises(ValueError, match="prefix_cache_blocks"):
        SimConfig(kv_events_endpoint="tcp://*:0")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        SimConfig(kv_events_replay_endpoint="tcp://*:0")
    with pytest.raises(ValueError, match="kv_events_encoding"):
        dataclasses.replace(on, kv_events_encoding="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="kv_events_drop_every"):
        dataclasses.replace(on, kv_events_drop_every=-1)


def test_fleet_flags_give_each_instance_two_ports() -> None:
    """--kv-events-port P: instance i publishes on P+2i and replays on P+2i+1."""
    args = _build_parser("fleet").parse_args(["--kv-events-port", "5557"])
    assert (args.kv_events_encoding, args.kv_events_drop_every) == ("map", 0)
    assert kv_endpoints(5557, 1) == ("tcp://*:5559", "tcp://*:5560")
    assert kv_endpoints(0, 3) == (None, None)


async def test_the_engine_publishes_one_batch_per_step_that_changed_the_cache() -> None:
    """Two prompts prefilled in one step give one batch; a repeat that only hits gives none."""
    batches: list[list[CacheEvent]] = []

    async def publish(events: Any) -> None:
        batches.append(list(events))

    config = SimConfig(prefix_cache_blocks=16, block_size=BS, speed=100.0)
    engine = Engine(config, SimStats(), publish_cache_events=publish)
    a, b = list(range(9)), list(range(50, 59))
    requests = [engine.submit(9, 1, ids) for ids in (a, b)]
    for req in requests:
        while await req.next_token() is not None:
            pass
    assert [[type(e) for e in batch] for batch in batches] == [[Stored, Stored]]
    repeat = engine.submit(9, 1, a)
    while await repeat.next_token() is not None:
        pass
    assert len(batches) == 1
    assert await engine.reset_prefix_cache()
    assert batches[-1] == [Cleared()]
    await engine.close()
