"""The load tools' parts, checked without a run: the seeded workload, percentiles and the
samples each needs, py-spy frame shares, --help of every flag, the progress display, and the
soak's latency figures."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import itertools
import time

import pytest

from loadtest import progress, report, soak
from loadtest.loadgen import Mix, Result, Run, make_workload
from loadtest.overhead import top_frames
from loadtest.progress import Progress


def test_workload_is_seeded_and_mixes_long_prompts() -> None:
    """The same seed gives the same arrivals and prompts; the long share lands above 4096."""
    a = make_workload(400, Mix(long_share=0.25), seed=5, rate=10.0)
    assert a == make_workload(400, Mix(long_share=0.25), seed=5, rate=10.0)
    assert a != make_workload(400, Mix(long_share=0.25), seed=6, rate=10.0)
    assert all(x.at <= y.at for x, y in itertools.pairwise(a))
    long = [s for s in a if s.long]
    assert 0.15 < len(long) / len(a) < 0.35
    assert all(len(s.prompt().encode()) // 4 + 4 > 4096 for s in long)


def test_percentiles_are_nearest_rank_and_ordered() -> None:
    """Percentiles come from the data itself, in order, with None for no data."""
    p = report.percentiles(float(v) for v in range(1, 101))
    assert (p["p50"], p["p90"], p["p99"], p["max"], p["n"]) == (50.0, 90.0, 99.0, 100.0, 100)
    assert report.percentiles([])["p99"] is None


def test_p99_is_not_reported_from_fewer_than_100_samples() -> None:
    """Below 100 samples there is no p99 (None with the count; "n/a" in tables); below 10
    no p90: nearest rank would just repeat the maximum."""
    p = report.percentiles(float(v) for v in range(1, 100))
    assert (p["n"], p["p99"], p["p90"], p["max"]) == (99, None, 90.0, 99.0)
    p = report.percentiles([0.5] * 9)
    assert (p["n"], p["p90"], p["p99"], p["p50"]) == (9, None, None, 0.5)
    summary = {
        "label": "tiny",
        "ok": 9,
        "requests": 9,
        "errors": {},
        "ttft_s": report.percentiles([0.01] * 9),
        "tpot_s": report.percentiles([]),
        "latency_s": report.percentiles([0.02] * 150),
        "requests_per_s": 1.0,
        "output_tokens_per_s": 1.0,
        "goodput_rps": 1.0,
    }
    row = report.run_table([summary]).splitlines()[2].split()
    # run ok/req errors retried | ttft p50 p90 p99 max | tpot p50 p90 p99 | e2e p50 p99 max
    assert row[3] == "0"  # a summary from before --retries counts none
    assert row[4:8] == ["10.0", "n/a", "n/a", "10.0"]
    assert row[8:11] == ["-", "-", "-"]  # no samples at all: nothing to report
    assert row[11:14] == ["20.0", "20.0", "20.0"]
    retried = report.run_table([{**summary, "retried": 3}]).splitlines()[2].split()
    assert retried[3] == "3"
    assert "p99 needs 100" in report.run_table([summary])


def test_top_frames_sums_py_spy_stacks() -> None:
    """Collapsed py-spy stacks become shares per function, the event loop's own apart."""
    raw = (
        "main (a.py:1);f (gateway/proxy/handler.py:10) 3\nmain (a.py:1);g (b.py:2) 1\n"
        "main (a.py:1);Runner.run (asyncio/runners.py:118) 5\n"
    )
    top = top_frames(raw)
    assert (top["samples"], top["loop_samples"]) == (4, 5)
    assert top["self"][0] == ("f (gateway/proxy/handler.py)", 0.75)
    assert ("main (a.py)", 1.0) in top["inclusive"]


def _help_entries(text: str) -> list[str]:
    """Each option's entry of an argparse --help text ("--flag X  its help"), wrapped lines
    joined; the usage and the description before the first section heading are skipped."""
    entries: list[str] = []
    in_section = False
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            in_section = True  # "options:", or an argument group's heading
            entries.append("")
        elif in_section and line.startswith("  -"):
            entries.append(line.strip())
        elif in_section and entries and line.startswith("     ") and line.strip():
            entries[-1] += "  " + line.strip()
    return [e for e in entries if e and not e.startswith("-h, --help")]


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("loadtest.__main__", ["run"]),
        ("loadtest.__main__", ["sweep"]),
        ("loadtest.__main__", ["compare"]),
        ("loadtest.__main__", ["lanes"]),
        ("loadtest.__main__", ["overhead"]),
        ("loadtest.fleet", []),
        ("gateway.sim.sim_fleet", []),
        ("loadtest.soak", []),
        ("loadtest.replicas", []),
        ("loadtest.affinity_cost", []),
        ("loadtest.lanes.ideal", []),
        ("loadtest.disagg.calibration", []),
        ("loadtest.disagg.bench", []),
    ],
)
def test_every_load_tool_flag_has_help_and_shows_its_default(
    module: str, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """--help of every load tool (and each scenario) explains each flag and gives its
    default, or says that it is required."""
    main_of = importlib.import_module(module).main
    with pytest.raises(SystemExit) as stop:
        main_of([*argv, "--help"])
    assert stop.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    assert len(entries) >= 3
    for entry in entries:
        _flag, _, explained = entry.partition("  ")
        assert explained.strip(), f"no help: {entry}"
        assert "(default" in entry or "(required)" in entry, f"no default shown: {entry}"


def test_progress_bar_shows_counts_and_an_eta() -> None:
    """With tqdm, a run's progress is a bar of answered requests with the rate and the time
    left, plus sent, errors and in flight; without tqdm, the plain line says the same."""
    pytest.importorskip("tqdm")
    run = Run("demo", started=time.perf_counter())
    run.results = [Result(i, False, run.started, status=200 if i else 500) for i in range(3)]
    stream = io.StringIO()
    bar = Progress(run, 10, stream=stream, bar=True)
    bar.sent = 5
    asyncio.run(_tick(bar))
    out = stream.getvalue()
    assert "[demo]" in out
    assert "3/10" in out
    assert "<" in out  # tqdm's "elapsed<remaining": the ETA
    assert "req/s" in out
    assert "sent 5 errors 1 in-flight 2" in out


def test_progress_line_without_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without tqdm (or off a terminal) progress is one line a second: sent, done, errors,
    in flight and the rate."""
    monkeypatch.setattr(progress, "_tqdm", lambda: None)
    run = Run("demo", started=time.perf_counter())
    run.results = [Result(0, False, run.started, status=200)]
    stream = io.StringIO()
    line = Progress(run, 4, stream=stream, bar=True)  # asked for, but there is no tqdm
    assert not line.bar
    line.sent = 2
    asyncio.run(_tick(line))
    assert "sent 2/4 done 1 errors 0 in-flight 1" in stream.getvalue()


async def _tick(p: Progress) -> None:
    """Let a progress reporter run one round, then cancel it as the runners do."""
    task = asyncio.create_task(p.loop(every=0.01))
    await asyncio.sleep(0.05)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_soak_reports_no_p99_from_fewer_than_100_answers() -> None:
    """The soak's latency has its count, and no p99 (null, "n/a (n<100)") below 100 answers."""
    few = soak._latency([0.2] * 50)
    assert few == {"n": 50, "p50": 0.2, "p99": None}
    assert soak._latency_text(few) == "p50 0.2 s, p99 n/a (n<100) (n=50)"
    many = soak._latency([float(v) for v in range(1, 201)])
    assert (many["n"], many["p99"]) == (200, 198.0)


def test_the_budget_gives_each_sample_to_its_innermost_stage() -> None:
    from loadtest.budget import OTHER, budget, stage_of

    site = "/x/.venv/lib/python3.11/site-packages/"
    handle = "handle (gateway/proxy/handler.py:171)"
    record = "record (gateway/observe/recorder.py:230)"
    inc = f"inc ({site}prometheus_client/metrics.py:310)"
    loop = f"run ({site}uvloop/__init__.py:82)"
    raw = "\n".join(
        [
            f"{loop};{handle};{record};{inc} 3",  # a metric counted from the access line
            f"{loop};{handle};{record} 1",
            f"{loop};{handle} 2",
            f"{loop};_run_once (asyncio/base_events.py:1900) 2",
            f"{loop} 100",  # idle: left out
        ]
    )
    assert stage_of([loop, handle, record, inc]) == "metrics"
    assert stage_of(["main (x.py:1)"]) == OTHER
    stages = budget(raw, cpu_ms_per_request=0.8)
    assert {k: v["share"] for k, v in stages.items()} == {
        "metrics": 0.375,
        "access line": 0.125,
        "handler": 0.25,
        OTHER: 0.25,
    }
    assert stages["metrics"]["us_per_request"] == 300.0


def test_fairness_fronts_spread_or_pin_each_keys_streams() -> None:
    """ "ours@r4" spreads a key's streams over the replicas by worker; "ours@r2p" sends each
    key through one replica, the keys dealt round them in order; "s" asks strict caps."""
    from loadtest import fairness

    assert fairness.variant("ours@r4") == (None, 4)
    assert fairness.variant("ours@r4s") == (None, 4)
    assert fairness.variant("ours@r2p") == (None, 2)
    assert fairness.variant("ours@q2") == (2, 1)
    spread = fairness.Front("ours@r4", ["u0", "u1", "u2", "u3"])
    assert [spread.route("calm")(None, w) for w in range(5)] == ["u0", "u1", "u2", "u3", "u0"]
    pinned = fairness.Front("ours@r2p", ["u0", "u1"], pinned=["flood", "calm", "x"])
    assert {pinned.route("calm")(None, w) for w in range(4)} == {"u1"}
    assert {pinned.route("flood")(None, w) for w in range(4)} == {"u0"}
    assert pinned.route("x")(None, 1) == "u0"
