"""Pure parts of the `kv` benchmark: who bypasses the front, the parts of a run, the truth
from the answers, each instance's own KV event ports in settings.json, and the targets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtest import harness, kv_bench, kv_report
from loadtest.loadgen import RequestSpec, Result, Run


def _specs(count: int) -> list[RequestSpec]:
    return [RequestSpec(index=i, at=i * 0.1, prompt_tokens=10, max_tokens=2, client=0)
            for i in range(count)]  # fmt: skip


def test_bypassing_is_seeded_and_about_its_share() -> None:
    """The same seed sends the same requests to the same instances; about `share` of them."""
    specs = _specs(2000)
    chosen = kv_bench.bypassing(specs, 0.3, 4, seed=1)
    assert chosen == kv_bench.bypassing(specs, 0.3, 4, seed=1)
    assert chosen != kv_bench.bypassing(specs, 0.3, 4, seed=2)
    assert 0.25 < len(chosen) / len(specs) < 0.35
    assert set(chosen.values()) == {0, 1, 2, 3}


def test_part_keeps_its_requests_and_counts_its_unfinished() -> None:
    """A part of a run holds only the results it keeps, and its own specs never answered."""
    specs = _specs(5)
    run = Run("r", [Result(i, False, 0.0, status=200) for i in (0, 1, 2)], 1.0, 2.0)
    odd = kv_bench.part(run, specs, lambda i: i % 2 == 1)
    assert [r.index for r in odd.results] == [1]
    assert odd.unfinished == 1  # request 3
    assert (odd.started, odd.ended) == (1.0, 2.0)


def test_truth_from_the_answers_needs_every_answer() -> None:
    """The answers give a hit rate only when every ok one said what was cached."""
    told = [Result(i, False, 0.0, status=200, prompt_tokens=100, cached_tokens=c)
            for i, c in enumerate((80, 0))]  # fmt: skip
    assert kv_bench.per_request_truth(told) == {
        "query_tokens": 200, "hit_tokens": 80, "hit_rate": 0.4,
    }  # fmt: skip
    assert kv_bench.per_request_truth([*told, Result(9, False, 0.0, status=200)]) is None
    assert kv_bench.per_request_truth([*told, Result(9, False, 0.0, status=503)]) is not None


def test_each_instance_gets_its_own_kv_event_ports(tmp_path: Path) -> None:
    """A list of instance fields is one per instance, in order; a wrong count is refused."""
    fleet = harness.FleetProc(proc=None, urls=["http://a:1", "http://b:2"], kv_events_port=20000)  # type: ignore[arg-type]
    _, settings = harness.gateway_files(
        tmp_path, 8080, fleet.urls, strategy="least_time", max_num_seqs=4,
        instance_fields=fleet.kv_event_fields(),
    )  # fmt: skip
    instances = json.loads(settings.read_text())["vllm"]["instances"]
    assert [i["kv_events"]["endpoint"] for i in instances] == ["tcp://*:20000", "tcp://*:20002"]
    assert [i["kv_events"]["replay_endpoint"] for i in instances] == [
        "tcp://*:20001",
        "tcp://*:20003",
    ]
    with pytest.raises(ValueError, match="2 instances but 1 instance_fields"):
        harness.gateway_files(
            tmp_path, 8080, fleet.urls, strategy="least_time", max_num_seqs=4,
            instance_fields=[{}],
        )  # fmt: skip


def _arm(error: float | None, p90: float, tps: float = 100.0) -> dict[str, Any]:
    return {
        "index": {"error": error},
        "ttft_s": {"p90": p90},
        "output_tokens_per_s": tps,
        "restart": {"after": {"error": error}},
    }


def test_targets_are_met_and_missed() -> None:
    """The estimate within 0.02, exact's p90 at most 0.7x approx's, uniform within the A/A
    floor and the cost ratio: each can be missed, and one without a measure is not judged."""
    cases = {
        "evict": {"runs": {"exact": _arm(0.01, 0.5), "approx": _arm(0.2, 1.0)}},
        "bypass": {"runs": {"exact": _arm(None, 0.8), "approx": _arm(None, 1.0)}},
        "restart": {"runs": {"exact": _arm(0.03, 1.0)}},
        "uniform": {
            "runs": {
                "exact": _arm(0.0, 1.09, 94.0),
                "approx": _arm(0.0, 1.0, 100.0),
                "approx#2": _arm(0.0, 1.1, 100.0),
            }
        },
        "cost": {"exact_over_approx": 1.2},
    }
    targets = kv_report.verdicts(cases, noise=0.05)
    assert [(t["case"], t["met"]) for t in targets] == [
        ("evict", True),  # estimate 0.01 off
        ("bypass", None),  # no truth for the requests through the front
        ("restart", False),  # 0.03 off after the restart
        ("evict", True),  # p90 0.5 <= 0.7 x 1.0
        ("bypass", False),  # p90 0.8 > 0.7 x 1.0
        ("uniform", True),  # p90 1.09 <= 1.05 x (1 + 0.1), the A/A spread
        ("uniform", False),  # tok/s 94 < 100 x (1 - 0.05), the least floor
        ("cost", False),  # 1.2 > 1.1
    ]
    assert targets[5]["floor"] == pytest.approx(0.1)
    assert targets[5]["bar"] == pytest.approx(1.155)


def test_an_arm_mark_sets_the_queue_at_the_instances() -> None:
    """`exact@q0` is the exact arm holding every request in the gateway's queue; a repeat
    keeps its mark; anything but `@qN` is refused rather than run as the plain arm."""
    assert kv_bench._base("exact@q0") == "exact"
    assert kv_bench._base("approx#2") == "approx"
    assert kv_bench._queue_mark("exact@q0") == {"max_queue_per_instance": 0}
    assert kv_bench._queue_mark("approx@q3#2") == {"max_queue_per_instance": 3}
    assert kv_bench._queue_mark("exact") is None
    with pytest.raises(ValueError, match="only @qN"):
        kv_bench._queue_mark("exact@r4")
