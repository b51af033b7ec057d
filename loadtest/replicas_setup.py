"""The processes of one setup of `python -m loadtest.replicas`, and what they measure.

A setup is a fresh fleet, N gateways pinned to the gateway core (sharing a view through a
throwaway Redis or not) and a round-robin open loop over them; it reports the gateways' CPU
and, with the prefix cache on, the fleet's hit rate. The cost part starts its own: one
gateway with `[shared]` and one without, an idle peer, and alternating closed loops.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import shutil
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from loadtest import harness, report
from loadtest.loadgen import (
    SEED_MIX,
    Client,
    Mix,
    RequestSpec,
    make_workload,
    run_closed,
    run_open,
    session,
)
from loadtest.scenarios import Common, cores, fleet_names, relabel, slo_block, summarize


@dataclass(frozen=True)
class ReplicaOptions:
    strategies: tuple[str, ...] = ("least_busy", "least_time")
    replicas: int = 4
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    max_num_seqs: int = 16
    load: float = 0.75
    duration: float = 30.0
    mix: Mix = field(default_factory=lambda: SEED_MIX)
    prefix: bool = True  # also the shared-prefix part
    prefix_duration: float = 30.0
    cost_requests: int = 0  # streamed requests per arm of the cost part; 0 skips it
    cost_rounds: int = 3
    # Run the one-replica baseline twice: the ratio of the two is the run's noise floor.
    baseline_twice: bool = False


@contextlib.asynccontextmanager
async def redis_process() -> AsyncIterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
    port = harness.free_port()
    proc = await asyncio.create_subprocess_exec(
        binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(100):
            with contextlib.suppress(OSError):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            await asyncio.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        await proc.wait()


async def _fleet_hit_rate(urls: Sequence[str]) -> dict[str, float | None]:
    """Each instance's prefix-cache hit rate from its own counters, and the fleet's."""
    totals: dict[str, tuple[float, float]] = {}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            queries = hits = 0.0
            for line in text.splitlines():
                if line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
            totals[url] = (queries, hits)
    out: dict[str, float | None] = {u: (h / q if q else None) for u, (q, h) in totals.items()}
    queries = sum(q for q, _ in totals.values())
    out["fleet"] = sum(h for _, h in totals.values()) / queries if queries else None
    return out


async def one_setup(
    label: str,
    specs: Sequence[RequestSpec],
    *,
    strategy: str,
    replicas: int,
    shared: bool,
    opts: ReplicaOptions,
    common: Common,
    prefix_cache_blocks: int = 0,
    push: bool = True,
) -> tuple[report.Summary, dict[str, float | None]]:
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                prefix_cache_blocks=prefix_cache_blocks,
            )
        )
        extra: dict[str, dict[str, Any]] = {}
        if shared:
            url = await stack.enter_async_context(redis_process())
            extra["shared"] = {"redis_url": url, "namespace": "bench"}
            if not push:  # the rounds alone, every publish_interval (what push adds)
                extra["shared"]["push_interval"] = 0
        gateways = [
            await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy=strategy,
                    max_num_seqs=opts.max_num_seqs,
                    core=gw_core,
                    source=common.gateway_dir,
                    slo=slo_block(common),
                    extra=extra,
                )
            )
            for _ in range(replicas)
        ]
        if shared:
            await asyncio.sleep(1.0)  # a few publish rounds: every replica sees the others
        turn = itertools.cycle([gw.base_url for gw in gateways])
        client = Client(await stack.enter_async_context(session()), harness.KEY)
        cpu_before, started = _cpu(gateways), time.monotonic()
        run = await run_open(
            client, specs, lambda spec, worker: next(turn), label=label, limit=common.limit
        )
        cpu, wall = _cpu(gateways) - cpu_before, time.monotonic() - started
        hits = await _fleet_hit_rate(fleet.urls) if prefix_cache_blocks else {}
        summary = relabel(summarize(run, common), fleet_names(fleet.urls, opts.speeds))
        # What the gateway processes used of their (one, shared) core while the run lasted.
        summary["gateway_cpu"] = {"cpu_s": cpu, "wall_s": wall, "core_share": cpu / wall}
        return summary, hits
    raise AssertionError("unreachable")  # pragma: no cover


def _cpu(gateways: Sequence[harness.GatewayProcess]) -> float:
    return sum(harness.cpu_seconds(gw.pid) for gw in gateways)


async def cost_part(opts: ReplicaOptions, common: Common) -> dict[str, Any]:
    """Gateway CPU per streamed request with and without the shared view, arms alternating."""
    from loadtest.overhead import IDLE_MIX

    gw_core, fleet_core = cores(common)
    cpu: dict[str, list[tuple[float, int]]] = {"local": [], "shared": []}
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                (1.0, 1.0), max_num_seqs=64, seed=common.seed, instant=True, core=fleet_core
            )
        )
        url = await stack.enter_async_context(redis_process())
        shared = {"shared": {"redis_url": url, "namespace": "cost"}}
        arms = {
            arm: await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy="least_busy",
                    max_num_seqs=64,
                    core=gw_core,
                    source=common.gateway_dir,
                    extra=extra,
                )
            )
            for arm, extra in (("local", None), ("shared", shared))
        }
        # An idle peer: the measured process reads and decodes its publication each round.
        await stack.enter_async_context(
            harness.gateway_process(
                fleet.urls, strategy="least_busy", max_num_seqs=64, core=fleet_core,
                source=common.gateway_dir, extra=shared,
            )
        )  # fmt: skip
        client = Client(await stack.enter_async_context(session()), harness.KEY)
        specs = make_workload(opts.cost_requests, IDLE_MIX, common.seed)
        for _ in range(opts.cost_rounds):
            for arm, gw in arms.items():
                before = harness.cpu_seconds(gw.pid)
                run = await run_closed(
                    client, specs, lambda s, w, u=gw.base_url: u, concurrency=32,
                    label=f"cost: {arm}", limit=common.limit,
                )  # fmt: skip
                done = sum(1 for r in run.results if r.ok)
                cpu[arm].append((harness.cpu_seconds(gw.pid) - before, done))
    per = {
        arm: 1000 * sum(c for c, _ in runs) / max(1, sum(n for _, n in runs))
        for arm, runs in cpu.items()
    }
    return {
        "cpu_ms_per_request": per,
        "rounds": {arm: [list(r) for r in runs] for arm, runs in cpu.items()},
        "shared_over_local": per["shared"] / per["local"] if per["local"] else None,
    }
