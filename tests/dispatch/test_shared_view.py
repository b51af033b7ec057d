"""The shared view in the core: the other processes' load, queues, speeds and retries count."""

from __future__ import annotations

import random

import pytest
from _sched_helpers import ahead_of, predicted_wait_of, queue_length_of

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    PeerLoad,
    PeerSpeed,
    Priority,
    Queued,
    Rejected,
    RetryBudget,
    Scheduler,
    SharedView,
    Ticket,
    score_all,
)
from gateway.dispatch.speed import BLEND_CAP

INTERACTIVE = Priority.INTERACTIVE

FAR = 1e9


def make(*specs: InstanceSpec, strategy: str = "least_busy", **limits: int) -> Scheduler:
    sched = Scheduler(list(specs), STRATEGIES[strategy](30.0), Limits(**limits))  # type: ignore[arg-type]
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, random.Random(0))
    return sched


def test_peers_in_flight_count_toward_the_per_instance_limit() -> None:
    """An instance full with the other processes' requests takes none of ours: it overflows."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=2), InstanceSpec("b", slots=2), max_queue_per_instance=0)
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=2)}, peers=1), 0.0, rng)
    for i in range(2):
        decision = sched.submit(Ticket(i, Lane.SHORT, FAR), 0.0, rng)
        assert isinstance(decision, Assigned)
        assert decision.instance == "b"
    assert isinstance(sched.submit(Ticket(9, Lane.SHORT, FAR), 0.0, rng), Queued)


def test_peers_load_enters_the_score_and_an_empty_view_restores_our_own() -> None:
    """least_busy counts the peers' requests; an empty view (Redis away) forgets them."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=5)}, peers=1), 0.0, rng)
    scores = score_all(sched.instances.states, 0.0, 30.0)
    assert scores["a"].peers == 5
    assert scores["a"].total > scores["b"].total
    sched.apply_shared(SharedView(), 0.0, rng)
    assert (
        score_all(sched.instances.states, 0.0, 30.0)["a"].total
        == score_all(sched.instances.states, 0.0, 30.0)["b"].total
    )


def test_least_time_counts_the_peers_prefill_work() -> None:
    """Tokens the peers have in prefill on an instance make it slower to reach for us."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"), strategy="least_time")
    view = SharedView(loads={"a": PeerLoad(inflight=1, pending_prefill_tokens=50_000)}, peers=1)
    sched.apply_shared(view, 0.0, rng)
    decision = sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=1000), 0.0, rng)
    assert isinstance(decision, Assigned)
    assert decision.instance == "b"


def test_peers_long_prefills_count_toward_the_long_cap() -> None:
    """Two long prefills of the other processes on an instance fill its two long places."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), InstanceSpec("b"), max_long_per_instance=2)
    view = SharedView(loads={"a": PeerLoad(2, 12_000, long_prefilling=2)}, peers=1)
    sched.apply_shared(view, 0.0, rng)
    for ticket_id in (1, 2):
        decision = sched.submit(Ticket(ticket_id, Lane.LONG, FAR, tokens=6000), 0.0, rng)
        assert isinstance(decision, Assigned)
        assert decision.instance == "b"
    queued = sched.submit(Ticket(3, Lane.LONG, FAR, tokens=6000), 0.0, rng)
    assert isinstance(queued, Queued)  # b's two places are ours, a's are the peers'
    # A peer's long prefill ends: its place on a goes to the request waiting here.
    view = SharedView(loads={"a": PeerLoad(2, 6_000, long_prefilling=1)}, peers=1)
    (placed,) = sched.apply_shared(view, 0.0, rng)
    assert isinstance(placed, Assigned)
    assert placed.instance == "a"


def test_share_publishes_our_long_prefills() -> None:
    """What we publish counts our long prefills per instance (for the others' long caps)
    and our long answers (for their shelter); a long answer still counts once its
    prefill is done."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"))
    sched.submit(Ticket(1, Lane.LONG, FAR, tokens=6000), 0.0, rng)
    assert sched.share(0.0).loads["a"] == PeerLoad(1, 6000, long_prefilling=1, long_running=1)
    sched.prefill_done(1, 0.5, rng)
    assert sched.share(0.5).loads["a"] == PeerLoad(1, 0, long_prefilling=0, long_running=1)
    sched.release(1, Outcome.SUCCESS, 1.0, rng)
    assert sched.share(1.0).loads["a"] == PeerLoad(0, 0, 0, 0)


def test_the_prefill_rate_learned_counts_the_peers_prefill_work_ahead() -> None:
    """A first token that waited behind the peers' prefill teaches the rate of all that work."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"), strategy="least_time")
    view = SharedView(loads={"a": PeerLoad(inflight=1, pending_prefill_tokens=6000)}, peers=1)
    sched.apply_shared(view, 0.0, rng)
    decision = sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=2000), 0.0, rng)
    assert isinstance(decision, Assigned)
    sched.prefill_done(1, 0.4, rng, ttft=0.4)
    # 6,000 tokens of the peers' and our 2,000 in 0.4 s: 20,000 tokens/s, not 5,000.
    assert sched.state("a").speed.prefill.value == pytest.approx(20_000)


def test_the_departure_rate_for_admission_adds_the_peers_rates() -> None:
    """With the others draining a lane too, a queued request's predicted wait is the
    fleet's: ahead over every process's saturated departure rate, not ours alone."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_per_instance=0)
    assert isinstance(sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng), Assigned)
    for i, now in enumerate((0.5, 1.0, 1.5, 2.0, 2.5), start=2):  # one departure per 0.5 s
        assert isinstance(sched.submit(Ticket(i, Lane.SHORT, FAR), now - 0.1, rng), Queued)
        (moved,) = sched.release(i - 1, Outcome.SUCCESS, now, rng)
        assert isinstance(moved, Assigned)
    assert sched.share(2.5).rates == {(Lane.SHORT, None, INTERACTIVE): pytest.approx(2.0)}
    assert predicted_wait_of(sched, Lane.SHORT, 2.5) == pytest.approx(0.5)  # 1 ahead, 2/s
    view = SharedView(rates={(Lane.SHORT, None, INTERACTIVE): 6.0}, peers=3)
    sched.apply_shared(view, 2.5, rng)
    assert predicted_wait_of(sched, Lane.SHORT, 2.5) == pytest.approx(1 / 8.0)
    sched.apply_shared(SharedView(), 2.5, rng)  # Redis away: our own rate again
    assert predicted_wait_of(sched, Lane.SHORT, 2.5) == pytest.approx(0.5)


def test_a_view_applied_without_placing_leaves_the_queue_to_place_waiting() -> None:
    """apply_shared(place=False) takes the view but places nobody; place_waiting() then does."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_per_instance=0)
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=1)}, peers=1), 0.0, rng)
    assert isinstance(sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng), Queued)
    assert sched.queued
    assert sched.apply_shared(SharedView(), 0.0, rng, place=False) == []
    assert sched.state("a").peers.inflight == 0
    (placed,) = sched.place_waiting(0.0, rng)
    assert isinstance(placed, Assigned)
    assert not sched.queued


def test_a_prefix_computed_for_us_is_told_settled_and_a_peer_learns_it() -> None:
    """Our request's first token settles its new prefix there; we hand it out once, and a
    peer that learns it lets a long prompt with that prefix skip the long cap there."""
    rng = random.Random(0)
    ours, theirs = make(InstanceSpec("a")), make(InstanceSpec("a"))
    prefix = tuple(range(1, 101))  # 6,400 tokens of blocks
    ticket = Ticket(1, Lane.LONG, FAR, tokens=6500, prefix=prefix)
    assert isinstance(ours.submit(ticket, 0.0, rng), Assigned)
    theirs.learn_placements(ours.take_placements())
    assert theirs.state("a").cache.match(prefix, settled=True) == 0
    assert ours.take_settled() == []  # no first token yet
    ours.prefill_done(1, 0.5, rng, ttft=0.5)
    settled = ours.take_settled()
    assert settled == [("a", prefix)]
    assert ours.take_settled() == []
    theirs.learn_settled(settled)
    assert theirs.state("a").cache.match(prefix, settled=True) == 100
    ours.release(1, Outcome.SUCCESS, 1.0, rng)
    # A second request there with the prefix settled already: nothing new to tell.
    assert isinstance(
        ours.submit(Ticket(2, Lane.LONG, FAR, tokens=6500, prefix=prefix), 1.0, rng), Assigned
    )
    ours.prefill_done(2, 1.2, rng, ttft=0.2)
    assert ours.take_settled() == []


def test_the_gateway_queue_bound_holds_across_processes() -> None:
    """The peers' queued requests fill the lane's bound: ours is refused queue_full."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_per_instance=0, gateway_queue_size=3)
    sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng)
    sched.apply_shared(SharedView(queued={Lane.SHORT: 3}, peers=1), 0.0, rng)
    refused = sched.submit(Ticket(2, Lane.SHORT, FAR), 0.0, rng)
    assert isinstance(refused, Rejected)
    assert refused.reason == "queue_full"
    assert isinstance(sched.submit(Ticket(3, Lane.LONG, FAR), 0.0, rng), Queued)  # other lane


def test_speeds_blend_by_samples_capped() -> None:
    """Our estimate and the peers' blend, each weighted by its samples up to BLEND_CAP."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a"))
    speed = sched.state("a").speed
    for _ in range(BLEND_CAP * 2):
        speed.observe_tpot(0.01)
    peers = [PeerSpeed(tpot=0.03, tpot_samples=BLEND_CAP * 5)]
    sched.apply_shared(SharedView(speeds={"a": peers}, peers=1), 0.0, rng)
    assert speed.tpot_value == pytest.approx(0.02)  # both capped: equal weights
    assert speed.tpot.value == pytest.approx(0.01)  # our own stays ours
    assert sched.share(0.0).speeds["a"].tpot == pytest.approx(0.01)  # and is what we publish


def test_share_publishes_only_our_own_load() -> None:
    """What a process publishes is its own load and queues, never the peers' it heard."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_per_instance=0)
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=0)}, peers=1), 0.0, rng)
    sched.submit(Ticket(1, Lane.SHORT, FAR, tokens=300), 0.0, rng)
    sched.submit(Ticket(2, Lane.SHORT, FAR), 0.0, rng)
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=7)}, peers=1), 0.0, rng)
    share = sched.share(0.0)
    assert share.loads["a"] == PeerLoad(inflight=1, pending_prefill_tokens=300)
    assert share.queued[Lane.SHORT] == 1


def test_the_retry_budget_counts_the_peers_retries() -> None:
    """With peers' retries in the window, the fleet-wide budget runs out sooner."""
    budget = RetryBudget(ratio=0.1, min_retries=1)
    for _ in range(100):
        budget.record_request(0.0)
    budget.peer_requests, budget.peer_retries = 100, 19
    assert budget.try_spend(0.0)  # 20 of 200 allowed: the 20th is ours
    assert not budget.try_spend(0.0)
    assert budget.own_totals(0.0) == (100, 1)


def test_a_peers_claim_fills_an_instance_at_most_and_not_past_what_it_reports() -> None:
    """A claim of 500 on a card of 4 slots and 2 queued places counts 6 at most; with the
    card's fresh metrics saying it is idle, 4 (one batch of slack): ours still fit there."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=4), max_queue_per_instance=2)
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=500)}, peers=1), 0.0, rng)
    assert sched.state("a").peers.inflight == 6
    assert isinstance(sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng), Queued)
    sched.report_load("a", LoadReport(running=0, waiting=0, kv_usage=0.0, at=1.0))
    sched.apply_shared(SharedView(loads={"a": PeerLoad(inflight=500)}, peers=1), 1.0, rng)
    assert sched.state("a").peers.inflight == 4
    assert isinstance(sched.submit(Ticket(2, Lane.SHORT, FAR), 1.0, rng), Assigned)


def test_an_instance_the_store_says_is_full_takes_no_queued_request_when_ours_leaves() -> None:
    """Strict caps refused our place: counted full first, so handing it back places nothing."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), max_queue_per_instance=0)
    assert isinstance(sched.submit(Ticket(1, Lane.SHORT, FAR), 0.0, rng), Assigned)
    assert isinstance(sched.submit(Ticket(2, Lane.SHORT, FAR), 0.0, rng), Queued)
    sched.note_full("a")
    assert sched.release(1, Outcome.NEUTRAL, 0.0, rng) == []  # ticket 2 stays queued
    assert queue_length_of(sched, Lane.SHORT) == 1


def test_a_peers_queue_beyond_what_a_gateway_may_queue_is_not_believed() -> None:
    """A claim of a million queued counts as full queues, not as a wall past them."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", slots=1), gateway_queue_size=4, max_queue_per_instance=0)
    view = SharedView(queued={Lane.SHORT: 1_000_000}, peers=1)
    sched.apply_shared(view, 0.0, rng)
    assert ahead_of(sched, Lane.SHORT) <= 4 + 1
