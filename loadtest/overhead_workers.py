"""`overhead` across cores: `gateway --workers 1` against `--workers 2`, side by side (issue 12).

`python -m loadtest.overhead_workers --workers 1,2 --gateway-ref HEAD`

The paced fleet of overhead_fronts.py (four instances, one chunk per token 5 ms apart,
16-token streams, 200-token prompts), closed loop at a concurrency meant to saturate the
gateway. For each setup in turn (alternating, `--rounds` times) a fresh gateway runs with
`--workers N` on the gateway's cores (`--gateway-cores`), and the report gives:

- streamed requests/s (ok requests over the span from the first driver's start to the
  last one's end);
- CPU seconds per request of the whole gateway tree: the supervisor, every worker and
  any helper process (utime + stime from /proc, plus what they reaped: cutime + cstime);
- how much of the gateway's cores it used, so a run that did not saturate shows it;
- each setup's requests/s and CPU per request against the first setup's.

One Python load generator cannot saturate even one worker (in `overhead` it is the
bottleneck), so the load comes from one process per load core (`--load-cores`), and the
fleet runs as one process per fleet core (`--fleet-cores`), up to one per instance. When
the machine has too few cores for the three groups to be apart, the run still happens,
but its report says that the figure says nothing about scaling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from loadtest import harness
from loadtest.coreplan import CorePlan, core_list, cores_text, plan_cores
from loadtest.helpfmt import HelpFormatter
from loadtest.loadgen import Client, Run, make_workload, run_closed, session
from loadtest.overhead_fronts import FRONT_MIX, INSTANCES, PACED_SPEED
from loadtest.scenarios import Common, say, summarize, write_json

START_DELAY = 1.0  # s: the drivers start together this long after they are handed the job


@dataclass(frozen=True)
class WorkersOptions:
    workers: tuple[int, ...] = (1, 2)
    requests: int = 12000  # per setup and round, over all the load processes
    concurrency: int = 384  # in all: past one worker's saturation (~150) and two's (~300)
    warmup: int = 400
    rounds: int = 2  # setups alternate within each round, so drift hits them alike
    gateway_cores: tuple[int, ...] | None = None  # default: the first max(workers) cores
    fleet_cores: tuple[int, ...] | None = None  # default: a third of the rest
    load_cores: tuple[int, ...] | None = None  # default: the remaining cores


@dataclass(frozen=True)
class Job:
    """One load process's share of a measured run."""

    url: str
    count: int
    concurrency: int
    seed: int
    core: int
    start_at: float  # time.time() at which to start sending
    limit: float
    label: str
    quiet: bool  # no progress lines: the first load process speaks for all


def _drive(job: Job) -> tuple[Run, float]:
    """In a load process: the job's closed-loop run, and how late it started (s)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {job.core})
    if job.quiet:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - for the process's life
    return asyncio.run(_drive_async(job))


async def _drive_async(job: Job) -> tuple[Run, float]:
    specs = make_workload(job.count, FRONT_MIX, job.seed)
    async with session() as http:
        late = time.time() - job.start_at
        await asyncio.sleep(max(0.0, -late))
        run = await run_closed(
            Client(http, harness.KEY),
            specs,
            lambda spec, worker: job.url,
            concurrency=job.concurrency,
            label=job.label,
            limit=job.limit,
        )
    return run, max(0.0, late)


def _spawned(_: int) -> None:
    time.sleep(0.5)  # holds its process, so the pool starts every process up front


def _merge(label: str, runs: Sequence[Run]) -> Run:
    merged = Run(label, started=min(r.started for r in runs), ended=max(r.ended for r in runs))
    for run in runs:  # perf_counter is CLOCK_MONOTONIC: one clock for every process
        merged.results.extend(run.results)
        merged.unfinished += run.unfinished
    return merged


async def _measure(
    workers: int,
    urls: list[str],
    plan: CorePlan,
    pool: ProcessPoolExecutor,
    opts: WorkersOptions,
    common: Common,
    label: str,
) -> dict[str, Any]:
    async with (
        harness.gateway_process(
            urls,
            strategy="least_busy",
            max_num_seqs=256,
            core=plan.gateway,
            gateway={"workers": workers, "max_connections": 512},
            source=common.gateway_dir,
        ) as gw,
        session() as http,
    ):
        client = Client(http, harness.KEY)
        for _ in range(10):  # until every worker answers: each checks the fleet on its own
            warm = make_workload(opts.warmup, FRONT_MIX, common.seed + 1)
            run = await run_closed(
                client, warm, lambda s, w: gw.base_url, concurrency=64, label="warm-up", limit=60
            )
            if all(r.ok for r in run.results):
                break
            await asyncio.sleep(1.0)
        loop = asyncio.get_running_loop()
        start_at = time.time() + START_DELAY
        n = len(plan.load)
        futures = [
            loop.run_in_executor(
                pool,
                _drive,
                Job(
                    url=gw.base_url,
                    count=opts.requests // n + (i < opts.requests % n),
                    concurrency=opts.concurrency // n + (i < opts.concurrency % n),
                    seed=common.seed + 100 * i,
                    core=plan.load[i],
                    start_at=start_at,
                    limit=common.limit,
                    label=label,
                    quiet=i > 0,
                ),
            )
            for i in range(n)
        ]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        before, wall = harness.tree_cpu_seconds(gw.pid), time.perf_counter()
        done = await asyncio.gather(*futures)
        cpu, wall = harness.tree_cpu_seconds(gw.pid) - before, time.perf_counter() - wall
        processes = len(harness.process_tree(gw.pid))
    summary = summarize(_merge(label, [run for run, _ in done]), common)
    ok = max(1, summary["ok"])
    return {
        "workers": workers,
        "requests": summary["requests"],
        "ok": summary["ok"],
        "errors": summary["errors"],
        "duration_s": summary["duration_s"],
        "requests_per_s": summary["requests_per_s"],
        "latency_s": summary["latency_s"],
        "gateway_cpu_s": cpu,
        "cpu_ms_per_request": 1000 * cpu / ok,
        "gateway_cores_used": cpu / wall,
        "gateway_processes": processes,
        "late_start_s": max(late for _, late in done),
    }


def combine(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One setup's rounds as one: requests/s and CPU per request over all of them."""
    ok = sum(r["ok"] for r in rounds)
    cpu = sum(r["gateway_cpu_s"] for r in rounds)
    return {
        "rounds": len(rounds),
        "ok": ok,
        "requests": sum(r["requests"] for r in rounds),
        "requests_per_s": ok / sum(r["duration_s"] for r in rounds),
        "cpu_ms_per_request": 1000 * cpu / max(1, ok),
        "gateway_cores_used": sum(r["gateway_cores_used"] for r in rounds) / len(rounds),
    }


def ratios(setups: dict[int, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each setup's requests/s and CPU per request against the first setup's."""
    base = setups[min(setups)]
    return {
        f"{w} / {min(setups)} workers": {
            "requests_per_s": s["requests_per_s"] / base["requests_per_s"],
            "cpu_per_request": s["cpu_ms_per_request"] / base["cpu_ms_per_request"],
        }
        for w, s in setups.items()
        if w != min(setups)
    }


async def compare_workers(opts: WorkersOptions, common: Common) -> dict[str, Any]:
    """Every setup, every round; prints the table and writes overhead-workers.json."""
    available = sorted(os.sched_getaffinity(0))
    plan = plan_cores(
        available, max(opts.workers), opts.gateway_cores, opts.fleet_cores, opts.load_cores
    )
    warning = plan.warning()
    say(
        f"cores: gateway {cores_text(plan.gateway)}, fleet {cores_text(plan.fleet)},"
        f" load {cores_text(plan.load)} (of {cores_text(available)})"
    )
    if warning:
        say(warning)
    os.sched_setaffinity(0, set(plan.load))  # the warm-up client, and what the pool inherits
    fleets = min(len(plan.fleet), INSTANCES)
    rounds: dict[int, list[dict[str, Any]]] = {w: [] for w in opts.workers}
    context = get_context("spawn")
    with ProcessPoolExecutor(len(plan.load), mp_context=context) as pool:
        list(pool.map(_spawned, range(len(plan.load))))
        async with contextlib.AsyncExitStack() as stack:
            urls: list[str] = []
            for i in range(fleets):
                share = INSTANCES // fleets + (i < INSTANCES % fleets)
                fleet = await stack.enter_async_context(
                    harness.fleet_process(
                        (PACED_SPEED,) * share,
                        max_num_seqs=256,
                        seed=common.seed + i,
                        core=plan.fleet[i],
                        decode_slowdown=0.0,
                    )
                )
                urls += fleet.urls
            for r in range(opts.rounds):
                for w in opts.workers:
                    label = f"workers={w} round {r + 1}"
                    say(f"measuring {label}")
                    rounds[w].append(await _measure(w, urls, plan, pool, opts, common, label))
    setups = {w: combine(rs) for w, rs in rounds.items()}
    body = {
        "options": asdict(opts),
        "cores": asdict(plan) | {"shared": plan.shared},
        "warning": warning,
        "rounds": {str(w): rs for w, rs in rounds.items()},
        "setups": {str(w): s for w, s in setups.items()},
        "ratios": ratios(setups),
    }
    say(table(body))
    say(f"wrote {write_json(common, 'overhead-workers', body)}")
    return body


def table(body: dict[str, Any]) -> str:
    """Per setup and in all: requests/s, CPU per request, gateway cores used; then ratios."""
    lines = [
        "| workers | round | ok | req/s | CPU ms/request | gateway cores used |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for w, rounds in body["rounds"].items():
        for i, r in enumerate(rounds, 1):
            lines.append(
                f"| {w} | {i} | {r['ok']}/{r['requests']} | {r['requests_per_s']:.0f} "
                f"| {r['cpu_ms_per_request']:.3f} | {r['gateway_cores_used']:.2f} |"
            )
        s = body["setups"][w]
        lines.append(
            f"| {w} | all | {s['ok']}/{s['requests']} | {s['requests_per_s']:.0f} "
            f"| {s['cpu_ms_per_request']:.3f} | {s['gateway_cores_used']:.2f} |"
        )
    for name, r in body["ratios"].items():
        lines.append(
            f"\n{name}: requests/s {r['requests_per_s']:.2f}x,"
            f" CPU per request {r['cpu_per_request']:.2f}x"
        )
    lines += unsaturated(body["setups"])
    if body["warning"]:
        lines.append(body["warning"])
    return "\n".join(lines)


def unsaturated(setups: dict[str, dict[str, Any]], share: float = 0.9) -> list[str]:
    """A line for each setup whose gateway used under `share` of a core per worker: there
    the load generator or the fleet set the pace, so its requests/s is not the gateway's."""
    return [
        f"workers={w}: the gateway used {s['gateway_cores_used']:.2f} cores for {w} workers:"
        " NOT SATURATED (the load or the fleet set the pace: give them more cores)"
        for w, s in setups.items()
        if s["gateway_cores_used"] < share * int(w)
    ]


def _workers(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        values = ()
    if len(values) < 2 or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected two or more worker counts like 1,2: {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.overhead_workers",
        description=(__doc__ or "").split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    d = WorkersOptions()
    p.add_argument("--workers", type=_workers, default=d.workers, help="setups, e.g. 1,2")
    p.add_argument("--requests", type=int, default=d.requests, help="per setup and round")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="in all")
    p.add_argument("--warmup", type=int, default=d.warmup, help="requests before each setup")
    p.add_argument("--rounds", type=int, default=d.rounds, help="setups alternate per round")
    for name, what in (
        ("gateway", "the gateway's processes (default: the first max(workers))"),
        ("fleet", "the simulated fleet, a process per core (default: a third of the rest)"),
        ("load", "the load generator, a process per core (default: the rest)"),
    ):
        p.add_argument(f"--{name}-cores", type=core_list, metavar="CORES", help=what)
    p.add_argument("--seed", type=int, default=1, help="workload and simulator seed")
    p.add_argument("--out", type=Path, default="loadtest/results", help="report folder")
    p.add_argument("--limit", type=float, default=300.0, help="seconds any one run may take")
    p.add_argument("--gateway-ref", help="run the gateway as committed at this git ref")
    return p


def options_of(args: argparse.Namespace) -> WorkersOptions:
    return WorkersOptions(
        workers=args.workers,
        requests=args.requests,
        concurrency=args.concurrency,
        warmup=args.warmup,
        rounds=args.rounds,
        gateway_cores=args.gateway_cores,
        fleet_cores=args.fleet_cores,
        load_cores=args.load_cores,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    ref = harness.pin_ref(args.gateway_ref)
    try:
        with harness.exported_gateway(ref) as folder:
            common = Common(
                seed=args.seed,
                out=args.out,
                limit=args.limit,
                gateway_ref=ref,
                gateway_dir=folder,
            )
            asyncio.run(compare_workers(options_of(args), common))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
