"""vLLM's KV cache events: their wire, and the publisher `--kv-events-config` turns on.

After `vllm/distributed/kv_events.py` (checked at vLLM 0181ea31) and its ZmqEventPublisher,
started with `{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": ...,
"replay_endpoint": ..., "topic": ...}`:

- Each engine step that changed the prefix cache publishes one batch on a PUB socket, as
  three frames: the topic, the batch's seq (8 bytes, big-endian, unsigned; 0 is the first
  batch since the engine started) and the payload.
- The payload is msgpack (encoded by msgspec) of an `EventBatch(ts, events,
  data_parallel_rank)`; the publisher sets the rank, 0 on a single engine. Current vLLM
  declares its structs as maps (`omit_defaults`), each event tagged by a "type" key first:
  `BlockStored`, `BlockRemoved`, `AllBlocksCleared`. Older vLLM, and vLLM's own example
  subscriber (`examples/online_serving/kv_events_subscriber.py`), declare them
  `array_like`: an event is `[tag, field, ...]` in declaration order, trailing defaults
  left out, and the batch `[ts, events, rank]`. Both forms are here ("map", "array"); the
  array form has the fields of then, before `lora_name` and `extra_keys`:
  `["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]`.
- Block hashes go out as ints, their low 64 bits unsigned (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES).
- Replay: a ROUTER socket. A client (DEALER sending `(b"", start)`, or REQ sending `start`,
  8 bytes big-endian) is answered `(seq, payload)` for every buffered batch from `start`
  on, then the end marker `(-1 as 8 signed bytes, b"")`, each a message of its own (so a
  REQ reads only the first). The buffer keeps the last `buffer_steps` batches (vLLM's
  default 10,000).

What the simulator changes: no thread and no queue (zmq.asyncio sockets in the instance's
event loop; a PUB send never blocks, it drops at the high-water mark as vLLM's does); it
binds on loopback only; and, for the gateway's tests, it can lose messages: every
`drop_every`-th batch is numbered and kept for replay but never sent, as a batch lost on the
wire; and `silence()` stops it for good, as a publisher that hung. The same requests give
the same batches on every run (the hashes are reproducible), but for their `ts`.

A publisher's life, one per instance, opened at each start (a fresh engine: seq from 0):

    closed --open()--> open --silence()--> silent
       ^                 |                   |
       +----close()------+------close()------+
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from .sim_engine import KvEventsEncoding, SimConfig, parse_endpoint
from .sim_prefix_cache import CacheEvent, Removed, Stored

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's last message: (END_SEQ, b"")
_HASH_MASK = 0xFFFF_FFFF_FFFF_FFFF
_PUB_HWM = 100_000  # vLLM's hwm for the PUB socket


# --- current vLLM: maps, each event tagged by a "type" key --------------------------------


class EventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """The events' base: tag=True writes the class name as "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


# --- older vLLM: the same names as arrays, before lora_name and extra_keys ---------------


class ArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class ArrayKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The events' base: each subclass names its tag, as vLLM's class names read."""


class ArrayBlockStored(ArrayKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class ArrayBlockRemoved(ArrayKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ArrayAllBlocksCleared(ArrayKVCacheEvent, tag="AllBlocksCleared"):
    pass


def _wire_hash(block_hash: int) -> int:
    return block_hash & _HASH_MASK


@dataclass(frozen=True)
class _Form:
    """One wire form: its classes, and whether its BlockStored has the newer fields."""

    batch: type[EventBatch] | type[ArrayEventBatch]
    stored: type[BlockStored] | type[ArrayBlockStored]
    removed: type[BlockRemoved] | type[ArrayBlockRemoved]
    cleared: type[AllBlocksCleared] | type[ArrayAllBlocksCleared]
    newer: bool  # lora_name and extra_keys (the array form is older vLLM's)

    def event(self, event: CacheEvent, lora_ids: Mapping[str, int]) -> msgspec.Struct:
        if isinstance(event, Removed):
            return self.removed(block_hashes=[_wire_hash(event.block_hash)], medium=MEDIUM_GPU)
        if not isinstance(event, Stored):
            return self.cleared()
        fields: dict[str, Any] = {
            "block_hashes": [_wire_hash(h) for h in event.block_hashes],
            "parent_block_hash": None if event.parent is None else _wire_hash(event.parent),
            "token_ids": event.token_ids,  # msgspec writes a tuple as the array vLLM sends
            "block_size": event.block_size,
            "lora_id": lora_ids.get(event.lora_name) if event.lora_name else None,
            "medium": MEDIUM_GPU,
        }
        if self.newer:
            fields |= {"lora_name": event.lora_name, "extra_keys": event.extra_keys}
        return self.stored(**fields)


_FORMS: Mapping[KvEventsEncoding, _Form] = {
    "map": _Form(EventBatch, BlockStored, BlockRemoved, AllBlocksCleared, newer=True),
    "array": _Form(
        ArrayEventBatch, ArrayBlockStored, ArrayBlockRemoved, ArrayAllBlocksCleared, newer=False
    ),
}


def encode_batch(
    events: Sequence[CacheEvent],
    ts: float,
    encoding: KvEventsEncoding = "map",
    lora_ids: Mapping[str, int] | None = None,
) -> bytes:
    """One step's events as a batch payload, in vLLM's map or (older) array form.

    lora_ids: each adapter's id (vLLM numbers them from 1 as it loads them), for `lora_id`.
    """
    form = _FORMS[encoding]
    ids = lora_ids or {}
    wire = [form.event(event, ids) for event in events]
    return msgspec.msgpack.encode(form.batch(ts=ts, events=wire, data_parallel_rank=0))


class Outbox:
    """Numbers batches from 0, keeps the last `buffer_steps` for replay, and decides which
    go out on the wire. Pure: the publisher does the sending."""

    def __init__(self, buffer_steps: int = 10_000, drop_every: int = 0) -> None:
        if buffer_steps < 1 or drop_every < 0:
            raise ValueError(
                f"buffer_steps must be >= 1 and drop_every >= 0, got {buffer_steps}, {drop_every}"
            )
        self.drop_every = drop_every
        self.next_seq = 0
        self.dropped = 0  # batches kept for replay but never sent
        self.silent = False
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_steps)

    def __repr__(self) -> str:
        return (
            f"Outbox(next_seq={self.next_seq}, buffered={len(self._buffer)}, "
            f"dropped={self.dropped}, drop_every={self.drop_every}, silent={self.silent})"
        )

    def add(self, payload: bytes) -> int | None:
        """Number and keep a batch: its seq when it is to be sent, None when it is lost.

        With drop_every 3 the batches 2, 5, 8, ... (every third) are lost: kept, not sent.
        A silent outbox neither numbers nor keeps anything.
        """
        if self.silent:
            return None
        seq = self.next_seq
        self.next_seq += 1
        self._buffer.append((seq, payload))
        if self.drop_every and (seq + 1) % self.drop_every == 0:
            self.dropped += 1
            return None
        return seq

    def since(self, start: int) -> list[tuple[int, bytes]]:
        """The buffered (seq, payload) from seq `start` on, oldest first."""
        return [(seq, payload) for seq, payload in self._buffer if seq >= start]


def replay_request(frames: Sequence[bytes]) -> tuple[bytes, int] | None:
    """(client id, start seq) of a request as the ROUTER receives it, `(id, b"", start)`;
    None for anything else (vLLM ignores it too). start is at most 8 bytes, big-endian."""
    if len(frames) != 3 or frames[1] != b"" or not 0 < len(frames[2]) <= 8:
        return None
    return frames[0], int.from_bytes(frames[2], "big")


def _bind(socket: zmq.asyncio.Socket, endpoint: str, own_host: str) -> str:
    """Bind to endpoint (host `*`: the instance's own address); the address bound."""
    host, port = parse_endpoint(endpoint)
    host = own_host if host == "*" else "127.0.0.1" if host == "localhost" else host
    if ":" in host:
        socket.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    address = f"tcp://{host}:{port or '*'}"
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:
        raise OSError(exc.errno, f"cannot bind KV events at {address}: {exc.strerror}") from None
    return socket.getsockopt_string(zmq.LAST_ENDPOINT)


class KvEventPublisher:
    """One instance's KV event publisher: a PUB socket, and a ROUTER that replays."""

    def __init__(self, config: SimConfig, clock: Callable[[], float] = time.time) -> None:
        """clock: the batches' `ts` (vLLM's is time.time())."""
        if config.kv_events_endpoint is None:
            raise ValueError("KvEventPublisher needs config.kv_events_endpoint")
        self._config = config
        self._clock = clock
        self._topic = config.kv_events_topic.encode()
        self._lora_ids = {name: i for i, name in enumerate(config.lora_adapters, 1)}
        self._outbox = self._new_outbox()
        self._context: zmq.asyncio.Context | None = None
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replaying: asyncio.Task[None] | None = None
        self.endpoint: str | None = None  # the PUB socket's bound address, once open
        self.replay_endpoint: str | None = None  # the ROUTER's, when replay is on
        self.rejected = 0  # malformed replay requests
        self.unsent = 0  # batches the PUB socket refused

    def __repr__(self) -> str:
        return (
            f"KvEventPublisher(endpoint={self.endpoint!r}, replay={self.replay_endpoint!r}, "
            f"encoding={self._config.kv_events_encoding!r}, {self._outbox!r}, "
            f"rejected={self.rejected}, unsent={self.unsent})"
        )

    def _new_outbox(self) -> Outbox:
        return Outbox(self._config.kv_events_buffer_steps, self._config.kv_events_drop_every)

    @property
    def is_open(self) -> bool:
        return self._pub is not None

    @property
    def next_seq(self) -> int:
        """The seq the next batch gets: how many were published (sent or lost) since open."""
        return self._outbox.next_seq

    async def open(self, host: str) -> None:
        """Bind the sockets (host: the instance's address, for an endpoint's `*`); numbering
        starts again from 0, as at an engine's start."""
        if self._context is not None:
            raise RuntimeError("KV event publisher already open")
        config = self._config
        assert config.kv_events_endpoint is not None
        self._outbox = self._new_outbox()
        self._context = zmq.asyncio.Context()
        try:
            self._pub = self._context.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, _PUB_HWM)
            self.endpoint = _bind(self._pub, config.kv_events_endpoint, host)
            if config.kv_events_replay_endpoint is not None:
                self._router = self._context.socket(zmq.ROUTER)
                self.replay_endpoint = _bind(self._router, config.kv_events_replay_endpoint, host)
                self._replaying = asyncio.get_running_loop().create_task(
                    self._serve_replay(self._router)
                )
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop replaying and close the sockets at once (nothing lingers); idempotent."""
        task, self._replaying = self._replaying, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        for socket in (self._pub, self._router):
            if socket is not None:
                socket.close(linger=0)
        self._pub = self._router = None
        self.endpoint = self.replay_endpoint = None
        context, self._context = self._context, None
        if context is not None:
            context.term()

    def silence(self) -> None:
        """Publish nothing more until closed: no batch is sent, numbered or kept (replay still
        answers with what was kept before)."""
        self._outbox.silent = True

    async def publish(self, events: Sequence[CacheEvent]) -> None:
        """Publish one engine step's events as one batch (nothing when closed or silent)."""
        if self._pub is None or not events:
            return
        config = self._config
        payload = encode_batch(events, self._clock(), config.kv_events_encoding, self._lora_ids)
        seq = self._outbox.add(payload)
        if seq is None:
            return
        try:
            await self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError:
            # As vLLM's publisher thread does, go on: the batch is kept for replay, and the
            # engine's step loop must not die of it.
            self.unsent += 1

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            request = replay_request(await router.recv_multipart())
            if request is None:
                self.rejected += 1
                continue
            client, start = request
            for seq, payload in self._outbox.since(start):
                await router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            await router.send_multipart((client, b"", END_SEQ, b""))
