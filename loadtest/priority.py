"""The `priority` scenario: an interactive and a batch key at twice the fleet's capacity,
with and without priority classes.

A fleet of continuous-batching simulated instances (`--speeds`, `--max-num-seqs` slots,
`--decode-s-per-token`), short prompts, streamed answers. First its capacity: what the
cards serve kept full (capacity.py), unless `--capacity` gives it. Then the same seeded
open-loop Poisson arrivals at `--load` x capacity, in two arms, each on a fresh fleet and
gateway:

    classes      key `chat` interactive, key `jobs` batch; the instances run vLLM's
                 priority scheduler (`scheduling_policy = "priority"`), and the gateway
                 judges batch by `[slo.batch]`
    no classes   both keys interactive, instances fcfs: the gateway as before

`chat` sends `--chat-share` of the load, `jobs` the rest. Per class and arm: requests
sent, 200s, 429s, 503s, p50/p99 TTFT of the 200s, goodput (streams within their class's
TTFT and TPOT objectives, per second of the run's span) and the gateway's mean queue wait
(from its `gateway_queue_wait_seconds`; per class where the metric says the class). The
targets: in "classes", interactive p99 TTFT within its objective, batch takes the
refusals, batch goodput above zero.

Where the gateway under test does not know the priority settings (`gateway --check`
refuses them), "classes" runs without them: the report says so and judges nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp

from loadtest import capacity, harness, report
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
from loadtest.scenarios import Common, cores, pin_self, say, slo_block, write_json

# The gateway's [slo.batch] defaults: batch waits up to its TTFT objective, streams slower.
BATCH_SLO = {"ttft": 30.0, "tpot": 0.2, "long_ttft": 120.0, "long_tpot": 0.2}
MIX = Mix(long_share=0.0, short_tokens=(100, 400), max_tokens=(32, 64))
JOBS_SEED = 104729  # the batch key's arrivals are drawn apart from the chat key's


@dataclass(frozen=True)
class Tenant:
    """A named key of the run: its class in each arm and its share of the load."""

    name: str
    share: float  # of the total rate

    @property
    def key(self) -> str:
        return f"sk-bench-{self.name}-0123456789"


@dataclass(frozen=True)
class PriorityOptions:
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    max_num_seqs: int = 8
    decode_s_per_token: float = 0.02  # a 70B-class model's decode step
    load: float = 2.0  # times capacity, both keys together
    chat_share: float = 0.25  # of the load: 0.5x capacity at 2x
    duration: float = 40.0  # seconds of arrivals per arm
    capacity: float | None = None  # req/s; None: measured
    capacity_window: float = 20.0  # seconds the capacity run keeps the cards full
    mix: Mix = MIX
    arms: tuple[str, ...] = ("classes", "no classes")

    def tenants(self) -> tuple[Tenant, Tenant]:
        return Tenant("chat", self.chat_share), Tenant("jobs", 1.0 - self.chat_share)


def _arm_config(arm: str, tenants: Sequence[Tenant]) -> dict[str, Any]:
    """The gateway settings of an arm: (channel, extra sections, instance fields)."""
    chat, jobs = tenants
    keys = [{"name": t.name, "key": t.key} for t in tenants]
    if arm == "no classes":
        return {"channel": {"keys": keys}, "extra": {}, "instance_fields": {}}
    classes = {chat.name: "interactive", jobs.name: "batch"}
    return {
        "channel": {"keys": [{**k, "priority": classes[k["name"]]} for k in keys]},
        "extra": {"slo.batch": BATCH_SLO},
        "instance_fields": {"scheduling_policy": "priority"},
    }


_QUEUE_WAIT = re.compile(r"^gateway_queue_wait_seconds_(sum|count)\{([^}]*)\} (\S+)$")


async def _queue_wait(url: str) -> dict[str, float | None]:
    """Mean gateway queue wait in seconds: "all", and per `priority` label where there is one."""
    totals: dict[str, list[float]] = {}
    with contextlib.suppress(aiohttp.ClientError, OSError):
        async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as resp:
            text = await resp.text()
        for line in text.splitlines():
            match = _QUEUE_WAIT.match(line)
            if not match:
                continue
            kind, labels, value = match.groups()
            found = re.search(r'priority="([^"]*)"', labels)
            for name in ("all", *([found.group(1)] if found else [])):
                pair = totals.setdefault(name, [0.0, 0.0])
                pair[kind == "count"] += float(value)
    return {name: s / n if n else None for name, (s, n) in totals.items()}


def class_report(
    run: Run, ttft_slo: float, tpot_slo: float, span: float, label: str
) -> dict[str, Any]:
    """One class's figures in one arm."""
    results: list[Result] = run.results
    statuses = Counter(r.status for r in results)
    ok = [r for r in results if r.ok]
    good = sum(report.meets(r, ttft_slo, tpot_slo) for r in results)
    ttft = report.percentiles(r.ttft for r in ok if r.ttft is not None)
    return {
        "class": label,
        "sent": len(results) + run.unfinished,
        "ok": len(ok),
        "status_200": statuses[200],
        "status_429": statuses[429],
        "status_503": statuses[503],
        "other": sum(n for s, n in statuses.items() if s not in (200, 429, 503)) + run.unfinished,
        "ttft_p50_s": ttft["p50"],
        "ttft_p99_s": ttft["p99"],
        "ttft_n": ttft["n"],
        "met_objectives": good,
        "goodput_rps": good / span if span else 0.0,
        "objectives": {"ttft_s": ttft_slo, "tpot_s": tpot_slo},
    }


async def run_arm(
    arm: str, opts: PriorityOptions, rate: float, common: Common, classes: bool
) -> dict[str, Any]:
    """One arm on a fresh fleet and gateway: both keys' arrivals at once."""
    tenants = opts.tenants()
    config = _arm_config(arm if classes else "no classes", tenants)
    policy = "priority" if arm == "classes" else "fcfs"
    gw_core, fleet_core = cores(common)
    slo: dict[str, Any] = slo_block(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                decode_s_per_token=opts.decode_s_per_token,
                scheduling_policy=policy,
            )
        )
        gateway = await stack.enter_async_context(
            harness.gateway_process(
                fleet.urls,
                strategy="least_busy",
                max_num_seqs=opts.max_num_seqs,
                core=gw_core,
                source=common.gateway_dir,
                slo=slo,
                extra=config["extra"],
                channel=config["channel"],
                instance_fields=config["instance_fields"],
            )
        )
        http = await stack.enter_async_context(session())
        say(f"{arm}: {rate:.1f} req/s for {opts.duration:g} s ({policy} instances)")
        url = gateway.base_url

        def route(spec: RequestSpec, worker: int) -> str:
            return url

        runs = []
        for index, tenant in enumerate(tenants):
            tenant_rate = rate * tenant.share
            count = max(1, round(tenant_rate * opts.duration))
            seed = common.seed + index * JOBS_SEED
            specs = make_workload(count, opts.mix, seed, rate=tenant_rate)
            client = Client(http, tenant.key)
            runs.append(
                run_open(
                    client,
                    specs,
                    route,
                    label=f"{arm}: {tenant.name}",
                    limit=common.limit,
                )
            )
        chat_run, jobs_run = await asyncio.gather(*runs)
        wait = await _queue_wait(gateway.url)
    started = min(chat_run.started, jobs_run.started)
    span = max(chat_run.ended, jobs_run.ended) - started
    batch_slo = BATCH_SLO if classes and arm == "classes" else slo
    return {
        "arm": arm,
        "scheduling_policy": policy,
        "span_s": span,
        "queue_wait_mean_s": wait,
        "classes": {
            "interactive": class_report(
                chat_run, common.ttft_slo, common.tpot_slo, span, "interactive"
            ),
            "batch" if arm == "classes" else "interactive (jobs)": class_report(
                jobs_run,
                batch_slo["ttft"],
                batch_slo["tpot"],
                span,
                "batch" if arm == "classes" else "interactive",
            ),
        },
    }


def targets(arm: dict[str, Any], ttft_slo: float) -> dict[str, Any]:
    """The issue's three targets, judged on the "classes" arm."""
    chat, jobs = arm["classes"]["interactive"], arm["classes"]["batch"]
    chat_refused = chat["status_429"] + chat["status_503"]
    jobs_refused = jobs["status_429"] + jobs["status_503"]
    p99 = chat["ttft_p99_s"]
    return {
        "interactive_p99_ttft_within_objective": p99 is not None and p99 <= ttft_slo,
        # Batch takes the refusals: some, and interactive at most 1% of what it sent.
        "batch_takes_the_refusals": jobs_refused > 0 and chat_refused <= 0.01 * chat["sent"],
        "batch_goodput_above_zero": jobs["goodput_rps"] > 0,
    }


async def priority(opts: PriorityOptions, common: Common) -> dict[str, Any]:
    pin_self(common)
    body: dict[str, Any] = {"options": asdict(opts)}
    refusal = harness.gateway_accepts(common.gateway_dir, **_arm_config("classes", opts.tenants()))
    classes = refusal is None
    body["gateway_classes"] = classes
    if not classes:
        say(f"the gateway does not take the priority settings ({refusal}): classes run without")
        body["gateway_refusal"] = refusal
    cap = opts.capacity
    if cap is None:
        measured = await capacity.measure(
            opts.speeds,
            opts.mix,
            max_num_seqs=opts.max_num_seqs,
            max_num_batched_tokens=2048,
            common=common,
            decode_s_per_token=opts.decode_s_per_token,
            window=opts.capacity_window,
        )
        cap = measured.req_per_s
        body["capacity_measured"] = measured.as_json()
    body["capacity_req_per_s"] = cap
    rate = opts.load * cap
    body["arms"] = {arm: await run_arm(arm, opts, rate, common, classes) for arm in opts.arms}
    if classes and "classes" in body["arms"]:
        body["targets"] = targets(body["arms"]["classes"], common.ttft_slo)
    _print(body, rate)
    say(f"wrote {write_json(common, 'priority', body)}")
    return body


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1000 * value:,.0f}"


def _print(body: dict[str, Any], rate: float) -> None:
    say(f"\ncapacity {body['capacity_req_per_s']:.2f} req/s; driven at {rate:.2f} req/s")
    rows = []
    for arm in body["arms"].values():
        for name, c in arm["classes"].items():
            wait = arm["queue_wait_mean_s"]
            mean = wait.get(c["class"], wait.get("all"))
            rows.append(
                [
                    arm["arm"],
                    name,
                    str(c["sent"]),
                    str(c["status_200"]),
                    str(c["status_429"]),
                    str(c["status_503"]),
                    f"{_ms(c['ttft_p50_s'])} / {_ms(c['ttft_p99_s'])}",
                    f"{c['goodput_rps']:.2f}",
                    _ms(mean),
                ]
            )
    headers = ["arm", "class", "sent", "200", "429", "503", "TTFT p50 / p99 ms", "goodput/s"]
    say(report.table([*headers, "queue wait ms"], rows))
    for name, met in body.get("targets", {}).items():
        say(f"  {'met   ' if met else 'MISSED'} {name}")
