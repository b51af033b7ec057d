"""Soak: minutes of mixed traffic through a real gateway process while instances die and return.

    python -m loadtest.soak --seconds 180

Simulated vLLM instances run in this process on loopback ports; the gateway runs as
`python -m gateway` (its own process, so /proc shows its memory alone). A closed loop of
clients sends chat requests, streamed and not, with short and long (long-lane) prompts.
On a schedule one instance at a time is stopped like a killed process (port closed, open
connections cut) and started again on the same port a few seconds later. At the end it
prints what was sent, what was answered, what failed and how, and the gateway's resident
memory at the start and the end. Everything is bounded in time and stays on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from gateway.sim.sim_vllm import SimConfig, SimInstance
from loadtest import plots
from loadtest import report as report_
from loadtest.harness import KEY, gateway_process, memory_kib
from loadtest.helpfmt import HelpFormatter
from loadtest.progress import make_bar, want_bar
from loadtest.report import MIN_SAMPLES, percentiles

_GRACE = 30.0  # seconds in-flight requests get after the run's time is up
_CLIENT_TIMEOUT = 60.0


@dataclass(frozen=True)
class Kind:
    name: str
    stream: bool
    long: bool
    weight: float


KINDS = (
    Kind("stream-short", stream=True, long=False, weight=0.55),
    Kind("whole-short", stream=False, long=False, weight=0.25),
    Kind("stream-long", stream=True, long=True, weight=0.15),
    Kind("whole-long", stream=False, long=True, weight=0.05),
)
_LONG_PROMPT = "lorem " * 4000  # about 6000 estimated tokens: the long lane
_SHORT_PROMPT = "say something short about soak tests"


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    by_kind: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    latencies: list[float] = field(default_factory=list)
    finished: list[tuple[float, bool, float]] = field(default_factory=list)  # (when, ok, s)

    def record(self, kind: Kind, outcome: str, latency: float) -> None:
        self.by_kind[kind.name][outcome] += 1
        self.finished.append((time.monotonic(), outcome == "ok", latency))
        if outcome == "ok":
            self.answered += 1
            self.latencies.append(latency)
        else:
            self.failed[outcome] += 1


async def _read_stream(resp: aiohttp.ClientResponse) -> str:
    """ "ok" for a stream ending in [DONE], "stream_error" for an in-band error, else "cut"."""
    buffer = b""
    done = errored = False
    async for data in resp.content.iter_any():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
            elif b'"error"' in payload[:12]:
                errored = True
    if errored:
        return "stream_error"
    return "ok" if done else "cut"


async def _one(session: aiohttp.ClientSession, url: str, kind: Kind, rng: random.Random) -> str:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": _LONG_PROMPT if kind.long else _SHORT_PROMPT}],
        "max_tokens": rng.randint(4, 24) if kind.long else rng.randint(4, 64),
        "ignore_eos": True,  # all of max_tokens, as `vllm bench serve` asks
        "stream": kind.stream,
    }
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Tag": f"soak-{kind.name}"}
    try:
        async with session.post(
            url + "/v1/chat/completions",
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=_CLIENT_TIMEOUT),
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return f"status_{resp.status}"
            if kind.stream:
                return await _read_stream(resp)
            answer = await resp.json()
            return "ok" if answer.get("choices") else "bad_body"
    except TimeoutError:
        return "client_timeout"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return f"client_{type(exc).__name__}"


async def _worker(
    session: aiohttp.ClientSession, url: str, tally: Tally, until: float, seed: int
) -> None:
    rng = random.Random(seed)
    weights = [k.weight for k in KINDS]
    while time.monotonic() < until:
        kind = rng.choices(KINDS, weights)[0]
        tally.sent += 1
        started = time.monotonic()
        outcome = await _one(session, url, kind, rng)
        tally.record(kind, outcome, time.monotonic() - started)


async def _chaos(
    sims: Sequence[SimInstance], until: float, every: float, down_for: float, log: list[str]
) -> int:
    """Stop one instance at a time (round robin) every `every` s, restart it after `down_for`."""
    kills = 0
    index = 0
    t0 = time.monotonic()
    while time.monotonic() + every < until:
        await asyncio.sleep(every)
        sim = sims[index % len(sims)]
        index += 1
        port = int(sim.url.rsplit(":", 1)[1])
        await sim.stop()
        kills += 1
        log.append(f"{time.monotonic() - t0:7.1f}s  killed   {sim.url}")
        await asyncio.sleep(min(down_for, max(0.0, until - time.monotonic())))
        await sim.start(port=port)
        log.append(f"{time.monotonic() - t0:7.1f}s  restored {sim.url}")
    return kills


async def _watch_memory(pid: int, samples: list[int], until: float) -> None:
    while time.monotonic() < until:
        with contextlib.suppress(OSError):
            samples.append(memory_kib(pid)["VmRSS"])
        await asyncio.sleep(1.0)


async def _gateway_counters(url: str) -> dict[str, float]:
    wanted = (
        "gateway_retries_total",
        "gateway_retries_refused_total",
        "gateway_rejections_total",
        "gateway_stream_aborts_total",
        "gateway_instance_ejections_total",
    )
    totals = dict.fromkeys(wanted, 0.0)
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
            for line in (await resp.text()).splitlines():
                name = line.split("{", 1)[0].split(" ", 1)[0]
                if name in totals:
                    totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


def _summarize_log(text: str) -> dict[str, Any]:
    """Access-log statuses, warning events, and a sample of the 5xx answers, from the log."""
    statuses: collections.Counter[str] = collections.Counter()
    events: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    for line in text.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "request":
            statuses[str(event.get("status"))] += 1
            if int(event.get("status") or 0) >= 500 and len(failures) < 10:
                keep = ("status", "route", "lane", "server", "attempts", "duration_ms")
                failures.append(json.dumps({k: event.get(k) for k in keep}))
        elif event.get("level") in ("warning", "error", "critical"):
            events[f"{event.get('level')}:{event.get('event')}"] += 1
        elif event.get("event") == "retrying":
            events[f"retrying:{event.get('reason')}"] += 1
    return {
        "requests_by_status": dict(statuses.most_common()),
        "events": dict(events.most_common()),
        "sample_5xx": failures,
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    speeds = [float(s) for s in args.speeds.split(",")]
    configs = [
        SimConfig(speed=s, max_num_seqs=args.max_num_seqs, decode_s_per_token=0.02, seed=i)
        for i, s in enumerate(speeds)
    ]
    sims = [SimInstance(c) for c in configs]
    for sim in sims:
        await sim.start()
    try:
        async with gateway_process(
            [s.url for s in sims],
            strategy=args.strategy,
            max_num_seqs=args.max_num_seqs,
            dispatch={"health_check_interval": 0.5},
            gateway={"request_timeout": 30, "drain_timeout": 5},
        ) as gw:
            rss_start = memory_kib(gw.pid)["VmRSS"]
            started = time.monotonic()
            until = started + args.seconds
            tally, chaos_log, rss = Tally(), list[str](), [rss_start]
            connector = aiohttp.TCPConnector(limit=args.concurrency * 2)
            async with aiohttp.ClientSession(connector=connector) as session:
                workers = [
                    asyncio.create_task(_worker(session, gw.url, tally, until, args.seed + i))
                    for i in range(args.concurrency)
                ]
                chaos = asyncio.create_task(
                    _chaos(sims, until, args.kill_every, args.down_for, chaos_log)
                )
                memory = asyncio.create_task(_watch_memory(gw.pid, rss, until + _GRACE))
                progress = asyncio.create_task(_progress(tally, started, until))
                _, pending = await asyncio.wait(workers, timeout=args.seconds + _GRACE)
                for task in (*pending, memory, progress):
                    task.cancel()
                kills = await chaos
                await asyncio.gather(*pending, memory, progress, return_exceptions=True)
            elapsed = time.monotonic() - started
            counters = await _gateway_counters(gw.url)
            final = memory_kib(gw.pid)
            alive = gw.proc.returncode is None
            gateway_log = await asyncio.to_thread(
                _summarize_log, gw.log.read_text(errors="replace")
            )
    finally:
        for sim in sims:
            await sim.stop()
    return {
        "seconds": round(elapsed, 1),
        "concurrency": args.concurrency,
        "instances": len(sims),
        "kills": kills,
        "sent": tally.sent,
        "answered": tally.answered,
        "failed": dict(tally.failed.most_common()),
        "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
        "unfinished_workers": len(pending),
        "latency_s": _latency(tally.latencies),
        "timeline": plots.soak_timeline(tally.finished, started, elapsed),
        "gateway_alive_at_end": alive,
        "gateway_rss_mib": {
            "start": round(rss_start / 1024, 1),
            "end": round(final["VmRSS"] / 1024, 1),
            "peak": round(final["VmHWM"] / 1024, 1),
            "max_sampled": round(max(rss) / 1024, 1),
        },
        "gateway_counters": counters,
        "gateway_log": gateway_log,
        "chaos": chaos_log,
    }


def _latency(latencies: list[float]) -> dict[str, Any]:
    """n, p50 and p99 in s (nearest rank); p99 None (JSON null) below 100 answers."""
    stats = percentiles(latencies)
    out: dict[str, Any] = {"n": stats["n"]}
    for key in ("p50", "p99"):
        out[key] = None if stats[key] is None else round(stats[key], 3)
    return out


def _latency_text(stats: dict[str, Any]) -> str:
    parts = []
    for key in ("p50", "p99"):
        value = stats[key]
        if value is not None:
            parts.append(f"{key} {value} s")
        elif stats["n"]:
            parts.append(f"{key} n/a (n<{MIN_SAMPLES[int(key[1:])]})")
        else:
            parts.append(f"{key} -")
    return ", ".join(parts) + f" (n={stats['n']})"


async def _progress(tally: Tally, started: float, until: float) -> None:
    if want_bar(sys.stderr, None):  # a bar with an ETA on a terminal
        with make_bar(round(until - started), "[soak]", "s", sys.stderr) as bar:
            while True:
                await asyncio.sleep(1.0)
                bar.update(min(bar.total, round(time.monotonic() - started)) - bar.n)
                bar.set_postfix_str(
                    f"sent {tally.sent} answered {tally.answered} "
                    f"failed {sum(tally.failed.values())}",
                    refresh=True,
                )
    while time.monotonic() < until:
        await asyncio.sleep(30)
        print(
            f"[soak] {time.monotonic() - started:5.0f}s sent={tally.sent} "
            f"answered={tally.answered} failed={sum(tally.failed.values())}",
            file=sys.stderr,
            flush=True,
        )


def _print(report: dict[str, Any]) -> None:
    rss = report["gateway_rss_mib"]
    print(f"soak: {report['seconds']} s, {report['concurrency']} clients, "
          f"{report['instances']} instances, {report['kills']} kills")  # fmt: skip
    print(f"  sent      {report['sent']}")
    print(f"  answered  {report['answered']}")
    for outcome, count in report["failed"].items():
        print(f"  failed    {count:6d}  {outcome}")
    print(f"  latency   {_latency_text(report['latency_s'])}")
    print(f"  gateway   rss start {rss['start']} MiB, end {rss['end']} MiB, "
          f"peak {rss['peak']} MiB; alive at end: {report['gateway_alive_at_end']}")  # fmt: skip
    for name, value in report["gateway_counters"].items():
        print(f"  {name:36s} {value:g}")
    gateway_log = report["gateway_log"]
    print(f"  gateway log: statuses {gateway_log['requests_by_status']}")
    print(f"  gateway log: events {gateway_log['events']}")
    for line in gateway_log["sample_5xx"]:
        print(f"    5xx {line}")
    for line in report["chaos"]:
        print(f"  {line}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.soak",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--seconds", type=float, default=180.0, help="traffic duration, 1..3600")
    p.add_argument("--concurrency", type=int, default=12, help="clients in the closed loop")
    p.add_argument("--speeds", default="1,1,0.5", help="one simulated instance per speed")
    p.add_argument("--max-num-seqs", type=int, default=16, help="sequences per instance")
    p.add_argument("--strategy", default="least_busy", help="the gateway's dispatch strategy")
    p.add_argument("--kill-every", type=float, default=20.0, help="seconds between kills")
    p.add_argument("--down-for", type=float, default=6.0, help="seconds an instance stays down")
    p.add_argument("--seed", type=int, default=0, help="client i's seed is seed+i")
    p.add_argument("--json", help="also write the report to this file (default: none)")
    p.add_argument(
        "--png", help="also plot latency and throughput over time, kills marked (default: none)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 1 <= args.seconds <= 3600 or args.concurrency < 1:
        print("soak: --seconds must be 1..3600 and --concurrency >= 1", file=sys.stderr)
        return 2
    report = asyncio.run(soak(args))
    _print(report)
    if args.png:
        if report_.can_plot():
            plots.plot_soak(report, args.png)
        else:
            print(f"no {args.png}: matplotlib is missing (pip install -e '.[bench]')")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0 if report["gateway_alive_at_end"] and report["answered"] else 1


if __name__ == "__main__":
    sys.exit(main())
