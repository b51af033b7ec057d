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

Simplification: the cache is a separate pool of `capacity` blocks; vLLM's pool also holds
the running requests' blocks and never evicts one in use.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

# Seed of the first block's parent hash (vLLM uses a random or PYTHONHASHSEED-derived one;
# a constant keeps runs reproducible). Python's hash of a tuple of ints is not salted.
_ROOT_HASH = 0x5EED


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of token_ids: hash i covers tokens [0, (i+1)*size)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[int] = []
    parent = _ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        hashes.append(parent)
    return hashes


class PrefixCache:
    """An LRU set of block hashes, with vLLM's query/hit counters in tokens."""

    def __init__(self, capacity: int, block_size: int = 16) -> None:
        if capacity < 1 or block_size < 1:
            raise ValueError(f"capacity and block_size must be >= 1, got {capacity}, {block_size}")
        self.capacity = capacity
        self.block_size = block_size
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
            f"block_size={self.block_size}, queries={self.queries}, hits={self.hits})"
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

    def insert(self, hashes: Sequence[int]) -> None:
        """Cache computed blocks (a prefix chain); the least recently used go beyond capacity."""
        self._touch(hashes)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def _touch(self, hashes: Sequence[int]) -> None:
        # Reverse order: a chain's head ends up most recent, as vLLM frees blocks tail first.
        for block_hash in reversed(hashes):
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)


def blocks_for_tokens(tokens: int, block_size: int = 16) -> int:
    """Cache capacity in blocks that holds `tokens` tokens of KV cache."""
    return max(0, tokens) // block_size
