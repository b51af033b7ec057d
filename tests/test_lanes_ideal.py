"""The ideal fleet's long TTFTs (loadtest/lanes/ideal.py)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from gateway.sim.sim_engine import SimConfig
from loadtest import compare
from loadtest.lanes import bench, ideal
from loadtest.loadgen import TEMPLATE_TOKENS, RequestSpec

SIM = SimConfig(max_num_seqs=16)  # 20,000 prefill tokens/s: 6,000 tokens in 0.3 s


def _spec(index: int, at: float, tokens: int, max_tokens: int = 0) -> RequestSpec:
    return RequestSpec(index, at, tokens - TEMPLATE_TOKENS, max_tokens, client=0)


def test_long_prompts_queue_oldest_first_on_one_card() -> None:
    """Nothing else to serve: the second prompt waits for the first's 0.3 s prefill."""
    fleet = ideal.ideal([_spec(0, 0.0, 6000), _spec(1, 0.1, 6000)], [1.0], SIM)
    assert fleet.rest_share == 0.0
    assert fleet.ttfts == pytest.approx([0.3, 0.5])


def test_each_goes_where_its_prefill_ends_soonest() -> None:
    """A free half-speed card (0.6 s) loses to a full-speed one free in 0.2 s (0.5 s)."""
    specs = [_spec(0, 0.0, 6000), _spec(1, 0.1, 6000), _spec(2, 0.1, 6000)]
    fleet = ideal.ideal(specs, [1.0, 0.5], SIM)
    # 0 on the fast card (0.3 s); 1 waits for it (ends at 0.6, not 0.7 on the slow
    # card: 0.5 s); 2 takes the slow card (ends at 0.7, not 0.9: 0.6 s).
    assert fleet.ttfts == pytest.approx([0.3, 0.5, 0.6])


def test_the_rest_of_the_work_slows_every_long_prefill_by_its_share() -> None:
    """Short prompts and every answer's decode take their price's share of the cards'
    time over the run; each long prefill runs on what is left."""
    specs = [_spec(0, 0.0, 6000, max_tokens=32), _spec(1, 0.5, 200, 32), _spec(2, 1.0, 200, 32)]
    rest = compare.request_cost(0, 32, SIM) + 2 * compare.request_cost(200, 32, SIM)
    share = rest / (1.0 * 1.0)  # over the span (the last arrival, 1 s) on one speed-1 card
    fleet = ideal.ideal(specs, [1.0], SIM)
    assert fleet.rest_share == pytest.approx(share)
    assert fleet.ttfts == pytest.approx([0.3 / (1 - share)])


def test_percentiles_want_enough_samples() -> None:
    few = ideal.Ideal([0.3, 0.5], 0.0)
    assert few.percentile(50) == 0.3
    assert math.isnan(few.percentile(99))


def test_the_same_requests_as_lanes_sends() -> None:
    """At 100% of the estimate on issue 10's fleet the rest takes about 17% of the cards'
    time (the long prefills 83%), and the long prompts queue."""
    opts = bench.LanesOptions()
    fleet = ideal.workload_ideal(1, 1.0, 30.0, opts)
    assert 0.15 < fleet.rest_share < 0.19
    assert fleet.percentile(50) > 0.3  # beyond one fast card's prefill: they queue


def _run(long_p99: float) -> dict[str, Any]:
    return {"long_ttft_s": {"p99": long_p99}}


def _options(**changes: Any) -> dict[str, Any]:
    """A sitting's options as `lanes` writes them (JSON: tuples as lists)."""
    saved = json.loads(json.dumps(asdict(bench.LanesOptions())))
    return {**saved, "duration": 90.0, **changes}


def _write(path: Path, body: Any) -> Path:
    path.write_text(json.dumps(body))
    return path


def test_sittings_bound_is_half_the_best_baseline(tmp_path: Path) -> None:
    runs = {
        "least_time:cap1": _run(3.0),
        "nginx": _run(7.0),
        "vllm-router": _run(6.0),
        "nginx#2": _run(4.0),  # a repeat: not a baseline
    }
    body = {"common": {"seed": 3}, "options": _options(speeds=[1.0, 0.5]), "loads": {"1": runs}}
    measured = {**body, "options": {**_options(), "capacity": "measured"}}
    no_baseline = {**body, "loads": {"1": {"least_time": _run(3.0)}}}
    paths = [
        _write(tmp_path / "a.json", body),
        _write(tmp_path / "b.json", measured),
        _write(tmp_path / "c.json", no_baseline),
        _write(tmp_path / "d.json", [{"not": "a lanes report"}]),
    ]
    (row,) = ideal.sittings(paths)
    assert row["report"] == "a.json"
    assert (row["seed"], row["load"], row["duration"]) == (3, 1.0, 90.0)
    assert row["bound"] == pytest.approx(3.0)
    assert row["ours"] == {"least_time:cap1": 3.0}
    assert row["opts"].speeds == (1.0, 0.5)  # the sitting's own fleet and mix
    assert row["opts"].mix == bench.LanesOptions().mix


def test_cli_prints_the_ideal_fleet_and_each_sitting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {"least_time": _run(3.0), "nginx": _run(7.0)}
    body = {"common": {"seed": 1}, "options": _options(duration=20.0), "loads": {"1": runs}}
    path = _write(tmp_path / "sitting.json", body)
    assert ideal.main(["--seeds", "1", "--loads", "1", "--duration", "20", str(path)]) == 0
    out = capsys.readouterr().out
    assert "   1  100%" in out
    assert "sitting.json 100%: bound 3,500; ideal" in out
    assert "least_time 3,000 (" in out
