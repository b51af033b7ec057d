"""Fair share between keys in the core: the queue's order by served tokens, shares, lifts,
admission per key, and (hypothesis) no starvation, bounded unfairness and work
conservation over any interleaving."""

from __future__ import annotations

import doctest
import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    Decision,
    InstanceSpec,
    Lane,
    Limits,
    Outcome,
    PeerLoad,
    Queued,
    Rejected,
    Scheduler,
    SharedView,
    Ticket,
    fairness,
)
from gateway.dispatch.fairness import OUTPUT_WEIGHT, PROMPT_WEIGHT, ServiceCounts

FAR = 1e9


def fleet(slots: int = 1, shares: dict[str, float] | None = None, wait: float = FAR) -> Scheduler:
    """One instance with `slots` running slots and no queue of its own: all waiting is ours."""
    limits = Limits(max_queue_per_instance=0, max_queue_wait_short=wait, shares=shares or {})
    sched = Scheduler([InstanceSpec("a", slots=slots)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, random.Random(0))
    return sched


def ticket(i: int, key: str, tokens: int = 100) -> Ticket:
    return Ticket(i, Lane.SHORT, FAR, tokens=tokens, key=key)


def turns(sched: Scheduler, held: int, places: int, rng: random.Random) -> Counter[str]:
    """One slot: end the running request `places` times; whose key each freed place went to."""
    count: Counter[str] = Counter()
    for _ in range(places):
        (decision,) = sched.release(held, Outcome.SUCCESS, 1.0, rng)
        held = decision.ticket.id
        count[decision.ticket.key] += 1
    return count


def test_the_module_examples_hold() -> None:
    assert doctest.testmod(fairness).failed == 0


def test_a_calm_key_goes_before_a_flood_that_queued_first() -> None:
    """Twenty of the flood's requests wait; the calm key's one goes out within two free
    places, not after the twenty: lifted to the flood's count, it ties with the flood's
    older head, which goes first and is counted; then the calm key is the least served."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    for i in range(2, 22):
        assert isinstance(sched.submit(ticket(i, "flood"), 0.0, rng), Queued)
    assert isinstance(sched.submit(ticket(100, "calm"), 0.5, rng), Queued)
    placed = []
    for done in (1, 2):
        (decision,) = sched.release(done, Outcome.SUCCESS, 1.0, rng)
        placed.append(decision.ticket.id)
    assert placed == [2, 100]


def test_within_a_key_the_order_is_arrival() -> None:
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "x"), 0.0, rng), Assigned)
    for i in (2, 3, 4):
        assert isinstance(sched.submit(ticket(i, "x"), 0.0, rng), Queued)
    order = []
    for done in (1, 2, 3):
        (decision,) = sched.release(done, Outcome.SUCCESS, float(done), rng)
        order.append(decision.ticket.id)
    assert order == [2, 3, 4]


def test_two_waiting_keys_take_turns_by_tokens_served() -> None:
    """Key `big` asks for prompts ten times `small`'s: `small` gets about ten places to
    each of `big`'s, so both are served the same tokens."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "big", 1000), 0.0, rng), Assigned)
    ids = iter(range(2, 10_000))
    for _ in range(30):
        sched.submit(ticket(next(ids), "big", 1000), 0.0, rng)
        sched.submit(ticket(next(ids), "small", 100), 0.0, rng)
    served = {"big": 1000, "small": 0}
    held = 1
    keys = {}
    for _ in range(30):
        (decision,) = sched.release(held, Outcome.SUCCESS, 1.0, rng)
        assert isinstance(decision, Assigned)
        held = decision.ticket.id
        keys[held] = decision.ticket.key
        served[decision.ticket.key] += decision.ticket.tokens
    assert list(keys.values()).count("small") > 20
    # `small` started waiting behind big's first 1000 tokens, lifted to them: from there
    # on the two are served alike, within one of big's requests.
    assert abs(served["big"] - (1000 + served["small"])) <= 1000


def test_output_tokens_count_twice_a_prompt_token() -> None:
    counts = ServiceCounts()
    counts.charge("a", prompt_tokens=100)
    counts.charge("b", output_tokens=50)
    assert counts.count("a") == counts.count("b") == 100 * PROMPT_WEIGHT == 50 * OUTPUT_WEIGHT


def test_a_key_with_share_two_is_served_twice_as_much() -> None:
    rng = random.Random(0)
    sched = fleet(shares={"gold": 2.0})
    assert isinstance(sched.submit(ticket(1, "gold"), 0.0, rng), Assigned)
    ids = iter(range(2, 10_000))
    for _ in range(40):
        sched.submit(ticket(next(ids), "gold"), 0.0, rng)
        sched.submit(ticket(next(ids), "plain"), 0.0, rng)
    assert turns(sched, 1, 30, rng) == {"gold": 20, "plain": 10}


def test_idleness_is_not_banked() -> None:
    """`early` was served alone for a long time; `late` arrives and is lifted to
    early's count: they alternate, `late` does not get the next hundred places."""
    counts = ServiceCounts()
    for _ in range(100):
        counts.charge("early", prompt_tokens=100)
        counts.picked("early")
    counts.arrive("late", waiting={"early"})
    assert counts.count("late") == counts.count("early")
    # Nobody waits: lifted to the last served key's count.
    counts.arrive("later", waiting=())
    assert counts.count("later") == counts.count("early")
    # A key above the floor keeps its count (a lift never lowers).
    counts.charge("late", prompt_tokens=500)
    before = counts.count("late")
    counts.arrive("late", waiting={"early"})
    assert counts.count("late") == before
    # Lifted a second time, it lands on the new floor, its first lift kept.
    for _ in range(20):
        counts.charge("early", prompt_tokens=100)
    counts.arrive("late", waiting={"early"})
    assert counts.count("late") == counts.count("early")


def test_the_peers_service_counts_in_the_order() -> None:
    """Both wait here, served alike here; then another replica says it served `b` a
    lot: `a` goes first though `b` waited longer."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "x"), 0.0, rng), Assigned)
    sched.submit(ticket(2, "b"), 0.0, rng)
    sched.submit(ticket(3, "a"), 0.1, rng)
    sched.apply_shared(SharedView(key_service={"b": 10_000.0}, peers=1), 0.2, rng)
    (decision,) = sched.release(1, Outcome.SUCCESS, 1.0, rng)
    assert decision.ticket.key == "a"


def test_a_key_waiting_at_another_replica_is_not_lifted_here() -> None:
    """`behind` has requests waiting at a peer: its queue here emptying and filling again
    is not a return from idleness, and it keeps the due its lower count gives it."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "ahead", 1000), 0.0, rng), Assigned)
    sched.submit(ticket(2, "ahead", 1000), 0.0, rng)
    sched.apply_shared(SharedView(key_queued={"behind": 3}, peers=1), 0.0, rng)
    sched.submit(ticket(3, "behind", 10), 0.0, rng)
    sched.submit(ticket(4, "ahead", 1000), 0.0, rng)
    sched.submit(ticket(5, "behind", 10), 0.0, rng)
    order = []
    held = 1
    for now in (1.0, 2.0, 3.0):
        (decision,) = sched.release(held, Outcome.SUCCESS, now, rng)
        held = decision.ticket.id
        order.append(decision.ticket.key)
    # Not lifted to ahead's 1000: behind's two go first, then ahead.
    assert order == ["behind", "behind", "ahead"]


def yielding(slots: int = 1, peer_yield: float = 0.1) -> Scheduler:
    """`fleet`, as one of several processes sharing a view: a place freed here is left
    for `peer_yield` at most to a lower-count key waiting at a peer."""
    limits = Limits(max_queue_per_instance=0, peer_yield=peer_yield)
    sched = Scheduler([InstanceSpec("a", slots=slots)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, random.Random(0))
    return sched


CALM_AT_PEER = SharedView(key_queued={"calm": 1}, key_service={"calm": 50.0}, peers=1)


def test_a_place_freed_here_waits_for_a_lower_count_key_at_a_peer() -> None:
    """The flood comes through here, the calm key through a peer: the place the flood's
    answer frees stays free while the peer's calm request (count 50, more than one of the
    flood's turns below its 200) could take it, for `peer_yield` at most; then the flood's
    next goes (the fleet does not idle on a peer that does not come), and the next freed
    place waits anew."""
    rng = random.Random(0)
    sched = yielding()
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    for i in (2, 3, 4):
        assert isinstance(sched.submit(ticket(i, "flood"), 0.0, rng), Queued)
    (second,) = sched.release(1, Outcome.SUCCESS, 0.5, rng)
    assert isinstance(second, Assigned)
    sched.apply_shared(CALM_AT_PEER, 0.6, rng)
    assert sched.release(2, Outcome.SUCCESS, 1.0, rng) == []
    assert sched.state("a").inflight == 0
    assert sched.apply_shared(CALM_AT_PEER, 1.05, rng) == []
    assert sched.yield_ends(1.05) == pytest.approx(1.1)  # the shell places again then
    (late,) = sched.place_waiting(1.1, rng)
    assert isinstance(late, Assigned)
    assert late.ticket.id == 3
    assert sched.yield_ends(1.1) is None
    assert sched.release(3, Outcome.SUCCESS, 2.0, rng) == []
    # The peer took the place and its calm key waits no more: ours goes at once.
    taken = SharedView(loads={"a": PeerLoad(inflight=1)}, key_service={"calm": 150.0}, peers=1)
    assert sched.apply_shared(taken, 2.02, rng) == []
    free = SharedView(key_service={"calm": 150.0}, peers=1)
    (placed,) = sched.apply_shared(free, 2.5, rng)
    assert isinstance(placed, Assigned)
    assert placed.ticket.id == 4


def test_a_peers_key_within_one_turn_is_not_owed_a_place() -> None:
    """The peers' counts arrive a push late: a key waiting there only just below the
    flood's count (within one of the flood's turns) is not owed the place freed here, so
    two replicas flooding equal keys do not both leave their places idle."""
    rng = random.Random(0)
    sched = yielding()
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    for i in (2, 3):
        sched.submit(ticket(i, "flood"), 0.0, rng)
    sched.release(1, Outcome.SUCCESS, 0.5, rng)  # the flood's count 200, a turn 100
    close = SharedView(key_queued={"calm": 1}, key_service={"calm": 150.0}, peers=1)
    sched.apply_shared(close, 0.6, rng)
    (decision,) = sched.release(2, Outcome.SUCCESS, 1.0, rng)
    assert isinstance(decision, Assigned)
    assert decision.ticket.id == 3


def test_no_request_waits_for_a_peer_into_the_end_of_its_own_wait() -> None:
    """A request whose wait in the queue ends within `peer_yield` takes the free place at
    once, though the place's wait for the peer has not run out: leaving it longer would
    run the request's own wait out."""
    rng = random.Random(0)
    limits = Limits(max_queue_per_instance=0, peer_yield=0.4, max_queue_wait_short=1.0)
    sched = Scheduler([InstanceSpec("a", slots=1)], STRATEGIES["least_busy"](30.0), limits)
    sched.probe("a", True, 0.0, rng)
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    sched.submit(ticket(2, "flood"), 0.0, rng)
    sched.submit(ticket(3, "flood"), 0.5, rng)  # may wait until 1.5
    sched.release(1, Outcome.SUCCESS, 0.2, rng)  # ticket 2 runs; the flood's count 200
    sched.apply_shared(CALM_AT_PEER, 0.3, rng)
    assert sched.release(2, Outcome.SUCCESS, 1.0, rng) == []  # left to the peer at 1.0
    (decision,) = sched.place_waiting(1.15, rng)  # 0.15 into 0.4, 0.35 of its wait left
    assert isinstance(decision, Assigned)
    assert decision.ticket.id == 3


def test_no_place_waits_for_a_peers_key_served_more() -> None:
    """A key waiting at a peer whose count is above the flood's waits its turn there: the
    place freed here goes to the flood's next at once."""
    rng = random.Random(0)
    sched = yielding()
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    sched.submit(ticket(2, "flood"), 0.0, rng)
    served = SharedView(key_queued={"calm": 1}, key_service={"calm": 10_000.0}, peers=1)
    sched.apply_shared(served, 0.5, rng)
    (decision,) = sched.release(1, Outcome.SUCCESS, 1.0, rng)
    assert isinstance(decision, Assigned)
    assert decision.ticket.id == 2


def test_places_beyond_what_the_peers_wait_for_are_taken_here() -> None:
    """One calm request waits at a peer: with one place free it is left to the peer; with
    two, the flood takes one at once and leaves the other."""
    rng = random.Random(0)
    sched = yielding(slots=2)
    for i in (1, 2):
        assert isinstance(sched.submit(ticket(i, "flood"), 0.0, rng), Assigned)
    for i in (3, 4):
        sched.submit(ticket(i, "flood"), 0.0, rng)
    sched.apply_shared(CALM_AT_PEER, 0.5, rng)
    assert sched.release(1, Outcome.SUCCESS, 1.0, rng) == []
    (decision,) = sched.release(2, Outcome.SUCCESS, 1.01, rng)
    assert isinstance(decision, Assigned)
    assert decision.ticket.id == 3
    assert sched.state("a").inflight == 1
    (late,) = sched.place_waiting(1.2, rng)
    assert isinstance(late, Assigned)
    assert late.ticket.id == 4


def test_one_process_alone_never_leaves_a_place_free() -> None:
    """Without a peer yield (one process, or one key) nothing waits while a place is free,
    whatever the view says."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "flood"), 0.0, rng), Assigned)
    sched.submit(ticket(2, "flood"), 0.0, rng)
    sched.apply_shared(CALM_AT_PEER, 0.5, rng)
    (decision,) = sched.release(1, Outcome.SUCCESS, 1.0, rng)
    assert isinstance(decision, Assigned)


peer_op_st = st.tuples(
    st.sampled_from(["submit", "release", "view", "later"]),
    st.sampled_from(["flood", "calm", "x"]),
    st.integers(0, 3),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(peer_op_st, max_size=150), st.integers(1, 3))
def test_a_place_is_left_to_the_peers_for_peer_yield_at_most(
    ops: list[tuple[str, str, int]], slots: int
) -> None:
    """Whatever the peers say is waiting there, and whatever arrives and ends here, once
    `peer_yield` has passed every place free is filled while anything waits here; and at
    the end everything is served."""
    rng = random.Random(0)
    sched = yielding(slots=slots, peer_yield=0.1)
    running: list[int] = []
    waiting: set[int] = set()
    now, ids = 0.0, iter(range(1, 10_000))

    def take(decisions: list[Decision]) -> None:
        for decision in decisions:
            if isinstance(decision, Queued):
                waiting.add(decision.ticket.id)
            elif isinstance(decision, Assigned):
                waiting.discard(decision.ticket.id)
                running.append(decision.ticket.id)
            else:
                raise AssertionError(decision)

    for op, key, n in ops:
        now += 0.01
        if op == "submit":
            take([sched.submit(ticket(next(ids), key, 100 * (n + 1)), now, rng)])
        elif op == "release" and running:
            take(sched.release(running.pop(0), Outcome.SUCCESS, now, rng))
        elif op == "view":
            view = SharedView(key_queued={key: n}, key_service={key: 40.0 * n}, peers=1)
            take(sched.apply_shared(view, now, rng))
        elif op == "later":
            now += 0.1
            take(sched.place_waiting(now, rng))
            assert not waiting or len(running) == slots
    for _ in range(10_000):
        if not (running or waiting):
            break
        now += 0.11
        take(sched.place_waiting(now, rng))
        if running:
            take(sched.release(running.pop(0), Outcome.SUCCESS, now, rng))
    assert not running
    assert not waiting


def learn_rate(sched: Scheduler, key: str, rng: random.Random) -> float:
    """Queue `key`'s requests and let three leave at 0.1 s gaps: a departure rate of 10/s.
    Returns the time then."""
    assert isinstance(sched.submit(ticket(1, key), 0.0, rng), Assigned)
    for i in range(2, 40):
        sched.submit(ticket(i, key), 0.0, rng)
    held, now = 1, 0.0
    for _ in range(4):
        now += 0.1
        (decision,) = sched.release(held, Outcome.SUCCESS, now, rng)
        held = decision.ticket.id
    return now


def test_admission_refuses_the_flood_and_admits_the_calm_key() -> None:
    """Thirty-four of the flood's requests wait, the lane drains at 10/s, a request may
    wait 2 s: the flood's next would wait 3.5 s (refused), the calm key's 0.2 s (its own
    place and one of the flood's)."""
    rng = random.Random(0)
    sched = fleet(wait=2.0)
    now = learn_rate(sched, "flood", rng)
    flood = sched.submit(ticket(500, "flood"), now, rng)
    assert isinstance(flood, Rejected)
    assert flood.reason == "predicted_wait"
    calm = sched.submit(ticket(501, "calm"), now, rng)
    assert isinstance(calm, Queued)


def test_admission_counts_the_peers_queue_of_the_same_key() -> None:
    """The calm key has 30 requests waiting at another replica: its next one here waits
    behind them."""
    rng = random.Random(0)
    sched = fleet(wait=2.0)
    now = learn_rate(sched, "flood", rng)
    sched.apply_shared(SharedView(key_queued={"calm": 30}, peers=1), now, rng)
    refused = sched.submit(ticket(501, "calm"), now, rng)
    assert isinstance(refused, Rejected)


def test_share_tells_the_peers_each_keys_queue_and_service() -> None:
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "a", 300), 0.0, rng), Assigned)
    sched.submit(ticket(2, "b"), 0.0, rng)
    sched.charge_output("a", 10)
    share = sched.share(0.0)
    assert share.key_queued == {"b": 1}
    assert share.key_service == {"a": 300 * PROMPT_WEIGHT + 10 * OUTPUT_WEIGHT}
    snap = sched.snapshot(0.0)
    assert dict(snap.key_queued) == {"b": 1}
    assert dict(snap.key_service) == share.key_service


# ------------------------------------------------------------ properties

keys_st = st.sampled_from([f"k{i}" for i in range(8)])
# An operation: a new request of a key with a prompt and an answer length, or a place
# freed (the oldest request running ends, its output counted).
op_st = st.one_of(
    st.tuples(st.just("submit"), keys_st, st.integers(1, 500), st.integers(0, 200)),
    st.tuples(st.just("release"), st.just(""), st.just(0), st.just(0)),
)


class Replay:
    """Runs operations on a scheduler, checking after each what must always hold."""

    def __init__(self, slots: int, shares: dict[str, float] | None = None) -> None:
        self.sched = fleet(slots, shares)
        self.rng = random.Random(0)
        self.running: list[Ticket] = []
        self.outputs: dict[int, int] = {}
        self.waiting: dict[int, Ticket] = {}
        self.placed_after: dict[int, int] = {}  # queued ticket -> places given since
        self.ids = iter(range(1, 1_000_000))
        self.slots = slots

    def submit(self, key: str, tokens: int, output: int) -> None:
        t = Ticket(next(self.ids), Lane.SHORT, FAR, tokens=tokens, key=key)
        self.outputs[t.id] = output
        self.take(self.sched.submit(t, 0.0, self.rng))

    def release(self) -> None:
        if not self.running:
            return
        done = self.running.pop(0)
        self.sched.charge_output(done.key, self.outputs[done.id])
        for decision in self.sched.release(done.id, Outcome.SUCCESS, 0.0, self.rng):
            self.take(decision)

    def take(self, decision: object) -> None:
        if isinstance(decision, Queued):
            self.waiting[decision.ticket.id] = decision.ticket
            self.placed_after[decision.ticket.id] = 0
        elif isinstance(decision, Assigned):
            self.waiting.pop(decision.ticket.id, None)
            self.placed_after.pop(decision.ticket.id, None)
            for tid in self.placed_after:
                self.placed_after[tid] += 1
            self.running.append(decision.ticket)
        else:
            raise AssertionError(decision)
        # Work conservation: nothing waits while a place is free.
        assert not self.waiting or len(self.running) == self.slots


@settings(max_examples=200, deadline=None)
@given(st.lists(op_st, max_size=300), st.integers(1, 4))
def test_nothing_waits_while_a_place_is_free_and_everything_is_served(
    ops: list[tuple[str, str, int, int]], slots: int
) -> None:
    replay = Replay(slots)
    for op, key, tokens, output in ops:
        if op == "submit":
            replay.submit(key, tokens, output)
        else:
            replay.release()
    while replay.running:  # arrivals stop: the queue empties, nobody starves
        replay.release()
    assert not replay.waiting


@settings(max_examples=200, deadline=None)
@given(st.lists(op_st, max_size=300))
def test_a_key_that_starts_waiting_is_placed_within_one_turn_of_each_other_key(
    ops: list[tuple[str, str, int, int]],
) -> None:
    """Equal shares: a new key is lifted to the least count of the keys waiting, and goes
    before any key served since; only the keys at that count with older requests go
    first, each once."""
    replay = Replay(1)
    firsts: dict[int, int] = {}  # a new key's first waiting request -> keys waiting then
    seen: set[str] = set()
    for op, key, tokens, output in ops:
        if op == "submit":
            alone = key not in seen
            seen.add(key)
            others = len({t.key for t in replay.waiting.values()} - {key})
            before = set(replay.waiting)
            replay.submit(key, tokens, output)
            new = set(replay.waiting) - before
            if alone and new:
                firsts[new.pop()] = others
        else:
            replay.release()
        for tid, others in firsts.items():
            if tid in replay.placed_after:
                assert replay.placed_after[tid] <= others, (tid, others)


@settings(max_examples=100, deadline=None)
@given(
    st.fixed_dictionaries({"k0": st.sampled_from([1.0, 2.0, 3.0]), "k1": st.just(1.0)}),
    st.lists(st.tuples(st.integers(1, 500), st.integers(0, 200)), min_size=200, max_size=200),
)
def test_backlogged_keys_stay_within_one_request_of_their_shares(
    shares: dict[str, float], sizes: list[tuple[int, int]]
) -> None:
    """Both keys always have requests waiting: at every moment their counts (service
    over share) differ by at most the largest request's weighted cost over the smaller
    share, plus what is still running (its output not yet counted) - VTC's bound."""
    replay = Replay(2, shares)
    sizes_iter = iter(sizes * 4)
    for _ in range(6):
        for key in ("k0", "k1"):
            tokens, output = next(sizes_iter)
            replay.submit(key, tokens, output)
    largest = max(PROMPT_WEIGHT * t + OUTPUT_WEIGHT * o for t, o in sizes)
    service = replay.sched._service  # the core's own counts
    for _ in range(150):
        replay.release()
        for key in ("k0", "k1"):
            if sum(1 for t in replay.waiting.values() if t.key == key) < 3:
                tokens, output = next(sizes_iter)
                replay.submit(key, tokens, output)
        gap = abs(service.count("k0") - service.count("k1"))
        assert gap <= 2 * largest / min(shares.values()) + 2 * largest, gap


def test_a_reload_changes_the_shares_of_the_keys_waiting() -> None:
    """Shares come with the limits: after a reload that gives `gold` share 3, it takes
    three places to each of `plain`'s while both wait."""
    rng = random.Random(0)
    sched = fleet()
    assert isinstance(sched.submit(ticket(1, "gold"), 0.0, rng), Assigned)
    ids = iter(range(2, 10_000))
    for _ in range(40):
        sched.submit(ticket(next(ids), "gold"), 0.0, rng)
        sched.submit(ticket(next(ids), "plain"), 0.0, rng)
    limits = Limits(max_queue_per_instance=0, shares={"gold": 3.0})
    specs = [InstanceSpec("a", slots=1)]
    assert sched.apply(specs, limits, sched.instances.health_policy, 0.5, rng) == []
    assert turns(sched, 1, 40, rng) == {"gold": 30, "plain": 10}


def test_places_before_steps_each_key_by_its_mean_cost_over_its_share() -> None:
    """`x` was placed twice at 100 weighted tokens, `y` once at 50: each turn adds a key's
    mean cost over its share to its count, and the other keys take the turns that keep
    their counts at or below the asking key's last one."""
    counts = ServiceCounts()
    counts.charge("x", prompt_tokens=100)
    counts.charge("x", prompt_tokens=100)
    counts.charge("y", prompt_tokens=50)
    # y's last turn comes at 50 + 2 x 50 = 150, below x's 200: x takes none.
    assert counts.places_before("y", {"x": 5, "y": 2}) == 3
    # x's comes at 300: y takes the turns at 50, 100, ... 300, six of its ten.
    assert counts.places_before("x", {"x": 1, "y": 10}) == 8
    # A key never placed steps by every key's mean, 250 / 3: at 0, 83, 167 up to x's 200.
    assert counts.places_before("x", {"z": 5}) == 4
    shared = ServiceCounts({"y": 2.0})
    for key, tokens in (("x", 100), ("x", 100), ("y", 50)):
        shared.charge(key, prompt_tokens=tokens)
    # Share 2: y's count is 25 and it steps by 25, up to x's 300: all ten of its turns.
    assert shared.places_before("x", {"x": 1, "y": 10}) == 12
