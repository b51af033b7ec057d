"""Smoke runs of the load generator and its scenarios on loopback: complete, consistent reports.

Tiny numbers, real processes (the scenarios start the fleet and the gateway as
subprocesses); what is checked is that every report adds up, not how fast anything is.
The parts that need no run (workload, percentiles, progress, --help) are checked in
tests/test_loadtest_parts.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fakes import fleet

from gateway.sim.sim_vllm import SimConfig
from loadtest import compare, overload_bench, report, scenarios, soak
from loadtest import tenants as tenants_bench
from loadtest.__main__ import main
from loadtest.loadgen import Client, Mix, make_workload, run_open, session
from loadtest.overhead import OverheadOptions, overhead

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
    # Side by side: direct, the gateway and the two Python floors always, nginx and
    # vllm-router (round robin and cache_aware) where installed; instant also alone (c=1).
    cells = body["fronts"]["cells"]
    assert set(cells) == {"instant", "paced"}
    assert set(cells["instant"]) == {"1", "32"}
    assert set(cells["paced"]) == {"32", "128"}
    for by_front in (
        cells["instant"]["1"],
        cells["instant"]["32"],
        cells["paced"]["32"],
        cells["paced"]["128"],
    ):
        assert {"direct", "gateway", "floor-aiohttp", "floor-httptools"} <= set(by_front)
        assert set(by_front) | set(body["fronts"]["skipped"]) == {
            "direct",
            "gateway",
            "floor-aiohttp",
            "floor-httptools",
            "nginx",
            "vllm-router-rr",
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
            if refused:  # a p90 takes 10 refusals (report.MIN_SAMPLES); a busy machine has fewer
                p90 = waits["p90"] if refused >= 10 else waits["max"]
                assert (waits["p90"] is None) == (refused < 10)
                assert 0 < waits["p50"] <= p90 <= waits["max"]
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


async def test_tenants_smoke(tmp_path: Path) -> None:
    """tenants with small limits driven hard: with Redis two replicas together admit what
    one bucket allows, and every refusal has OpenAI's headers; without, each replica
    admits its own bucket's worth."""
    keys = (
        tenants_bench.LimitedKey("requests", "requests", 6, 10, 4),
        tenants_bench.LimitedKey("tokens", "tokens", 600, 40, 20),
    )
    opts = tenants_bench.TenantsOptions(
        replicas=2, window=6.0, overdrive=30.0, keys=keys, cost_requests=0
    )
    body = await tenants_bench.tenants(opts, common(tmp_path))
    saved = json.loads((tmp_path / "tenants.json").read_text())
    assert set(saved["limits"]) == {"with_redis", "without_redis"}
    shared = body["limits"]["with_redis"]["keys"]
    alone = body["limits"]["without_redis"]["keys"]
    for name, key in shared.items():
        assert key["refused"] > 0
        assert key["refusals_with_openai_headers"] == key["refused"]
        assert key["other_statuses"] == []
        assert key["admitted"] <= key["due"]
        assert key["answers_with_ratelimit_headers"] == key["admitted_requests"]
        assert sum(r["admitted"] for r in key["per_replica"]) == key["admitted"]
        assert alone[name]["admitted"] > key["admitted"]  # each replica its own bucket
    assert shared["requests"]["admitted"] == 6  # the burst; a seventh is 10 s away
    assert [r["admitted"] for r in alone["requests"]["per_replica"]] == [6, 6]
