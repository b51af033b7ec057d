"""Smoke runs of the load generator and its scenarios on loopback: complete, consistent reports.

Tiny numbers, real processes (the scenarios start the fleet and the gateway as
subprocesses); what is checked is that every report adds up, not how fast anything is.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from fakes import fleet

from loadtest import compare, overload_bench, report, scenarios
from loadtest.__main__ import main
from loadtest.loadgen import Client, Mix, make_workload, run_open, session
from loadtest.overhead import OverheadOptions, overhead, top_frames
from loadtest.sim_vllm import SimConfig

TINY = Mix(long_share=0.3, short_tokens=(20, 60), long_tokens=(4200, 4400), max_tokens=(3, 6))


def common(tmp_path: Path) -> scenarios.Common:
    # No pinning: it would move the test process itself onto one core.
    return scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)


def assert_consistent(summary: dict[str, Any]) -> None:
    assert summary["completed"] + summary["errors"].get("unfinished", 0) == summary["requests"]
    failed = sum(n for key, n in summary["errors"].items() if key != "unfinished")
    assert summary["ok"] + failed == summary["completed"]
    for key in ("ttft_s", "tpot_s", "latency_s", "output_tokens", "long_ttft_s"):
        p = summary[key]
        if p["p50"] is not None:
            assert p["p50"] <= p["p90"] <= p["p99"] <= p["max"], key
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
    assert (p["p50"], p["p90"], p["p99"], p["max"]) == (50.0, 90.0, 99.0, 100.0)
    assert report.percentiles([])["p99"] is None


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


async def test_run_scenario_reports_a_closed_loop_run(tmp_path: Path) -> None:
    """`run` drives any base URL in a closed loop and writes a consistent report."""
    async with fleet(SimConfig(seed=4)) as sims:
        opts = scenarios.RunOptions(
            base_url=sims[0].url + "/v1", key="unused", requests=10, concurrency=3, mix=TINY
        )
        summary = await scenarios.run_once(opts, common(tmp_path))
    assert_consistent(summary)
    assert summary["ok"] == 10
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["options"]["key"] == "***"


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


async def test_compare_smoke(tmp_path: Path) -> None:
    """compare runs each strategy and the no-gateway baseline, open, closed and laddered."""
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


async def test_sweep_smoke(tmp_path: Path) -> None:
    """sweep measures every concurrency level through the gateway and draws the plot."""
    opts = scenarios.SweepOptions(
        speeds=(1.0, 0.5), levels=(1, 2, 4), requests_per_client=2, mix=TINY
    )
    body = await scenarios.sweep(opts, common(tmp_path))
    assert [p["concurrency"] for p in body["points"]] == [1, 2, 4]
    for point in body["points"]:
        assert_consistent(point)
        assert point["ok"] == point["requests"] == point["concurrency"] * 2
    assert (tmp_path / "sweep.png").exists() == report.can_plot()


async def test_overhead_smoke(tmp_path: Path) -> None:
    """overhead reports added latency, CPU per request and memory with open streams."""
    opts = OverheadOptions(
        idle_requests=8, rounds=2, requests=40, concurrency=4, streams=30, profile=False
    )
    body = await overhead(opts, common(tmp_path))
    for summary in body["idle"]["runs"].values():
        assert_consistent(summary)
        assert summary["ok"] == 8
    assert {"latency_s_p50_ms", "ttft_s_p99_ms"} <= set(body["idle"]["added"])
    for key in ("cpu_instant", "cpu_paced"):
        assert body[key]["run"]["ok"] == 40
        assert body[key]["gateway_cpu_s"] >= 0
    streams = body["streams"]
    assert_consistent(streams["run"])
    assert streams["run"]["ok"] == 30
    assert streams["memory_kib_after"]["VmHWM"] >= streams["memory_kib_at_start"]["VmRSS"]
    assert (tmp_path / "overhead.json").exists()


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
