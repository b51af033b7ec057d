"""Issue 10's targets judged inside one `lanes` run (loadtest/lanes/targets.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.lanes import targets

RESULTS = Path(__file__).resolve().parent.parent / "loadtest" / "results" / "lanes"


def _summary(
    short_ttft: tuple[float | None, float | None] = (0.05, 0.5),
    long_p99: float | None = 2.0,
    short_e2e: float = 0.8,
    e2e: float = 1.0,
    tokens: float = 400.0,
    met: int = 350,
) -> dict[str, Any]:
    return {
        "short_ttft_s": {"p50": short_ttft[0], "p99": short_ttft[1]},
        "long_ttft_s": {"p50": 0.4, "p99": long_p99},
        "short_latency_s": {"p50": short_e2e},
        "latency_s": {"p50": e2e},
        "output_tokens_per_s": tokens,
        "met_slo": met,
        "ok": 420,
        "requests": 422,
    }


def _saved(folder: Path, loads: dict[str, dict[str, Any]], name: str = "lanes.json") -> Path:
    """A `lanes` report as a sitting writes it, at commit abc1234."""
    path = folder / name
    path.write_text(json.dumps({"source": {"commit": "abc1234"}, "loads": loads}))
    return path


def _met(verdicts: list[targets.Verdict]) -> dict[str, bool]:
    return {v.target: v.met for v in verdicts}


def test_each_target_is_judged_against_the_best_baseline_for_it() -> None:
    """The best is taken per target: nginx's TTFT, vllm-router's tokens/s."""
    nginx = _summary(short_ttft=(0.03, 2.0), long_p99=2.4, tokens=390.0, met=340)
    router = _summary(short_ttft=(0.06, 1.6), long_p99=3.0, tokens=410.0, met=345)
    ours = _summary(short_ttft=(0.03, 0.7), long_p99=1.3, short_e2e=0.7, e2e=1.02, tokens=405.0)
    verdicts = {v.target: v for v in targets.judge(ours, [nginx, router])}
    assert verdicts["short p50 TTFT"].best == 0.03
    assert verdicts["short p50 TTFT"].met  # equal is no worse
    assert verdicts["short p99 TTFT"].bound == pytest.approx(0.8)  # half of 1.6
    assert verdicts["short p99 TTFT"].met
    assert verdicts["long p99 TTFT"].bound == pytest.approx(1.2)  # half of 2.4
    assert not verdicts["long p99 TTFT"].met
    assert verdicts["short p50 end-to-end"].met
    assert not verdicts["p50 end-to-end, all requests"].met  # 1.02 against 1.0
    assert verdicts["output tokens/s"].best == 410.0
    assert not verdicts["output tokens/s"].met
    assert verdicts["goodput (both objectives)"].met  # 350 against 345


def test_goodput_must_be_the_highest_and_tokens_only_as_high() -> None:
    base = _summary(tokens=400.0, met=350)
    verdicts = _met(targets.judge(_summary(tokens=400.0, met=350), [base]))
    assert verdicts["output tokens/s"]
    assert not verdicts["goodput (both objectives)"]
    # Between two baselines: beating the worse one is not the highest.
    low, high = _summary(met=340), _summary(met=360)
    verdicts = _met(targets.judge(_summary(met=350), [low, high]))
    assert not verdicts["goodput (both objectives)"]


def test_a_percentile_too_few_samples_had_is_not_judged() -> None:
    ours = _summary(short_ttft=(0.05, None))
    verdicts = targets.judge(ours, [_summary()])
    names = {v.target for v in verdicts}
    assert "short p99 TTFT" not in names
    assert "short p50 TTFT" in names
    text = targets.render("0.75", "ours", verdicts, ours)
    assert "420 of 422 requests answered (1 targets not judged" in text


def test_a_run_without_baselines_judges_nothing() -> None:
    assert targets.judge_run({"least_time": _summary(), "least_busy": _summary()}) == {}
    judged = targets.judge_run({"least_time": _summary(), "nginx": _summary()})
    assert list(judged) == ["least_time"]


def test_a_saved_report_is_judged_as_the_benchmark_page_says() -> None:
    """`lanes-6e72517-run2.json` (loadtest/README.md, "Round 5", run 2): at 75% every
    target but the median of all requests; at 100% every one."""
    path = RESULTS / "lanes-6e72517-run2.json"
    text = targets.render_report(
        path, json.loads(path.read_text()), setup="least_time:shared+cap1+running4"
    )
    at_75, at_100 = text.split("\n\n")[1:]
    assert "6 of 7 targets met" in at_75
    assert [line.split()[0:2] for line in at_75.splitlines() if "MISSED" in line] == [
        ["p50", "end-to-end,"]
    ]
    assert "7 of 7 targets met" in at_100
    assert "MISSED" not in at_100


def test_an_unknown_setup_is_an_error_not_an_empty_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    runs = {"least_time:cap1": _summary(), "least_busy": _summary(), "nginx": _summary()}
    with pytest.raises(SystemExit) as exited:
        targets.main([str(_saved(tmp_path, {"0.75": runs})), "--setup", "least_tme"])
    assert exited.value.code == 2
    assert "no setup 'least_tme' (there: least_busy, least_time:cap1, nginx)" in (
        capsys.readouterr().err
    )


def test_sticky_is_a_baseline_not_a_setup_to_judge() -> None:
    judged = targets.judge_run({"least_time": _summary(), "sticky": _summary()})
    assert list(judged) == ["least_time"]


def test_main_prints_every_gateway_setup_and_skips_what_is_no_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every gateway setup at every load is judged; a load without a baseline says so; a
    JSON file that is not a `lanes` report is skipped with a line."""
    runs = {"least_time": _summary(), "least_busy": _summary(), "nginx": _summary()}
    loads = {"0.75": runs, "1": runs, "1.25": {"least_time": _summary()}}
    other = tmp_path / "capacity.json"
    other.write_text(json.dumps([{"seed": 1}]))
    assert targets.main([str(_saved(tmp_path, loads)), str(other)]) == 0
    out, err = capsys.readouterr()
    assert "lanes.json (gateway at abc1234;" in out
    assert out.count("targets met") == 4  # two gateway setups at two loads
    assert "125%: no baseline ran beside the gateway; nothing judged" in out
    assert "capacity.json: not a lanes report (no loads), skipped" in err


def test_a_repeat_is_neither_judged_nor_a_baseline_but_gives_the_a_a_spread() -> None:
    """`nginx#2` is nginx again: it does not raise the bar ("best" stays the first
    nginx's), is not judged as a gateway setup, and each target's spread is reported."""
    nginx = _summary(tokens=400.0, e2e=1.00)
    again = _summary(tokens=404.0, e2e=1.05)
    runs = {"least_time": _summary(tokens=402.0, e2e=1.0), "nginx": nginx, "nginx#2": again}
    judged = targets.judge_run(runs)
    assert list(judged) == ["least_time"]
    tokens = next(v for v in judged["least_time"] if v.target == "output tokens/s")
    assert tokens.best == 400.0  # not the repeat's 404
    assert tokens.met
    (spreads,) = targets.spread(runs).values()
    by_target = {s.target: s for s in spreads}
    assert by_target["output tokens/s"].relative == pytest.approx(0.01)
    assert by_target["p50 end-to-end, all requests"].relative == pytest.approx(0.05)
    assert by_target["short p50 TTFT"].relative == 0.0
    text = targets.render_spread("0.75", "nginx#2", spreads)
    assert text.startswith("nginx#2 at 75% of capacity: A/A spread against nginx")
    assert "5.0%" in text


def test_a_repeat_without_its_first_run_has_no_spread() -> None:
    assert targets.spread({"nginx#2": _summary(), "least_time": _summary()}) == {}
