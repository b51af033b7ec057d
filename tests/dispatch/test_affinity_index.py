"""Prefix affinity in the pure core, the parts below the scheduler: the prefix index and how
a prompt becomes text and blocks."""

from __future__ import annotations

import random

from _affinity_helpers import make, text, tk
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import InstanceSpec, InstanceState
from gateway.dispatch.affinity import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    PrefixIndex,
    prompt_blocks,
    prompt_text,
)

SMALL_BLOCK = 4  # bytes: tiny blocks make shared prefixes and evictions common


def held(index: PrefixIndex, block: int) -> bool:
    """Whether `index` holds `block` (a one-block chain matches iff it is held)."""
    return index.match((block,)) == 1


# Prompts built from a few 4-byte pieces share prefixes of every length.
pieces = st.sampled_from([b"aaaa", b"bbbb", b"cccc"])
chains = st.lists(pieces, min_size=0, max_size=8).map(b"".join)


# ------------------------------------------------------------------ the index


@given(st.binary(max_size=4 * BLOCK_BYTES), st.integers(1, 64))
def test_match_after_insert_is_the_full_length(prompt: bytes, capacity: int) -> None:
    """A prompt just inserted matches all its blocks, as far as the capacity holds them."""
    index = PrefixIndex(capacity)
    blocks = prompt_blocks(prompt)
    index.insert(blocks)
    assert index.match(blocks) == min(len(blocks), capacity)
    assert len(index) <= capacity


@given(st.binary(min_size=BLOCK_BYTES, max_size=3 * BLOCK_BYTES), st.integers(0, BLOCK_BYTES - 1))
def test_a_different_first_block_matches_nothing(prompt: bytes, at: int) -> None:
    """Two prompts that differ in their first block share no block: the hashes chain."""
    other = bytearray(prompt)
    other[at] ^= 0xFF
    index = PrefixIndex()
    index.insert(prompt_blocks(prompt))
    assert index.match(prompt_blocks(bytes(other))) == 0


@settings(max_examples=300)
@given(st.lists(chains, max_size=30), st.integers(1, 12), chains)
def test_blocks_held_along_a_chain_are_a_leading_run(
    inserted: list[bytes], capacity: int, probe: bytes
) -> None:
    """After any inserts, a chain's held blocks are a leading run, so binary search is exact."""
    index = PrefixIndex(capacity)
    for prompt in inserted:
        index.insert(prompt_blocks(prompt, SMALL_BLOCK))
        assert len(index) <= capacity
    for prompt in [*inserted, probe]:
        blocks = prompt_blocks(prompt, SMALL_BLOCK)
        present = [held(index, b) for b in blocks]
        run = present.index(False) if False in present else len(present)
        assert not any(present[run:]), present  # nothing held past the first gap
        assert index.match(blocks) == run


@given(chains, st.lists(chains, min_size=1, max_size=10), st.integers(1, 12))
def test_an_evicted_prefix_is_gone_after_capacity_of_other_blocks(
    prompt: bytes, others: list[bytes], capacity: int
) -> None:
    """Once `capacity` other blocks went in after a prompt, none of its blocks is left."""
    index = PrefixIndex(capacity)
    mine = prompt_blocks(prompt, SMALL_BLOCK)
    index.insert(mine)
    # Others that start with a different piece share no block with `prompt`.
    foreign = [b"dddd" + o for o in others]
    fresh = {b for o in foreign for b in prompt_blocks(o, SMALL_BLOCK)}
    for other in foreign:
        index.insert(prompt_blocks(other, SMALL_BLOCK))
    if len(fresh) >= capacity:
        assert index.match(mine) == 0
        assert not any(held(index, b) for b in mine)


@given(
    st.lists(st.binary(max_size=3 * BLOCK_BYTES), max_size=6),
    st.binary(max_size=6 * BLOCK_BYTES),
    st.integers(0, 10_000),
)
def test_estimates_never_exceed_the_prompt(sent: list[bytes], prompt: bytes, tokens: int) -> None:
    """The cached estimate is at most the prompt's tokens (whatever the token count says)."""
    state = InstanceState(InstanceSpec("a"))
    for other in [*sent, prompt]:
        state.cache.insert(prompt_blocks(other))
    ticket = tk(1, prompt, tokens=tokens)
    cached = state.cached_tokens(ticket)
    assert 0 <= cached <= tokens
    assert cached <= len(ticket.prefix) * BLOCK_TOKENS


@given(st.lists(st.integers(1, 6), min_size=1, max_size=20), st.integers(0, 3))
def test_uncached_work_is_never_negative(sizes: list[int], seed: int) -> None:
    """Through the scheduler, prefill work left on an instance never goes below zero."""
    sched = make("a", "b")
    rng = random.Random(seed)
    shared = text(seed, 2 * BLOCK_BYTES)
    for i, size in enumerate(sizes):
        # The token count may undercount the text: the estimate must still not exceed it.
        sched.submit(tk(i, shared + text(i, size * 100), tokens=size), 0.0, rng)
        for state in sched.instances.states:
            assert state.pending_prefill_tokens >= 0
    for i in range(len(sizes)):
        sched.prefill_done(i, 1.0, rng)
    assert [s.pending_prefill_tokens for s in sched.instances.states] == [0, 0]


# ------------------------------------------------------------------ prompt text


def test_chat_prompt_text_puts_roles_and_contents_in_order() -> None:
    """A chat's prompt text holds each message's role then content, in message order."""
    payload = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Hello"}]},
            {"role": "assistant", "content": "Hi."},
        ]
    }
    got = prompt_text(payload)
    order = [b"system", b"You are terse.", b"user", b"Hello", b"assistant", b"Hi."]
    positions = [got.find(part) for part in order]
    assert -1 not in positions
    assert positions == sorted(positions)
    swapped = {"messages": [{**m, "role": "user"} for m in payload["messages"]]}
    assert prompt_text(swapped) != got  # the roles are part of what the instance sees


@given(
    st.lists(st.text(max_size=300), min_size=1, max_size=4),
    st.text(max_size=300),
    st.text(max_size=300),
)
def test_chats_sharing_their_first_messages_share_leading_blocks(
    history: list[str], reply: str, question: str
) -> None:
    """A chat that re-sends another's messages and adds some keeps all its full blocks."""
    first = [{"role": "user" if i % 2 else "system", "content": c} for i, c in enumerate(history)]
    later = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": question}]
    before = prompt_blocks(prompt_text({"messages": first}))
    after = prompt_blocks(prompt_text({"messages": later}))
    assert after[: len(before)] == before
    index = PrefixIndex()
    index.insert(before)
    assert index.match(after) == len(before)


def test_chats_with_one_long_system_prompt_share_its_blocks() -> None:
    """Two chats with the same long system prompt and different questions share its blocks."""
    system = {"role": "system", "content": "Answer from the manual. " * 200}
    one = prompt_blocks(prompt_text({"messages": [system, {"role": "user", "content": "a?"}]}))
    two = prompt_blocks(prompt_text({"messages": [system, {"role": "user", "content": "b?"}]}))
    full_system_blocks = len(str(system["content"])) // BLOCK_BYTES
    assert full_system_blocks >= 15
    index = PrefixIndex()
    index.insert(one)
    assert index.match(two) >= full_system_blocks


json_scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5)


@given(st.integers(), st.lists(json_scalars | st.lists(json_scalars, max_size=2), max_size=6))
def test_a_token_id_prompt_of_any_values_never_raises(first: int, rest: list[object]) -> None:
    """Token ids out of 32-bit range or not ints at all give no prompt text, not an error."""
    prompt = [first, *rest]
    got = prompt_text({"prompt": prompt})
    if all(isinstance(t, int) and -(2**31) <= t < 2**31 for t in prompt):
        assert len(got) == 4 * len(prompt)
    else:
        assert got == b""


@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=200))
def test_token_id_prompts_are_four_little_endian_bytes_each(ids: list[int]) -> None:
    """Valid token ids hash as 4 little-endian bytes each, the same on every replica."""
    expected = b"".join(t.to_bytes(4, "little", signed=True) for t in ids)
    assert prompt_text({"prompt": ids}) == expected
