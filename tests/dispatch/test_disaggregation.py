"""Prefill/decode disaggregation in the core: which hop goes where, whether a request is
split in two, and which prefill instance is predicted to finish first."""

from __future__ import annotations

import random
from dataclasses import replace

from _sched_helpers import FAR, assigned_to, bring_up, make

from gateway.dispatch import (
    Assigned,
    Hop,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    Queued,
    Scheduler,
    Ticket,
)
from gateway.dispatch.disaggregation import fastest_prefill, predicted_prefill

P1, P2, D = (
    InstanceSpec("p1", role="prefill"),
    InstanceSpec("p2", role="prefill"),
    InstanceSpec("d", role="decode"),
)
LIMITS = Limits(long_input_threshold=4096, tpot_objective=0.04)


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


def test_before_any_rate_is_learned_the_long_input_threshold_decides() -> None:
    sched, _ = pd_fleet()
    assert not sched.splits(ticket(1, tokens=4096), 0.0)
    assert sched.splits(ticket(2, tokens=4097), 0.0)


def test_a_prefill_longer_than_the_tpot_objective_on_the_decode_instance_splits() -> None:
    sched, _ = pd_fleet()
    sched.state("d").speed.observe_prefill(5000, 1.0)
    # 5,000 tokens/s: 200 tokens take the 40 ms objective exactly.
    assert not sched.splits(ticket(1, tokens=200), 0.0)
    assert sched.splits(ticket(2, tokens=260), 0.0)


def test_a_transfer_dearer_than_the_local_prefill_keeps_the_request_whole() -> None:
    sched, rng = pd_fleet()
    sched.state("d").speed.observe_prefill(5000, 1.0)
    assert sched.splits(ticket(1, tokens=1000), 0.0)
    # A decode hop whose first token took 0.5 ms per prompt token: the link is slower
    # than prefilling locally (0.2 ms per token), so the second hop does not pay.
    decode = assigned_to(sched.submit(ticket(2, tokens=1000, hop=Hop.DECODE), 0.0, rng))
    assert decode == "d"
    sched.prefill_done(2, 0.5, rng, ttft=0.5)
    assert not sched.splits(ticket(3, tokens=1000), 0.0)
    # ...and it taught no prefill rate: that hop computed no prompt.
    assert sched.state("d").speed.prefill_rate == 5000


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
    one_slot = Limits(max_queue_per_instance=0, tpot_objective=0.04)
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
    double the drain rate admission predicts waits with."""
    one_slot = Limits(max_queue_per_instance=0, tpot_objective=0.04)
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
        rate = sched.predicted_wait(Lane.SHORT, 30.0)
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
    assert sched.splits(ticket(99, tokens=4608), 0.0)


def test_short_prompts_stay_whole_though_the_decode_instance_learned_a_low_rate() -> None:
    """A decode instance learns its rate from the short prompts it serves whole, whose
    first tokens are mostly fixed costs: the prefill instances' long prompts show the
    card's real rate, and the rule uses the fastest it knows."""
    sched, _ = pd_fleet()
    sched.state("d").speed.observe_prefill(64, 0.06)  # about 1,070 tokens/s
    sched.state("p1").speed.observe_prefill(4608, 1.05)  # about 4,390 tokens/s
    assert not sched.splits(ticket(1, tokens=128), 0.0)  # 29 ms at 4,390: under 40
    assert sched.splits(ticket(2, tokens=512), 0.0)  # 117 ms
