"""vLLM's NixlConnector, as the simulator models it: prefill/decode disaggregation.

After vLLM's v1 connector (`vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py`,
`NixlConnectorScheduler`), every instance started with
`--kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'` acts per request
on the `kv_transfer_params` of its body:

- A prefill leg carries `{"do_remote_decode": true, ...}`. The proxy sends it with
  max_tokens 1. When it finishes by length, the instance keeps the prompt's full KV blocks
  for a decode instance instead of freeing them, and answers (non-streamed) with params that
  name them: `{"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids",
  "remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size"}`. A
  prompt shorter than one block gives an empty list and holds nothing.
- It frees the held blocks once a decode instance has read them, or after
  VLLM_NIXL_ABORT_REQUEST_TIMEOUT seconds (480 by default) if none does.
- A decode leg is the client's body with those params copied in. The decode instance reads
  the blocks (the transfer), prefills only the rest of the prompt (at least its last token,
  whose logits it needs), then decodes as usual. Params it cannot use (malformed, an engine
  it cannot reach, blocks no longer held) make it prefill the whole prompt itself, silently.

What the simulator puts in place of the hardware:

- The network is a registry of connectors by engine id (`KvRegistry`; `SimInstance` uses the
  process's one, registering at start and leaving at stop). A decode instance reaches a
  prefill instance only inside one process, as the instances of one `gateway.sim.sim_fleet` are.
  A stopped instance has left the registry, so params naming it are unusable.
- A transfer takes blocks x block_size x kv_bytes_per_token / kv_link_bytes_per_s seconds of
  the decode instance's link; it is not scaled by the card's `speed`.
- Expiry is checked lazily, against a clock, whenever the holds are looked at (a decode
  leg's lookup, kv_cache_usage, /metrics): no timer task, and a test with a fake clock is
  deterministic.
- Block ids come from a counter per instance, so they are unique on it and the same in every
  run of the same requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .sim_engine import ApiError, SimConfig, SimStats


def request_params(body: Mapping[str, Any]) -> dict[str, Any] | None:
    """A request's kv_transfer_params: None when absent or null; a 400 when not an object,
    as vLLM's request model (`dict[str, Any] | None`) answers it."""
    params = body.get("kv_transfer_params")
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ApiError(400, "kv_transfer_params: Input should be a valid dictionary")
    return params


def wants_remote_decode(params: Mapping[str, Any]) -> bool:
    """A prefill leg: this instance computes the prompt and keeps its KV for another."""
    return bool(params.get("do_remote_decode")) and not params.get("do_remote_prefill")


def wants_remote_prefill(params: Mapping[str, Any]) -> bool:
    """A decode leg: the prompt's KV is to be read from the instance the params name."""
    return bool(params.get("do_remote_prefill"))


@dataclass
class _Hold:
    block_ids: tuple[int, ...]
    expires: float
    reading: bool = False  # a decode instance is reading it: it no longer expires


@dataclass(frozen=True)
class Transfer:
    """A decode leg's read of a prefill instance's held blocks, decided before it is waited."""

    producer: KvConnector
    request_id: str
    blocks: int
    tokens: int  # prompt tokens the blocks hold
    seconds: float  # how long the read takes on the consumer's link


class KvRegistry:
    """The connectors reachable by engine id: the simulator's stand-in for the network."""

    def __init__(self) -> None:
        self._connectors: dict[str, KvConnector] = {}

    def __repr__(self) -> str:
        return f"KvRegistry(engines={sorted(self._connectors)})"

    def add(self, connector: KvConnector) -> None:
        if connector.engine_id is None:
            raise ValueError("an unbound connector has no engine id")
        self._connectors[connector.engine_id] = connector

    def remove(self, engine_id: str) -> None:
        self._connectors.pop(engine_id, None)

    def get(self, engine_id: str) -> KvConnector | None:
        return self._connectors.get(engine_id)


# The process's registry. Process-wide on purpose: it stands for the network between the
# instances of one fleet, which are created independently of one another.
PROCESS_REGISTRY = KvRegistry()


class KvConnector:
    """One instance's NixlConnector in the kv_both role: producer and consumer of KV blocks."""

    def __init__(
        self,
        config: SimConfig,
        stats: SimStats,
        registry: KvRegistry = PROCESS_REGISTRY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._stats = stats
        self._registry = registry
        self._clock = clock
        self.engine_id: str | None = None
        self.host = ""
        self.port = 0
        self._holds: dict[str, _Hold] = {}
        self._next_block = 0

    def __repr__(self) -> str:
        return (
            f"KvConnector(engine_id={self.engine_id!r}, holds={len(self._holds)}, "
            f"blocks_held={sum(len(h.block_ids) for h in self._holds.values())})"
        )

    # --- lifetime ---------------------------------------------------------------------------

    def bind(self, host: str, port: int) -> None:
        """Become reachable at host:port (the instance's own address stands for NIXL's side
        channel); the engine id names the address, so it is unique among live instances."""
        self.unbind()
        self.host, self.port = host, port
        self.engine_id = f"sim-{host}:{port}"
        self._registry.add(self)

    def unbind(self) -> None:
        """Leave the registry and drop every hold: a stopped instance's KV cache is gone."""
        if self.engine_id is not None:
            self._registry.remove(self.engine_id)
        self.engine_id = None
        self._holds.clear()
        self._stats.kv_blocks_held = 0

    # --- producer ---------------------------------------------------------------------------

    def blocks_held(self) -> int:
        """Blocks held for decode instances now, after freeing the expired ones."""
        now = self._clock()
        expired = [rid for rid, h in self._holds.items() if not h.reading and h.expires <= now]
        for request_id in expired:
            self._stats.kv_blocks_expired += len(self._holds.pop(request_id).block_ids)
        held = sum(len(h.block_ids) for h in self._holds.values())
        self._stats.kv_blocks_held = held
        return held

    def held_tokens(self) -> int:
        """KV tokens the held blocks take, for the engine's kv_cache_usage."""
        return self.blocks_held() * self.config.block_size

    def produce(self, request_id: str, prompt_tokens: int) -> dict[str, Any]:
        """A prefill leg finished: hold its prompt's full blocks, and return the params the
        answer carries. A later prefill under the same id replaces the earlier hold."""
        if self.engine_id is None:
            raise RuntimeError("the connector is not bound to an address")
        blocks = max(0, prompt_tokens) // self.config.block_size
        block_ids = tuple(range(self._next_block, self._next_block + blocks))
        self._next_block += blocks
        self._holds.pop(request_id, None)
        if block_ids:
            expires = self._clock() + self.config.kv_hold_timeout_s
            self._holds[request_id] = _Hold(block_ids, expires)
        self._stats.kv_produced += 1
        self.blocks_held()
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(block_ids),
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "tp_size": 1,
        }

    def _lend(self, request_id: str, block_ids: list[int]) -> bool:
        """Start a decode instance's read of a hold; False when it is not held (any more)."""
        self.blocks_held()
        hold = self._holds.get(request_id)
        if hold is None or hold.reading or list(hold.block_ids) != block_ids:
            return False
        hold.reading = True
        return True

    def _free(self, request_id: str) -> bool:
        """The read is over (done or abandoned): free the blocks. False if they were gone."""
        freed = self._holds.pop(request_id, None) is not None
        self.blocks_held()
        return freed

    # --- consumer ---------------------------------------------------------------------------

    def claim(self, params: Mapping[str, Any]) -> Transfer | None:
        """Decide a decode leg's transfer from its params; None (counted as a fallback to a
        local prefill) when they are malformed, name no live instance, or blocks not held."""
        transfer = self._claim(params)
        if transfer is None:
            self._stats.kv_fallbacks += 1
        return transfer

    def _claim(self, params: Mapping[str, Any]) -> Transfer | None:
        engine_id, request_id = params.get("remote_engine_id"), params.get("remote_request_id")
        host, port = params.get("remote_host"), params.get("remote_port")
        block_ids = params.get("remote_block_ids")
        if params.get("do_remote_prefill") is not True:
            return None
        if not isinstance(engine_id, str) or not isinstance(request_id, str):
            return None
        if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool):
            return None
        if not isinstance(block_ids, list) or not all(
            isinstance(b, int) and not isinstance(b, bool) for b in block_ids
        ):
            return None
        producer = self._registry.get(engine_id)
        # vLLM's handshake goes to remote_host:remote_port and checks the engine id it finds.
        if producer is None or (producer.host, producer.port) != (host, port):
            return None
        if block_ids and not producer._lend(request_id, block_ids):
            return None
        tokens = len(block_ids) * self.config.block_size
        seconds = tokens * self.config.kv_bytes_per_token / self.config.kv_link_bytes_per_s
        return Transfer(producer, request_id, len(block_ids), tokens, seconds)

    async def receive(self, params: Mapping[str, Any], *, wait: bool = True) -> int:
        """Read a decode leg's prompt KV; the prompt tokens it holds (0: prefill it all here).

        The producer frees the blocks when the read ends, also when the client leaves during
        it (vLLM's decode side then still tells the producer to free them). wait=False skips
        the transfer time (the simulator's instant mode).
        """
        transfer = self.claim(params)
        if transfer is None:
            return 0
        try:
            if wait and transfer.blocks:
                await asyncio.sleep(transfer.seconds)
        finally:
            read = not transfer.blocks or transfer.producer._free(transfer.request_id)
        if not read:  # the producer stopped during the read
            self._stats.kv_fallbacks += 1
            return 0
        self._stats.kv_transfers += 1
        return transfer.tokens
