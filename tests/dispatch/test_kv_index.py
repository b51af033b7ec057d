"""The KV events index in the pure core: what the events say is cached, the sequence and
its gaps, staleness, and how the scheduler's cost reads it beside the inferred index."""

from __future__ import annotations

import dataclasses
import random

from _sched_helpers import bring_up, make
from hypothesis import given
from hypothesis import strategies as st

from gateway.dispatch import Assigned, Hop, InstanceSpec, Lane, Outcome, Scheduler, Ticket
from gateway.dispatch.affinity import prompt_blocks
from gateway.dispatch.kv_index import (
    ClearedCache,
    KvIndex,
    KvState,
    RemovedBlocks,
    StoredBlocks,
    chain,
)

BS = 4  # a small block, so prompts stay readable


def engine_hashes(ids: list[int], salt: str | None = None) -> list[int]:
    """An engine's own hashes: anything unique per prefix; not ours (the index must not care)."""
    out, parent = [], 7
    for k in range(len(ids) // BS):
        parent = hash(
            ("engine", parent, tuple(ids[k * BS : (k + 1) * BS]), salt if k == 0 else None)
        )
        out.append(parent)
    return out


def stored(
    ids: list[int], first: int = 0, count: int | None = None, salt: str | None = None
) -> StoredBlocks:
    """The engine stores blocks first..first+count of prompt `ids` (one chain)."""
    hashes = engine_hashes(ids, salt)
    count = len(hashes) - first if count is None else count
    extra = [((salt,) if salt and k == 0 else None) for k in range(first, first + count)]
    return StoredBlocks(
        block_hashes=hashes[first : first + count],
        parent=hashes[first - 1] if first else None,
        token_ids=ids[first * BS : (first + count) * BS],
        block_size=BS,
        extra_keys=extra,
        medium="GPU",
    )


def removed(ids: list[int], blocks: range) -> RemovedBlocks:
    hashes = engine_hashes(ids)
    return RemovedBlocks([hashes[k] for k in blocks], "GPU")


PROMPT = list(range(100, 124))  # 6 blocks


def whole(*events: object, seq: int = 0) -> KvIndex:
    index = KvIndex()
    assert index.arrival(0) == "apply"
    index.apply_batch(0, [], 0.0)
    for n, event in enumerate(events, start=1):
        assert index.arrival(n) == "apply"
        index.apply_batch(n, [event], float(n))  # type: ignore[list-item]
    return index


def test_stored_blocks_match_a_request_of_the_same_tokens_in_several_batches() -> None:
    index = whole(stored(PROMPT, 0, 2), stored(PROMPT, 2, 3))
    assert index.state is KvState.WHOLE
    assert index.match(chain(PROMPT, BS)) == 5
    assert index.match(chain(PROMPT[:8] + [0] * 16, BS)) == 2  # shares two blocks
    assert index.match(chain([1, *PROMPT[1:]], BS)) == 0  # its first block differs


def test_removed_blocks_stop_matching_from_the_first_missing_one() -> None:
    index = whole(stored(PROMPT), removed(PROMPT, range(3, 6)))
    assert index.match(chain(PROMPT, BS)) == 3
    index.apply_batch(3, [removed(PROMPT, range(0, 1))], 3.0)
    # vLLM's lookup stops at the first miss, even if later blocks are still there.
    assert index.match(chain(PROMPT, BS)) == 0
    assert len(index) == 2


def test_a_block_held_in_two_media_stays_until_both_remove_it() -> None:
    cpu = stored(PROMPT)
    cpu = StoredBlocks(cpu.block_hashes, None, cpu.token_ids, BS, cpu.extra_keys, None, "CPU")
    index = whole(stored(PROMPT), cpu, removed(PROMPT, range(6)))
    assert index.match(chain(PROMPT, BS)) == 6
    index.apply_batch(4, [RemovedBlocks(engine_hashes(PROMPT), "CPU")], 4.0)
    assert index.match(chain(PROMPT, BS)) == 0
    assert len(index) == 0


def test_a_cache_salt_and_an_adapter_never_share_blocks() -> None:
    index = whole(stored(PROMPT, salt="tenant-a"))
    assert index.match(chain(PROMPT, BS, cache_salt="tenant-a")) == 6
    assert index.match(chain(PROMPT, BS)) == 0
    assert index.match(chain(PROMPT, BS, cache_salt="tenant-b")) == 0
    lora = StoredBlocks(
        engine_hashes(PROMPT, "x"), None, PROMPT, BS, [("sql",)] * 6, lora_name="sql"
    )
    index.apply_batch(2, [lora], 2.0)
    assert index.adapters == {"sql"}
    assert index.match(chain(PROMPT, BS, lora_name="sql")) == 6
    # An older engine sends no extra keys: its adapter's name keeps it apart all the same.
    old = whole(StoredBlocks(engine_hashes(PROMPT, "y"), None, PROMPT, BS, lora_name="sql"))
    assert old.match(chain(PROMPT, BS, lora_name="sql")) == 6
    assert old.match(chain(PROMPT, BS)) == 0


def test_all_blocks_cleared_empties_it_and_makes_it_whole() -> None:
    index = whole(stored(PROMPT))
    index.unreplayed(5)
    assert index.state is KvState.PARTIAL
    index.apply_batch(5, [ClearedCache()], 5.0)
    assert index.state is KvState.WHOLE
    assert len(index) == 0


def test_a_stored_block_whose_parent_was_never_seen_is_skipped_and_counted() -> None:
    index = whole(stored(PROMPT, 2, 2))
    assert len(index) == 0
    assert index.unchained_total == 2


def test_other_kv_cache_groups_are_not_indexed() -> None:
    event = stored(PROMPT)
    other = StoredBlocks(event.block_hashes, None, event.token_ids, BS, group=1)
    index = whole(other)
    assert len(index) == 0


# ------------------------------------------------------------------ the sequence


def test_the_first_batch_at_zero_is_whole_and_a_late_join_asks_a_replay_from_zero() -> None:
    index = KvIndex()
    assert index.state is KvState.WAITING
    assert not index.usable
    assert index.arrival(7) == "replay"
    assert index.replay_from() == 0
    index.gap(replaying=True)
    assert index.gaps_total == 0
    assert index.replays_total == 1
    # The replay brings 0..6: whole.
    for seq in range(7):
        assert index.arrival(seq) == "apply"
        index.apply_batch(seq, [], 0.0)
    assert index.state is KvState.WHOLE
    assert index.next_seq == 7


def test_a_late_join_whose_replay_does_not_reach_zero_is_partial() -> None:
    index = KvIndex()
    index.unreplayed(40)
    index.apply_batch(40, [stored(PROMPT)], 1.0)
    assert index.state is KvState.PARTIAL
    assert index.usable
    assert index.next_seq == 41


def test_a_gap_asks_a_replay_from_the_next_one() -> None:
    index = whole(stored(PROMPT, 0, 1))
    assert index.arrival(5) == "replay"
    assert index.replay_from() == 2
    index.gap(replaying=True)
    assert index.gaps_total == 1
    for seq in (2, 3, 4):
        index.apply_batch(seq, [], 0.0)
    assert index.arrival(5) == "apply"
    assert index.state is KvState.WHOLE


def test_a_lost_gap_empties_a_whole_index_and_keeps_a_partial_ones_blocks() -> None:
    index = whole(stored(PROMPT))
    index.unreplayed(9)
    assert index.state is KvState.PARTIAL
    assert len(index) == 0
    assert index.next_seq == 9
    index.apply_batch(9, [stored(PROMPT)], 9.0)
    index.unreplayed(20)
    assert len(index) == 6  # partial already: what it holds is still surely there


def test_numbering_that_goes_back_is_an_engine_restart() -> None:
    """Its batch 0, or a later one when batch 0 went by before the subscriber reconnected:
    the index starts over (and replays the new engine's start)."""
    for first in (0, 3):
        index = whole(*(stored(PROMPT, k, 1) for k in range(6)))  # next_seq 7
        assert index.arrival(first) == "restart"
        index.restarted()
        assert index.state is KvState.WAITING
        assert len(index) == 0
        assert index.arrival(first) == ("apply" if first == 0 else "replay")
        assert index.replay_from() == 0
        index.apply_batch(0, [], 10.0)
        assert index.state is KvState.WHOLE


def test_a_malformed_batch_is_lost_like_a_gap() -> None:
    index = whole(stored(PROMPT))
    index.malformed(2)
    assert index.state is KvState.PARTIAL
    assert index.next_seq == 3
    assert index.malformed_total == 1


# ------------------------------------------------------------------ staleness


def test_events_owed_for_a_health_interval_make_it_stale_and_one_event_revives_it() -> None:
    index = whole()
    other = list(range(500, 524))
    index.hold(1, chain(other, BS), now=9.0)  # placed: its blocks are not there
    index.computed(1, now=10.0)  # its first token, and no event since it was placed
    assert index.expecting_since == 10.0
    assert not index.check(now=10.9, grace=1.0)
    assert index.check(now=11.0, grace=1.0)
    assert index.state is KvState.STALE
    assert not index.usable
    assert index.stale_total == 1
    assert not index.check(now=20.0, grace=1.0)  # once
    # The next batch in order: the engine was only silent, nothing was missed.
    assert index.arrival(1) == "apply"
    index.apply_batch(1, [stored(PROMPT)], 21.0)
    assert index.state is KvState.WHOLE
    assert index.match(chain(PROMPT, BS)) == 6


def test_a_stale_index_that_then_misses_batches_is_partial_and_emptied() -> None:
    index = whole(stored(PROMPT))
    index.hold(1, chain(list(range(500, 524)), BS), now=9.0)
    index.computed(1, now=10.0)
    assert index.check(now=11.0, grace=1.0)
    assert len(index) == 6  # kept, not trusted
    assert index.arrival(7) == "replay"
    index.unreplayed(7)
    assert index.state is KvState.PARTIAL
    assert len(index) == 0  # it was whole: it cannot say what it missed


def test_an_event_after_the_first_token_pays_what_was_owed() -> None:
    index = whole()
    index.hold(1, chain(PROMPT, BS), now=9.0)
    index.computed(1, now=10.0)
    index.apply_batch(1, [stored(PROMPT)], 10.1)  # it came just after the first token
    assert not index.check(now=30.0, grace=1.0)


def test_nothing_is_owed_for_a_cached_prompt_or_after_an_event_since_placing() -> None:
    index = whole(stored(PROMPT))
    index.hold(1, chain(PROMPT, BS), now=9.0)  # all held: it stores nothing
    index.computed(1, now=10.0)
    assert index.expecting_since is None
    other = list(range(500, 524))
    index.hold(2, chain(other, BS), now=11.0)
    index.apply_batch(2, [stored(other)], 11.5)  # its blocks, before its first token
    index.apply_batch(3, [removed(other, range(6))], 11.6)  # and evicted at once
    index.computed(2, now=12.0)
    assert index.expecting_since is None  # the engine spoke since it was placed
    assert not index.check(now=30.0, grace=1.0)


# ------------------------------------------------------------------ in the scheduler


def kv_ticket(i: int, ids: list[int], text: bytes = b"") -> Ticket:
    return Ticket(
        i,
        Lane.SHORT,
        1e9,
        tokens=len(ids),
        prefix=prompt_blocks(text) if text else (),
        kv_chain=chain(ids, BS),
        kv_block_size=BS,
    )


def scheduler_with_events() -> tuple[Scheduler, random.Random]:
    sched = make(
        InstanceSpec("a", kv_events=True), InstanceSpec("b", kv_events=True), strategy="least_time"
    )
    rng = random.Random(3)
    bring_up(sched, rng)
    return sched, rng


def test_the_cost_reads_an_exact_index_and_not_the_inferred_one() -> None:
    sched, _rng = scheduler_with_events()
    a, b = sched.state("a"), sched.state("b")
    for state in (a, b):
        state.kv.apply_batch(0, [], 0.0)
    long_text = bytes(range(256)) * 8  # 8 inferred blocks
    ids = list(range(64))
    # The gateway sent the prompt to a (inferred: cached there) but a's events say it evicted.
    a.cache.insert(prompt_blocks(long_text))
    ticket = kv_ticket(1, ids, long_text)
    assert a.cached_tokens(ticket) == 0
    b.kv.apply_batch(1, [stored(ids)], 1.0)
    assert b.cached_tokens(ticket) == 64
    assert b.cached_tokens(ticket, settled=True) == 64
    # Partial: the larger of both.
    a.kv.unreplayed(9)
    assert a.cached_tokens(ticket) == min(64, 2 * 64)
    # Another block size, or no chain: the inferred index alone.
    other = Ticket(2, Lane.SHORT, 1e9, tokens=64, prefix=prompt_blocks(long_text))
    assert a.cached_tokens(other) == 64
    assert b.cached_tokens(other) == 0


def test_a_placed_prompt_attracts_its_twin_until_it_is_computed() -> None:
    sched, rng = scheduler_with_events()
    for state in sched.instances.states:
        state.kv.apply_batch(0, [], 0.0)
    ids = list(range(400))
    first = sched.submit(kv_ticket(1, ids), 0.1, rng)
    assert isinstance(first, Assigned)
    home = sched.state(first.instance)
    twin = kv_ticket(2, ids)
    assert home.cached_tokens(twin) == 400  # pending there
    assert home.cached_tokens(twin, settled=True) == 0  # not computed yet
    second = sched.submit(twin, 0.1, rng)
    assert isinstance(second, Assigned)
    assert second.instance == first.instance
    # Its first token came and no event said the blocks are stored: an event is owed.
    sched.prefill_done(1, 0.5, rng)
    assert home.kv.expecting_since == 0.5
    sched.release(1, Outcome.FAILURE, 0.6, rng)
    sched.release(2, Outcome.SUCCESS, 0.7, rng)
    assert home.kv.match_pending(chain(ids, BS)) == 0


def test_the_fleet_says_how_to_chain_a_prompt_once_an_index_is_usable() -> None:
    sched, _rng = scheduler_with_events()
    assert sched.kv_blocks("m") is None
    a = sched.state("a")
    a.kv.apply_batch(0, [StoredBlocks([1], None, [1, 2, 3, 4], BS, lora_name="sql")], 0.0)
    assert sched.kv_blocks("m") == (BS, None)
    assert sched.kv_blocks("sql") == (BS, "sql")
    plain = make("c")
    assert plain.kv_blocks(None) is None
    assert plain.state("c").kv is None


@given(
    st.lists(
        st.tuples(st.sampled_from(["store", "remove"]), st.integers(0, 3), st.integers(1, 6)),
        max_size=40,
    )
)
def test_the_index_is_exactly_the_cache_its_events_describe(
    ops: list[tuple[str, int, int]],
) -> None:
    """Against a plain set of (prompt, block) held: after any stores and removes, each
    prompt matches exactly its leading run of held blocks."""
    prompts = [[p * 1000 + t for t in range(24)] for p in range(4)]
    truth: set[tuple[int, int]] = set()
    index = whole()
    for n, (op, p, upto) in enumerate(ops, start=1):
        if op == "store":
            index.apply_batch(n, [stored(prompts[p], 0, upto)], float(n))
            truth |= {(p, k) for k in range(upto)}
        else:
            index.apply_batch(n, [removed(prompts[p], range(upto - 1, upto))], float(n))
            truth.discard((p, upto - 1))
    for p, ids in enumerate(prompts):
        run = 0
        while (p, run) in truth:
            run += 1
        assert index.match(chain(ids, BS)) == run


def test_a_decode_hop_holds_no_pending_blocks_and_owes_no_event() -> None:
    """It reads its prompt's blocks from the prefill instance: nothing computed there."""
    sched, rng = scheduler_with_events()
    for state in sched.instances.states:
        state.kv.apply_batch(0, [], 0.0)
    ids = list(range(400))
    decode = dataclasses.replace(kv_ticket(1, ids), hop=Hop.DECODE)
    placed = sched.submit(decode, 0.1, rng)
    assert isinstance(placed, Assigned)
    home = sched.state(placed.instance)
    assert home.kv.match_pending(chain(ids, BS)) == 0
    sched.prefill_done(1, 0.5, rng)
    assert home.kv.expecting_since is None
