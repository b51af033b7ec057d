"""vLLM's KV event payloads in both of its wire forms, encoded as vLLM's own msgspec
declarations encode them (the current maps, and the older array_like arrays that vLLM's
example subscriber and llm-d read), decoded into the index's events."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.dispatch.kv_index import ClearedCache, RemovedBlocks, StoredBlocks
from gateway.fleet.kv_wire import BadPayload, decode_batch


# vLLM's declarations at 0181ea31 (vllm/distributed/kv_events.py): plain structs.
class Batch(msgspec.Struct, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(Event):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(Event):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(Event):
    pass


# The older declarations (and vLLM's examples/online_serving/kv_events_subscriber.py).
class OldBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


HASHES = [2**64 - 1, 12345]  # the low 64 bits, unsigned: the first needs all 64


def test_the_current_map_form() -> None:
    payload = msgspec.msgpack.encode(
        Batch(
            ts=1.5,
            events=[
                BlockStored(
                    block_hashes=HASHES,
                    parent_block_hash=None,
                    token_ids=list(range(32)),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[("salt",), None],
                    kv_cache_spec_kind="full_attention",
                ),
                BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
    )
    assert msgspec.msgpack.decode(payload)["events"][0]["type"] == "BlockStored"
    stored, removed, cleared = decode_batch(payload)
    assert isinstance(stored, StoredBlocks)
    assert list(stored.block_hashes) == HASHES
    assert stored.parent is None
    assert stored.block_size == 16
    assert list(stored.token_ids) == list(range(32))
    assert stored.extra_keys == [("salt",), None]
    assert stored.medium == "GPU"
    assert removed == RemovedBlocks([7], "GPU", 0)
    assert isinstance(cleared, ClearedCache)


def test_the_older_array_like_form_with_trailing_fields_absent() -> None:
    payload = msgspec.msgpack.encode(
        OldBatch(
            ts=1.0,
            events=[
                OldBlockStored(HASHES, 99, list(range(32)), 16, None, "GPU"),
                OldBlockRemoved([99], None),
                OldAllBlocksCleared(),
            ],
        )
    )
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored"
    assert len(raw[1][0]) == 7  # tag and six fields: no lora_name, extra_keys, group_idx
    stored, removed, cleared = decode_batch(payload)
    assert isinstance(stored, StoredBlocks)
    assert stored.parent == 99
    assert stored.extra_keys is None
    assert stored.lora_name is None
    assert stored.group is None
    assert removed == RemovedBlocks([99], None, None)
    assert isinstance(cleared, ClearedCache)


def test_bytes_hashes_decode_as_bytes() -> None:
    """With VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 the hashes are the engine's bytes."""
    payload = msgspec.msgpack.encode(
        Batch(0.0, [BlockStored([b"\x01" * 32], b"\x02" * 32, [1] * 16, 16, None, None, None)])
    )
    (stored,) = decode_batch(payload)
    assert isinstance(stored, StoredBlocks)
    assert stored.block_hashes == [b"\x01" * 32]
    assert stored.parent == b"\x02" * 32


def test_an_unknown_event_kind_is_skipped() -> None:
    payload = msgspec.msgpack.encode({"ts": 0.0, "events": [{"type": "BlockPinned", "x": 1}]})
    assert decode_batch(payload) == []


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never used in msgpack
        msgspec.msgpack.encode(3),
        msgspec.msgpack.encode({"ts": 0.0, "events": 5}),
        msgspec.msgpack.encode({"ts": 0.0, "events": [7]}),
        msgspec.msgpack.encode({"ts": 0.0, "events": [{"no": "type"}]}),
        msgspec.msgpack.encode([0.0, [["BlockStored", [1], None, "tokens", 16, None, None]]]),
        msgspec.msgpack.encode([0.0, [["BlockRemoved", 5, None]]]),
    ],
)
def test_a_payload_of_the_wrong_shape_is_refused(payload: bytes) -> None:
    with pytest.raises(BadPayload):
        decode_batch(payload)
