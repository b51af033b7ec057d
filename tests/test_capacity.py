"""What `loadtest/capacity.py` counts: the priced work of answers that ended inside the
window every card was kept full."""

from __future__ import annotations

import pytest

from gateway.sim.sim_engine import SimConfig
from loadtest import compare
from loadtest.capacity import Measured, shares, work_in_window
from loadtest.loadgen import TEMPLATE_TOKENS, Mix, RequestSpec, Result, Run

NAMES = {"127.0.0.1:1": "#0 x1.0", "127.0.0.1:2": "#1 x0.4"}
SIM = SimConfig(max_num_seqs=16)
SHORT, LONG = 200 - TEMPLATE_TOKENS, 6000 - TEMPLATE_TOKENS


def _spec(index: int, prompt: int) -> RequestSpec:
    return RequestSpec(index=index, at=0.0, prompt_tokens=prompt, max_tokens=32, client=0)


def _answer(index: int, instance: str, sent: float, latency: float, status: int = 200) -> Result:
    return Result(
        index=index,
        long=False,
        sent=sent,
        status=status,
        instance=instance,
        latency=latency,
        tokens=32,
    )


def test_only_answers_ending_between_warm_up_and_last_send_count_at_their_price() -> None:
    specs = [_spec(i, LONG if i % 2 else SHORT) for i in range(6)]
    run = Run("capacity", started=100.0, last_sent=112.0)
    run.results = [
        _answer(0, "127.0.0.1:1", 100.0, 1.5),  # ends in the warm-up: batches still filling
        _answer(1, "127.0.0.1:1", 101.0, 2.0),  # ends at 103.0: the window's first instant
        _answer(2, "127.0.0.1:1", 104.0, 3.0),
        _answer(3, "127.0.0.1:2", 105.0, 6.0),
        _answer(4, "127.0.0.1:2", 110.0, 4.0),  # ends at 114, after the last send: draining
        _answer(5, "127.0.0.1:1", 106.0, 1.0, status=503),  # refused: served nothing
    ]
    window, work = work_in_window(run, specs, NAMES, warm=3.0, sim=SIM)
    short = compare.request_cost(200, 32, SIM)
    long = compare.request_cost(6000, 32, SIM)
    assert window == pytest.approx(9.0)
    assert work == pytest.approx({"#0 x1.0": long + short, "#1 x0.4": long})
    # A long prompt weighs as its prefill does, not as one answer: 5,800 tokens more at
    # 20,000 tokens/s.
    assert long - short == pytest.approx(5800 / SIM.prefill_tokens_per_s)


def test_shares_divide_the_work_by_the_window_and_the_speed() -> None:
    fleet, per_card = shares(10.0, {"a": 9.0, "b": 2.0}, {"a": 1.0, "b": 0.4})
    assert per_card == pytest.approx({"a": 0.9, "b": 0.5})
    assert fleet == pytest.approx(11.0 / 14.0)


def test_the_estimate_prices_the_mean_request_as_request_cost_does() -> None:
    """One formula: a fleet of speed 1 serving requests of exactly the mix's means."""
    mix = Mix(
        long_share=0.5, short_tokens=(200, 200), long_tokens=(6000, 6000), max_tokens=(32, 32)
    )
    cost = compare.request_cost(mix.mean_prompt_tokens(), 32, SIM)
    assert compare.capacity([1.0, 1.0], mix, SIM) == pytest.approx(2.0 / cost)


def test_a_card_that_finished_nothing_is_reported_at_zero() -> None:
    run = Run("capacity", started=0.0, last_sent=10.0)
    run.results = [_answer(0, "127.0.0.1:1", 1.0, 2.0)]
    _, work = work_in_window(run, [_spec(0, SHORT)], NAMES, warm=1.0, sim=SIM)
    assert work["#1 x0.4"] == 0.0


def test_no_window_when_the_sends_ended_inside_the_warm_up() -> None:
    run = Run("capacity", started=0.0, last_sent=2.0)
    with pytest.raises(ValueError, match="no window"):
        work_in_window(run, [], NAMES, warm=5.0, sim=SIM)


def test_the_report_carries_the_share_and_the_rate_it_gives() -> None:
    out = Measured(10.0, 0.9, 30.0, {"#0 x1.0": 0.9}).as_json()
    assert out["share_of_estimate"] == 0.9
    assert out["req_per_s"] == out["estimate_req_per_s"] * out["share_of_estimate"]
