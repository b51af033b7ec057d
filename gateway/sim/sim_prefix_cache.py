"""vLLM's automatic prefix cache, as the simulator models it: chained block hashes and an LRU.

After vLLM's v1 design (docs.vllm.ai, design/prefix_caching; `vllm/v1/core/kv_cache_utils.py`
and `kv_cache_manager.py`):

- A prompt's token ids are cut into full blocks of `block_size` tokens (vLLM's default 16);
  a trailing partial block is never cached. Each block's hash covers its own tokens and its
  parent block's hash, so a block hash names the whole prefix up to the block's end.
- A request's cache hit is the longest run of leading blocks whose hashes are cached, capped
  at `prompt - 1` tokens (`max_cache_hit_length = num_tokens - 1`): the last prompt token is
  always computed, for its logits, so a fully cached prompt still prefills its last block.
- vLLM counts, per lookup, the prompt's tokens as queries and the hit's tokens as hits
  (`vllm:prefix_cache_queries` / `vllm:prefix_cache_hits`, counters in tokens).
- Freed blocks join an LRU free queue in reverse order, so a request's tail blocks are
  evicted before its head blocks: a shared prefix outlives the suffixes that followed it.
- A block's hash also covers its "extra keys" (`generate_block_hash_extra_keys`): the LoRA
  adapter's name on every block, the request's `cache_salt` on its first block only, so an
  adapter or a salt never shares a block with another.
- With KV cache events on (sim_kv_events.py), the block pool reports what changed
  (`vllm/v1/core/block_pool.py`): the blocks a request newly caches, as one `Stored` run of
  consecutive blocks; each evicted block as its own `Removed`; `Cleared` for a reset. Blocks
  found cached and only touched report nothing. Here `insert` and `clear` return these
  events as values, when the cache was made with `events=True` (else nothing, at no cost).

Since a block's ancestors are touched whenever it is, they are always more recently used
than it, and so evicted after it: what the cache holds of a chain is always a prefix of it,
and the blocks one insert adds are always its chain's next ones.

Simplification: the cache is a separate pool of `capacity` blocks; vLLM's pool also holds
the running requests' blocks and never evicts one in use. A chain longer than the pool here
evicts its own tail in the insert that stores it (its events: Stored, then Removed).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

# Seed of the first block's parent hash (vLLM uses a random or PYTHONHASHSEED-derived one;
# a constant keeps runs reproducible). Python's hash of a tuple of ints is not salted.
_ROOT_HASH = 0x5EED


@dataclass(frozen=True)
class BlockKeys:
    """What vLLM hashes into a prompt's blocks besides their tokens and parent (its extra keys)."""

    lora_name: str | None = None  # the adapter that serves the request: on every block
    cache_salt: str | None = None  # the request's `cache_salt`: on the first block only

    def of_block(self, index: int) -> tuple[str, ...] | None:
        """Block `index`'s extra keys as vLLM reports them; None where there are none."""
        keys = (self.lora_name,) if self.lora_name else ()
        if index == 0 and self.cache_salt:
            keys = (*keys, self.cache_salt)
        return keys or None


NO_KEYS = BlockKeys()


def _stable(text: str) -> int:
    # Python's hash of a str is salted per process; a digest keeps runs reproducible.
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def block_hashes(token_ids: Sequence[int], block_size: int, keys: BlockKeys = NO_KEYS) -> list[int]:
    """Chained hashes of the full blocks of token_ids: hash i covers tokens [0, (i+1)*size)
    and the extra keys of blocks 0..i."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    lora = (_stable(keys.lora_name),) if keys.lora_name else ()
    salt = (_stable(keys.cache_salt),) if keys.cache_salt else ()
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        extra = (*lora, *salt) if start == 0 else lora
        parent = hash((parent, *token_ids[start : start + block_size], *extra))
        hashes.append(parent)
    return hashes


@dataclass(frozen=True)
class Stored:
    """Consecutive blocks of one chain newly cached (vLLM's BlockStored)."""

    block_hashes: tuple[int, ...]
    parent: int | None  # the hash of the block before the first; None: the prompt's first
    token_ids: tuple[int, ...]  # the blocks' tokens, block_size of them per block
    block_size: int
    extra_keys: tuple[tuple[str, ...] | None, ...]  # one per block
    lora_name: str | None = None


@dataclass(frozen=True)
class Removed:
    """One cached block evicted (vLLM's BlockRemoved, one per block as its pool sends it)."""

    block_hash: int


@dataclass(frozen=True)
class Cleared:
    """The whole cache emptied (vLLM's AllBlocksCleared, after /reset_prefix_cache)."""


CacheEvent = Stored | Removed | Cleared


class PrefixCache:
    """An LRU set of block hashes, with vLLM's query/hit counters in tokens."""

    def __init__(self, capacity: int, block_size: int = 16, *, events: bool = False) -> None:
        """events: insert and clear report what changed (vLLM's KV cache events)."""
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity and block_size must be >= 1, got {capacity}, {block_size}")
        self.capacity = capacity
        self.block_size = block_size
        self.events = events
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found cached
        self._blocks: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._blocks

    def __repr__(self) -> str:
        return (
            f"PrefixCache(blocks={len(self._blocks)}/{self.capacity}, "
            f"block_size={self.block_size}, queries={self.queries}, hits={self.hits}, "
            f"events={self.events})"
        )

    def cached_tokens(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Tokens of the prompt's longest cached prefix, capped at prompt - 1; no side effects."""
        limit = max(0, prompt_tokens - 1) // self.block_size
        found = 0
        for block_hash in hashes[:limit]:
            if block_hash not in self._blocks:
                break
            found += 1
        return found * self.block_size

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Count one request's lookup (as vLLM's scheduler does) and return its cached tokens.

        The hit blocks become the most recently used, head last, so that the head is evicted last.
        """
        cached = self.cached_tokens(hashes, prompt_tokens)
        self.queries += prompt_tokens
        self.hits += cached
        self._touch(hashes[: cached // self.block_size])
        return cached

    def insert(
        self, hashes: Sequence[int], token_ids: Sequence[int] = (), keys: BlockKeys = NO_KEYS
    ) -> list[CacheEvent]:
        """Cache computed blocks (a prefix chain); the least recently used go beyond capacity.

        With events on, returns what changed: a `Stored` for the blocks not cached before
        (their tokens taken from token_ids, the prompt's), then a `Removed` per evicted
        block, oldest first.
        """
        events: list[CacheEvent] = []
        # The cache holds a prefix of any chain, so the new blocks are a suffix: walking back
        # from the end costs only as many lookups as there are new blocks.
        first = len(hashes)
        while self.events and first > 0 and hashes[first - 1] not in self._blocks:
            first -= 1
        if first < len(hashes):
            size = self.block_size
            events.append(
                Stored(
                    block_hashes=tuple(hashes[first:]),
                    parent=hashes[first - 1] if first > 0 else None,
                    token_ids=tuple(token_ids[first * size : len(hashes) * size]),
                    block_size=size,
                    extra_keys=tuple(keys.of_block(i) for i in range(first, len(hashes))),
                    lora_name=keys.lora_name,
                )
            )
        self._touch(hashes)
        while len(self._blocks) > self.capacity:
            evicted, _ = self._blocks.popitem(last=False)
            if self.events:
                events.append(Removed(evicted))
        return events

    def clear(self) -> list[CacheEvent]:
        """Empty the cache (vLLM's reset_prefix_cache); the counters keep counting."""
        self._blocks.clear()
        return [Cleared()] if self.events else []

    def _touch(self, hashes: Sequence[int]) -> None:
        # Reverse order: a chain's head ends up most recent, as vLLM frees blocks tail first.
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)


def blocks_for_tokens(tokens: int, block_size: int = 16) -> int:
    """Cache capacity in blocks that holds `tokens` tokens of KV cache."""
    return max(0, tokens) // block_size
