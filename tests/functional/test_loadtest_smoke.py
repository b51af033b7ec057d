"""Smoke runs of the load generator and its scenarios on loopback: complete, consistent reports.

Tiny numbers, real processes (the scenarios start the fleet and the gateway as
subprocesses); what is checked is that every report adds up, not how fast anything is.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import io
import itertools
import json
import time
from pathlib import Path
from typing import Any

import pytest
from fakes import fleet

from gateway.sim.sim_vllm import SimConfig
from loadtest import compare, overload_bench, progress, report, scenarios, soak
from loadtest.__main__ import main
from loadtest.loadgen import Client, Mix, Result, Run, make_workload, run_open, session
from loadtest.overhead import OverheadOptions, overhead, top_frames
from loadtest.progress import Progress

TINY = Mix(long_share=0.3, short_tokens=(20, 60), long_tokens=(4200, 4400), max_tokens=(3, 6))


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The texts (titles, labels, legends, notes) of each figure a test saves, one string a
    figure; stays empty without matplotlib."""
    saved: list[str] = []
    if not report.can_plot():
        return saved
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    original = Figure.savefig

    def savefig(self: Figure, *args: Any, **kwargs: Any) -> Any:
        saved.append("\n".join(t.get_text() for t in self.findobj(Text)))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def assert_plotted(figures: list[str], *needles: str) -> None:
    """With matplotlib, one figure was saved and shows each needle; without, none was."""
    if not report.can_plot():
        assert figures == []
        return
    assert len(figures) == 1
    for needle in needles:
        assert needle in figures[0], (needle, figures[0])


def common(tmp_path: Path) -> scenarios.Common:
    # No pinning: it would move the test process itself onto one core.
    return scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)


def assert_consistent(summary: dict[str, Any]) -> None:
    assert summary["completed"] + summary["errors"].get("unfinished", 0) == summary["requests"]
    failed = sum(n for key, n in summary["errors"].items() if key != "unfinished")
    assert summary["ok"] + failed == summary["completed"]
    for key in ("ttft_s", "tpot_s", "latency_s", "output_tokens", "long_ttft_s"):
        p = summary[key]
        # a percentile is reported exactly when there are enough samples for it
        for name, least in report.MIN_SAMPLES.items():
            assert (p[f"p{name}"] is None) == (p["n"] < least), (key, name, p)
        present = [p[k] for k in ("p50", "p90", "p99", "max") if p[k] is not None]
        assert present == sorted(present), key
    line = summary["timeline"]
    assert sum(line["ok"]) == summary["ok"]
    assert sum(line["ok"]) + sum(line["failed"]) == summary["completed"]
    assert 0 <= summary["goodput_rps"] <= summary["requests_per_s"] + 1e-9
    assert summary["met_slo"] <= summary["ok"]
    assert 0 < summary["window_s"] <= summary["duration_s"]
    if summary["ok"]:
        shares = [v["share"] for v in summary["instances"].values()]
        assert sum(shares) == pytest.approx(1.0)
        assert sum(v["requests"] for v in summary["instances"].values()) == summary["ok"]


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
    # ttft p50 p90 p99 max | tpot p50 p90 p99 | e2e p50 p99 max
    assert row[3:7] == ["10.0", "n/a", "n/a", "10.0"]
    assert row[7:10] == ["-", "-", "-"]  # no samples at all: nothing to report
    assert row[10:13] == ["20.0", "20.0", "20.0"]
    assert "p99 needs 100" in report.run_table([summary])


def test_top_frames_sums_py_spy_stacks() -> None:
    """Collapsed py-spy stacks become shares per function, the event loop's own apart."""
    raw = (
        "main (a.py:1);f (gateway/proxy.py:10) 3\nmain (a.py:1);g (b.py:2) 1\n"
        "main (a.py:1);Runner.run (asyncio/runners.py:118) 5\n"
    )
    top = top_frames(raw)
    assert (top["samples"], top["loop_samples"]) == (4, 5)
    assert top["self"][0] == ("f (gateway/proxy.py)", 0.75)
    assert ("main (a.py)", 1.0) in top["inclusive"]


async def test_open_loop_run_against_instances_times_every_stream(tmp_path: Path) -> None:
    """An open-loop run straight at two simulated instances records TTFT, TPOT and tokens."""
    async with fleet(SimConfig(seed=1), SimConfig(seed=2)) as sims, session() as http:
        client = Client(http, "unused")
        specs = make_workload(12, TINY, seed=1, rate=40.0)
        urls = [s.url + "/v1" for s in sims]
        run = await run_open(client, specs, lambda s, w: urls[w % 2], label="direct", limit=20)
    summary = report.summarize(run, ttft_slo=1.0, tpot_slo=0.1)
    assert_consistent(summary)
    assert summary["ok"] == 12
    assert all(
        r.tokens == s.max_tokens
        for r, s in zip(sorted(run.results, key=lambda r: r.index), specs, strict=True)
    )
    assert summary["tpot_s"]["p50"] is not None


async def test_run_scenario_reports_a_closed_loop_run(tmp_path: Path, figures: list[str]) -> None:
    """`run` drives any base URL in a closed loop and writes a consistent report, and a PNG
    of TTFT over time (n=10, no p99 from 10 samples) beside the throughput over time."""
    async with fleet(SimConfig(seed=4)) as sims:
        opts = scenarios.RunOptions(
            base_url=sims[0].url + "/v1", key="unused", requests=10, concurrency=3, mix=TINY
        )
        summary = await scenarios.run_once(opts, common(tmp_path))
    assert_consistent(summary)
    assert summary["ok"] == 10
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["options"]["key"] == "***"
    assert saved["run"]["ttft_s"]["p99"] is None
    assert saved["run"]["ttft_s"]["n"] == 10
    assert (tmp_path / "run.png").exists() == report.can_plot()
    assert_plotted(figures, "n=10", "p99 n/a (n<100)", "throughput over time", "output tokens/s")


def test_cli_counts_refused_connections_as_errors(tmp_path: Path) -> None:
    """The CLI runs to the end against a closed port and reports every request as failed."""
    status = main(
        ["run", "--base-url", "http://127.0.0.1:9/v1", "--key", "k", "--requests", "4",
         "--concurrency", "2", "--no-pin", "--out", str(tmp_path)]
    )  # fmt: skip
    assert status == 0
    summary = json.loads((tmp_path / "run.json").read_text())["run"]
    assert_consistent(summary)
    assert summary["ok"] == 0
    assert sum(summary["errors"].values()) == 4


async def test_compare_smoke(tmp_path: Path, figures: list[str]) -> None:
    """compare runs each strategy and the no-gateway baseline, open, closed and laddered;
    its plots give sample counts, no p99 from a handful, and throughput over time."""
    opts = compare.CompareOptions(
        duration=1.0,
        load=0.3,
        concurrency=4,
        closed_requests=8,
        mix=TINY,
        closed_mix=TINY,
        ladder=(0.4,),
        ladder_duration=0.8,
    )
    body = await compare.compare(opts, common(tmp_path))
    for phase in ("open", "closed"):
        runs = body["phases"][phase]
        assert set(runs) == {"round_robin", "least_busy", "independent"}
        for summary in runs.values():
            assert_consistent(summary)
            assert summary["ok"] == summary["requests"]
    for runs in body["ladder"].values():
        for summary in runs.values():
            assert_consistent(summary)
    assert set(body["served_load_at_90pct_slo"]) == {"round_robin", "least_busy", "independent"}
    open_counts = {s["requests"] for s in body["phases"]["open"].values()}
    assert len(open_counts) == 1  # the same workload for every setup
    assert set(body["least_busy_over_round_robin"]) == {"open", "closed"}
    assert json.loads((tmp_path / "compare.json").read_text())["phases"]
    assert (tmp_path / "compare.png").exists() == report.can_plot()
    assert (tmp_path / "compare-ladder.png").exists() == report.can_plot()
    if report.can_plot():
        assert len(figures) == 2  # compare.png, compare-ladder.png
        assert "n/a\n(n=" in figures[0]
        assert "throughput over time" in figures[0]
        assert "(n=" in figures[1]
        assert "n/a (n<100)" in figures[1]


async def test_sweep_smoke(tmp_path: Path, figures: list[str]) -> None:
    """sweep measures every concurrency level through the gateway and draws the plot, with
    each level's sample count, p99 left out (too few samples) and a throughput panel."""
    opts = scenarios.SweepOptions(
        speeds=(1.0, 0.5), levels=(1, 2, 4), requests_per_client=2, mix=TINY
    )
    body = await scenarios.sweep(opts, common(tmp_path))
    assert [p["concurrency"] for p in body["points"]] == [1, 2, 4]
    for point in body["points"]:
        assert_consistent(point)
        assert point["ok"] == point["requests"] == point["concurrency"] * 2
    assert (tmp_path / "sweep.png").exists() == report.can_plot()
    assert_plotted(figures, "n=2", "n=8", "p99 (n/a at 3 of 3", "throughput")


async def test_overhead_smoke(tmp_path: Path, figures: list[str]) -> None:
    """overhead reports added latency, CPU per request and memory with open streams, and
    draws them (p99 n/a from 8 idle requests per arm; the loaded runs' throughput)."""
    opts = OverheadOptions(
        idle_requests=8,
        rounds=2,
        requests=40,
        concurrency=4,
        streams=30,
        profile=False,
        front_requests=40,
    )
    body = await overhead(opts, common(tmp_path))
    for summary in body["idle"]["runs"].values():
        assert_consistent(summary)
        assert summary["ok"] == 8
    # 8 requests an arm: a p50 to compare, no p99
    assert set(body["idle"]["added"]) == {"latency_s_p50_ms", "ttft_s_p50_ms"}
    for key in ("cpu_instant", "cpu_paced"):
        assert body[key]["run"]["ok"] == 40
        assert body[key]["gateway_cpu_s"] >= 0
    # Side by side: direct and the gateway always, nginx and vllm-router where installed.
    cells = body["fronts"]["cells"]
    assert set(cells) == {"instant", "paced"}
    assert set(cells["paced"]) == {"32", "128"}
    for by_front in (cells["instant"]["32"], cells["paced"]["32"], cells["paced"]["128"]):
        assert {"direct", "gateway"} <= set(by_front)
        assert set(by_front) | set(body["fronts"]["skipped"]) == {
            "direct",
            "gateway",
            "nginx",
            "vllm-router",
        }
        for name, cell in by_front.items():
            assert cell["ok"] == 40, name
            assert (cell["cpu_ms_per_request"] is None) == (name == "direct")
    assert "rps_vs_direct" in body["fronts"]["ratios"]["paced c=128 gateway"]
    streams = body["streams"]
    assert_consistent(streams["run"])
    assert streams["run"]["ok"] == 30
    assert streams["memory_kib_after"]["VmHWM"] >= streams["memory_kib_at_start"]["VmRSS"]
    assert (tmp_path / "overhead.json").exists()
    assert (tmp_path / "overhead.png").exists() == report.can_plot()
    assert_plotted(figures, "direct (n=8)", "gateway (n=8)", "n/a", "throughput over time")


async def test_compare_least_busy_keeps_most_requests_off_a_slow_card(tmp_path: Path) -> None:
    """In a closed loop of 2 on a fast and a 10x slower card, least_busy sends the slow card
    under 30% of requests; a load-blind choice sends it about half (round robin exactly)."""
    # Each instance holds one of the two requests at a time (the other instance always has
    # more of ours in flight), so the fast card serves about 10 for each the slow one does:
    # an expected share of 1/11, and under 0.3 unless per-request overhead outgrows the
    # 0.8 s of the slow card's decode. A random choice lands at most 12 of 40 there with
    # probability under 1%.
    short = Mix(long_share=0.0, short_tokens=(20, 40), max_tokens=(8, 8))
    opts = compare.CompareOptions(
        strategies=("least_busy",),
        speeds=(1.0, 0.1),
        duration=0.5,
        load=0.2,
        concurrency=2,
        closed_requests=40,
        mix=short,
        closed_mix=short,
        independent=False,
    )
    body = await compare.compare(opts, common(tmp_path))
    closed = body["phases"]["closed"]["least_busy"]
    assert_consistent(closed)
    assert closed["ok"] == closed["requests"] == 40
    shares = {name: v["share"] for name, v in closed["instances"].items()}
    assert set(shares) == {"#0 x1.0", "#1 x0.1"}
    assert shares["#1 x0.1"] < 0.3, shares


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
        ("loadtest.__main__", ["overhead"]),
        ("loadtest.fleet", []),
        ("gateway.sim.fleet", []),
        ("loadtest.soak", []),
        ("loadtest.replicas", []),
        ("loadtest.affinity_cost", []),
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


def test_soak_smoke_writes_its_report_and_plot(tmp_path: Path, figures: list[str]) -> None:
    """A two-second soak through a real gateway: the report adds up (its timeline counts
    every answer) and --png draws latency with its count beside throughput over time."""
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    argv = ["--seconds", "2", "--concurrency", "2", "--speeds", "1", "--kill-every", "60"]
    assert soak.main([*argv, "--json", str(out), "--png", str(png)]) == 0
    body = json.loads(out.read_text())
    line = body["timeline"]
    assert sum(line["ok"]) == body["answered"] == body["latency_s"]["n"] > 0
    assert sum(line["failed"]) == sum(body["failed"].values())
    assert png.exists() == report.can_plot()
    n = body["latency_s"]["n"]
    needle = "p99 n/a (n<100)" if n < 100 else "p99 "
    assert_plotted(figures, f"n={n} answered", needle, "throughput over time")


async def test_overload_smoke(tmp_path: Path) -> None:
    """overload runs both setups at each load; every request is counted once, every refusal
    has a wait, and the JSON holds each figure the page reports."""
    opts = overload_bench.OverloadOptions(
        speeds=(1.0, 1.0), max_num_seqs=2, loads=(1.0, 3.0), duration=0.8, mix=TINY,
        max_queue_per_instance=0,  # queue at the gateway at once, so admission has work
        warmup=0.4,
    )  # fmt: skip
    body = await overload_bench.overload(opts, common(tmp_path))
    saved = json.loads((tmp_path / "overload.json").read_text())
    assert set(saved["loads"]) == {"1", "3"}
    assert set(saved["verdict"]) == set(overload_bench.SETUPS)
    for key, at_load in saved["loads"].items():
        assert at_load["offered_rps"] == pytest.approx(float(key) * saved["capacity_req_per_s"])
        assert set(at_load["setups"]) == set(overload_bench.SETUPS)
        for entry in at_load["setups"].values():
            assert entry["requests"] == at_load["sent"]
            refused = sum(entry["refused"].values())
            assert (
                entry["answered_200"] + refused + entry["no_answer"] + entry["unfinished"]
                == entry["requests"]
            )
            assert entry["ok"] + entry["broken_200"] == entry["answered_200"]
            timeline = entry["by_second_sent"]
            assert sum(t["200"] for t in timeline) == entry["answered_200"]
            assert (
                sum(t["429"] + t["503"] + t["other"] for t in timeline)
                == refused + entry["no_answer"]
            )
            assert_consistent(entry["summary"])
            waits = entry["refusal_wait_s"]
            assert (waits["p50"] is not None) == (refused > 0)
            if refused:
                assert 0 < waits["p50"] <= waits["p90"] <= waits["max"]
            lanes = entry["admitted_ttft_s"]
            assert sum(lane["admitted"] for lane in lanes.values()) <= entry["answered_200"]
            for lane in lanes.values():
                assert {"objective_s", "admitted", "p50", "p99"} <= set(lane)
            assert entry["refusal_waits"] == refused
            warm = entry["after_warmup"]
            assert 0 < warm["sent"] < entry["requests"]
            assert warm["refusal_waits"] <= refused
            assert set(warm["admitted_ttft_s"]) == set(lanes)
            assert entry["goodput_rps"] == entry["summary"]["goodput_rps"]
            assert entry["goodput_share_of_base"] is not None
            assert entry["output_tokens_per_s"] >= 0
            expected = set() if key == "1" else set(overload_bench.judge(entry, 1.0))
            assert set(entry["targets"]) == expected
    # Three times the capacity with no room at the instances: admission refuses some at once.
    assert sum(saved["loads"]["3"]["setups"]["admission"]["refused"].values()) > 0
    assert body["loads"]["1"]["setups"]["admission"]["goodput_share_of_base"] == 1.0
    assert (tmp_path / "overload.png").exists() == report.can_plot()
