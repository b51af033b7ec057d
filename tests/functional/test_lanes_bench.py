"""The `lanes` benchmark scenario end to end, tiny: every setup runs on the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import capacity, lanes_bench, lanes_targets, report, scenarios
from loadtest.loadgen import Mix, Result

TINY = Mix(long_share=0.5, short_tokens=(20, 20), long_tokens=(4400, 4400), max_tokens=(3, 3))


async def test_lanes_smoke(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lanes measures the fleet's capacity, then runs the gateway queueing all, least_time
    with a flag, and an unknown setup (skipped), per class, at a share of it."""
    monkeypatch.setattr(capacity, "WARM", 1.0)
    monkeypatch.setattr(capacity, "WINDOW", 3.0)
    opts = lanes_bench.LanesOptions(
        setups=(
            "least_busy:queue_all",
            "least_time:cap1",
            "least_time:cap1#2",
            "nginx_nowhere",
        ),
        speeds=(1.0, 0.4),
        loads=(0.4,),
        duration=2.0,
        mix=TINY,
        capacity="measured",
    )
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await lanes_bench.lanes(opts, common)
    measured = body["capacity_measured"]
    # Every card kept full serves something, and the loads are shares of what was
    # measured rather than of the estimate.
    assert all(share > 0 for share in measured["per_card"].values())
    assert body["capacity_estimate_req_per_s"] == measured["estimate_req_per_s"]
    assert (
        body["capacity_req_per_s"]
        == measured["req_per_s"]
        == pytest.approx(measured["estimate_req_per_s"] * measured["share_of_estimate"])
    )
    runs = body["loads"]["0.4"]
    assert set(runs) == {
        "least_busy:queue_all",
        "least_time:cap1",
        "least_time:cap1#2",  # a repeat runs as its own setup
    }
    assert len({s["requests"] for s in runs.values()}) == 1  # the same requests for each
    for summary in runs.values():  # every request is good or missed in exactly one way
        missed = sum(n for by in summary["missed"].values() for n in by.values())
        assert summary["met_slo"] + missed == summary["requests"]
    for summary in runs.values():
        assert summary["ok"] == summary["requests"]
        assert len(summary["short_ttfts"]) + len(summary["long_ttfts"]) == summary["ok"]
        assert summary["long_ttfts"] == sorted(summary["long_ttfts"])
        assert summary["short_ttft_s"]["p50"] is not None
        last = summary["last_answers"]
        ends = [a["end_s"] for a in last]
        assert ends == sorted(ends)
        assert 0 < len(last) <= 5
        # The last answer ends the run's span (the span is measured after it).
        assert ends[-1] <= summary["duration_s"]
        assert all(a["end_s"] == pytest.approx(a["sent_s"] + a["latency_s"]) for a in last)
    assert json.loads((tmp_path / "lanes.json").read_text())["loads"]
    assert (tmp_path / "lanes.png").exists() == report.can_plot()


def test_setup_flags_become_dispatch_settings() -> None:
    """`queue_all` lifts the queue wait past any run; `cap1` allows one long prefill per
    instance; no flag leaves the gateway's defaults."""
    assert lanes_bench._dispatch(set()) == {}
    assert lanes_bench._prefill(set()) == {}
    assert lanes_bench._prefill({"cap1", "queue_all"}) == {"max_long_per_instance": 1}
    assert lanes_bench._dispatch({"queue_all", "cap1"}) == {"max_queue_wait": lanes_bench.QUEUE_ALL}
    assert lanes_bench._dispatch({"cardq0"}) == {"max_queue_per_instance": 0}
    assert lanes_bench._dispatch({"cardq4", "queue_all"}) == {
        "max_queue_per_instance": 4,
        "max_queue_wait": lanes_bench.QUEUE_ALL,
    }


def test_a_setup_names_its_strategy_flags_and_ref() -> None:
    """`strategy:flag+flag@ref` splits into its parts; a bare name has no flag and no ref;
    an unknown flag is an error naming it."""
    assert lanes_bench.parse_setup("least_busy:queue_all+cap1@ae9739e") == (
        "least_busy",
        {"queue_all", "cap1"},
        "ae9739e",
    )
    assert lanes_bench.parse_setup("least_time") == ("least_time", set(), None)
    with pytest.raises(ValueError, match="'bogus'"):
        lanes_bench.parse_setup("least_time:bogus")


def test_a_repeated_gateway_setup_is_the_same_setup() -> None:
    assert lanes_bench.parse_setup("least_time:queue_all+cap1@abc#2") == (
        "least_time",
        {"queue_all", "cap1"},
        "abc",
    )
    assert lanes_targets.front("nginx#2") == "nginx"
    assert not lanes_targets.is_repeat("nginx")


def test_missed_goodput_is_split_by_class_and_objective() -> None:
    """Each request out of goodput counts once, in its class, under the objective it missed
    (or both, or failed); requests within both objectives count nowhere."""
    results = [
        Result(0, long=False, sent=0.0, status=200, ttft=0.1, tpot=0.01),  # good
        Result(1, long=False, sent=0.0, status=200, ttft=2.0, tpot=0.01),  # late
        Result(2, long=True, sent=0.0, status=200, ttft=0.5, tpot=0.09),  # slow
        Result(3, long=True, sent=0.0, status=200, ttft=1.5, tpot=0.09),  # both
        Result(4, long=True, sent=0.0, status=429),  # refused
    ]
    assert lanes_bench.missed_objectives(results, 1.0, 0.05) == {
        "short": {"failed": 0, "ttft": 1, "tpot": 0, "both": 0},
        "long": {"failed": 1, "ttft": 0, "tpot": 1, "both": 1},
    }
