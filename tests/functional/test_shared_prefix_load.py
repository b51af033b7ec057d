"""Shared-prefix workloads driven against simulators with the prefix cache on, on loopback."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import aiohttp
from fakes import fleet
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_engine import tokenize_messages
from gateway.sim.sim_vllm import SimConfig
from loadtest import harness, report, scenarios
from loadtest.__main__ import main
from loadtest.loadgen import Client, session
from loadtest.workloads import (
    ConversationMix,
    PrefixMix,
    make_conversations,
    make_prefix_workload,
    run_conversations,
)


async def test_conversation_turns_wait_and_hit_their_history() -> None:
    """Each turn is sent after the previous one ended, and hits exactly its full cached blocks."""
    mix = ConversationMix(conversations=3, turns=3, user_tokens=(40, 90), max_tokens=(3, 5))
    specs = make_conversations(mix, seed=7)
    async with fleet(SimConfig(prefix_cache_blocks=4096)) as sims, session() as http:
        url = sims[0].url + "/v1"
        run = await run_conversations(
            Client(http, "unused"), specs, lambda s, w: url, label="conv", limit=20
        )
        stats = sims[0].stats
    assert len(run.results) == len(specs)
    assert all(r.ok for r in run.results)
    by_index = {r.index: r for r in run.results}
    expected_hits = 0
    for before, after in itertools.pairwise(specs):
        if before.conversation != after.conversation:
            continue
        done = by_index[before.index].sent + (by_index[before.index].latency or 0.0)
        assert by_index[after.index].sent >= done
        # The previous turn's full blocks are cached; its partial last block is not.
        expected_hits += len(tokenize_messages(before.chat_messages())) // 16 * 16
    assert stats.prefix_cache_hits == expected_hits > 0
    assert stats.prefix_cache_queries == sum(
        len(tokenize_messages(s.chat_messages())) for s in specs
    )
    assert report.summarize(run, ttft_slo=1.0, tpot_slo=0.1)["ok"] == len(specs)


async def test_users_stop_sending_at_the_duration() -> None:
    """With a duration, no request is sent after it; the requests never sent are not part
    of the run (not unfinished), and each user's requests still go one after another."""
    mix = ConversationMix(
        turns=3, user_tokens=(40, 90), max_tokens=(3, 5), users=4, think_s=0.5,
        requests_per_user=50,
    )  # fmt: skip
    specs = make_conversations(mix, seed=7)
    async with fleet(SimConfig(prefix_cache_blocks=4096)) as sims, session() as http:
        url = sims[0].url + "/v1"
        run = await run_conversations(
            Client(http, "unused"), specs, lambda s, w: url, label="users", limit=20, duration=1.0
        )
    assert 4 <= len(run.results) < len(specs)
    assert run.unfinished == 0
    assert all(r.ok for r in run.results)
    assert all(r.sent - run.started < 1.0 for r in run.results)
    # It ends with its last answer, not when its users' last think times would have ended.
    last = max(r.sent + (r.latency or 0.0) for r in run.results)
    assert run.ended - last < 0.1
    summary = report.summarize(run, ttft_slo=1.0, tpot_slo=0.1)
    assert summary["requests"] == summary["ok"] == len(run.results)
    by_index = {r.index: r for r in run.results}
    for before, after in itertools.pairwise(specs):
        if before.user == after.user and after.index in by_index:
            done = by_index[before.index].sent + (by_index[before.index].latency or 0.0)
            assert by_index[after.index].sent >= done + after.think - 0.005


async def test_run_scenario_with_prefix_groups(tmp_path: Path) -> None:
    """`run` with prefix groups hits the cache on every repeat of a group after its first."""
    prefix = PrefixMix(groups=2, prefix_tokens=160, suffix_tokens=20, max_tokens=(2, 3))
    async with fleet(SimConfig(prefix_cache_blocks=4096)) as sims:
        opts = scenarios.RunOptions(
            base_url=sims[0].url + "/v1", key="unused", requests=8, concurrency=1, prefix=prefix
        )
        common = scenarios.Common(seed=3, out=tmp_path, pin=False, limit=30.0)
        summary = await scenarios.run_once(opts, common)
        stats = sims[0].stats
    assert summary["ok"] == 8
    groups = {s.group for s in make_prefix_workload(8, prefix, seed=3)}
    assert groups == {0, 1}
    # One at a time: every request after its group's first hits the 4 + 160 shared tokens' blocks.
    assert stats.prefix_cache_hits == (8 - len(groups)) * (164 // 16 * 16)
    assert json.loads((tmp_path / "run.json").read_text())["options"]["prefix"]["groups"] == 2


def test_cli_runs_conversations(tmp_path: Path) -> None:
    """The CLI's --conversations sends every turn of every conversation (here to a closed port)."""
    status = main(
        ["run", "--base-url", "http://127.0.0.1:9/v1", "--key", "k", "--conversations", "2",
         "--turns", "3", "--no-pin", "--out", str(tmp_path)]
    )  # fmt: skip
    assert status == 0
    summary = json.loads((tmp_path / "run.json").read_text())["run"]
    assert summary["requests"] == 6
    assert summary["ok"] == 0


async def test_fleet_process_turns_the_prefix_cache_on() -> None:
    """harness.fleet_process passes --prefix-cache-blocks to the fleet CLI: a repeat prompt hits."""
    body = {"model": "sim-model", "prompt": list(range(100, 164)), "max_tokens": 1}
    async with (
        harness.fleet_process([1.0], max_num_seqs=4, seed=0, prefix_cache_blocks=64) as fleet_proc,
        aiohttp.ClientSession() as http,
    ):
        url = fleet_proc.urls[0]
        for _ in range(2):
            async with http.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
    assert "vllm:prefix_cache_queries_total" in text
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["vllm:prefix_cache_queries_total"] == 128
    assert samples["vllm:prefix_cache_hits_total"] == 48
