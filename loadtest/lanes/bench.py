"""The `lanes` scenario (issue 10): keep short prompts out of long prefills.

The issue's mix: half the requests 200-token prompts, half 6,000-token ones, every one
max_tokens 32, on the slow-card fleet (speeds 1, 1, 1, 0.4) whose simulated engines
batch up to 8,192 tokens a step (vLLM's default `max_num_batched_tokens` for its OpenAI
server on GPUs of 70 GiB and more), Poisson arrivals at each of `loads` times the fleet's
capacity: `compare.capacity`'s estimate, or with `--capacity measured` what the fleet
serves with every card kept full straight to it (`capacity.py`). Every setup gets a fresh
fleet (and gateway) and exactly the same requests.

Setups: a strategy name (`least_busy`, `least_time`, `round_robin`) runs the gateway as
configured by default; `@ref` at the end runs the gateway as committed at that git ref (a
change beside its parent in one run: `least_busy@HEAD~1`); flags after a colon, joined by
`+`, change the settings (e.g. `least_time:cap1+queue_all@HEAD~1`): `cap1` sets
`max_long_per_instance = 1`; `queue_all` sets `max_queue_wait` to `QUEUE_ALL` seconds, so
admission refuses nothing and every request is served, late if need be, as the baselines
do (like with like for tokens/s, and a p99 over every request rather than over the ones
admitted); `cardq0` and `cardq4` set `max_queue_per_instance` (requests a card holds
waiting beyond its running slots; the rest wait in the gateway, oldest first across the
lanes). The fronts a user would pick instead, `nginx` (least_conn), `vllm-router`
(cache_aware) and `sticky` (our copy of the routers' rule), come from
`loadtest/baselines.py` and are skipped with a line where they are not installed. Any
setup may be named again with `#N` (`nginx#2`): the same front once more, on the same
requests, for the A/A spread that `targets` prints (how far one front lands from itself
in one sitting).

Reported per prompt class: p50/p99 TTFT; overall and short p50 end-to-end latency, output
tokens/s and goodput (both objectives met). The PNG has the TTFT CDF per class and setup.
Where a baseline ran, each gateway setup is judged against issue 10's targets beside it
(`targets.py`, which also reads saved reports).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import baselines, capacity, compare, harness, report
from loadtest.lanes import targets
from loadtest.loadgen import (
    SEED_MIX,
    Client,
    Mix,
    RequestSpec,
    Result,
    Route,
    Run,
    make_workload,
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
    write_json,
)

QUEUE_ALL = 600.0  # s: longer than any run, so no request is refused for its wait


@dataclass(frozen=True)
class LanesOptions:
    setups: tuple[str, ...] = ("least_busy", "least_time")
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    loads: tuple[float, ...] = (0.75, 1.0)
    duration: float = 40.0  # seconds of Poisson arrivals per load
    mix: Mix = field(default_factory=lambda: SEED_MIX)
    name: str = "lanes"  # the report's file name (JSON and PNG)
    # What `loads` are shares of: "estimate" (`compare.capacity`) or "measured" (every card
    # kept full, straight to it: `capacity.py`), which checks the estimate.
    capacity: str = "estimate"


STRATEGIES = ("least_busy", "least_time", "round_robin")  # the gateway's, as setups
# A setup's flags: each sets these settings, by section of the gateway's config.
FLAGS: dict[str, dict[str, dict[str, Any]]] = {
    "cap1": {"prefill": {"max_long_per_instance": 1}},
    "queue_all": {"dispatch": {"max_queue_wait": QUEUE_ALL}},
    "cardq0": {"dispatch": {"max_queue_per_instance": 0}},
    "cardq4": {"dispatch": {"max_queue_per_instance": 4}},
}


def parse_setup(setup: str) -> tuple[str, set[str], str | None]:
    """`strategy[:flag+flag][@ref][#N]` as (strategy, flags, ref or None); unknown flags
    raise. `#N` marks a repeat (`targets.front`) and changes nothing of the setup."""
    name, _, ref = targets.front(setup).partition("@")
    strategy, _, variant = name.partition(":")
    flags = set(variant.split("+")) if variant else set()
    if unknown := flags - FLAGS.keys():
        raise ValueError(
            f"unknown setup flags {sorted(unknown)} in {setup!r} (known: {', '.join(FLAGS)})"
        )
    return strategy, flags, ref or None


def settings(flags: set[str]) -> dict[str, dict[str, Any]]:
    """The config sections a setup's flags set, each section's settings merged."""
    out: dict[str, dict[str, Any]] = {}
    for flag in sorted(flags):
        for section, values in FLAGS[flag].items():
            out.setdefault(section, {}).update(values)
    return out


async def _sitting(
    setup: str, specs: Sequence[RequestSpec], opts: LanesOptions, common: Common
) -> tuple[Run, dict[str, str]]:
    """One fresh fleet behind a fresh front running `setup` (a baseline, or the gateway
    as its flags and ref say): the run and the fleet's names."""
    strategy, flags, ref = parse_setup(setup)
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        # Pinned: the run's report names the commit that ran, not what HEAD~1 meant later.
        pinned = harness.pin_ref(ref) if ref else None
        source = stack.enter_context(harness.exported_gateway(pinned)) if pinned else None
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                max_num_batched_tokens=opts.max_num_batched_tokens,
            )
        )
        if strategy in baselines.BASELINES:  # pinned where the gateway would be
            front = baselines.front(strategy, fleet.urls, core=gw_core, seed=common.seed)
            url = await stack.enter_async_context(front) + "/v1"
        else:
            sections = settings(flags)
            gw = await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy=strategy,
                    max_num_seqs=opts.max_num_seqs,
                    core=gw_core,
                    source=source or common.gateway_dir,
                    slo=slo_block(common),
                    dispatch=sections.pop("dispatch", None),
                    extra=sections,
                )
            )
            url = gw.base_url
        route: Route = lambda spec, worker: url  # noqa: E731
        http = await stack.enter_async_context(session())
        client = Client(http, harness.KEY, retries=common.retries)
        run = await run_open(client, specs, route, label=setup, limit=common.limit)
        return run, fleet_names(fleet.urls, opts.speeds)
    raise AssertionError("unreachable")  # pragma: no cover - the stack never swallows


def by_class(run: Run, common: Common, names: dict[str, str]) -> report.Summary:
    """The run's summary plus TTFT per prompt class, short requests' latency, and the raw
    TTFTs of each class (for the CDF)."""
    summary = relabel(summarize(run, common), names)
    ok = [r for r in run.results if r.ok and r.ttft is not None]
    for name, long in (("short", False), ("long", True)):
        ttfts = sorted(r.ttft for r in ok if r.long is long and r.ttft is not None)
        summary[f"{name}_ttft_s"] = report.percentiles(ttfts)
        summary[f"{name}_ttfts"] = ttfts
    summary["short_latency_s"] = report.percentiles(
        r.latency for r in ok if not r.long and r.latency is not None
    )
    summary["missed"] = missed_objectives(run.results, common.ttft_slo, common.tpot_slo)
    summary["last_answers"] = last_answers(run, names)
    return summary


def last_answers(run: Run, names: dict[str, str], most: int = 5) -> list[dict[str, Any]]:
    """The `most` answers that ended last, last one last, timed from the run's start.

    When every front serves every request, tokens/s differs only by the span, and the
    span ends with the last answer: these say which request that was and where it went
    (the benchmark page, `lanes`, "Round 8": one long prompt on the slow card).
    """
    ended = [(r.sent + r.latency, r) for r in run.results if r.ok and r.latency is not None]
    ended.sort(key=lambda pair: pair[0])
    return [
        {
            "end_s": end - run.started,
            "sent_s": r.sent - run.started,
            "long": r.long,
            "instance": names.get(r.instance, r.instance),
            "ttft_s": r.ttft,
            "latency_s": r.latency,
        }
        for end, r in ended[-most:]
    ]


def missed_objectives(
    results: Sequence[Result], ttft_slo: float, tpot_slo: float
) -> dict[str, dict[str, int]]:
    """Per prompt class, how many requests missed goodput and why: failed, TTFT only, TPOT
    only, or both (a router can lose goodput to either objective: its total hides which)."""
    out = {name: {"failed": 0, "ttft": 0, "tpot": 0, "both": 0} for name in ("short", "long")}
    for r in results:
        counts = out["long" if r.long else "short"]
        if not r.ok or r.ttft is None:
            counts["failed"] += 1
            continue
        late = r.ttft > ttft_slo
        slow = r.tpot is not None and r.tpot > tpot_slo
        if late or slow:
            counts["both" if late and slow else "ttft" if late else "tpot"] += 1
    return out


async def _one(
    setup: str, specs: Sequence[RequestSpec], opts: LanesOptions, common: Common
) -> report.Summary | None:
    """`setup`'s sitting at one load, summarized; None, said in a line, where it cannot run."""
    if (base := targets.front(setup)) in baselines.BASELINES:
        if why := baselines.missing(base):
            say(f"{setup}: skipped ({why})")
            return None
    elif parse_setup(setup)[0] not in STRATEGIES:
        say(f"{setup}: skipped (no such setup here)")
        return None
    run, names = await _sitting(setup, specs, opts, common)
    return by_class(run, common, names)


def estimate(opts: LanesOptions) -> float:
    """The fleet's capacity in requests/s by `compare.capacity`'s estimate."""
    return compare.capacity(opts.speeds, opts.mix, SimConfig(max_num_seqs=opts.max_num_seqs))


def workload(opts: LanesOptions, rate: float, seed: int) -> list[RequestSpec]:
    """The requests a sitting sends at `rate` per second for `opts.duration`."""
    return make_workload(max(1, round(rate * opts.duration)), opts.mix, seed, rate=rate)


async def lanes(opts: LanesOptions, common: Common) -> dict[str, Any]:
    """Every setup at every load, on the same requests per load."""
    for setup in opts.setups:  # a misspelt flag stops the run before anything starts
        parse_setup(setup)
    pin_self(common)
    cap = estimate(opts)
    say(f"capacity estimate {cap:.1f} req/s")
    loads: dict[str, dict[str, report.Summary]] = {}
    body: dict[str, Any] = {"options": asdict(opts), "capacity_estimate_req_per_s": cap}
    if opts.capacity == "measured":
        measured = await capacity.measure(
            opts.speeds,
            opts.mix,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=opts.max_num_batched_tokens,
            common=common,
        )
        body["capacity_measured"] = measured.as_json()
        cap = measured.req_per_s
    body.update(capacity_req_per_s=cap, loads=loads)  # the rate each load is a share of
    for load in opts.loads:
        specs = workload(opts, load * cap, common.seed)
        say(f"open loop at {load:.0%} of capacity: {load * cap:.1f} req/s, {len(specs)} requests")
        runs = {}
        for setup in opts.setups:
            summary = await _one(setup, specs, opts, common)
            if summary is not None:
                runs[setup] = summary
                loads[f"{load:g}"] = runs
                write_json(common, opts.name, body)  # what is done so far survives a stop
        say(table(runs))
        for name, verdicts in targets.judge_run(runs).items():
            say(targets.render(f"{load:g}", name, verdicts, runs[name]))
        for name, spreads in targets.spread(runs).items():
            say(targets.render_spread(f"{load:g}", name, spreads))
    say(f"wrote {write_json(common, opts.name, body)}")
    if plot_path(common, f"{opts.name}.png"):
        plot_cdf(loads, common.out / f"{opts.name}.png", opts)
    return body


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f}"


def table(runs: dict[str, report.Summary]) -> str:
    """The issue's table: per-class TTFT, latency, tokens/s, goodput."""
    rows = []
    for name, s in runs.items():
        short, long = s["short_ttft_s"], s["long_ttft_s"]
        rows.append(
            [
                name,
                f"{_cell(short['p50'])} / {_cell(short['p99'])}",
                f"{_cell(long['p50'])} / {_cell(long['p99'])}",
                _cell(s["latency_s"]["p50"]),
                _cell(s["short_latency_s"]["p50"]),
                f"{s['output_tokens_per_s']:,.0f}",
                f"{s['goodput_rps']:.2f}",
                str(sum(s["errors"].values())),
                str(s.get("retried", 0)),
            ]
        )
    headers = [
        "setup",
        "short p50 / p99 TTFT ms",
        "long p50 / p99 TTFT ms",
        "p50 latency ms",
        "short p50 latency ms",
        "out tok/s",
        "goodput req/s",
        "errors",
        "retried",
    ]
    return report.table(headers, rows)


def plot_cdf(loads: dict[str, dict[str, report.Summary]], path: Any, opts: LanesOptions) -> None:
    """TTFT CDF per prompt class (columns) and load (rows), one line per setup."""
    plt = report._pyplot()
    fig, axes = plt.subplots(len(loads), 2, figsize=(11, 3.6 * len(loads)), squeeze=False)
    for row, (load, runs) in enumerate(loads.items()):
        for col, klass in enumerate(("short", "long")):
            ax = axes[row][col]
            for name, s in runs.items():
                ttfts = s[f"{klass}_ttfts"]
                if ttfts:
                    ys = [(k + 1) / len(ttfts) for k in range(len(ttfts))]
                    ax.step([t * 1000 for t in ttfts], ys, where="post", label=name)
            ax.set_xscale("log")
            ax.set_xlabel("TTFT (ms)")
            ax.set_ylabel("share of requests")
            ax.set_title(f"{klass} prompts, {float(load):.0%} of capacity", fontsize=9)
            ax.grid(True, alpha=0.3)
            if ax.get_lines():
                ax.legend(fontsize=7)
    fig.suptitle(f"TTFT CDF: speeds {opts.speeds}, {opts.mix.long_share:.0%} long prompts")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
