"""The `overhead` scenario: what the gateway itself costs, measured from outside its process.

The gateway runs as its own process pinned to core 0; the instant simulator and this
load generator share core 1. Four measurements, side by side in one run:

1. idle latency: concurrency 1, blocks alternating straight-to-instance and via-gateway,
   so drift hits both arms alike; the added latency is the difference of the medians;
2. CPU per streamed request (16 tokens): utime + stime of the gateway process from
   /proc/<pid>/stat around a closed-loop run, once with an instant instance (the chunks
   arrive in bursts) and once with tokens paced 5 ms apart (one chunk per token, four
   instances);
3. hot spots: py-spy sampling the gateway during a longer run of the paced streams
   (concurrency 128);
4. memory: VmHWM from /proc/<pid>/status with `streams` streams open at once against
   slow-decoding instances;
5. side by side (overhead_fronts.py): CPU per streamed request, requests/s and added
   latency of the gateway, nginx and vLLM's Rust router, instant and paced, c=32 and 128.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import shutil
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import budget, harness, overhead_fronts, plots, report
from loadtest.loadgen import Client, Mix, Run, make_workload, run_closed, session
from loadtest.scenarios import (
    Common,
    cores,
    pin_self,
    plot_path,
    say,
    summarize,
    to_v1,
    write_json,
)

IDLE_MIX = Mix(long_share=0.0, short_tokens=(100, 100), max_tokens=(16, 16))
STREAM_MIX = Mix(long_share=0.0, short_tokens=(50, 50), max_tokens=(32, 32))


@dataclass(frozen=True)
class OverheadOptions:
    idle_requests: int = 400  # per arm
    requests: int = 3000
    concurrency: int = 32
    streams: int = 2000
    profile: bool = True
    profile_requests: int = 6000  # streams sampled by py-spy (its own run, per fleet)
    rounds: int = 4  # idle blocks per arm
    fronts: bool = True  # the side-by-side part (overhead_fronts.py)
    front_requests: int = 3000  # per front, fleet and concurrency


@dataclass
class System:
    fleet: harness.FleetProc
    gw: harness.GatewayProc
    client: Client


@contextlib.asynccontextmanager
async def _system(
    common: Common,
    speeds: Sequence[float],
    *,
    instant: bool,
    max_num_seqs: int,
    max_connections: int = 64,
    decode_slowdown: float | None = None,
    max_client_connections: int | None = None,
) -> AsyncIterator[System]:
    gw_core, fleet_core = cores(common)
    async with (
        harness.fleet_process(
            speeds,
            max_num_seqs=max_num_seqs,
            seed=common.seed,
            instant=instant,
            core=fleet_core,
            decode_slowdown=decode_slowdown,
        ) as fleet,
        harness.gateway_process(
            fleet.urls,
            strategy="least_busy",
            max_num_seqs=max_num_seqs,
            core=gw_core,
            gateway={"max_connections": max_connections}
            | (
                {"max_client_connections": max_client_connections} if max_client_connections else {}
            ),
            source=common.gateway_dir,
        ) as gw,
        session() as http,
    ):
        yield System(fleet, gw, Client(http, harness.KEY))


async def _closed(
    system: System, url: str, count: int, concurrency: int, label: str, mix: Mix, common: Common
) -> Run:
    specs = make_workload(count, mix, common.seed)
    return await run_closed(
        system.client,
        specs,
        lambda s, w: url,
        concurrency=concurrency,
        label=label,
        limit=common.limit,
    )


def _merge(label: str, runs: Sequence[Run]) -> Run:
    merged = Run(label, started=0.0, ended=sum(r.duration for r in runs))
    for run in runs:
        merged.results.extend(run.results)
        merged.unfinished += run.unfinished
    return merged


async def _idle(system: System, opts: OverheadOptions, common: Common) -> dict[str, Any]:
    direct, via = to_v1(system.fleet.urls[0]), system.gw.base_url
    for url in (direct, via):  # warm both paths' connections and code
        await _closed(system, url, 20, 1, "warm-up", IDLE_MIX, common)
    per_block = max(1, opts.idle_requests // opts.rounds)
    arms: dict[str, list[Run]] = {"direct": [], "gateway": []}
    for _ in range(opts.rounds):
        for arm, url in (("direct", direct), ("gateway", via)):
            arms[arm].append(await _closed(system, url, per_block, 1, arm, IDLE_MIX, common))
    runs = {arm: summarize(_merge(arm, r), common) for arm, r in arms.items()}
    added = {
        f"{metric}_{p}_ms": 1000 * (runs["gateway"][metric][p] - runs["direct"][metric][p])
        for metric in ("latency_s", "ttft_s")
        for p in ("p50", "p99")
        if runs["gateway"][metric][p] is not None and runs["direct"][metric][p] is not None
    }
    return {"runs": runs, "added": added}


async def _cpu(system: System, opts: OverheadOptions, common: Common, label: str) -> dict[str, Any]:
    await _closed(system, system.gw.base_url, 100, opts.concurrency, "warm-up", IDLE_MIX, common)
    before, wall = harness.cpu_seconds(system.gw.pid), time.perf_counter()
    run = await _closed(
        system, system.gw.base_url, opts.requests, opts.concurrency, label, IDLE_MIX, common
    )
    cpu = harness.cpu_seconds(system.gw.pid) - before
    wall = time.perf_counter() - wall
    summary = summarize(run, common)
    done = max(1, summary["completed"])
    return {
        "run": summary,
        "gateway_cpu_s": cpu,
        "cpu_ms_per_request": 1000 * cpu / done,
        "cpu_s_per_1000_requests": 1000 * cpu / done,
        "gateway_core_utilisation": cpu / wall,
        "requests_per_s": summary["requests_per_s"],
        "requests_per_s_per_gateway_core": done / cpu if cpu else None,
        "reads_per_stream_p50": summary["reads_per_stream"]["p50"],
        "memory_kib": harness.memory_kib(system.gw.pid),
    }


async def _profile(
    system: System, opts: OverheadOptions, common: Common, kind: str, cpu_ms: float
) -> Any:
    """py-spy on the gateway through a run like the `kind` CPU run (its concurrency and
    workload): the hot frames, and the request's budget by stage (`cpu_ms` per request)."""
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return {"skipped": "py-spy is not installed (pip install py-spy)"}
    raw = common.out / f"overhead-pyspy-{kind}.txt"
    args = [
        *harness.pin_prefix(cores(common)[1]),
        spy,
        "record",
        "-p",
        str(system.gw.pid),
        "-r",
        "500",
        "-f",
        "raw",
        "-o",
        str(raw),
    ]  # blocking mode: each sample pauses the gateway, so stacks are whole
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    await asyncio.sleep(1.0)  # let it attach
    await _closed(
        system,
        system.gw.base_url,
        opts.profile_requests,
        opts.concurrency,
        f"py-spy {kind}",
        IDLE_MIX,
        common,
    )
    proc.send_signal(signal.SIGINT)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        proc.kill()
        return {"skipped": "py-spy did not stop"}
    if not raw.exists():
        return {"skipped": f"py-spy wrote nothing: {err.decode(errors='replace')[-300:]}"}
    collapsed = raw.read_text()
    return {**top_frames(collapsed), "budget": budget.budget(collapsed, cpu_ms)}


def top_frames(collapsed: str, count: int = 15) -> dict[str, Any]:
    """Self and inclusive shares per function from py-spy's collapsed stacks.

    Shares are of the samples in Python code: those that end in the loop's run() are
    counted apart (`loop_samples`), since idle waiting and C-level I/O both land there.
    """
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = loop = 0
    for line in collapsed.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        samples = int(n)
        frames = [budget.frame_name(f) for f in stack.split(";")]
        if frames[-1] in budget.LOOP_LEAVES:
            loop += samples
            continue
        total += samples
        own[frames[-1]] += samples
        for name in set(frames):
            inclusive[name] += samples

    def share(counts: Counter[str]) -> list[tuple[str, float]]:
        return [(name, round(n / max(1, total), 4)) for name, n in counts.most_common(count)]

    ours = Counter({name: n for name, n in inclusive.items() if "(gateway/" in name})
    return {
        "samples": total,
        "loop_samples": loop,
        "self": share(own),
        "inclusive": share(inclusive),
        "gateway_inclusive": share(ours),
    }


async def _memory(opts: OverheadOptions, common: Common) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * opts.streams + 1024
    if soft < want:  # children inherit it: fleet, gateway
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    speeds = (0.5, 0.5, 0.5, 0.5)
    seqs = max(16, -(-opts.streams // len(speeds)) + 8)
    async with _system(
        common,
        speeds,
        instant=False,
        max_num_seqs=seqs,
        max_connections=opts.streams + 64,
        # Else the gateway's own cap (900 by default) answers the rest 503.
        max_client_connections=opts.streams + 64,
    ) as system:
        pid = system.gw.pid
        at_start = harness.memory_kib(pid)
        peak = {"inflight": 0}
        watcher = asyncio.create_task(_watch_inflight(system.gw.url, peak))
        try:
            run = await _closed(
                system,
                system.gw.base_url,
                opts.streams,
                opts.streams,
                "streams",
                STREAM_MIX,
                common,
            )
        finally:
            watcher.cancel()
        return {
            "streams": opts.streams,
            "peak_inflight_seen": peak["inflight"],
            "memory_kib_at_start": at_start,
            "memory_kib_after": harness.memory_kib(pid),
            "run": summarize(run, common),
        }


async def _watch_inflight(url: str, peak: dict[str, int]) -> None:
    headers = {"Authorization": f"Bearer {harness.KEY}"}
    async with aiohttp.ClientSession() as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url + "/admin/instances", headers=headers) as resp:
                    peak["inflight"] = max(peak["inflight"], (await resp.json())["inflight"])
            await asyncio.sleep(0.25)


async def overhead(opts: OverheadOptions, common: Common) -> dict[str, Any]:
    """All four measurements; prints a summary and writes overhead.json."""
    pin_self(common)
    common.out.mkdir(parents=True, exist_ok=True)
    body: dict[str, Any] = {"options": asdict(opts), "pinned": bool(harness.pin_prefix(0))}
    async with _system(common, (1.0,), instant=True, max_num_seqs=256) as system:
        body["idle"] = await _idle(system, opts, common)
        body["cpu_instant"] = await _cpu(system, opts, common, "instant")
        body["memory_kib_loaded"] = harness.memory_kib(system.gw.pid)
        if opts.profile:  # after the CPU measurements: py-spy's pauses must not be in them
            cpu_ms = body["cpu_instant"]["cpu_ms_per_request"]
            body["profile_instant"] = await _profile(system, opts, common, "instant", cpu_ms)
    paced = (overhead_fronts.PACED_SPEED,) * overhead_fronts.INSTANCES
    async with _system(
        common, paced, instant=False, max_num_seqs=256, max_connections=512, decode_slowdown=0.0
    ) as system:
        body["cpu_paced"] = await _cpu(system, opts, common, "paced 5 ms/token")
        if opts.profile:
            cpu_ms = body["cpu_paced"]["cpu_ms_per_request"]
            body["profile_paced"] = await _profile(system, opts, common, "paced", cpu_ms)
    if opts.fronts:
        fronts = overhead_fronts.FrontOptions(requests=opts.front_requests)
        body["fronts"] = await overhead_fronts.fronts(fronts, common)
    body["streams"] = await _memory(opts, common)
    _print(body)
    say(f"wrote {write_json(common, 'overhead', body)}")
    if plot_path(common, "overhead.png"):
        plots.plot_overhead(body, common.out / "overhead.png")
    return body


def _print(body: dict[str, Any]) -> None:
    idle = body["idle"]
    say(report.run_table(list(idle["runs"].values())))
    say("added by the gateway (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in idle["added"].items()))
    for key in ("cpu_instant", "cpu_paced"):
        c = body[key]
        say(
            f"{key}: {c['cpu_ms_per_request']:.3f} ms CPU/request, {c['requests_per_s']:.0f} req/s"
            f" at {c['gateway_core_utilisation']:.0%} of a core -> "
            f"{c['requests_per_s_per_gateway_core'] or 0:.0f} req/s per core; "
            f"{c['reads_per_stream_p50']} reads/stream; "
            f"VmHWM {c['memory_kib']['VmHWM'] / 1024:.1f} MiB"
        )
    s = body["streams"]
    say(
        f"{s['streams']} streams (peak {s['peak_inflight_seen']} in flight): VmHWM "
        f"{s['memory_kib_after']['VmHWM'] / 1024:.1f} MiB (at start "
        f"{s['memory_kib_at_start']['VmRSS'] / 1024:.1f} MiB); "
        f"{s['run']['ok']}/{s['run']['requests']} ok"
    )
    if "fronts" in body:
        say(overhead_fronts.table(body["fronts"]))
    for run in ("instant", "paced"):
        prof = body.get(f"profile_{run}") or {}
        for kind in ("self", "gateway_inclusive"):
            for name, share in prof.get(kind, [])[:12]:
                say(f"  {run} {kind:17} {share:6.1%}  {name}")
        if "budget" in prof:
            say(f"{run}: one request's CPU by stage\n" + budget.table(prof["budget"]))
