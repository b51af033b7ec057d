"""`overhead`'s side-by-side part: the gateway beside nginx and vLLM's Rust router.

Four simulated instances, 200-token prompts, 16-token streamed answers, closed loop. Two
fleets: *instant* (each answer's 16 chunks written at once, so a front reads it in one or
two reads) and *paced* (one chunk per token, 5 ms apart, however many run at once: the
simulator's batch slowdown is off so every front sees the same pace). In front of each:

- `direct`: the load generator spreads requests over the instances itself (round robin);
- `gateway`: ours, `least_busy`, every feature on, as `overhead` runs it;
- `floor-aiohttp` and `floor-httptools` (loadtest/floor.py): the least a Python forwarder
  on our HTTP client costs, on aiohttp's server and on a bare httptools one;
- `nginx` (`least_conn`), and vLLM's Rust router in its cheapest policy (`vllm-router-rr`,
  `round_robin`) and its default (`vllm-router`, `cache_aware`), where installed.

Each front runs alone on the gateway's core; its CPU time (utime + stime of its process,
all threads) around a run, divided by the requests, is its cost per streamed request.
Requests per second and end-to-end latency are compared with `direct` in the same fleet,
so what a front adds is the difference. Paced streams run at concurrency 32 and 128,
instant ones at 1 (the latency a front adds to one request alone) and 32.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest import baselines, harness
from loadtest.loadgen import Client, Mix, make_workload, run_closed, session
from loadtest.scenarios import Common, cores, say, summarize, to_v1

FRONT_MIX = Mix(long_share=0.0, short_tokens=(200, 200), max_tokens=(16, 16))
FRONTS = (
    "direct",
    "gateway",
    "floor-aiohttp",
    "floor-httptools",
    "nginx",
    "vllm-router-rr",
    "vllm-router",
)
# Whose CPU each front's is compared with: the router's cheapest and default policies, nginx.
BASES = ("vllm-router-rr", "vllm-router", "nginx")
INSTANCES = 4
PACED_SPEED = 2.0  # the simulator's 10 ms a token at speed 1: 5 ms apart
CELLS: dict[str, tuple[int, ...]] = {"instant": (1, 32), "paced": (32, 128)}


@dataclass(frozen=True)
class FrontOptions:
    requests: int = 3000  # per cell (front, fleet, concurrency)
    warmup: int = 200


@dataclass
class Front:
    name: str
    urls: list[str]  # base URLs ending in /v1; requests go round robin over them
    pid: int | None  # the process whose CPU is counted (None: direct)


@contextlib.asynccontextmanager
async def _front(name: str, fleet: Sequence[str], common: Common) -> AsyncIterator[Front]:
    core = cores(common)[0]
    if name == "direct":
        yield Front(name, [to_v1(u) for u in fleet], None)
    elif name == "gateway":
        async with harness.gateway_process(
            fleet,
            strategy="least_busy",
            max_num_seqs=256,
            core=core,
            gateway={"max_connections": 512},
            source=common.gateway_dir,
        ) as gw:
            yield Front(name, [gw.base_url], gw.pid)
    else:
        pids: list[int] = []
        async with baselines.front(name, fleet, core=core, seed=common.seed, pids=pids) as url:
            yield Front(name, [to_v1(url)], pids[0])


async def _cell(
    client: Client, front: Front, concurrency: int, opts: FrontOptions, common: Common, label: str
) -> dict[str, Any]:
    urls = front.urls

    def route(spec: Any, worker: int) -> str:
        return urls[worker % len(urls)]

    warm = make_workload(opts.warmup, FRONT_MIX, common.seed + 1)
    await run_closed(client, warm, route, concurrency=concurrency, label="warm-up", limit=60)
    specs = make_workload(opts.requests, FRONT_MIX, common.seed)
    before = harness.cpu_seconds(front.pid) if front.pid else 0.0
    wall = time.perf_counter()
    run = await run_closed(
        client, specs, route, concurrency=concurrency, label=label, limit=common.limit
    )
    wall = time.perf_counter() - wall
    cpu = harness.cpu_seconds(front.pid) - before if front.pid else None
    summary = summarize(run, common)
    done = max(1, summary["ok"])
    return {
        "requests": summary["requests"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "requests_per_s": summary["requests_per_s"],
        "latency_s": summary["latency_s"],
        "ttft_s": summary["ttft_s"],
        "reads_per_stream_p50": summary["reads_per_stream"]["p50"],
        "cpu_s": cpu,
        "cpu_ms_per_request": None if cpu is None else 1000 * cpu / done,
        "core_utilisation": None if cpu is None else cpu / wall,
    }


async def fronts(opts: FrontOptions, common: Common) -> dict[str, Any]:
    """Every front at every cell; `cells[fleet][concurrency][front]`, then the ratios."""
    cells: dict[str, dict[str, dict[str, Any]]] = {}
    skipped: dict[str, str] = {}
    fleet_core = cores(common)[1]
    for kind, concurrencies in CELLS.items():
        async with (
            harness.fleet_process(
                (PACED_SPEED,) * INSTANCES,
                max_num_seqs=256,
                seed=common.seed,
                instant=kind == "instant",
                core=fleet_core,
                decode_slowdown=0.0,
            ) as fleet,
            session() as http,
        ):
            client = Client(http, harness.KEY)
            for name in FRONTS:
                why = baselines.missing(name) if name in baselines.BASELINES else None
                if why is not None:
                    skipped[name] = why
                    continue
                async with _front(name, fleet.urls, common) as front:
                    for c in concurrencies:
                        label = f"{name} {kind} c={c}"
                        say(f"front {label}")
                        cell = await _cell(client, front, c, opts, common, label)
                        cells.setdefault(kind, {}).setdefault(str(c), {})[name] = cell
    return {"cells": cells, "skipped": skipped, "ratios": ratios(cells)}


def ratios(cells: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per cell: each front's CPU against the Rust router's and nginx's, its requests/s
    against direct's, and the latency it adds at p50 and p99 (ms)."""
    out: dict[str, Any] = {}
    for kind, by_c in cells.items():
        for c, by_front in by_c.items():
            direct = by_front.get("direct")
            for name, cell in by_front.items():
                if name == "direct":
                    continue
                row: dict[str, float | None] = {}
                for base in BASES:
                    other = by_front.get(base, {}).get("cpu_ms_per_request")
                    mine = cell.get("cpu_ms_per_request")
                    if other and mine is not None and base != name:
                        row[f"cpu_vs_{base}"] = mine / other
                if direct is not None:
                    row["rps_vs_direct"] = cell["requests_per_s"] / direct["requests_per_s"]
                    for p in ("p50", "p99"):
                        mine, theirs = cell["latency_s"][p], direct["latency_s"][p]
                        if mine is not None and theirs is not None:
                            row[f"added_{p}_ms"] = 1000 * (mine - theirs)
                out[f"{kind} c={c} {name}"] = row
    return out


def table(body: dict[str, Any]) -> str:
    """The side-by-side table, one row per cell and front."""
    lines = [
        "| fleet | c | front | CPU ms/request | req/s | vs direct | p50 / p99 latency ms "
        "| added p50 / p99 ms | CPU vs vllm-router-rr | CPU vs vllm-router |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratio = body["ratios"]
    for kind, by_c in body["cells"].items():
        for c, by_front in by_c.items():
            for name, cell in by_front.items():
                r = ratio.get(f"{kind} c={c} {name}", {})
                cpu = cell["cpu_ms_per_request"]
                lat = cell["latency_s"]
                lines.append(
                    f"| {kind} | {c} | {name} | {_num(cpu, 3)} | {cell['requests_per_s']:.0f} "
                    f"| {_num(r.get('rps_vs_direct'), 2, 'x')} "
                    f"| {_ms(lat['p50'])} / {_ms(lat['p99'])} "
                    f"| {_num(r.get('added_p50_ms'), 1)} / {_num(r.get('added_p99_ms'), 1)} "
                    f"| {_num(r.get('cpu_vs_vllm-router-rr'), 2, 'x')} "
                    f"| {_num(r.get('cpu_vs_vllm-router'), 2, 'x')} |"
                )
    for name, why in body["skipped"].items():
        lines.append(f"\n{name}: not run ({why})")
    return "\n".join(lines)


def _num(value: float | None, digits: int, suffix: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f}"
