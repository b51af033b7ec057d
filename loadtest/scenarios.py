"""The scenarios behind `python -m loadtest`: run, sweep and compare (overhead has its own module).

- `run`: one load against any OpenAI-compatible base URL with a key.
- `sweep`: TTFT and TPOT against concurrency 1, 2, 4, 8, 16 through the gateway.
- `compare`: one seeded workload through each strategy, and through no gateway at all,
  on a fleet with one slow card; at a fixed offered load (open loop) and saturated
  (closed loop), because tokens per second only measure a setup when it is saturated.

Each writes a JSON report and a PNG under the output folder and prints tables.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest import harness, report
from loadtest.loadgen import (
    Client,
    Mix,
    RequestSpec,
    Route,
    Run,
    make_workload,
    run_closed,
    run_open,
    session,
)
from loadtest.sim_engine import SimConfig


@dataclass(frozen=True)
class Common:
    """Options every scenario takes."""

    seed: int = 1
    ttft_slo: float = 1.0  # seconds
    tpot_slo: float = 0.05  # seconds per output token
    out: Path = Path("loadtest/results")
    pin: bool = True  # gateway on core 0; fleet and load generator on core 1
    limit: float = 300.0  # seconds any one run may take


def say(text: str = "") -> None:
    print(text, flush=True)


def summarize(run: Run, common: Common) -> report.Summary:
    return report.summarize(run, ttft_slo=common.ttft_slo, tpot_slo=common.tpot_slo)


def write_json(common: Common, name: str, body: dict[str, Any]) -> Path:
    common.out.mkdir(parents=True, exist_ok=True)
    path = common.out / f"{name}.json"
    path.write_text(json.dumps(body, indent=2, default=str) + "\n")
    return path


def plot_path(common: Common, name: str) -> bool:
    """Say where a plot goes, or why there is none; True when it can be drawn."""
    if not report.can_plot():
        say(f"no {name}: matplotlib is missing (pip install -e '.[bench]')")
        return False
    say(f"wrote {common.out / name}")
    return True


def pin_self(common: Common) -> None:
    """Move this process (the load generator) to core 1, off the gateway's core."""
    with contextlib.suppress(AttributeError, OSError):
        if common.pin and len(os.sched_getaffinity(0)) > 1:
            os.sched_setaffinity(0, {1})


def cores(common: Common) -> tuple[int | None, int | None]:
    """(gateway core, fleet core) when pinning."""
    return (0, 1) if common.pin else (None, None)


def to_v1(url: str) -> str:
    return url.rstrip("/") + "/v1"


# --- run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    base_url: str
    key: str
    model: str = "sim-model"
    requests: int = 100
    concurrency: int | None = 8  # closed loop; None: open loop at `rate`
    rate: float | None = None
    mix: Mix = field(default_factory=Mix)


async def run_once(opts: RunOptions, common: Common) -> report.Summary:
    """One load against any OpenAI-compatible base URL (ending in /v1)."""
    specs = make_workload(opts.requests, opts.mix, common.seed, rate=opts.rate)
    async with session() as http:
        client = Client(http, opts.key, model=opts.model)
        route: Route = lambda spec, worker: opts.base_url.rstrip("/")  # noqa: E731
        if opts.concurrency is None:
            run = await run_open(client, specs, route, label="run", limit=common.limit)
        else:
            run = await run_closed(
                client,
                specs,
                route,
                concurrency=opts.concurrency,
                label="run",
                limit=common.limit,
            )
    summary = summarize(run, common)
    say(report.run_table([summary]))
    path = write_json(common, "run", {"options": asdict(opts) | {"key": "***"}, "run": summary})
    say(f"wrote {path}")
    return summary


# --- sweep --------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepOptions:
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    levels: tuple[int, ...] = (1, 2, 4, 8, 16)
    requests_per_client: int = 16
    max_num_seqs: int = 16
    strategy: str = "least_busy"
    mix: Mix = field(default_factory=lambda: Mix(long_share=0.0, max_tokens=(64, 64)))


async def sweep(opts: SweepOptions, common: Common) -> dict[str, Any]:
    """TTFT and TPOT at each concurrency level, closed loop, through one gateway."""
    pin_self(common)
    gw_core, fleet_core = cores(common)
    points: list[tuple[int, report.Summary]] = []
    async with (
        harness.fleet_process(
            opts.speeds, max_num_seqs=opts.max_num_seqs, seed=common.seed, core=fleet_core
        ) as fleet,
        harness.gateway_process(
            fleet.urls, strategy=opts.strategy, max_num_seqs=opts.max_num_seqs, core=gw_core
        ) as gw,
        session() as http,
    ):
        client = Client(http, harness.KEY)
        for level in opts.levels:
            specs = make_workload(level * opts.requests_per_client, opts.mix, common.seed)
            run = await run_closed(
                client,
                specs,
                lambda s, w: gw.base_url,
                concurrency=level,
                label=f"c={level}",
                limit=common.limit,
            )
            points.append((level, summarize(run, common)))
    say(report.run_table([s for _, s in points]))
    title = f"{opts.strategy} via gateway, fleet speeds {','.join(map(str, opts.speeds))}"
    body = {"options": asdict(opts), "points": [{"concurrency": c, **s} for c, s in points]}
    say(f"wrote {write_json(common, 'sweep', body)}")
    if plot_path(common, "sweep.png"):
        report.plot_sweep(points, common.out / "sweep.png", title)
    return body


# --- compare ------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompareOptions:
    strategies: tuple[str, ...] = ("round_robin", "least_busy")
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    max_num_seqs: int = 16
    load: float = 0.75  # share of the fleet's estimated capacity (open loop)
    duration: float = 40.0  # seconds of arrivals (open loop)
    concurrency: int = 16  # closed loop; 0 skips the saturated phase
    closed_requests: int = 160
    closed_mix: Mix = field(default_factory=lambda: Mix(long_share=1.0))
    mix: Mix = field(default_factory=Mix)
    independent: bool = True  # also the baseline without a gateway
    clients: int = 16  # clients pinned at random in the baseline (open loop)


def capacity(speeds: Sequence[float], mix: Mix, sim: SimConfig) -> float:
    """Requests/s the simulated fleet serves at full batches, from the simulator's model.

    A step costs (prefill tokens in it) / prefill_tokens_per_s plus, when anything
    decodes, decode_s_per_token * (1 + decode_slowdown_per_seq * (seqs - 1)), all divided
    by the speed. With full batches of max_num_seqs, a request costs its prefill plus
    max_tokens / max_num_seqs of the decode steps.
    """
    seqs = sim.max_num_seqs
    step = sim.decode_s_per_token * (1 + sim.decode_slowdown_per_seq * (seqs - 1))
    per_request = mix.mean_prompt_tokens() / sim.prefill_tokens_per_s
    per_request += mix.mean_max_tokens() * step / seqs
    return sum(speeds) / per_request


@contextlib.asynccontextmanager
async def _fleet(opts: CompareOptions, common: Common) -> AsyncIterator[harness.FleetProc]:
    async with harness.fleet_process(
        opts.speeds, max_num_seqs=opts.max_num_seqs, seed=common.seed, core=cores(common)[1]
    ) as fleet:
        yield fleet


async def _one_setup(
    name: str,
    specs: Sequence[RequestSpec],
    concurrency: int | None,
    opts: CompareOptions,
    common: Common,
) -> Run:
    """One fresh fleet, through a fresh gateway running strategy `name` or, for
    `independent`, straight to the instances with clients pinned at random."""
    label = f"{name} (c={concurrency})" if concurrency else name
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(_fleet(opts, common))
        if name == "independent":
            pins = random.Random(common.seed + 1)
            clients = concurrency or opts.clients
            urls = [to_v1(fleet.urls[pins.randrange(len(fleet.urls))]) for _ in range(clients)]
            route: Route = lambda spec, worker: urls[worker % clients]  # noqa: E731
        else:
            gw = await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy=name,
                    max_num_seqs=opts.max_num_seqs,
                    core=cores(common)[0],
                )
            )
            route = lambda spec, worker: gw.base_url  # noqa: E731
        http = await stack.enter_async_context(session())
        client = Client(http, harness.KEY)
        if concurrency is None:
            return await run_open(client, specs, route, label=label, limit=common.limit)
        return await run_closed(
            client, specs, route, concurrency=concurrency, label=label, limit=common.limit
        )
    raise AssertionError("unreachable")  # pragma: no cover - the stack never swallows


def ratios(summaries: dict[str, report.Summary], base: str, other: str) -> dict[str, float]:
    """other / base for tok/s, p99 TTFT and goodput (1.5 tok/s and 0.5 TTFT are the targets)."""
    a, b = summaries[base], summaries[other]

    def div(x: float | None, y: float | None) -> float:
        return float("nan") if x is None or not y else x / y

    return {
        "tokens_per_s": div(b["output_tokens_per_s"], a["output_tokens_per_s"]),
        "steady_tokens_per_s": div(
            b["window_output_tokens_per_s"], a["window_output_tokens_per_s"]
        ),
        "p99_ttft": div(b["ttft_s"]["p99"], a["ttft_s"]["p99"]),
        "goodput": div(b["goodput_rps"], a["goodput_rps"]),
    }


async def compare(opts: CompareOptions, common: Common) -> dict[str, Any]:
    """Open loop at `load` of capacity, then closed loop at `concurrency`, every setup."""
    pin_self(common)
    setups = [*opts.strategies, *(["independent"] if opts.independent else [])]
    cap = capacity(opts.speeds, opts.mix, SimConfig(max_num_seqs=opts.max_num_seqs))
    rate = opts.load * cap
    count = max(1, round(rate * opts.duration))
    open_specs = make_workload(count, opts.mix, common.seed, rate=rate, clients=opts.clients)
    say(f"capacity estimate {cap:.1f} req/s; open loop at {rate:.1f} req/s, {count} requests")
    phases: dict[str, dict[str, report.Summary]] = {"open": {}}
    for name in setups:
        phases["open"][name] = summarize(
            await _one_setup(name, open_specs, None, opts, common), common
        )
    if opts.concurrency:
        closed_specs = make_workload(opts.closed_requests, opts.closed_mix, common.seed + 7)
        phases["closed"] = {}
        for name in setups:
            run = await _one_setup(name, closed_specs, opts.concurrency, opts, common)
            phases["closed"][name] = summarize(run, common)
    body: dict[str, Any] = {
        "options": asdict(opts),
        "capacity_req_per_s": cap,
        "open_rate_req_per_s": rate,
        "phases": phases,
    }
    if {"round_robin", "least_busy"} <= set(setups):
        body["least_busy_over_round_robin"] = {
            phase: ratios(runs, "round_robin", "least_busy") for phase, runs in phases.items()
        }
    say(f"wrote {write_json(common, 'compare', body)}")
    for phase, runs in phases.items():
        say(f"\n== {phase} loop ==")
        say(report.seed_table(list(runs.values())))
        say(report.run_table(list(runs.values())))
    say(json.dumps(body.get("least_busy_over_round_robin", {}), indent=2))
    if not plot_path(common, "compare.png"):
        return body
    groups = [
        (f"open loop {opts.load:.0%} of capacity", list(phases["open"].values())),
        *(
            [(f"closed loop c={opts.concurrency}", list(phases["closed"].values()))]
            if "closed" in phases
            else []
        ),
    ]
    report.plot_compare(groups, common.out / "compare.png", f"one slow card: speeds {opts.speeds}")
    return body


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
