"""The `compare` scenario: one seeded workload through each strategy, and through no gateway.

The fleet has one slow card (speeds 1, 1, 1, 0.4 by default). Every setup gets a fresh
fleet (and a fresh gateway) and exactly the same requests: the same prompts and, in the
open loop, the same arrival times. Three shapes of load, because each answers another
question:

- open loop at `load` of the fleet's capacity: with arrivals fixed, every setup that keeps
  up delivers the offered tokens/s, so what differs is latency and goodput;
- closed loop at `concurrency` with long prompts (the seed post's test): the fleet is
  saturated, so tokens/s is what each setup can get out of it;
- optionally a ladder of open-loop loads: SLO attainment against offered load, and the
  highest load each setup serves with 90% of requests within both objectives.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import harness, report, report_plots
from loadtest.loadgen import (
    Client,
    Mix,
    RequestSpec,
    Route,
    make_workload,
    run_closed,
    run_open,
    session,
)
from loadtest.scenarios import (
    Common,
    cores,
    fleet_names,
    pin_self,
    plot_path,
    relabel,
    say,
    slo_block,
    summarize,
    to_v1,
    write_json,
)

ATTAINMENT = 0.9  # DistServe's bar: the share of requests that must meet both objectives


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
    ladder: tuple[float, ...] = ()  # extra open-loop loads (shares of capacity)
    ladder_duration: float = 20.0


def capacity(speeds: Sequence[float], mix: Mix, sim: SimConfig) -> float:
    """Requests/s the simulated fleet serves at full batches, from the simulator's model.

    A step costs (prefill tokens in it) / prefill_tokens_per_s plus, when anything
    decodes, decode_s_per_token * (1 + decode_slowdown_per_seq * (seqs - 1)), all divided
    by the speed. With full batches of max_num_seqs, a request costs its prefill plus
    max_tokens / max_num_seqs of the decode steps.
    """
    per_request = request_cost(mix.mean_prompt_tokens(), mix.mean_max_tokens(), sim)
    return sum(speeds) / per_request


def request_cost(prompt_tokens: float, max_tokens: float, sim: SimConfig) -> float:
    """Seconds of a speed-1 card one request costs at full batches (see `capacity`)."""
    seqs = sim.max_num_seqs
    step = sim.decode_s_per_token * (1 + sim.decode_slowdown_per_seq * (seqs - 1))
    return prompt_tokens / sim.prefill_tokens_per_s + max_tokens * step / seqs


async def _one_setup(
    name: str,
    specs: Sequence[RequestSpec],
    concurrency: int | None,
    opts: CompareOptions,
    common: Common,
) -> report.Summary:
    """One fresh fleet, through a fresh gateway running strategy `name` or, for
    `independent`, straight to the instances with clients pinned at random."""
    label = f"{name} (c={concurrency})" if concurrency else name
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds, max_num_seqs=opts.max_num_seqs, seed=common.seed, core=fleet_core
            )
        )
        names = fleet_names(fleet.urls, opts.speeds)
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
                    core=gw_core,
                    source=common.gateway_dir,
                    slo=slo_block(common),
                )
            )
            route = lambda spec, worker: gw.base_url  # noqa: E731
        http = await stack.enter_async_context(session())
        client = Client(http, harness.KEY, retries=common.retries)
        if concurrency is None:
            run = await run_open(client, specs, route, label=label, limit=common.limit)
        else:
            run = await run_closed(
                client, specs, route, concurrency=concurrency, label=label, limit=common.limit
            )
        return relabel(summarize(run, common), names)
    raise AssertionError("unreachable")  # pragma: no cover - the stack never swallows


def ratios(summaries: dict[str, report.Summary], base: str, other: str) -> dict[str, float | None]:
    """other / base for tok/s, p99 TTFT and goodput (1.5 tok/s and 0.5 TTFT are the targets);
    None (JSON null) where either side has none, e.g. a p99 from fewer than 100 samples."""
    a, b = summaries[base], summaries[other]

    def div(x: float | None, y: float | None) -> float | None:
        return None if x is None or not y else x / y

    return {
        "tokens_per_s": div(b["output_tokens_per_s"], a["output_tokens_per_s"]),
        "steady_tokens_per_s": div(
            b["window_output_tokens_per_s"], a["window_output_tokens_per_s"]
        ),
        "p99_ttft": div(b["ttft_s"]["p99"], a["ttft_s"]["p99"]),
        "goodput": div(b["goodput_rps"], a["goodput_rps"]),
    }


async def _open(
    load: float,
    duration: float,
    cap: float,
    setups: Sequence[str],
    opts: CompareOptions,
    common: Common,
) -> dict[str, report.Summary]:
    rate = load * cap
    count = max(1, round(rate * duration))
    specs = make_workload(count, opts.mix, common.seed, rate=rate, clients=opts.clients)
    say(f"open loop at {load:.0%} of capacity: {rate:.1f} req/s, {count} requests")
    return {name: await _one_setup(name, specs, None, opts, common) for name in setups}


def served_load(ladder: dict[str, dict[str, report.Summary]], setup: str) -> float | None:
    """The highest ladder load at which `setup` met both objectives for 90% of requests."""
    met = [
        float(load)
        for load, runs in ladder.items()
        if runs[setup]["met_slo"] >= ATTAINMENT * runs[setup]["requests"]
    ]
    return max(met, default=None)


async def compare(opts: CompareOptions, common: Common) -> dict[str, Any]:
    """Open loop at `load`, closed loop at `concurrency`, then the ladder; every setup."""
    pin_self(common)
    setups = [*opts.strategies, *(["independent"] if opts.independent else [])]
    cap = capacity(opts.speeds, opts.mix, SimConfig(max_num_seqs=opts.max_num_seqs))
    say(f"capacity estimate {cap:.1f} req/s")
    phases: dict[str, dict[str, report.Summary]] = {
        "open": await _open(opts.load, opts.duration, cap, setups, opts, common)
    }
    if opts.concurrency:
        specs = make_workload(opts.closed_requests, opts.closed_mix, common.seed + 7)
        phases["closed"] = {
            name: await _one_setup(name, specs, opts.concurrency, opts, common) for name in setups
        }
    ladder = {
        f"{load:g}": await _open(load, opts.ladder_duration, cap, setups, opts, common)
        for load in opts.ladder
    }
    body: dict[str, Any] = {
        "options": asdict(opts),
        "capacity_req_per_s": cap,
        "open_rate_req_per_s": opts.load * cap,
        "phases": phases,
        "ladder": ladder,
        "served_load_at_90pct_slo": {name: served_load(ladder, name) for name in setups}
        if ladder
        else {},
    }
    if {"round_robin", "least_busy"} <= set(setups):
        body["least_busy_over_round_robin"] = {
            phase: ratios(runs, "round_robin", "least_busy") for phase, runs in phases.items()
        }
    say(f"wrote {write_json(common, 'compare', body)}")
    _print(body)
    if plot_path(common, "compare.png"):
        groups = [(f"open loop {opts.load:.0%} of capacity", list(phases["open"].values()))]
        if "closed" in phases:
            groups.append((f"closed loop c={opts.concurrency}", list(phases["closed"].values())))
        title = f"one slow card: speeds {opts.speeds}"
        report_plots.plot_compare(groups, common.out / "compare.png", title)
    if ladder and plot_path(common, "compare-ladder.png"):
        report_plots.plot_ladder(ladder, setups, common.out / "compare-ladder.png", cap)
    return body


def _print(body: dict[str, Any]) -> None:
    for phase, runs in body["phases"].items():
        say(f"\n== {phase} loop ==")
        say(report.seed_table(list(runs.values())))
        say(report.run_table(list(runs.values())))
    for load, runs in body["ladder"].items():
        say(f"\n== ladder: {float(load):.0%} of capacity ==")
        say(report.seed_table(list(runs.values())))
    if body["served_load_at_90pct_slo"]:
        say(f"served load at 90% SLO attainment: {body['served_load_at_90pct_slo']}")
    say(json.dumps(body.get("least_busy_over_round_robin", {}), indent=2))
