"""A smoke run of `python -m loadtest.replicas`: 1 vs 2 replicas, with and without sharing.

Tiny numbers and real processes (fleet, gateways and a redis-server as subprocesses);
what is checked is that the report adds up and names what the issue's targets compare.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from loadtest import replicas, scenarios
from loadtest.loadgen import Mix

TINY = Mix(long_share=0.5, short_tokens=(20, 20), long_tokens=(4200, 4200), max_tokens=(3, 3))


@pytest.fixture(autouse=True)
def needs_redis() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing: .ci/run installs Debian's redis-server")
        pytest.skip("redis-server is not installed (apt-get install redis-server)")


async def test_replicas_report_adds_up(tmp_path: Path) -> None:
    """Each setup answers every request, the ratios exist, the cost part measured both arms."""
    opts = replicas.ReplicaOptions(
        strategies=("least_busy",),
        replicas=2,
        duration=2.0,
        load=0.5,
        mix=TINY,
        prefix=False,
        cost_requests=60,
        cost_rounds=1,
    )
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await replicas.replicas(opts, common)
    part = body["slow_card"]["least_busy"]
    assert set(part["runs"]) == {
        "1 replica",
        "2 replicas shared",
        "2 replicas shared, rounds only",
        "2 replicas not shared",
    }
    for summary in part["runs"].values():
        assert summary["ok"] == summary["requests"] > 0
        assert summary["gateway_cpu"]["cpu_s"] > 0
    assert part["tok_s_shared_over_one"] > 0
    assert part["p99_ttft_shared_over_one"] is None or part["p99_ttft_shared_over_one"] > 0
    cost = body["cost"]
    assert [n for _, n in cost["rounds"]["local"]] == [60]
    assert [n for _, n in cost["rounds"]["shared"]] == [60]
    assert cost["cpu_ms_per_request"]["shared"] > 0
    saved = json.loads((tmp_path / "replicas.json").read_text())
    counts = {
        label: run["requests"] for label, run in saved["slow_card"]["least_busy"]["runs"].items()
    }
    assert len(set(counts.values())) == 1, counts  # one workload through every setup


def test_only_cost_runs_the_cost_part_alone() -> None:
    """`--only cost` drops the slow-card setups and the shared-prefix part, keeps the cost part."""
    opts = replicas.options(replicas._parser().parse_args(["--only", "cost", "--cost-rounds", "5"]))
    assert opts.strategies == ()
    assert opts.prefix is False
    assert opts.cost_requests == 2000
    assert opts.cost_rounds == 5
    full = replicas.options(replicas._parser().parse_args([]))
    assert full.strategies == ("least_busy", "least_time")
    assert full.prefix


async def test_the_cost_part_alone_writes_its_own_report(tmp_path: Path) -> None:
    """Run alone, the cost part measures both arms and writes replicas-cost.json, not the
    full run's replicas.json."""
    opts = replicas.ReplicaOptions(strategies=(), prefix=False, cost_requests=40, cost_rounds=1)
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await replicas.replicas(opts, common)
    assert body["slow_card"] == {}
    assert [n for _, n in body["cost"]["rounds"]["shared"]] == [40]
    assert (tmp_path / "replicas-cost.json").exists()
    assert not (tmp_path / "replicas.json").exists()
