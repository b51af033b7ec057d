"""Issue 10's targets pooled over sittings (loadtest/lanes/pool.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from loadtest.lanes import pool


def _summary(tokens: float, e2e: float = 1.0) -> dict[str, Any]:
    return {
        "short_ttft_s": {"p50": 0.05, "p99": 0.5},
        "long_ttft_s": {"p50": 0.4, "p99": 2.0},
        "short_latency_s": {"p50": 0.8},
        "latency_s": {"p50": e2e},
        "output_tokens_per_s": tokens,
        "met_slo": 350,
        "ok": 420,
        "requests": 422,
    }


def _report(commit: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"source": {"commit": commit}, "loads": {"0.75": runs}}


def _sittings() -> list[dict[str, Any]]:
    """Three sittings of `least_time` against nginx: tokens/s 2% above, 1% below and
    equal; one more at another commit, and one under an @ref name."""
    return [
        _report("aaa", {"least_time": _summary(408.0), "nginx": _summary(400.0)}),
        _report("aaa", {"least_time": _summary(396.0), "nginx": _summary(400.0)}),
        _report("zzz", {"least_time@aaa": _summary(400.0), "nginx": _summary(400.0)}),
        _report("bbb", {"least_time": _summary(200.0), "nginx": _summary(400.0)}),
    ]


def _tokens(pooled: list[pool.Pooled]) -> pool.Pooled:
    (tokens,) = [p for p in pooled if p.target == "output tokens/s"]
    return tokens


def test_each_sitting_is_judged_against_its_own_baselines_and_pooled_by_commit() -> None:
    tokens = _tokens(pool.pool(_sittings(), "least_time", {"aaa"}))
    assert tokens.margins == pytest.approx((1.02, 0.99, 1.0))
    assert tokens.met == 2
    assert tokens.geometric_mean == pytest.approx((1.02 * 0.99) ** (1 / 3))
    low, high = tokens.interval or (math.nan, math.nan)
    assert low < 1 < high  # three sittings cannot tell it from its bound


def test_without_a_commit_every_sitting_of_the_setup_counts() -> None:
    tokens = _tokens(pool.pool(_sittings(), "least_time"))
    assert len(tokens.margins) == 4
    assert min(tokens.margins) == pytest.approx(0.5)


def test_a_margin_is_above_one_on_the_good_side_for_either_direction() -> None:
    pooled = pool.pool(_sittings()[:1], "least_time")
    by_target = {p.target: p for p in pooled}
    assert by_target["output tokens/s"].margins == pytest.approx((1.02,))
    assert by_target["long p99 TTFT"].margins == pytest.approx((0.5,))  # 2.0 against 0.5 x 2.0
    assert by_target["output tokens/s"].interval is None  # one sitting has no spread


def test_main_skips_what_is_not_a_lanes_report_and_prints_the_pool(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = []
    for i, body in enumerate([*_sittings(), [{"seed": 1}]]):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(body))
        paths.append(str(path))
    assert pool.main([*paths, "--setup", "least_time", "--commit", "aaa"]) == 0
    out, err = capsys.readouterr()
    assert "4.json: not a lanes report" in err
    assert "output tokens/s" in out
    assert "2 of 3" in out


def test_a_setup_no_report_judged_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sitting.json"
    path.write_text(json.dumps(_sittings()[0]))
    with pytest.raises(SystemExit) as exited:
        pool.main([str(path), "--setup", "least_tme"])
    assert exited.value.code == 2
    assert "no report judged least_tme" in capsys.readouterr().err


def test_a_zero_on_either_side_has_no_margin_and_is_left_out() -> None:
    nothing = _summary(400.0) | {"met_slo": 0}
    pooled = pool.pool(
        [_report("aaa", {"least_time": _summary(400.0), "nginx": nothing})], "least_time"
    )
    assert "goodput (both objectives)" not in {p.target for p in pooled}
    assert "output tokens/s" in {p.target for p in pooled}
