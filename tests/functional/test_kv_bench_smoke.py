"""A smoke run of the `kv` benchmark on loopback: a few seconds of its `evict` case through
the gateway with KV events and without.

Tiny workload, real processes; what is checked is that the report adds up and that the
exact arm's index is whole and says what the instances' own counters say, not how fast
anything is. vllm-router is not needed.
"""

from __future__ import annotations

import json
from pathlib import Path

from test_loadtest_smoke import assert_consistent

from loadtest import kv_bench, scenarios
from loadtest.workloads import PrefixMix

# 6 prefixes of 20 blocks; each instance's cache holds 48 blocks: it evicts.
TINY = PrefixMix(groups=6, prefix_tokens=320, suffix_tokens=40, max_tokens=(2, 4))


async def test_kv_benchmark_exact_index_matches_the_instances(tmp_path: Path) -> None:
    """Both gateway arms serve the same requests; the exact arm's index is whole wherever
    requests went and its hit estimate is the instances' own hit rate, give or take 0.05;
    the approx arm has no KV index; the estimate's target is judged."""
    opts = kv_bench.KvOptions(
        cases=("evict",),
        arms=("exact", "approx"),
        prefix=TINY,
        evict_cache_blocks=48,
        load=0.02,  # ~17 requests/s of a tiny mix
        duration=3.0,
    )
    common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await kv_bench.kv(opts, common)
    case = body["cases"]["evict"]
    assert set(case["runs"]) == {"exact", "approx"}
    for arm, summary in case["runs"].items():
        assert_consistent(summary)
        assert summary["ok"] == summary["requests"] == case["requests"], arm
        cache = summary["cache"]
        assert 0 < cache["hit_tokens"] <= cache["query_tokens"]
        # Every request went through the front: its answers' cached tokens are the
        # instances' counters, request by request.
        assert summary["index"]["true_from"] == "answers"
        assert summary["index"]["true"]["hit_tokens"] == cache["hit_tokens"]
        (gateway,) = summary["index"]["gateways"]
        assert gateway["estimate"]["query_tokens"] > 0
    exact = case["runs"]["exact"]
    (gateway,) = exact["index"]["gateways"]
    served = [name for name, v in exact["cache"]["instances"].items() if v["requests"]]
    assert served
    assert {gateway["kv"]["state"][name] for name in served} == {"whole"}
    assert gateway["kv"]["events"] > 0
    assert abs(exact["index"]["estimated"]["hit_rate"] - exact["cache"]["hit_rate"]) <= 0.05
    assert case["runs"]["approx"]["index"]["gateways"][0]["kv"]["state"] == {}
    judged = {t["target"]: t for t in body["targets"] if t["case"] == "evict"}
    estimate = judged["exact: |estimated - true hit rate| <= 0.02"]
    assert estimate["measured"] == exact["index"]["error"]
    assert estimate["met"] is not None
    assert judged["exact: p90 TTFT <= 0.7 x approx's"]["met"] is not None
    saved = json.loads((tmp_path / "kv.json").read_text())
    assert saved["targets"] == body["targets"]
