"""vLLM's KV event payloads, decoded into the index's events (dispatch/kv_index.py).

A payload is an `EventBatch` (`ts`, `events`, `data_parallel_rank`) that vLLM encodes with
msgspec. Its versions disagree on the form:

- the current `vllm/distributed/kv_events.py` declares plain structs: a batch is a map,
  each event a map whose `type` names its class, fields left at their default omitted;
- older versions, vLLM's example subscriber and llm-d's decoder declare them `array_like`:
  a batch is `[ts, events]` or `[ts, events, dp_rank]`, an event an array with its class
  name first and its fields in declaration order, trailing defaults absent.

Both are read here, by shape, from msgspec's untyped decode: one C pass, then field access.
Block hashes are ints (vLLM's default, their low 64 bits) or bytes (with
`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`); the index takes either. An event of a kind this
gateway does not know is skipped; a payload of the wrong shape raises `BadPayload`.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import msgspec

from gateway.dispatch.kv_index import ClearedCache, Event, RemovedBlocks, StoredBlocks

_decode = msgspec.msgpack.Decoder().decode

# The array_like field order (vLLM's declaration order, after the tag).
_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class BadPayload(ValueError):
    """A payload that is not a KV event batch in either of vLLM's forms."""


def decode_batch(payload: bytes) -> list[Event]:
    """The events of one `EventBatch`, in order."""
    try:
        batch = _decode(payload)
    except msgspec.DecodeError as exc:
        raise BadPayload(f"not msgpack: {exc}") from None
    if isinstance(batch, Mapping):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise BadPayload(f"not an EventBatch: {type(batch).__name__}")
    if not isinstance(events, list):
        raise BadPayload("EventBatch.events is not a list")
    out = []
    for raw in events:
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _fields(raw: Any) -> tuple[str, Mapping[str, Any]]:
    """(class name, fields by name) of one event in either form."""
    if isinstance(raw, Mapping):
        kind = raw.get("type")
        if not isinstance(kind, str):
            raise BadPayload("an event without its type")
        return kind, raw
    if isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS
        return kind, dict(zip(names, raw[1:], strict=False))
    raise BadPayload(f"not a KV event: {type(raw).__name__}")


def _hashes(value: Any) -> list[Hashable]:
    if not isinstance(value, list):
        raise BadPayload("block_hashes is not a list")
    return [h if isinstance(h, int | bytes) else _hashable(h) for h in value]


def _hashable(value: Any) -> Hashable:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    if isinstance(value, int | float | str | bytes | bool) or value is None:
        return value
    raise BadPayload(f"unhashable key: {type(value).__name__}")


def _extra(value: Any) -> Sequence[tuple[Hashable, ...] | None] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise BadPayload("extra_keys is not a list")
    return [tuple(_hashable(k) for k in keys) if isinstance(keys, list) else None for keys in value]


def _optional_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise BadPayload(f"{name} is not an int")


def _event(raw: Any) -> Event | None:
    kind, f = _fields(raw)
    if kind == "BlockStored":
        tokens = f.get("token_ids")
        size = f.get("block_size")
        if not isinstance(tokens, list) or not isinstance(size, int):
            raise BadPayload("BlockStored without token_ids or block_size")
        parent = f.get("parent_block_hash")
        lora = f.get("lora_name")
        medium = f.get("medium")
        return StoredBlocks(
            block_hashes=_hashes(f.get("block_hashes")),
            parent=None if parent is None else _hashable(parent),
            token_ids=tokens,
            block_size=size,
            extra_keys=_extra(f.get("extra_keys")),
            lora_name=lora if isinstance(lora, str) else None,
            medium=medium if isinstance(medium, str) else None,
            group=_optional_int(f.get("group_idx"), "group_idx"),
        )
    if kind == "BlockRemoved":
        medium = f.get("medium")
        return RemovedBlocks(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=medium if isinstance(medium, str) else None,
            group=_optional_int(f.get("group_idx"), "group_idx"),
        )
    if kind == "AllBlocksCleared":
        return ClearedCache()
    return None  # a kind of a later version: not ours to read
