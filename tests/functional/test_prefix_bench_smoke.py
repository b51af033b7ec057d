"""Smoke runs of the `prefix` benchmark and its sticky cache-aware front, on loopback.

Tiny workloads, real processes; what is checked is that the report adds up and that the
sticky baseline does what the routers' `cache_aware` rule does, not how fast anything is.
Neither nginx nor vllm-router is needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from test_loadtest_smoke import assert_consistent

from loadtest import baselines, harness, prefix_bench, report, scenarios
from loadtest.sticky import StickyPolicy, request_text
from loadtest.workloads import ConversationMix, PrefixMix, group_prefix

TINY = PrefixMix(groups=2, prefix_tokens=160, suffix_tokens=20, max_tokens=(2, 3))


def _chat(text: str) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], "max_tokens": 2}


def test_sticky_policy_follows_the_prefix_until_the_load_is_imbalanced() -> None:
    """A repeated prefix goes where it went; a large imbalance sends it to the least loaded."""
    policy = StickyPolicy(["a", "b", "c"], balance_abs=2, balance_rel=1.5, seed=1)
    prefix = group_prefix(0, 400, seed=1)
    first = policy.choose(request_text(_chat(prefix + "one suffix")))
    assert [policy.choose(request_text(_chat(prefix + f"suffix {n}"))) for n in range(2)] == [
        first,
        first,
    ]
    assert policy.decisions["affinity"] == 2
    # Three in flight at `first`, none elsewhere: 3 - 0 > 2 and 3 > 0 x 1.5, imbalanced.
    assert policy.choose(request_text(_chat(prefix + "more"))) != first
    assert policy.decisions["imbalanced"] == 1
    for _ in range(3):
        policy.done(first)
    # Balanced again (1 - 0 <= 2): a prompt that matches nothing goes to the least loaded.
    other = policy.choose(request_text(_chat(group_prefix(1, 400, seed=1))))
    assert policy.inflight[other] == 1
    assert policy.decisions["least_loaded"] == 2


async def test_sticky_front_routes_a_repeated_prefix_to_one_instance() -> None:
    """Through the sticky process, requests sharing a long prefix all land on one instance."""
    prefix = group_prefix(0, 300, seed=2)
    async with (
        harness.fleet_process([1.0, 1.0, 1.0], max_num_seqs=4, seed=0, instant=True) as fleet,
        baselines.front("sticky", fleet.urls, core=None, seed=0) as url,
        aiohttp.ClientSession() as http,
    ):
        seen = []
        for n in range(4):
            body = _chat(prefix + f"question number {n}")
            async with http.post(url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                assert (await resp.json())["usage"]["completion_tokens"] == 2
                seen.append(resp.headers["X-Gateway-Instance"])
    assert len(set(seen)) == 1
    assert seen[0] in {u.removeprefix("http://") for u in fleet.urls}


async def test_prefix_benchmark_report_adds_up(tmp_path: Path) -> None:
    """Each scenario's runs are complete and consistent, hits never exceed lookups, and every
    target whose setups ran gets a verdict."""
    opts = prefix_bench.PrefixOptions(
        scenarios=("uniform", "conversations"),
        setups=("least_time", "sticky"),
        prefix=TINY,
        cache_blocks=64,
        duration=0.3,
        conversations=ConversationMix(
            conversations=2, turns=2, user_tokens=(40, 60), max_tokens=(2, 3)
        ),
        conversation_setups=("least_busy/no-affinity", "least_time"),
    )
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await prefix_bench.prefix(opts, common)
    for name, scenario in body["scenarios"].items():
        counts = set()
        for summary in scenario["runs"].values():
            assert_consistent(summary)
            assert summary["ok"] == summary["requests"], name
            cache = summary["cache"]
            assert 0 <= cache["hit_tokens"] <= cache["query_tokens"]
            assert cache["hit_tokens"] == sum(v["hit_tokens"] for v in cache["instances"].values())
            assert sum(v["requests"] for v in cache["instances"].values()) == summary["ok"]
            q = summary["ttft_quantiles_s"]
            assert q == sorted(q)
            assert len(q) == 101
            assert q[50] == pytest.approx(summary["ttft_s"]["p50"])
            counts.add(summary["requests"])
        assert len(counts) == 1  # the same workload for every setup
    uniform = body["scenarios"]["uniform"]
    assert set(uniform["runs"]) == {"least_time", "sticky"}
    assert uniform["runs"]["sticky"]["cache"]["hit_rate"] > 0  # a group's repeats hit
    assert {t["scenario"] for t in body["targets"]} == {"uniform", "conversations"}
    for target in body["targets"]:  # a verdict wherever both sides were run
        assert (target["met"] is None) == (target["measured"] is None or target["bar"] is None)
    assert all(t["met"] is not None for t in body["targets"] if t["scenario"] == "uniform")
    saved = json.loads((tmp_path / "prefix.json").read_text())
    assert saved["targets"] == body["targets"]
    assert (tmp_path / "prefix-ttft.png").exists() == report.can_plot()


async def test_a_missing_baseline_is_skipped_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A baseline that is not installed starts nothing: one line says why, and no run."""
    monkeypatch.setattr(baselines, "_nginx", lambda: None)
    monkeypatch.setattr(baselines, "_vllm_router", lambda: None)
    opts = prefix_bench.PrefixOptions(prefix=TINY)
    common = scenarios.Common(seed=3, pin=False, limit=5.0)
    for name in ("nginx", "vllm-router"):
        assert await prefix_bench.run_setup(name, "open", [], (1.0,), 64, opts, common) is None
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "skipped nginx: nginx is not installed (apt-get install nginx-light)",
        "skipped vllm-router: vllm-router is not installed (pip install -e '.[baselines]')",
    ]
