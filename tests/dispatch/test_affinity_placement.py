"""Prefix affinity in the pure core, as the scheduler uses it: the cost a cached prefix
saves, and how models and queues interact with it."""

from __future__ import annotations

import random

import pytest
from _affinity_helpers import make, text, tk
from hypothesis import given
from hypothesis import strategies as st

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    InstanceState,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Queued,
    Rejected,
    Scheduler,
    Ticket,
)
from gateway.dispatch.affinity import BLOCK_BYTES, BLOCK_TOKENS, prompt_blocks
from gateway.dispatch.least_time import LeastTime


def placed(decision: object) -> str:
    assert isinstance(decision, Assigned), decision
    return decision.instance


# ------------------------------------------------------------------ the cost


def test_a_cached_prefix_attracts_and_an_evicted_one_stops() -> None:
    """least_time prefers where a prefix is cached, and stops once other prompts evicted it."""
    sched = make("a", "b", limits=Limits(prefix_index_blocks=16))
    strategy = sched.strategy
    assert isinstance(strategy, LeastTime)
    rng = random.Random(1)
    prompt = text(0, 8 * BLOCK_BYTES)
    home = placed(sched.submit(tk(0, prompt), 0.0, rng))
    sched.prefill_done(0, 0.0, rng)
    sched.release(0, Outcome.SUCCESS, 0.0, rng)
    for i in range(1, 6):  # the same prompt keeps going home
        assert placed(sched.submit(tk(i, prompt), 0.0, rng)) == home
        sched.prefill_done(i, 0.0, rng)
        sched.release(i, Outcome.SUCCESS, 0.0, rng)
    # Other prompts, each 8 blocks, fill both indexes several times over.
    for i in range(100, 140):
        sched.submit(tk(i, text(i, 8 * BLOCK_BYTES)), 0.0, rng)
        sched.prefill_done(i, 0.0, rng)
        sched.release(i, Outcome.SUCCESS, 0.0, rng)
    assert sched.state(home).cache.match(prompt_blocks(prompt)) == 0
    costs = strategy.costs(sched.instances.states, sched.instances.states, tk(999, prompt), 0.0)
    assert costs["a"] == costs["b"]
    homes = set()
    for seed in range(20):
        homes.add(
            strategy.choose(
                sched.instances.states, sched.instances.states, tk(999, prompt), 0.0, rng
            ).name
        )
        rng = random.Random(seed)
    assert homes == {"a", "b"}


def test_a_hot_prefix_spreads_under_load_with_least_time() -> None:
    """Requests sharing a cached prefix pile on its instance only until the work queued there
    outweighs what the cache saves; then they go elsewhere too."""
    sched = make("a", "b", "c")
    rng = random.Random(2)
    shared = text(0, 4000 * 4)  # a 4,000-token system prompt
    home = placed(sched.submit(tk(0, shared + text(0, 200 * 4)), 0.0, rng))
    sched.prefill_done(0, 0.5, rng)
    sched.release(0, Outcome.SUCCESS, 1.0, rng)
    # A burst: none of these finishes its prefill, so the work queues up where they go.
    where = [placed(sched.submit(tk(i, shared + text(i, 200 * 4)), 1.0, rng)) for i in range(1, 61)]
    assert where[:8] == [home] * 8  # the cache wins while the queue there is short
    assert set(where) == {"a", "b", "c"}  # and then the prefix spreads
    assert where.count(home) < 60 * 0.75
    # Where it spread to, it is cached now too.
    for name in ("a", "b", "c"):
        assert sched.state(name).cache.match(prompt_blocks(shared)) == len(prompt_blocks(shared))


def _two_instances(*, home_pending: int, away_inflight: int) -> tuple[list[InstanceState], bytes]:
    """`home` holds a 4,000-token prefix and has `home_pending` tokens of other prompts in
    prefill; `away` holds nothing and has `away_inflight` short requests in decode."""
    shared = text(0, 4000 * 4)
    home = InstanceState(InstanceSpec("home"), up=True)
    away = InstanceState(InstanceSpec("away"), up=True)
    home.cache.insert(prompt_blocks(shared))
    home.cache.settle(prompt_blocks(shared))
    home.pending_prefill_tokens = home_pending
    home.inflight = 1 if home_pending else 0
    away.inflight = away_inflight
    return [home, away], shared


def test_a_miss_pays_the_prefill_it_adds_for_the_requests_already_there() -> None:
    """A request whose prefix is cached at an instance with a prefill in progress stays
    there rather than recompute the prefix where other requests would wait for it: the miss
    is charged its uncached prefill once more for each request it would stall there."""
    fleet, shared = _two_instances(home_pending=5000, away_inflight=3)
    ticket = tk(1, shared + text(1, 200 * 4))
    costs = LeastTime(30).costs(fleet, fleet, ticket, 0.0)
    rate = LeastTime.PRIOR_PREFILL
    uncached_home = ticket.tokens - fleet[0].cached_tokens(ticket)
    assert costs["home"] == pytest.approx((5000 + 2 * uncached_home) / rate)  # 1 in flight
    assert costs["away"] == pytest.approx((1 + 3) * ticket.tokens / rate)  # 3 in flight
    # Judged on its own first token alone, the 5,000 tokens ahead at home would send it
    # away (5,000 + 264 > 4,200 tokens): the old, greedy choice.
    assert 5000 + uncached_home > ticket.tokens
    assert LeastTime(30).choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "home"


def test_a_prefix_still_spreads_to_an_idle_instance() -> None:
    """An instance with nothing in flight delays nobody: there a miss pays only its own
    prefill, so the same request leaves a busy home for it."""
    fleet, shared = _two_instances(home_pending=5000, away_inflight=0)
    ticket = tk(1, shared + text(1, 200 * 4))
    costs = LeastTime(30).costs(fleet, fleet, ticket, 0.0)
    assert costs["away"] == pytest.approx(ticket.tokens / LeastTime.PRIOR_PREFILL)
    assert LeastTime(30).choose(fleet, fleet, ticket, 0.0, random.Random(0)).name == "away"


@pytest.mark.parametrize("seed", range(10))
def test_least_busy_affinity_decides_ties_but_never_overrides_an_imbalance(seed: int) -> None:
    """least_busy sends a cached prompt home at equal loads, elsewhere when home is busier."""
    sched = make("a", "b", strategy="least_busy")
    rng = random.Random(seed)
    shared = text(0, 2000 * 4)
    home = placed(sched.submit(tk(0, shared + b"q0"), 0.0, rng))
    other = ({"a", "b"} - {home}).pop()
    sched.release(0, Outcome.SUCCESS, 0.0, rng)
    # Equal loads: the cache decides, every time (no coin toss).
    assert placed(sched.submit(tk(1, shared + b"q1"), 0.0, rng)) == home
    # Home now has one more in flight: even a 99%-cached prompt goes elsewhere.
    assert placed(sched.submit(tk(2, shared + b"q2"), 0.0, rng)) == other


def test_learned_prefill_speed_counts_only_uncached_tokens() -> None:
    """A cache hit's fast first token is not read as a fast card: the rate uses uncached tokens."""
    sched = make("a")
    rng = random.Random(4)
    prompt = text(0, 4000 * 4)
    sched.submit(tk(0, prompt), 0.0, rng)
    sched.prefill_done(0, 1.0, rng, ttft=0.8)  # 4,000 tokens in 0.8 s: 5,000 tokens/s
    sched.release(0, Outcome.SUCCESS, 1.0, rng)
    first = sched.state("a").speed.prefill.value
    assert first == 4000 / 0.8
    # The same prompt again: all but a few tokens cached, first token in 10 ms.
    ticket = tk(1, prompt)
    uncached = ticket.tokens - sched.state("a").cached_tokens(ticket)
    assert uncached < BLOCK_TOKENS
    sched.submit(ticket, 2.0, rng)
    sched.prefill_done(1, 2.01, rng, ttft=0.01)
    after = sched.state("a").speed.prefill.value
    assert after is not None
    assert after <= max(first, uncached / 0.01)
    assert after < first  # 4,000 tokens / 10 ms would have read as a 400k tokens/s card


@given(st.floats(0.001, 5.0), st.integers(1, 60))
def test_a_cache_hit_never_raises_the_prefill_rate_past_its_uncached_work(
    ttft: float, prefix_blocks: int
) -> None:
    """Whatever the hit's TTFT, the rate moves toward uncached tokens / TTFT, not the prompt's."""
    sched = make("a")
    rng = random.Random(5)
    prefix = text(0, prefix_blocks * BLOCK_BYTES)
    sched.submit(tk(0, prefix), 0.0, rng)
    sched.prefill_done(0, 1.0, rng, ttft=1.0)
    sched.release(0, Outcome.SUCCESS, 1.0, rng)
    first = sched.state("a").speed.prefill.value
    assert first is not None
    ticket = tk(1, prefix + text(1, 3 * BLOCK_BYTES))
    uncached = ticket.tokens - sched.state("a").cached_tokens(ticket)
    sched.submit(ticket, 2.0, rng)
    sched.prefill_done(1, 2.0 + ttft, rng, ttft=ttft)
    after = sched.state("a").speed.prefill.value
    assert after is not None
    assert min(first, uncached / ttft) - 1e-6 <= after <= max(first, uncached / ttft) + 1e-6


def test_a_long_request_mostly_cached_takes_no_long_place() -> None:
    """A long prompt cached but for a short tail takes no long place; an uncached one waits."""
    limits = Limits(max_long_per_instance=1, long_input_threshold=4096)
    sched = make("a", limits=limits)
    rng = random.Random(6)
    document = text(0, 20_000 * 4)
    assert placed(sched.submit(tk(0, document, lane=Lane.LONG), 0.0, rng)) == "a"
    sched.prefill_done(0, 1.0, rng)  # the document is in a's cache now
    sched.release(0, Outcome.SUCCESS, 2.0, rng)
    # Another long prompt, still in prefill, holds a's one long place.
    assert placed(sched.submit(tk(1, text(1, 20_000 * 4), lane=Lane.LONG), 3.0, rng)) == "a"
    assert sched.state("a").long_prefilling == 1
    # The document with a new 1,000-token question: 1,000 tokens to compute, a short job.
    cheap = tk(2, document + text(2, 1000 * 4), lane=Lane.LONG)
    assert placed(sched.submit(cheap, 3.0, rng)) == "a"
    assert sched.state("a").long_prefilling == 1
    # A different long prompt is real long work: it waits for the place.
    assert isinstance(sched.submit(tk(3, text(3, 20_000 * 4), lane=Lane.LONG), 3.0, rng), Queued)


def test_a_long_request_whose_uncached_tail_is_long_still_takes_a_long_place() -> None:
    """A cached prefix does not exempt a long request whose uncached part is itself long."""
    limits = Limits(max_long_per_instance=1, long_input_threshold=4096)
    sched = make("a", limits=limits)
    rng = random.Random(6)
    document = text(0, 20_000 * 4)
    sched.submit(tk(0, document, lane=Lane.LONG), 0.0, rng)
    sched.prefill_done(0, 1.0, rng)
    sched.release(0, Outcome.SUCCESS, 2.0, rng)
    assert placed(sched.submit(tk(1, text(1, 20_000 * 4), lane=Lane.LONG), 3.0, rng)) == "a"
    tail = tk(2, document + text(2, 5000 * 4), lane=Lane.LONG)
    assert isinstance(sched.submit(tail, 3.0, rng), Queued)


# ------------------------------------------------------------------ models and queues


def test_fifo_is_per_lane_and_model() -> None:
    """A queued model-a request does not hold up model-b; model-a requests keep their order."""
    limits = Limits(max_queue_per_instance=0)
    sched = make(
        InstanceSpec("a", slots=1, models=frozenset({"model-a"})),
        InstanceSpec("b", slots=1, models=frozenset({"model-b"})),
        limits=limits,
    )
    rng = random.Random(7)
    assert placed(sched.submit(tk(1, model="model-a"), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2, model="model-a"), 0.0, rng), Queued)
    third = sched.submit(tk(3, model="model-a"), 0.0, rng)
    assert isinstance(third, Queued)
    assert third.position == 2
    assert placed(sched.submit(tk(4, model="model-b"), 0.0, rng)) == "b"
    [next_a] = sched.release(1, Outcome.SUCCESS, 1.0, rng)
    assert isinstance(next_a, Assigned)
    assert (next_a.ticket.id, next_a.instance) == (2, "a")
    [last_a] = sched.release(2, Outcome.SUCCESS, 2.0, rng)
    assert isinstance(last_a, Assigned)
    assert (last_a.ticket.id, last_a.instance) == (3, "a")


def test_set_models_drains_requests_waiting_for_a_model_that_appeared() -> None:
    """A request queued for a model goes as soon as an idle instance starts listing it."""
    limits = Limits(max_queue_per_instance=0)
    sched = make(InstanceSpec("a", slots=1), InstanceSpec("b", slots=1), limits=limits)
    rng = random.Random(8)
    assert sched.set_models("b", frozenset({"model-b"}), 0.0, rng) == []
    # a's models are not known yet: it may serve model-x, but it is full.
    assert placed(sched.submit(tk(1, model="model-x"), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2, model="model-x"), 0.0, rng), Queued)
    [moved] = sched.set_models("b", frozenset({"model-b", "model-x"}), 1.0, rng)
    assert isinstance(moved, Assigned)
    assert (moved.ticket.id, moved.instance) == (2, "b")


def test_set_models_turns_away_requests_for_a_model_nobody_serves_any_more() -> None:
    """Requests queued for a model that its only instance stops listing are rejected at once."""
    limits = Limits(max_queue_per_instance=0)
    sched = make(InstanceSpec("a", slots=1), limits=limits)
    rng = random.Random(9)
    assert placed(sched.submit(tk(1, model="model-x"), 0.0, rng)) == "a"
    assert isinstance(sched.submit(tk(2, model="model-x"), 0.0, rng), Queued)
    [gone] = sched.set_models("a", frozenset({"model-y"}), 1.0, rng)
    assert isinstance(gone, Rejected)
    assert (gone.ticket.id, gone.reason) == (2, "no_instance")


def test_a_new_model_list_forgets_the_instances_cached_prefixes() -> None:
    """An instance that changed models has a cold cache: its prefix index is emptied."""
    sched = make("a")
    rng = random.Random(10)
    sched.set_models("a", frozenset({"model-a"}), 0.0, rng)
    prompt = text(0, 4 * BLOCK_BYTES)
    sched.submit(tk(1, prompt, model="model-a"), 0.0, rng)
    assert sched.state("a").cache.match(prompt_blocks(prompt)) == 4
    sched.set_models("a", frozenset({"model-a"}), 1.0, rng)  # the same list: nothing changes
    assert sched.state("a").cache.match(prompt_blocks(prompt)) == 4
    sched.set_models("a", frozenset({"model-c"}), 2.0, rng)
    assert len(sched.state("a").cache) == 0


def test_a_burst_sharing_a_long_document_waits_for_the_first_prefill() -> None:
    """Long prompts sharing a document that is still being prefilled each take a long place;
    once the first prefill is done, the rest are cheap there and skip the cap."""
    rng = random.Random(0)
    sched = Scheduler(
        [InstanceSpec("a", slots=64)],
        STRATEGIES["least_time"](30.0),
        Limits(max_long_per_instance=1, long_input_threshold=4096),
    )
    sched.probe("a", True, 0.0, rng)
    document = prompt_blocks(b"d" * 4 * 20_000)  # 20k tokens, the same for all
    tickets = [Ticket(i, Lane.LONG, 1e9, tokens=20_000, prefix=document) for i in (1, 2, 3)]
    assert isinstance(sched.submit(tickets[0], 0.0, rng), Assigned)
    assert isinstance(sched.submit(tickets[1], 0.0, rng), Queued)  # not computed yet
    placed = sched.prefill_done(1, 1.0, rng, ttft=1.0)
    assert [type(d) for d in placed] == [Assigned]  # now cached: no long place needed
    assert isinstance(sched.submit(tickets[2], 1.0, rng), Assigned)
    assert sched.state("a").long_prefilling == 0


def test_an_instance_whose_prefix_counters_go_back_restarted_with_a_cold_cache() -> None:
    """vLLM's prefix-cache counters falling between scrapes mean a restart: the index empties."""
    rng = random.Random(0)
    sched = Scheduler([InstanceSpec("a")], STRATEGIES["least_time"](30.0))
    sched.probe("a", True, 0.0, rng)
    blocks = prompt_blocks(b"p" * BLOCK_BYTES * 4)
    sched.submit(Ticket(1, Lane.SHORT, 1e9, tokens=4 * BLOCK_TOKENS, prefix=blocks), 0.0, rng)
    sched.report_load("a", LoadReport(1, 0, 0.1, 1.0, prefix_queries=5000, prefix_hits=100))
    sched.report_load("a", LoadReport(1, 0, 0.1, 2.0, prefix_queries=6000, prefix_hits=900))
    assert sched.state("a").cache.match(blocks) == 4
    sched.report_load("a", LoadReport(0, 0, 0.0, 3.0, prefix_queries=40, prefix_hits=0))
    assert sched.state("a").cache.match(blocks) == 0


def test_the_index_is_sized_from_the_instances_reported_cache() -> None:
    """vllm:cache_config_info's size (tokens) becomes the index's capacity, evicting beyond it;
    prefix caching off makes it 0; an operator's fixed size is left alone."""
    rng = random.Random(0)
    sched = Scheduler([InstanceSpec("a")], STRATEGIES["least_time"](30.0))
    sched.probe("a", True, 0.0, rng)
    blocks = prompt_blocks(b"q" * BLOCK_BYTES * 40)
    sched.submit(Ticket(1, Lane.SHORT, 1e9, tokens=40 * BLOCK_TOKENS, prefix=blocks), 0.0, rng)
    assert len(sched.state("a").cache) == 40
    sched.report_load("a", LoadReport(1, 0, 0.1, 1.0, cache_tokens=10 * BLOCK_TOKENS))
    cache = sched.state("a").cache
    assert (cache.capacity, len(cache)) == (10, 10)
    assert cache.match(blocks) == 10  # the deepest blocks went first: the head stays
    sched.report_load("a", LoadReport(1, 0, 0.1, 2.0, cache_tokens=0))
    assert (cache.capacity, len(cache)) == (0, 0)
    fixed = Scheduler(
        [InstanceSpec("a")],
        STRATEGIES["least_time"](30.0),
        Limits(prefix_index_blocks=500, prefix_index_learned=False),
    )
    fixed.report_load("a", LoadReport(0, 0, 0.0, 1.0, cache_tokens=10 * BLOCK_TOKENS))
    assert fixed.state("a").cache.capacity == 500


def test_a_cached_prefix_is_not_outweighed_by_one_other_request_on_its_instance() -> None:
    """One request of others' traffic where a 4,000-token prefix is cached costs the size of
    this request's uncached tail there, not a whole prompt: the cached instance still wins."""
    rng = random.Random(0)
    sched = Scheduler([InstanceSpec("a"), InstanceSpec("b")], STRATEGIES["least_time"](30.0))
    for name in ("a", "b"):
        sched.probe(name, True, 0.0, rng)
    prefix = b"s" * BLOCK_BYTES * 64  # 64 blocks of 64 tokens: 4,096 tokens
    first = prompt_blocks(prefix + b"one" * 300)
    decision = sched.submit(Ticket(1, Lane.SHORT, 1e9, tokens=4300, prefix=first), 0.0, rng)
    assert isinstance(decision, Assigned)
    placed = decision.instance
    sched.release(1, Outcome.SUCCESS, 0.5, rng)
    other = "b" if placed == "a" else "a"
    sched.report_load(placed, LoadReport(1, 0, 0.1, 1.0))  # one request we did not send
    sched.report_load(other, LoadReport(0, 0, 0.0, 1.0))  # idle
    again = Ticket(2, Lane.SHORT, 1e9, tokens=4300, prefix=prompt_blocks(prefix + b"two" * 300))
    decision = sched.submit(again, 1.0, rng)
    assert isinstance(decision, Assigned)
    assert decision.instance == placed
