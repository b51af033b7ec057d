"""Prefill/decode disaggregation in the core: which hop goes where, whether a request is
split in two, and which prefill instance is predicted to finish first."""

from __future__ import annotations

import random
from dataclasses import replace

from _sched_helpers import FAR, assigned_to, bring_up, make, predicted_wait_of

from gateway.dispatch import (
    Assigned,
    Hop,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Queued,
    Scheduler,
    Ticket,
)
from gateway.dispatch.disaggregation import MIN_SPLIT_TOKENS, fastest_prefill, predicted_prefill

P1, P2, D = (
    InstanceSpec("p1", role="prefill"),
    InstanceSpec("p2", role="prefill"),
    InstanceSpec("d", role="decode"),
)
LIMITS = Limits(long_input_threshold=4096)


def ticket(i: int, tokens: int = 512, hop: Hop = Hop.WHOLE, lane: Lane = Lane.SHORT) -> Ticket:
    return Ticket(i, lane, FAR, tokens=tokens, hop=hop)


def pd_fleet(*specs: InstanceSpec) -> tuple[Scheduler, random.Random]:
    sched = make(*(specs or (P1, P2, D)), limits=LIMITS)
    rng = random.Random(1)
    bring_up(sched, rng)
    return sched, rng


def test_each_hop_goes_only_to_the_roles_that_take_it() -> None:
    sched, rng = pd_fleet(P1, P2, D, InstanceSpec("b"))
    for i in range(8):
        assert assigned_to(sched.submit(ticket(i, hop=Hop.PREFILL), 0.0, rng)) in {"p1", "p2", "b"}
        assert assigned_to(sched.submit(ticket(100 + i, hop=Hop.DECODE), 0.0, rng)) in {"d", "b"}
        # A prompt served whole never lands on a prefill instance: it answers one token.
        assert assigned_to(sched.submit(ticket(200 + i), 0.0, rng)) in {"d", "b"}


def test_a_fleet_without_prefill_instances_never_splits() -> None:
    sched, _ = pd_fleet(InstanceSpec("a"), InstanceSpec("b", role="decode"))
    assert not sched.has_prefill_role
    assert not sched.splits(ticket(1, tokens=100_000), 0.0)


def load(sched: Scheduler, name: str, requests: int) -> None:
    """`requests` of ours in flight on `name` (as placed requests would count)."""
    sched.state(name).inflight = requests


def test_before_any_rate_is_learned_the_comparison_runs_in_tokens() -> None:
    """Two hops cost the prefill instance's queue and the prompt; whole costs the prompt
    for the request and for each at the decode instance (at least the next to come)."""
    sched, _ = pd_fleet()
    assert sched.splits(ticket(1, tokens=512), 0.0)  # 512 < 512 x 2
    for name in ("p1", "p2"):
        sched.state(name).pending_prefill_tokens = 600
    assert not sched.splits(ticket(2, tokens=512), 0.0)  # 1,112 > 1,024
    load(sched, "d", 3)
    assert sched.splits(ticket(3, tokens=512), 0.0)  # 1,112 < 2,048


def test_a_prompt_of_two_blocks_or_less_stays_whole_whatever_the_loads() -> None:
    sched, _ = pd_fleet()
    load(sched, "d", 60)
    assert not sched.splits(ticket(1, tokens=MIN_SPLIT_TOKENS), 0.0)
    assert sched.splits(ticket(2, tokens=MIN_SPLIT_TOKENS + 1), 0.0)


def test_the_stall_on_everything_at_the_decode_instance_outweighs_one_requests_hop() -> None:
    """A 512-token prefill is 0.1 s at 5,000 tokens/s; with the hop at 0.5 ms a token
    (0.256 s), two hops (0.358 s) cost more than the prefill and its stall on two answers
    decoding there (0.307 s; on an idle one, the next to come counts), but less than its
    stall on three (0.41 s)."""
    sched, rng = pd_fleet()
    sched.state("d").speed.observe_prefill(5000, 1.0)
    hop = ticket(2, tokens=1000, hop=Hop.DECODE)
    assert assigned_to(sched.submit(hop, 0.0, rng)) == "d"
    sched.prefill_done(2, 0.5, rng, ttft=0.5)  # no step learned there: all of it moving
    sched.release(2, Outcome.SUCCESS, 0.5, rng)
    for running, splits in ((0, False), (2, False), (3, True), (40, True)):
        load(sched, "d", running)
        assert sched.splits(ticket(3, tokens=512), 0.0) is splits, running
    # ...and that hop taught no prefill rate: it computed no prompt.
    assert sched.state("d").speed.prefill_rate == 5000


def test_a_prompt_cached_on_the_decode_instance_counts_only_its_uncached_rest() -> None:
    """Its cached part costs the decode instance nothing: with all but its last 64 tokens
    cached there, stalling ten answers for 64 tokens beats a prefill of 4,096 elsewhere."""
    sched, _ = pd_fleet()
    load(sched, "d", 10)
    prompt = replace(ticket(1, tokens=4096), prefix=tuple(range(64)))
    sched.state("d").speed.observe_prefill(5000, 1.0)
    assert sched.splits(prompt, 0.0)
    sched.state("d").cache.insert(prompt.prefix[:-1])
    assert not sched.splits(prompt, 0.0)


def test_traffic_from_elsewhere_at_the_decode_instance_stalls_as_much() -> None:
    sched, rng = pd_fleet()
    sched.state("d").speed.observe_prefill(5000, 1.0)
    sched.state("d").report = LoadReport(running=6, waiting=2, kv_usage=None, at=0.0)
    hop = ticket(2, tokens=1000, hop=Hop.DECODE)  # a transfer of 0.3 ms a token
    assert assigned_to(sched.submit(hop, 0.0, rng)) == "d"
    sched.prefill_done(2, 0.0, rng, ttft=0.3)
    sched.release(2, Outcome.SUCCESS, 0.0, rng)
    assert sched.splits(ticket(1), 1.0)  # 0.256 s against 0.1 x 9
    # A scrape too old to trust says nothing: the instance is idle as far as we know.
    assert not sched.splits(ticket(1), 1.0 + LIMITS.metrics_stale_after + 1)


def test_the_prefill_side_takes_prompts_until_its_queue_outweighs_the_stall() -> None:
    """Prefill instances that have room take every prompt; when their queue is longer than
    the stall a whole prefill would cause, the decode instance takes the overflow."""
    sched, _ = pd_fleet()
    for name in ("p1", "p2", "d"):
        sched.state(name).speed.observe_prefill(5000, 1.0)
    load(sched, "d", 4)  # a whole 512-token prompt: 0.1024 s x 5 = 0.512 s of delay
    for queued in ((0, 0), (1000, 1200), (1900, 1900)):
        sched.state("p1").pending_prefill_tokens, sched.state("p2").pending_prefill_tokens = queued
        assert sched.splits(ticket(1), 0.0), queued
    sched.state("p1").pending_prefill_tokens = sched.state("p2").pending_prefill_tokens = 2100
    assert not sched.splits(ticket(1), 0.0)


def test_no_prefill_instance_up_keeps_every_request_whole() -> None:
    sched, rng = pd_fleet()
    for name in ("p1", "p2"):
        for _ in range(3):
            sched.probe(name, False, 1.0, rng)
    assert not sched.splits(ticket(1, tokens=10_000), 2.0)


def test_a_decode_hop_holds_no_prefill_work_and_no_long_place() -> None:
    sched, rng = pd_fleet(P1, InstanceSpec("d", role="decode", slots=4))
    long = ticket(1, tokens=9000, hop=Hop.DECODE, lane=Lane.LONG)
    for i in range(4):  # more long decode hops than max_long_per_instance (2)
        assert assigned_to(sched.submit(replace(long, id=i), 0.0, rng)) == "d"
    state = sched.state("d")
    assert state.pending_prefill_tokens == 0
    assert state.long_prefilling == 0


def test_a_prefill_instance_takes_long_prompts_beyond_the_long_cap() -> None:
    """The long cap keeps long prefills from stalling decodes; a prefill instance has none."""
    sched, rng = pd_fleet(P1, D)
    for i in range(5):
        hop = ticket(i, tokens=9000, hop=Hop.PREFILL, lane=Lane.LONG)
        assert assigned_to(sched.submit(hop, 0.0, rng)) == "p1"


def test_a_prefill_hop_waiting_does_not_hold_up_a_whole_request() -> None:
    one_slot = Limits(max_queue_per_instance=0)
    sched = make(
        InstanceSpec("p", role="prefill", slots=1),
        InstanceSpec("d", role="decode"),
        limits=one_slot,
    )
    rng = random.Random(1)
    bring_up(sched, rng)
    assert assigned_to(sched.submit(ticket(1, hop=Hop.PREFILL), 0.0, rng)) == "p"
    assert isinstance(sched.submit(ticket(2, hop=Hop.PREFILL), 0.0, rng), Queued)
    # Same lane and model, but another hop: its FIFO is its own.
    assert assigned_to(sched.submit(ticket(3), 0.0, rng)) == "d"
    woken = sched.release(1, Outcome.SUCCESS, 0.1, rng)
    assert [(type(d), d.ticket.id) for d in woken] == [(Assigned, 2)]


def test_the_prefill_hop_goes_where_it_is_predicted_to_finish_first() -> None:
    sched, rng = pd_fleet()
    p1, p2 = sched.state("p1"), sched.state("p2")
    p1.speed.observe_prefill(10_000, 1.0)
    p2.speed.observe_prefill(2_000, 1.0)
    p2.speed.slow = True  # the fleet's slow-card verdict (speed.py): its own rate counts
    # p1 is five times as fast: with 1,000 tokens queued there it still finishes first
    # (0.15 s against 0.256 s); with 4,000 (0.45 s) the idle slow one does.
    p1.pending_prefill_tokens = 1000
    assert fastest_prefill([p1, p2], ticket(1), rng) is p1
    p1.pending_prefill_tokens = 4000
    assert fastest_prefill([p1, p2], ticket(1), rng) is p2
    assert predicted_prefill(p2, ticket(1), None) == 512 / 2000


def test_alike_cards_are_ranked_by_work_not_by_their_noisy_rates() -> None:
    sched, rng = pd_fleet()
    p1, p2 = sched.state("p1"), sched.state("p2")
    p1.speed.observe_prefill(4_800, 1.0)  # learned under load: 10% apart, no slow card
    p2.speed.observe_prefill(4_300, 1.0)
    p1.pending_prefill_tokens = 512
    assert fastest_prefill([p1, p2], ticket(1), rng) is p2


def test_a_cached_prompt_prefills_where_it_is_cached() -> None:
    sched, rng = pd_fleet()
    p1, p2 = sched.state("p1"), sched.state("p2")
    prompt = replace(ticket(1, tokens=4096), prefix=tuple(range(256)))
    p2.cache.insert(prompt.prefix)
    assert fastest_prefill([p1, p2], prompt, rng) is p2
    assert assigned_to(sched.submit(replace(prompt, hop=Hop.PREFILL), 0.0, rng)) == "p2"


def test_prefill_hops_are_not_departures_for_admission() -> None:
    """A request departs when its decode hop does: counting its prefill hop too would
    double the departure rate admission predicts waits with."""
    one_slot = Limits(max_queue_per_instance=0)
    sched = make(
        InstanceSpec("p", role="prefill", slots=1),
        InstanceSpec("d", role="decode", slots=1),
        limits=one_slot,
    )
    rng = random.Random(1)
    bring_up(sched, rng)
    for hop, base in ((Hop.PREFILL, 0), (Hop.WHOLE, 1000)):
        sched.submit(ticket(base, hop=hop), 0.0, rng)
        for i in range(1, 30):  # each leaves while the next one waits: saturated
            sched.submit(ticket(base + i, hop=hop), i - 0.5, rng)
            sched.release(base + i - 1, Outcome.SUCCESS, float(i), rng)
        sched.release(base + 29, Outcome.SUCCESS, 30.0, rng)
        rate = predicted_wait_of(sched, Lane.SHORT, 30.0)
        # After the prefill hops alone no rate is known; the whole ones teach one.
        assert (rate is None) == (hop is Hop.PREFILL)


def test_a_busy_decode_instance_does_not_make_the_transfer_look_dear() -> None:
    """Decode hops slowed by the decode instance's queue would slow a whole request as
    much: the transfer estimate follows the quick ones, and long prompts keep splitting."""
    sched, rng = pd_fleet()
    sched.state("d").speed.observe_prefill(4370, 1.0)
    for i, ttft in enumerate((0.05, 2.0, 3.0, 2.5, 3.5)):  # one quick hop, then a queue
        assert assigned_to(sched.submit(ticket(i, tokens=4608, hop=Hop.DECODE), 0.0, rng)) == "d"
        sched.prefill_done(i, 0.0, rng, ttft=ttft)
        sched.release(i, Outcome.SUCCESS, 0.0, rng)
    load(sched, "d", 1)
    assert sched.splits(ticket(99, tokens=4608), 0.0)


def test_short_prompts_stay_whole_behind_long_prefills_and_long_ones_still_split() -> None:
    """The mixed workload: the prefill instances hold a long prompt each (about 1 s of
    work), the decode instance three answers. A 128-token prompt served whole stalls them
    for 29 ms each, far less than its wait on the prefill side; a 4,608-token one would
    stall them for a second each, more than that wait."""
    sched, _ = pd_fleet()
    sched.state("d").speed.observe_prefill(64, 0.06)  # from short prompts: about 1,070/s
    sched.state("p1").speed.observe_prefill(4608, 1.05)  # the card's real rate, ~4,390/s
    for name in ("p1", "p2"):
        sched.state(name).pending_prefill_tokens = 4608
    load(sched, "d", 3)
    assert not sched.splits(ticket(1, tokens=128), 0.0)
    assert sched.splits(ticket(2, tokens=4608, lane=Lane.LONG), 0.0)
