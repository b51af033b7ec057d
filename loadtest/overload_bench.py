"""The `overload` scenario: what admission control keeps when 2x to 10x capacity arrives.

Issue 11's benchmark. The `compare` fleet (speeds 1, 1, 1, 0.4, the same mix, the same
capacity estimate) gets open-loop Poisson arrivals at multiples of its capacity, each
load on a fresh fleet and a fresh gateway process, from the same seed. Two setups side
by side at each load, the same requests for both:

- `admission`: the gateway's defaults; `max_queue_wait` is each lane's TTFT objective
  (the `[slo]` block `compare` passes), so a request predicted to wait longer is refused
  at once with 429, and one that waited that long gets 503;
- `queue_to_deadline`: the same gateway with `max_queue_wait = request_timeout`, the
  behaviour before admission: a request waits in the queue until its deadline.

For each setup and load: goodput and its share of the lowest load's figure (1x), the
TTFT of admitted (200) requests per lane against the lane's objective, refusals by status
and how long a refused client waited for its status line, and tokens/s. The issue's
targets, at every load above the lowest: goodput at least 90% of the 1x figure, admitted
p99 TTFT within the lane's objective, and a refused request told within 100 ms at the
median.
"""

from __future__ import annotations

import contextlib
import math
import resource
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import compare, harness, report, report_plots
from loadtest.loadgen import (
    Client,
    Mix,
    RequestSpec,
    Result,
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

SETUPS = ("admission", "queue_to_deadline")
GOODPUT_SHARE = 0.9  # of the 1x figure, at every higher load
REFUSAL_MEDIAN = 0.1  # seconds until a refused request hears so, at the median
LANES = (("short", False, "ttft"), ("long", True, "long_ttft"))  # name, RequestSpec.long, [slo]


@dataclass(frozen=True)
class OverloadOptions:
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    max_num_seqs: int = 16
    loads: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0)  # multiples of the estimated capacity
    duration: float = 10.0  # seconds of arrivals at each load
    mix: Mix = field(default_factory=Mix)
    strategy: str = "least_busy"
    # The gateway's default; `queue_to_deadline` lets a request wait in the queue this long.
    request_timeout: float = 120.0
    max_queue_per_instance: int | None = None  # None: the gateway's default
    # Requests sent this long after the start are also reported apart ("after_warmup"):
    # until about three requests left the fleet, a fresh gateway cannot predict waits.
    warmup: float = 2.0
    clients: int = 16


def _sections(setup: str, opts: OverloadOptions) -> dict[str, dict[str, Any]]:
    """The config sections that make the one difference between the setups."""
    dispatch: dict[str, Any] = {}
    if opts.max_queue_per_instance is not None:
        dispatch["max_queue_per_instance"] = opts.max_queue_per_instance
    if setup == "queue_to_deadline":
        dispatch["max_queue_wait"] = opts.request_timeout
    return {"gateway": {"request_timeout": opts.request_timeout}, "dispatch": dispatch}


async def _one_run(
    setup: str, label: str, specs: Sequence[RequestSpec], opts: OverloadOptions, common: Common
) -> tuple[Run, report.Summary]:
    """A fresh fleet and a fresh gateway set up as `setup`, the open loop through it."""
    gw_core, fleet_core = cores(common)
    sections = _sections(setup, opts)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds, max_num_seqs=opts.max_num_seqs, seed=common.seed, core=fleet_core
            )
        )
        gw = await stack.enter_async_context(
            harness.gateway_process(
                fleet.urls,
                strategy=opts.strategy,
                max_num_seqs=opts.max_num_seqs,
                core=gw_core,
                source=common.gateway_dir,
                slo=slo_block(common),
                gateway=sections["gateway"],
                dispatch=sections["dispatch"],
            )
        )
        # The client waits past the gateway's deadline, so the gateway's answer is what counts.
        http = await stack.enter_async_context(session())
        client = Client(http, harness.KEY, timeout=opts.request_timeout + 10)
        run = await run_open(
            client, specs, lambda spec, worker: gw.base_url, label=label, limit=common.limit
        )
        return run, relabel(summarize(run, common), fleet_names(fleet.urls, opts.speeds))
    raise AssertionError("unreachable")  # pragma: no cover - the stack never swallows


def latencies(results: Sequence[Result], slo: dict[str, float]) -> dict[str, Any]:
    """Admitted (200) requests' TTFT per lane, and how long refused ones waited for a status."""
    answered = [r for r in results if r.status == 200]
    lanes: dict[str, dict[str, Any]] = {}
    for lane, long, key in LANES:
        ttfts = [r.ttft for r in answered if r.long == long and r.ttft is not None]
        p = report.percentiles(ttfts)
        lanes[lane] = {"objective_s": slo[key], "admitted": len(ttfts), **p}
    waits = [r.answered for r in results if r.status not in (0, 200) and r.answered is not None]
    return {
        "admitted_ttft_s": lanes,
        "refusal_waits": len(waits),
        "refusal_wait_s": report.percentiles(waits),
    }


def figures(
    run: Run, summary: report.Summary, slo: dict[str, float], warmup: float
) -> dict[str, Any]:
    """What the overload report shows of one run; every request lands in one count."""
    results = run.results
    answered = [r for r in results if r.status == 200]
    by_status = Counter(_status_key(r.status) for r in results if r.status not in (0, 200))
    # What each second of arrivals got: shows a fresh gateway's first seconds apart.
    timeline: dict[int, Counter[str]] = {}
    for r in results:
        second = timeline.setdefault(int(r.sent - run.started), Counter())
        second[_status_key(r.status)] += 1
    steady = [r for r in results if r.sent - run.started >= warmup]
    return {
        "requests": len(results) + run.unfinished,
        "answered_200": len(answered),
        "ok": sum(1 for r in answered if r.ok),
        "broken_200": sum(1 for r in answered if not r.ok),  # a stream that failed after 200
        "refused": {key: by_status.get(key, 0) for key in ("429", "503", "other")},
        "no_answer": sum(1 for r in results if r.status == 0),  # timeouts, connection errors
        "unfinished": run.unfinished,
        "goodput_rps": summary["goodput_rps"],
        "met_slo": summary["met_slo"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "duration_s": summary["duration_s"],
        **latencies(results, slo),
        # The same, for requests sent once the fresh gateway had learned the fleet's pace.
        "after_warmup": {"from_s": warmup, "sent": len(steady), **latencies(steady, slo)},
        "by_second_sent": [
            {"second": t, **{k: timeline[t].get(k, 0) for k in ("200", "429", "503", "other")}}
            for t in sorted(timeline)
        ],
    }


def _status_key(status: int) -> str:
    """200, 429 and 503 by name; any other answer, or none, as "other"."""
    return str(status) if status in (200, 429, 503) else "other"


def judge(entry: dict[str, Any], base_goodput: float) -> dict[str, bool | None]:
    """The issue's targets for one setup at one load above 1x (None: nothing to judge)."""
    out: dict[str, bool | None] = {
        "goodput_at_least_90pct_of_1x": entry["goodput_rps"] >= GOODPUT_SHARE * base_goodput
    }
    for lane, _, _ in LANES:
        ttft = entry["admitted_ttft_s"][lane]
        p99 = ttft["p99"]
        out[f"{lane}_p99_ttft_within_objective"] = (
            None if p99 is None else p99 <= ttft["objective_s"]
        )
    median = entry["refusal_wait_s"]["p50"]
    out["median_refusal_under_100ms"] = None if median is None else median < REFUSAL_MEDIAN
    return out


def _share(value: float, base: float) -> float | None:
    return value / base if base > 0 else None


def _raise_open_files(connections: int) -> None:
    """Room for every request held open at once, here and in the children (they inherit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 3 * connections + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        limit = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))


async def overload(opts: OverloadOptions, common: Common) -> dict[str, Any]:
    """Every load, both setups side by side; then the targets, the JSON and the plot."""
    if not opts.loads:
        raise ValueError("overload needs at least one load")
    pin_self(common)
    cap = compare.capacity(opts.speeds, opts.mix, SimConfig(max_num_seqs=opts.max_num_seqs))
    loads = sorted(opts.loads)
    slo = slo_block(common)
    say(f"capacity estimate {cap:.1f} req/s; loads {', '.join(f'{x:g}x' for x in loads)}")
    _raise_open_files(round(max(loads) * cap * opts.duration))
    body: dict[str, Any] = {
        "options": asdict(opts),
        "capacity_req_per_s": cap,
        "slo": slo,
        "base_load": loads[0],
        "targets": {"goodput_share": GOODPUT_SHARE, "refusal_median_s": REFUSAL_MEDIAN},
        "loads": {},
    }
    for load in loads:
        rate = load * cap
        count = max(1, round(rate * opts.duration))
        specs = make_workload(count, opts.mix, common.seed, rate=rate, clients=opts.clients)
        say(f"\n{load:g}x capacity: {rate:.1f} req/s, {count} requests")
        setups = {}
        for setup in SETUPS:
            run, summary = await _one_run(setup, f"{setup} {load:g}x", specs, opts, common)
            setups[setup] = figures(run, summary, slo, opts.warmup) | {"summary": summary}
        body["loads"][f"{load:g}"] = {"offered_rps": rate, "sent": count, "setups": setups}
    base = body["loads"][f"{loads[0]:g}"]["setups"]
    for key, at_load in body["loads"].items():
        for setup, entry in at_load["setups"].items():
            base_goodput = base[setup]["goodput_rps"]
            entry["goodput_share_of_base"] = _share(entry["goodput_rps"], base_goodput)
            entry["targets"] = judge(entry, base_goodput) if float(key) > loads[0] else {}
    body["verdict"] = verdict(body)
    say(f"\nwrote {write_json(common, 'overload', body)}")
    say(tables(body))
    if plot_path(common, "overload.png"):
        report_plots.plot_overload(body, common.out / "overload.png")
    return body


def verdict(body: dict[str, Any]) -> dict[str, dict[str, bool | None]]:
    """Per setup and target: met at every load above 1x (None where nothing could be judged)."""
    out: dict[str, dict[str, bool | None]] = {}
    for setup in SETUPS:
        judged: dict[str, list[bool]] = {}
        for at_load in body["loads"].values():
            for target, met in at_load["setups"][setup]["targets"].items():
                judged.setdefault(target, [])
                if met is not None:
                    judged[target].append(met)
        out[setup] = {t: (all(m) if m else None) for t, m in judged.items()}
    return out


# --- text ---------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.0%}"


def _mark(met: bool | None) -> str:
    return "n/a" if met is None else ("met" if met else "MISSED")


def tables(body: dict[str, Any]) -> str:
    """The measured figures, one row per load and setup, then the targets."""
    rows, marks = [], []
    for key, at_load in body["loads"].items():
        for setup, e in at_load["setups"].items():
            short, long = e["admitted_ttft_s"]["short"], e["admitted_ttft_s"]["long"]
            wait = e["refusal_wait_s"]
            rows.append(
                [
                    f"{key}x {setup}",
                    f"{at_load['offered_rps']:.1f}",
                    f"{e['answered_200']}/{e['requests']}",
                    f"{e['goodput_rps']:.2f}",
                    _pct(e["goodput_share_of_base"]),
                    f"{report.ms(short['p50'])} / {report.ms(short['p99'])}",
                    f"{report.ms(long['p50'])} / {report.ms(long['p99'])}",
                    " ".join(str(e["refused"][k]) for k in ("429", "503", "other")),
                    str(e["no_answer"] + e["unfinished"] + e["broken_200"]),
                    f"{report.ms(wait['p50'])} / {report.ms(wait['p90'])}",
                    f"{e['output_tokens_per_s']:.0f}",
                ]
            )
            if e["targets"]:
                marks.append([f"{key}x {setup}", *(_mark(m) for m in e["targets"].values())])
    slo = body["slo"]
    text = report.table(
        [
            "load setup",
            "offered req/s",
            "200/sent",
            "goodput",
            "of 1x",
            "short TTFT p50/p99",
            "long TTFT p50/p99",
            "429 503 other",
            "failed",
            "refusal p50/p90",
            "tok/s",
        ],
        rows,
    )
    text += (
        f"\n(ms; TTFT of admitted requests, objectives short {slo['ttft']:g} s, long "
        f"{slo['long_ttft']:g} s; refusal: send to status line; failed: no answer, "
        "unfinished or a broken 200 stream)"
    )
    if marks:
        headers = ["load setup", "goodput >= 90% of 1x", "short p99", "long p99", "refusal p50"]
        text += "\n\ntargets\n" + report.table(headers, marks)
    return text + "\n\n" + _warm_table(body)


def _warm_table(body: dict[str, Any]) -> str:
    """Admitted TTFT and refusal waits of the requests sent after the warm-up."""
    rows = []
    for key, at_load in body["loads"].items():
        for setup, e in at_load["setups"].items():
            w = e["after_warmup"]
            short, long = w["admitted_ttft_s"]["short"], w["admitted_ttft_s"]["long"]
            wait = w["refusal_wait_s"]
            rows.append(
                [
                    f"{key}x {setup}",
                    str(w["sent"]),
                    f"{report.ms(short['p50'])} / {report.ms(short['p99'])}",
                    f"{report.ms(long['p50'])} / {report.ms(long['p99'])}",
                    str(w["refusal_waits"]),
                    f"{report.ms(wait['p50'])} / {report.ms(wait['p90'])}",
                ]
            )
    warmup = body["options"]["warmup"]
    headers = [
        "load setup",
        "sent",
        "short TTFT p50/p99",
        "long p50/p99",
        "refused",
        "wait p50/p90",
    ]
    return f"requests sent from {warmup:g} s on (ms)\n" + report.table(headers, rows)
