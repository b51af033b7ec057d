"""A smoke run of `python -m loadtest priority`: both arms on a tiny fleet, a report that
adds up (not how fast anything is)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import priority
from loadtest.loadgen import Mix
from loadtest.scenarios import Common


async def test_priority_smoke(tmp_path: Path) -> None:
    """Two arms on the same seeded arrivals; per class every request sent is counted once,
    under a status or as unfinished, and the report is written."""
    opts = priority.PriorityOptions(
        speeds=(1.0, 1.0),
        max_num_seqs=2,
        decode_s_per_token=0.005,
        duration=2.0,
        capacity=6.0,
        mix=Mix(long_share=0.0, short_tokens=(20, 40), max_tokens=(3, 6)),
    )
    common = Common(seed=3, out=tmp_path, pin=False, limit=30.0)
    body = await priority.priority(opts, common)
    saved = json.loads((tmp_path / "priority.json").read_text())
    assert list(saved["arms"]) == ["classes", "no classes"]
    assert saved["capacity_req_per_s"] == 6.0
    for arm in body["arms"].values():
        chat, jobs = arm["classes"].values()
        assert chat["sent"] == 6  # 0.25 and 0.75 of 2 x 6 req/s, for 2 s
        assert jobs["sent"] == 18
        for c in (chat, jobs):
            counted = c["status_200"] + c["status_429"] + c["status_503"] + c["other"]
            assert counted == c["sent"]
            assert c["ok"] <= c["status_200"]
            assert c["met_objectives"] <= c["ok"]
    assert arm["scheduling_policy"] == "fcfs"
    assert body["arms"]["classes"]["scheduling_policy"] == "priority"
    if body["gateway_classes"]:
        assert set(body["targets"]) == {
            "interactive_p99_ttft_within_objective",
            "batch_takes_the_refusals",
            "batch_goodput_above_zero",
        }
    else:
        assert body["gateway_refusal"]
