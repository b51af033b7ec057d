"""The disaggregation benchmark's pure parts: the schedule, the SLO arithmetic, the bisection,
the prompts' token counts and the engine model."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sim.sim_engine import SimConfig, count_tokens, prompt_token_count
from loadtest.disagg import calibration, fronts, loadgen
from loadtest.disagg.model import Arrival, token_times
from loadtest.disagg.schedule import arrivals
from loadtest.disagg.search import Bisection, search
from loadtest.disagg.slo import FIGURE_1, Outcome, Slo, attainment, meets, served

# --- schedule -------------------------------------------------------------------------------


def test_a_seed_gives_the_same_schedule() -> None:
    """The same rate, duration and seed give the same arrivals; another seed others."""
    assert arrivals(5.0, 30.0, 1) == arrivals(5.0, 30.0, 1)
    assert arrivals(5.0, 30.0, 1) != arrivals(5.0, 30.0, 2)


def test_rates_scale_one_pattern() -> None:
    """Common random numbers: twice the rate is the same pattern in half the time."""
    slow, fast = arrivals(2.0, 20.0, 7), arrivals(4.0, 10.0, 7)
    assert fast == pytest.approx([t / 2 for t in slow])


@given(st.floats(0.1, 50), st.floats(1, 100), st.integers(0, 10**6))
def test_arrivals_start_at_zero_and_stay_in_the_window(
    rate: float, duration: float, seed: int
) -> None:
    """The first request comes at 0, the times rise, and none is at or past the duration."""
    times = arrivals(rate, duration, seed)
    assert times[0] == 0.0
    assert times == sorted(times)
    assert times[-1] < duration


def test_a_long_schedule_has_the_rate_it_was_asked() -> None:
    """Over 2,000 s at 5 rps, the count is within 3% of 10,000."""
    assert len(arrivals(5.0, 2000.0, 3)) == pytest.approx(10_000, rel=0.03)


def test_a_schedule_needs_a_positive_rate() -> None:
    """A rate or duration of zero is refused, not looped on."""
    with pytest.raises(ValueError, match="rate"):
        arrivals(0.0, 10.0, 1)


# --- SLO arithmetic -------------------------------------------------------------------------


def test_tpot_is_the_span_of_the_tokens_over_their_gaps() -> None:
    """TPOT = (last token - first token) / (tokens - 1); TTFT from the send."""
    outcome = Outcome.from_times(10.0, [10.3, 10.34, 10.38, 10.5])
    assert outcome.ttft == pytest.approx(0.3)
    assert outcome.tpot == pytest.approx(0.2 / 3)
    assert outcome.tokens == 4


def test_a_one_token_answer_has_no_tpot_to_miss() -> None:
    """As in DistServe's code, one token gives a TPOT of 0; no token is a failure."""
    assert Outcome.from_times(0.0, [0.2]).tpot == 0.0
    assert Outcome.from_times(0.0, []).error == "no tokens"


@pytest.mark.parametrize(
    ("ttft", "tpot", "met"),
    [(0.4, 0.04, True), (0.41, 0.01, False), (0.1, 0.0401, False), (0.0, 0.0, True)],
)
def test_a_request_meets_both_objectives_or_not_at_all(ttft: float, tpot: float, met: bool) -> None:
    """The bounds are inclusive, and both must hold."""
    assert meets(Outcome(ttft, tpot, 64), FIGURE_1) is met


def test_an_objective_left_out_is_not_judged() -> None:
    """With tpot None (the prefill-only setup) only TTFT counts."""
    assert meets(Outcome(0.3, 9.0, 2), Slo(ttft=0.4, tpot=None))
    assert not meets(Outcome(0.5, 0.0, 2), Slo(ttft=0.4, tpot=None))


def test_failed_requests_count_against_attainment() -> None:
    """A request that failed or never finished is in the denominator and never meets."""
    good = Outcome(0.1, 0.02, 64)
    outcomes = [good] * 8 + [Outcome(None, None, 0, "unfinished"), Outcome(0.1, 0.02, 64, "x")]
    assert attainment(outcomes, FIGURE_1) == 0.8
    assert attainment([], FIGURE_1) == 0.0


def test_a_rate_is_served_at_ninety_percent_exactly() -> None:
    """9 of 10 within the objectives serves the rate; 8 of 10 does not."""
    good, bad = Outcome(0.1, 0.02, 64), Outcome(1.0, 0.02, 64)
    assert served([good] * 9 + [bad], FIGURE_1)
    assert not served([good] * 8 + [bad] * 2, FIGURE_1)
    assert not served([], FIGURE_1)


# --- bisection --------------------------------------------------------------------------------


def test_the_bisection_tries_what_its_docstring_says() -> None:
    """low=4, high=8, two steps, capacity 5.5: tries 4, 8, 6, 5 and ends at 5."""
    found = search(lambda rate: rate <= 5.5, Bisection(4.0, 8.0, steps=2))
    assert found.tried == [(4.0, True), (8.0, False), (6.0, False), (5.0, True)]
    assert found.capacity == 5.0


def test_a_bracket_that_is_too_high_is_halved_without_judging_a_rate_twice() -> None:
    """A failing low halves the bracket; the old low is known to fail and not tried again."""
    found = search(lambda rate: rate <= 1.5, Bisection(4.0, 8.0, steps=1))
    assert found.tried == [(4.0, False), (2.0, False), (1.0, True), (1.5, True)]
    assert found.capacity == 1.5


def test_a_bracket_that_is_too_low_is_doubled() -> None:
    """A passing high doubles the bracket."""
    found = search(lambda rate: rate <= 20.0, Bisection(4.0, 8.0, steps=0))
    assert [rate for rate, _ in found.tried] == [4.0, 8.0, 16.0, 32.0]
    assert found.capacity == 16.0


def test_nothing_served_gives_zero() -> None:
    """When even low / 2**widen fails, the capacity is 0."""
    found = search(lambda rate: False, Bisection(4.0, 8.0, steps=3, widen=2))
    assert found.capacity == 0.0
    assert [rate for rate, _ in found.tried] == [4.0, 2.0, 1.0]


@given(st.floats(0.6, 60.0), st.integers(0, 8))
def test_the_bisection_lands_below_the_threshold_within_its_resolution(
    threshold: float, steps: int
) -> None:
    """For a monotone verdict, capacity <= threshold < capacity + the final bracket."""
    found = search(lambda rate: rate <= threshold, Bisection(4.0, 8.0, steps=steps))
    assert found.capacity <= threshold
    assert threshold < found.high
    assert found.high - found.low <= 64.0 / 2**steps
    assert len({rate for rate, _ in found.tried}) == len(found.tried)


# --- prompts and legs ---------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 7, 12345678, 10**9 + 3])
def test_a_prompt_is_exactly_512_simulator_tokens(index: int) -> None:
    """The simulator counts each request's prompt as exactly 512 tokens."""
    text = loadgen.prompt(index)
    assert count_tokens(text) == 512
    assert prompt_token_count(text) == 512


def test_the_prefill_leg_is_what_the_proxies_send() -> None:
    """max_tokens 1, not streamed, no stream_options, do_remote_decode; the rest kept."""
    body = {**loadgen.completion(3, 64), "stream_options": {"include_usage": True}}
    leg = loadgen.prefill_leg(body)
    assert (leg["max_tokens"], leg["stream"], leg["prompt"]) == (1, False, body["prompt"])
    assert "stream_options" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert body["max_tokens"] == 64  # the original is untouched


def test_a_prompts_transfer_takes_its_blocks_over_the_link() -> None:
    """32 blocks x 16 tokens x 819,200 bytes over 25 GB/s: 16.8 ms."""
    assert calibration.transfer_s(SimConfig()) == pytest.approx(0.016777, rel=1e-4)


def test_pd_front_needs_prefill_and_decode_instances() -> None:
    """vllm-router's PD mode refuses a fleet without both roles before starting anything."""
    with pytest.raises(ValueError, match="prefill and decode"):
        fronts.vllm_router_pd([fronts.Instance("http://a", "prefill")])
    with pytest.raises(ValueError, match="both"):
        fronts.vllm_router([fronts.Instance("http://a", "decode")])


# --- the engine model ---------------------------------------------------------------------


def test_the_model_prefills_then_decodes_at_the_step_time() -> None:
    """One request: its prefill step, then one token per decode step."""
    config = SimConfig(prefill_tokens_per_s=1000.0, decode_s_per_token=0.02)
    (times,) = token_times(config, [Arrival(1.0, 500, 3)])
    assert times == pytest.approx([1.5, 1.52, 1.54])


def test_the_model_slows_decode_steps_and_skips_remote_prefill() -> None:
    """Two decoding requests slow each step; KV already present leaves one token to prefill."""
    config = SimConfig(
        prefill_tokens_per_s=1000.0, decode_s_per_token=0.02, decode_slowdown_per_seq=0.5
    )
    first, second = token_times(config, [Arrival(0.0, 100, 2, 100), Arrival(0.0, 100, 2, 100)])
    # Both 1-token tails in one step of 0.002 s, then one decode step of 0.02 x 1.5.
    assert first == pytest.approx([0.002, 0.032])
    assert second == pytest.approx([0.002, 0.032])


def test_the_model_queues_beyond_max_num_seqs() -> None:
    """With one slot the second request starts when the first finishes."""
    config = SimConfig(prefill_tokens_per_s=1000.0, decode_s_per_token=0.01, max_num_seqs=1)
    first, second = token_times(config, [Arrival(0.0, 10, 2), Arrival(0.0, 10, 2)])
    assert first == pytest.approx([0.01, 0.02])
    assert second == pytest.approx([0.03, 0.04])


def test_the_split_is_the_one_whose_slower_side_serves_most() -> None:
    from loadtest.disagg.sizing import best_split

    # DistServe's Figure 1: 5.6 rps prefill-only, 10 decode-only, 1.6 colocated per GPU.
    three = best_split(3, 5.6, 10.0, 1.6)
    assert (three.prefill, three.decode) == (2, 1)
    assert three.rate == 10.0  # the decode instance bounds it, as in the paper
    assert (best_split(2, 5.6, 10.0, 1.6).prefill, best_split(2, 5.6, 10.0, 1.6).decode) == (1, 1)
    # Colocated wins where it serves more than any split's slower side.
    assert best_split(3, 5.6, 10.0, 4.0).colocated
    assert best_split(1, 5.6, 10.0, 1.6).colocated
