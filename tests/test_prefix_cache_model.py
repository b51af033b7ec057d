"""Pure tests of the simulator's prefix-cache model: chained block hashes and the LRU."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sim.sim_engine import SimConfig
from gateway.sim.sim_prefix_cache import PrefixCache, block_hashes, blocks_for_tokens

BS = 4  # a small block size keeps the examples short
tokens = st.lists(st.integers(0, 31999), min_size=0, max_size=80)


def test_hashes_cover_full_blocks_only() -> None:
    """Only full blocks are hashed: 35 tokens in blocks of 16 give two hashes."""
    assert len(block_hashes(list(range(35)), 16)) == 2
    assert block_hashes(list(range(15)), 16) == []
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], 0)


@given(tokens.filter(lambda t: len(t) >= BS), st.data())
def test_hash_chains_over_the_prefix(ids: list[int], data: st.DataObject) -> None:
    """Changing one token changes its block's hash and every later one, never an earlier one."""
    at = data.draw(st.integers(0, len(ids) - 1))
    changed = [*ids[:at], ids[at] + 1, *ids[at + 1 :]]
    before, after = block_hashes(ids, BS), block_hashes(changed, BS)
    first = at // BS
    assert before[:first] == after[:first]
    assert all(b != a for b, a in zip(before[first:], after[first:], strict=True))


def test_a_different_first_block_breaks_the_chain() -> None:
    """Prompts that differ only in their first block share no block hash at all."""
    ids = list(range(100, 164))
    other = [7, *ids[1:]]
    assert not set(block_hashes(ids, 16)) & set(block_hashes(other, 16))


@given(st.lists(tokens, max_size=6), tokens, st.integers(1, 40))
def test_hits_never_exceed_the_prompt(history: list[list[int]], ids: list[int], cap: int) -> None:
    """A hit is whole blocks, at most prompt - 1 tokens, and counters add up per lookup."""
    cache = PrefixCache(cap, BS)
    for past in history:
        cache.insert(block_hashes(past, BS))
        assert len(cache) <= cap
    queries, hits = cache.queries, cache.hits
    hit = cache.lookup(block_hashes(ids, BS), len(ids))
    assert 0 <= hit <= max(0, len(ids) - 1)
    assert hit % BS == 0
    assert cache.queries == queries + len(ids)
    assert cache.hits == hits + hit


@given(tokens, st.lists(tokens, max_size=5), st.integers(1, 60))
def test_a_prompt_hits_after_insertion_unless_evicted(
    ids: list[int], later: list[list[int]], cap: int
) -> None:
    """Once cached, a prompt hits all but its last token while nothing has evicted it."""
    cache = PrefixCache(cap, BS)
    own = block_hashes(ids, BS)
    cache.insert(own)
    added = set()
    for other in later:
        hashes = block_hashes(other, BS)
        cache.insert(hashes)
        added |= set(hashes) - set(own)
    if len(set(own)) + len(added) <= cap:
        assert cache.lookup(own, len(ids)) == (max(0, len(ids) - 1) // BS) * BS


def test_lru_evicts_the_least_recent_prompt_tail_first() -> None:
    """Beyond capacity the least recently used prompt goes, its tail blocks before its head."""
    cache = PrefixCache(12, BS)
    old, new = list(range(40)), list(range(1000, 1020))  # 10 blocks, then 5
    cache.insert(block_hashes(old, BS))
    cache.insert(block_hashes(new, BS))
    # 15 blocks for 12 places: the old prompt's last three blocks are gone, its head stays.
    assert cache.cached_tokens(block_hashes(old, BS), 41) == 7 * BS
    assert cache.cached_tokens(block_hashes(new, BS), 21) == 5 * BS
    assert "blocks=12/12" in repr(cache)


def test_a_lookup_refreshes_a_prefix() -> None:
    """A hit makes its blocks the most recently used, so the other prompt is evicted instead."""
    cache = PrefixCache(10, BS)
    a, b, c = list(range(20)), list(range(100, 120)), list(range(200, 220))  # 5 blocks each
    cache.insert(block_hashes(a, BS))
    cache.insert(block_hashes(b, BS))
    assert cache.lookup(block_hashes(a, BS), 21) == 20
    cache.insert(block_hashes(c, BS))
    assert cache.cached_tokens(block_hashes(a, BS), 21) == 20
    assert cache.cached_tokens(block_hashes(b, BS), 21) == 0


def test_config_is_off_by_default_and_validated() -> None:
    """The prefix cache is off unless given blocks; negative sizes are refused."""
    assert not SimConfig().prefix_caching
    assert SimConfig(prefix_cache_blocks=blocks_for_tokens(64_000)).prefix_cache_blocks == 4000
    with pytest.raises(ValueError, match="prefix_cache_blocks"):
        SimConfig(prefix_cache_blocks=-1)
    with pytest.raises(ValueError, match="block_size"):
        SimConfig(block_size=0)
    with pytest.raises(ValueError, match="capacity"):
        PrefixCache(0)
