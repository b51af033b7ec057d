"""The `lanes` benchmark scenario end to end, tiny: every setup runs on the same requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import capacity, report, scenarios
from loadtest.lanes import bench
from loadtest.loadgen import Mix

TINY = Mix(long_share=0.5, short_tokens=(20, 20), long_tokens=(4400, 4400), max_tokens=(3, 3))


async def test_lanes_smoke(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """lanes measures the fleet's capacity, then runs least_time with flags, the sticky
    baseline that judges it, sticky again (its A/A spread) and an unknown setup (skipped),
    per class, at a share of it."""
    monkeypatch.setattr(capacity, "WARM", 1.0)
    monkeypatch.setattr(capacity, "WINDOW", 3.0)
    opts = bench.LanesOptions(
        setups=(
            "least_time:cap1+queue_all",
            "sticky",
            "sticky#2",
            "nginx_nowhere",
        ),
        speeds=(1.0, 0.4),
        loads=(0.4,),
        duration=2.0,
        mix=TINY,
        capacity="measured",
    )
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await bench.lanes(opts, common)
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
        "least_time:cap1+queue_all",
        "sticky",
        "sticky#2",  # a repeat runs as its own setup
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
    out = capsys.readouterr().out
    assert "nginx_nowhere: skipped (no such setup here)" in out
    assert "least_time:cap1+queue_all at 40% of capacity: " in out  # judged against sticky
    assert "sticky#2 at 40% of capacity: A/A spread against sticky" in out
    assert json.loads((tmp_path / "lanes.json").read_text())["loads"]
    assert (tmp_path / "lanes.png").exists() == report.can_plot()
