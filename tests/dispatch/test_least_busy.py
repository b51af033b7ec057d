"""least_busy's score, `(own + others) / weight + kv + failures`, term by term; its tie-break.

Every test builds a state where the term under test, and only it, decides the choice, so a
score that drops or misapplies the term picks the other instance. Mutation testing found
that no test failed with `weight`, `kv` or the `failures` term left out.
"""

from __future__ import annotations

import random

import pytest

from gateway.dispatch import (
    STRATEGIES,
    Assigned,
    HealthPolicy,
    InstanceSpec,
    Lane,
    Limits,
    LoadReport,
    Outcome,
    Scheduler,
    Ticket,
    score_all,
)

SEEDS = range(20)  # the tie-break is random: a term that decides must decide for every seed


def make(*specs: InstanceSpec) -> Scheduler:
    """A least_busy scheduler over `specs` that never ejects, every instance up at t=0."""
    sched = Scheduler(
        list(specs),
        STRATEGIES["least_busy"](30.0, None),
        Limits(),
        HealthPolicy(eject_after_failures=1000),
    )
    rng = random.Random(0)
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, rng)
    return sched


def place(sched: Scheduler, ticket_id: int, on: str, rng: random.Random) -> None:
    """Put one request of ours on instance `on` (a retry excluding all the others)."""
    others = {s.name for s in sched.instances.states} - {on}
    decision = sched.submit(Ticket(ticket_id, Lane.SHORT, 1e9, frozenset(others)), 0.0, rng)
    assert decision == Assigned(decision.ticket, on), decision


def choose(sched: Scheduler, rng: random.Random) -> str:
    decision = sched.submit(Ticket(99, Lane.SHORT, 1e9), 0.0, rng)
    assert isinstance(decision, Assigned), decision
    return decision.instance


def test_score_adds_every_term_as_documented() -> None:
    """own 2 + others 3 over weight 2, plus kv 0.5, plus 1 failure, totals 4.0."""
    rng = random.Random(0)
    sched = make(InstanceSpec("a", weight=2.0))
    place(sched, 1, "a", rng)
    place(sched, 2, "a", rng)
    sched.release(2, Outcome.FAILURE, 0.0, rng)
    place(sched, 3, "a", rng)
    # The instance runs 5: our 2 (ids 1 and 3) and 3 of traffic that bypasses us.
    sched.report_load("a", LoadReport(running=4, waiting=1, kv_usage=0.5, at=0.0))
    score = score_all(sched.instances.states, 0.0, 30.0)["a"]
    assert (score.own, score.others, score.weight, score.kv, score.failures) == (2, 3, 2.0, 0.5, 1)
    assert score.total == pytest.approx(4.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_weight_divides_the_load(seed: int) -> None:
    """An instance of weight 3 holding 2 (score 2/3) beats one of weight 1 holding 1."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("big", weight=3.0), InstanceSpec("small"))
    place(sched, 1, "big", rng)
    place(sched, 2, "big", rng)
    place(sched, 3, "small", rng)
    assert choose(sched, rng) == "big"


@pytest.mark.parametrize("seed", SEEDS)
def test_consecutive_failures_count_against_an_instance(seed: int) -> None:
    """An idle instance with 2 failures in a row loses to one holding a single request."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("failing"), InstanceSpec("busy"))
    for i in (1, 2):
        place(sched, i, "failing", rng)
        sched.release(i, Outcome.FAILURE, 0.0, rng)
    assert sched.state("failing").consecutive_failures == 2
    place(sched, 3, "busy", rng)
    assert choose(sched, rng) == "busy"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_success_clears_the_failures_term(seed: int) -> None:
    """After a success the once-failing idle instance is preferred again."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("flaky"), InstanceSpec("busy"))
    for i in (1, 2):
        place(sched, i, "flaky", rng)
        sched.release(i, Outcome.FAILURE, 0.0, rng)
    place(sched, 3, "flaky", rng)
    sched.release(3, Outcome.SUCCESS, 0.0, rng)
    place(sched, 4, "busy", rng)
    assert choose(sched, rng) == "flaky"


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_cache_usage_counts_against_an_instance(seed: int) -> None:
    """Idle with 90% of its KV cache used (0.9) loses to weight 2 holding one at 10% (0.6)."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("full_cache"), InstanceSpec("roomy", weight=2.0))
    place(sched, 1, "roomy", rng)
    sched.report_load("full_cache", LoadReport(running=0, waiting=0, kv_usage=0.9, at=0.0))
    sched.report_load("roomy", LoadReport(running=1, waiting=0, kv_usage=0.1, at=0.0))
    assert choose(sched, rng) == "roomy"


@pytest.mark.parametrize("seed", SEEDS)
def test_foreign_traffic_counts_like_our_own(seed: int) -> None:
    """An instance we hold nothing on but that reports 2 running loses to one holding 1."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("shared"), InstanceSpec("ours"))
    place(sched, 1, "ours", rng)
    sched.report_load("shared", LoadReport(running=2, waiting=0, kv_usage=None, at=0.0))
    sched.report_load("ours", LoadReport(running=1, waiting=0, kv_usage=None, at=0.0))
    assert choose(sched, rng) == "ours"


def test_a_tie_between_two_breaks_at_random() -> None:
    """Two idle equal instances each get a fair share of 200 requests, not always the first."""
    rng = random.Random(7)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    counts = {"a": 0, "b": 0}
    for i in range(200):
        decision = sched.submit(Ticket(i, Lane.SHORT, 1e9), 0.0, rng)
        assert isinstance(decision, Assigned)
        counts[decision.instance] += 1
        sched.release(i, Outcome.SUCCESS, 0.0, rng)
    assert 70 <= counts["a"] <= 130, counts


def test_no_report_anywhere_scores_no_foreign_load() -> None:
    """With no fresh report in the fleet, unknown load is taken as none: others 0, kv 0."""
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    for score in score_all(sched.instances.states, 0.0, 30.0).values():
        assert (score.others, score.kv, score.fresh, score.total) == (0.0, 0.0, False, 0.0)


def test_round_robin_refuses_an_empty_candidate_list() -> None:
    """round_robin called without candidates raises, naming the mistake."""
    strategy = STRATEGIES["round_robin"](30.0, None)
    sched = make(InstanceSpec("a"))
    with pytest.raises(ValueError, match=r"choose\(\) needs at least one candidate"):
        strategy.choose(
            [], sched.instances.states, Ticket(1, Lane.SHORT, 1e9), 0.0, random.Random(0)
        )


def place_long(sched: Scheduler, ticket_id: int, on: str, rng: random.Random) -> None:
    """Put one 6,000-token prompt of ours on `on`, still short of its first token."""
    others = {s.name for s in sched.instances.states} - {on}
    ticket = Ticket(ticket_id, Lane.LONG, 1e9, frozenset(others), tokens=6000, max_tokens=32)
    decision = sched.submit(ticket, 0.0, rng)
    assert decision == Assigned(decision.ticket, on), decision


def prefilling_and_decoding(rng: random.Random) -> Scheduler:
    """Instance "prefilling" holds one 6,000-token prompt short of its first token;
    "decoding" holds three requests past theirs."""
    sched = make(InstanceSpec("prefilling"), InstanceSpec("decoding"))
    place_long(sched, 1, "prefilling", rng)
    for i in (2, 3, 4):
        place(sched, i, "decoding", rng)
    return sched


@pytest.mark.parametrize("seed", SEEDS)
def test_a_long_prompt_goes_where_the_least_prefill_work_is_ahead(seed: int) -> None:
    """A long prompt picks the instance with three requests decoding over the one with a
    single 6,000-token prompt still prefilling: it would wait for that prefill there."""
    rng = random.Random(seed)
    sched = prefilling_and_decoding(rng)
    long = Ticket(99, Lane.LONG, 1e9, tokens=6000, max_tokens=32)
    decision = sched.submit(long, 0.0, rng)
    assert decision == Assigned(long, "decoding"), decision


@pytest.mark.parametrize("seed", SEEDS)
def test_a_short_prompt_keeps_clear_of_a_long_prefill(seed: int) -> None:
    """In the same fleet a short prompt goes where three requests decode rather than
    behind the long prompt's prefill chunks, which vLLM schedules before it."""
    rng = random.Random(seed)
    sched = prefilling_and_decoding(rng)
    assert choose(sched, rng) == "decoding"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_short_prompt_counts_requests_where_long_prefills_are_alike(seed: int) -> None:
    """With a long prompt in prefill on every instance, requests decide again."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("a"), InstanceSpec("b"))
    place_long(sched, 1, "a", rng)
    place_long(sched, 2, "b", rng)
    for i in (3, 4):
        place(sched, i, "b", rng)
    assert choose(sched, rng) == "a"


@pytest.mark.parametrize("seed", SEEDS)
def test_a_first_token_clears_the_prefill_work(seed: int) -> None:
    """Once the prefilling prompt has its first token, that instance (one request) wins
    the long prompt back from the one with three: only work ahead decides, not history."""
    rng = random.Random(seed)
    sched = prefilling_and_decoding(rng)
    sched.prefill_done(1, 0.3, rng)
    long = Ticket(99, Lane.LONG, 1e9, tokens=6000, max_tokens=32)
    decision = sched.submit(long, 0.3, rng)
    assert decision == Assigned(long, "prefilling"), decision


@pytest.mark.parametrize("seed", SEEDS)
def test_a_long_prompt_avoids_an_instance_without_a_free_slot(seed: int) -> None:
    """No prefill work ahead is no help where every running slot is taken: the long
    prompt goes to the instance with a slot free, though a prefill is pending there."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("full", slots=2), InstanceSpec("prefilling", slots=2))
    place_long(sched, 1, "prefilling", rng)
    for i in (2, 3):
        place(sched, i, "full", rng)
    long = Ticket(99, Lane.LONG, 1e9, tokens=6000, max_tokens=32)
    decision = sched.submit(long, 0.0, rng)
    assert decision == Assigned(long, "prefilling"), decision


@pytest.mark.parametrize("seed", SEEDS)
def test_a_long_prompt_cached_somewhere_is_left_to_the_affinity_term(seed: int) -> None:
    """A long prompt with 4,032 of its 6,000 tokens cached on the instance where a prefill
    is pending goes there, as the score with its affinity term says (0.67 of a request
    less), not to the instance with nothing pending that would compute it all again."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("cached"), InstanceSpec("cold"))
    place_long(sched, 1, "cached", rng)
    place(sched, 2, "cold", rng)
    blocks = tuple(range(1, 95))  # 94 blocks of 64 tokens: the whole 6,000-token prompt
    sched.state("cached").cache.insert(blocks[:63])  # its first 4,032 tokens
    long = Ticket(99, Lane.LONG, 1e9, tokens=6000, max_tokens=32, prefix=blocks)
    decision = sched.submit(long, 0.0, rng)
    assert decision == Assigned(long, "cached"), decision


@pytest.mark.parametrize("seed", SEEDS)
def test_a_short_prompt_cached_behind_a_long_prefill_is_left_to_the_affinity_term(
    seed: int,
) -> None:
    """A short prompt whose prefix is cached where a long prompt prefills is not narrowed:
    the score and its bounded affinity term decide (decision 0016), and the cache wins
    over one request more elsewhere."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("prefilling"), InstanceSpec("decoding"))
    place_long(sched, 1, "prefilling", rng)
    place(sched, 2, "decoding", rng)
    prompt = Ticket(99, Lane.SHORT, 1e9, tokens=512, prefix=tuple(range(8)))
    sched.state("prefilling").cache.insert(prompt.prefix)
    decision = sched.submit(prompt, 0.0, rng)
    assert decision == Assigned(prompt, "prefilling"), decision


@pytest.mark.parametrize("seed", SEEDS)
def test_with_a_long_prefill_everywhere_a_short_prompt_goes_where_it_clears_first(
    seed: int,
) -> None:
    """Both cards prefill a 6,000-token prompt; the slow one (0.4x, flagged) would take
    2.5 times as long to clear it. The short prompt goes to the fast card though three
    more requests run there: it would wait for the slow card's prefill otherwise."""
    rng = random.Random(seed)
    sched = make(InstanceSpec("fast"), InstanceSpec("slow"))
    place_long(sched, 1, "fast", rng)
    place_long(sched, 2, "slow", rng)
    for i in (3, 4, 5):
        place(sched, i, "fast", rng)
    sched.state("fast").speed.observe_prefill(10_000, 1.0)
    sched.state("slow").speed.observe_prefill(4_000, 1.0)
    sched.state("slow").speed.slow = True
    assert choose(sched, rng) == "fast"
