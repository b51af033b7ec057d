"""Shared scenario plumbing, and the `run` and `sweep` scenarios of `python -m loadtest`.

- `run`: one load against any OpenAI-compatible base URL with a key.
- `sweep`: TTFT and TPOT against concurrency 1, 2, 4, 8, 16 through the gateway.

`compare` and `overhead` have modules of their own. Each scenario writes a JSON report
(and a PNG where it draws one) under the output folder and prints tables.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest import harness, plots, report, report_plots
from loadtest.loadgen import (
    Client,
    Mix,
    Route,
    Run,
    instance_label,
    make_workload,
    run_closed,
    run_open,
    session,
)
from loadtest.workloads import (
    ConversationMix,
    PrefixMix,
    make_conversations,
    make_prefix_workload,
    run_conversations,
)


@dataclass(frozen=True)
class Common:
    """Options every scenario takes."""

    seed: int = 1
    ttft_slo: float = 1.0  # seconds
    tpot_slo: float = 0.05  # seconds per output token
    out: Path = Path("loadtest/results")
    pin: bool = True  # gateway on core 0; fleet and load generator on core 1
    limit: float = 300.0  # seconds any one run may take
    gateway_ref: str | None = None  # run the gateway as committed at this ref
    gateway_dir: Path | None = None  # where that snapshot lies (set by the CLI)
    retries: int = 0  # the client's retries, as the OpenAI SDK's (lanes and compare)


def say(text: str = "") -> None:
    print(text, flush=True)


def summarize(run: Run, common: Common) -> report.Summary:
    return report.summarize(run, ttft_slo=common.ttft_slo, tpot_slo=common.tpot_slo)


def slo_block(common: Common) -> dict[str, float]:
    """The gateway's `[slo]` section: the objectives the load generator judges by, both lanes."""
    return {
        "ttft": common.ttft_slo,
        "tpot": common.tpot_slo,
        "long_ttft": common.ttft_slo,
        "long_tpot": common.tpot_slo,
    }


def write_json(common: Common, name: str, body: dict[str, Any]) -> Path:
    """Write a report, stamped with the source it measured and how it was run."""
    common.out.mkdir(parents=True, exist_ok=True)
    path = common.out / f"{name}.json"
    stamp = {"source": harness.source_state(common.gateway_ref), "common": asdict(common)}
    path.write_text(json.dumps(stamp | body, indent=2, default=str) + "\n")
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


def fleet_names(urls: Sequence[str], speeds: Sequence[float]) -> dict[str, str]:
    """host:port -> "#3 x0.4": an instance's place in the fleet and its speed."""
    return {
        instance_label(url): f"#{i} x{speed}"
        for i, (url, speed) in enumerate(zip(urls, speeds, strict=True))
    }


def relabel(summary: report.Summary, names: dict[str, str]) -> report.Summary:
    """Name a summary's instances by fleet_names instead of host:port."""
    instances = {names.get(k, k): v for k, v in summary["instances"].items()}
    return {**summary, "instances": dict(sorted(instances.items()))}


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
    prefix: PrefixMix | None = None  # shared-prefix groups instead of the mix
    conversations: ConversationMix | None = None  # multi-turn conversations instead


async def run_once(opts: RunOptions, common: Common) -> report.Summary:
    """One load against any OpenAI-compatible base URL (ending in /v1)."""
    if opts.conversations is not None:
        # --rate, if given, spaces the conversations' starts; each one is a closed loop.
        specs = make_conversations(opts.conversations, common.seed, rate=opts.rate)
    elif opts.prefix is not None:
        specs = make_prefix_workload(opts.requests, opts.prefix, common.seed, rate=opts.rate)
    else:
        specs = make_workload(opts.requests, opts.mix, common.seed, rate=opts.rate)
    async with session() as http:
        client = Client(http, opts.key, model=opts.model)
        route: Route = lambda spec, worker: opts.base_url.rstrip("/")  # noqa: E731
        if opts.conversations is not None:
            run = await run_conversations(client, specs, route, label="run", limit=common.limit)
        elif opts.concurrency is None:
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
    if plot_path(common, "run.png"):
        loop = "open loop" if opts.concurrency is None else f"closed loop c={opts.concurrency}"
        plots.plot_run(summary, common.out / "run.png", f"{opts.base_url}, {loop}")
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
            fleet.urls,
            strategy=opts.strategy,
            max_num_seqs=opts.max_num_seqs,
            core=gw_core,
            source=common.gateway_dir,
        ) as gw,
        session() as http,
    ):
        client = Client(http, harness.KEY)
        names = fleet_names(fleet.urls, opts.speeds)
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
            points.append((level, relabel(summarize(run, common), names)))
    say(report.run_table([s for _, s in points]))
    title = f"{opts.strategy} via gateway, fleet speeds {','.join(map(str, opts.speeds))}"
    body = {"options": asdict(opts), "points": [{"concurrency": c, **s} for c, s in points]}
    say(f"wrote {write_json(common, 'sweep', body)}")
    if plot_path(common, "sweep.png"):
        report_plots.plot_sweep(points, common.out / "sweep.png", title)
    return body
