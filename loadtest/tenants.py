"""The `tenants` scenario: named keys' limits across replicas, and what named keys cost.

Part 1, limits. Four gateway replicas (processes, all on the gateway core) in front of two
instant simulated instances, each replica with two named keys: `requests` (600 requests a
minute) and `tokens` (200,000 tokens a minute). The load generator drives each key at 3x
its limit for `--window` seconds, requests evenly spaced and sent round robin over the
replicas (an L4 balancer), whole chat answers whose usage it reads: `requests` sends
50-token prompts for 16 tokens; `tokens` 400-token prompts for 600 (the reservation, the
prompt estimate plus max_tokens, is what the instance then reports, 1,004 tokens).

    with Redis     the replicas share `[shared] redis_url` on one real Redis: one bucket
                   per key and limit for the fleet
    without        the same replicas without it: each counts the keys alone

A limit a minute is a bucket that holds a minute's worth and refills continuously
(dispatch/key_limits.py), so from a full bucket over a window of W seconds a key is due
the limit x (1 + W / 60); after its first refusal (the bucket empty), the limit x the
time left / 60. Both are reported against what was admitted (requests, and the tokens the
instance counted), with each replica's part, and every 429 is checked: OpenAI's type
(`requests`, `tokens`), code `rate_limit_exceeded`, `retry-after-ms` and `Retry-After`
agreeing, `x-ratelimit-limit-*` the limit and `x-ratelimit-remaining-*` too little.

Part 2, cost. CPU per streamed request (closed loop, 32 at once, instant instances, from
/proc around each run, arms alternating so drift hits all) of one gateway process with
the unified key alone; with 50 named keys, each with limits (too high to refuse), the
requests spread over them; and both again with `[shared]` (its view of the fleet costs
something of its own), where every admission of a limited key is a Redis round trip.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from loadtest import harness
from loadtest.loadgen import Client, Mix, RequestSpec, Result, make_workload, run_closed, session
from loadtest.replicas_setup import redis_process
from loadtest.scenarios import Common, cores, pin_self, say, write_json

COST_MIX = Mix(long_share=0.0, short_tokens=(100, 100), max_tokens=(16, 16))
# Limits no cost run reaches: the arithmetic runs, nothing is refused.
UNREACHED = {"requests_per_minute": 10**7, "tokens_per_minute": 10**9, "max_concurrent": 10**4}


@dataclass(frozen=True)
class LimitedKey:
    """A key the limits part drives: its limit, and the requests it sends."""

    name: str
    kind: str  # "requests" or "tokens": which limit it has
    limit: int  # a minute
    prompt_tokens: int  # content tokens (the chat template adds 4)
    max_tokens: int

    @property
    def key(self) -> str:
        return f"sk-bench-{self.name}-0123456789"

    @property
    def cost(self) -> int:
        """What one request takes of the limit (the instant simulator answers max_tokens)."""
        return 1 if self.kind == "requests" else self.prompt_tokens + 4 + self.max_tokens

    def entry(self) -> dict[str, Any]:
        return {"name": self.name, "key": self.key, f"{self.kind}_per_minute": self.limit}


@dataclass(frozen=True)
class TenantsOptions:
    replicas: int = 4
    window: float = 120.0  # seconds each key is driven
    overdrive: float = 3.0  # times its limit
    keys: tuple[LimitedKey, ...] = (
        LimitedKey("requests", "requests", 600, 50, 16),
        LimitedKey("tokens", "tokens", 200_000, 400, 600),
    )
    cost_keys: int = 50
    cost_requests: int = 2000  # per arm and round
    cost_rounds: int = 3
    cost_concurrency: int = 32


@dataclass
class Answer:
    """One request of the limits part, as the client saw it."""

    key: str
    replica: int
    sent: float  # seconds after the start
    status: int = 0
    used: int = 0  # prompt + completion tokens, as the instance's usage says
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------- part 1: limits


async def _ask(http: aiohttp.ClientSession, url: str, key: LimitedKey, answer: Answer) -> None:
    body = {
        "model": "sim-model",
        "messages": [{"role": "user", "content": "abcd" * key.prompt_tokens}],
        "max_tokens": key.max_tokens,
        "ignore_eos": True,  # all of max_tokens: the limit's cost counts them
    }
    headers = {"Authorization": f"Bearer {key.key}"}
    try:
        async with http.post(url + "/v1/chat/completions", json=body, headers=headers) as resp:
            answer.status = resp.status
            answer.headers = {k.lower(): v for k, v in resp.headers.items()}
            data = await resp.json(content_type=None)
    except (aiohttp.ClientError, OSError, ValueError):
        answer.status = answer.status or -1
        return
    if answer.status == 200:
        usage = data.get("usage") or {}
        answer.used = int(usage.get("prompt_tokens", 0)) + int(usage.get("completion_tokens", 0))
    elif isinstance(data, dict):
        answer.error = data.get("error") or {}


async def _drive(
    urls: Sequence[str], opts: TenantsOptions, limit: float
) -> tuple[list[Answer], float]:
    """Each key at `overdrive` x its limit, evenly spaced, round robin over `urls`."""
    answers: list[Answer] = []
    schedule: list[tuple[float, LimitedKey, int]] = []
    for key in opts.keys:
        per_s = opts.overdrive * key.limit / key.cost / 60
        count = int(opts.window * per_s)
        turn = itertools.cycle(range(len(urls)))
        schedule += [(i / per_s, key, next(turn)) for i in range(count)]
    schedule.sort(key=lambda item: item[0])
    async with harness_session() as http:
        start = time.monotonic()

        async def one(at: float, key: LimitedKey, replica: int) -> None:
            await asyncio.sleep(max(0.0, start + at - time.monotonic()))
            answer = Answer(key.name, replica, time.monotonic() - start)
            answers.append(answer)
            await _ask(http, urls[replica], key, answer)

        tasks = [asyncio.create_task(one(*item)) for item in schedule]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=limit)
    return answers, time.monotonic() - start


@contextlib.asynccontextmanager
async def harness_session() -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        yield http


def _refusal_ok(answer: Answer, key: LimitedKey) -> bool:
    """Whether a 429 says what OpenAI's says: the limit's type, code, waits that agree,
    the limit and too little remaining."""
    h = answer.headers
    try:
        wait_ms = int(h["retry-after-ms"])
        remaining = int(h[f"x-ratelimit-remaining-{key.kind}"])
        ok = (
            answer.error.get("type") == key.kind
            and answer.error.get("code") == "rate_limit_exceeded"
            and wait_ms > 0
            and h["retry-after"] == str(max(1, math.ceil(wait_ms / 1000)))
            and h[f"x-ratelimit-limit-{key.kind}"] == str(key.limit)
            and remaining < key.cost
            and bool(h[f"x-ratelimit-reset-{key.kind}"])
        )
    except (KeyError, ValueError):
        return False
    return ok


def _key_report(
    answers: Sequence[Answer], key: LimitedKey, replicas: int, span: float
) -> dict[str, Any]:
    mine = [a for a in answers if a.key == key.name]
    admitted = [a for a in mine if a.status == 200]
    # The key's own refusals; a 429 of the gateway's admission (it predicted too long a
    # wait: "overloaded") says nothing of the key's limit and is counted apart.
    refused = [a for a in mine if a.status == 429 and a.error.get("code") == "rate_limit_exceeded"]
    overloaded = sum(1 for a in mine if a.status == 429) - len(refused)
    taken = len(admitted) if key.kind == "requests" else sum(a.used for a in admitted)
    due = key.limit * (1 + span / 60)
    first_refusal = min((a.sent for a in refused), default=None)
    steady: dict[str, Any] | None = None
    if first_refusal is not None:
        after = [a for a in admitted if a.sent > first_refusal]
        taken_after = len(after) if key.kind == "requests" else sum(a.used for a in after)
        due_after = key.limit * (span - first_refusal) / 60
        steady = {
            "from_s": round(first_refusal, 3),
            "admitted": taken_after,
            "due": round(due_after, 1),
            "ratio": taken_after / due_after if due_after else None,
        }
    per_replica = []
    for replica in range(replicas):
        got = [a for a in admitted if a.replica == replica]
        part = len(got) if key.kind == "requests" else sum(a.used for a in got)
        per_replica.append(
            {
                "replica": replica,
                "admitted": part,
                "refused": sum(1 for a in refused if a.replica == replica),
                "share_of_limit": part / due,
            }
        )
    return {
        "limit_per_minute": key.limit,
        "kind": key.kind,
        "sent": len(mine),
        "admitted_requests": len(admitted),
        "admitted": taken,
        "due": round(due, 1),
        "ratio": taken / due,
        "steady": steady,
        "refused": len(refused),
        "refusals_with_openai_headers": sum(_refusal_ok(a, key) for a in refused),
        "other_statuses": sorted({a.status for a in mine} - {200, 429}),
        "refused_by_admission": overloaded,
        "answers_with_ratelimit_headers": sum(
            f"x-ratelimit-limit-{key.kind}" in a.headers for a in admitted
        ),
        "per_replica": per_replica,
    }


async def limits_setup(opts: TenantsOptions, common: Common, shared: bool) -> dict[str, Any]:
    label = "with Redis" if shared else "without Redis"
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                (1.0, 1.0), max_num_seqs=256, seed=common.seed, instant=True, core=fleet_core
            )
        )
        extra: dict[str, dict[str, Any]] = {}
        if shared:
            url = await stack.enter_async_context(redis_process())
            extra["shared"] = {"redis_url": url, "namespace": "tenants"}
        channel = {"keys": [key.entry() for key in opts.keys]}
        gateways = [
            await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy="least_busy",
                    max_num_seqs=256,
                    core=gw_core,
                    source=common.gateway_dir,
                    extra=extra,
                    channel=channel,
                )
            )
            for _ in range(opts.replicas)
        ]
        if shared:
            await asyncio.sleep(1.0)  # a few publish rounds: every replica sees Redis up
        say(f"limits, {label}: {opts.replicas} replicas, {opts.window:g} s at {opts.overdrive:g}x")
        cpu_before = sum(harness.cpu_seconds(gw.pid) for gw in gateways)
        answers, wall = await _drive([gw.url for gw in gateways], opts, common.limit)
        cpu = sum(harness.cpu_seconds(gw.pid) for gw in gateways) - cpu_before
    span = max(a.sent for a in answers) if answers else 0.0
    return {
        "label": label,
        "span_s": round(span, 3),
        "wall_s": round(wall, 3),
        "gateway_cpu_ms_per_request": 1000 * cpu / max(1, len(answers)),
        "keys": {key.name: _key_report(answers, key, opts.replicas, span) for key in opts.keys},
    }


# ---------------------------------------------------------------- part 2: cost


class ManyKeys(Client):
    """Streams each request with one of `keys`, in turn by the request's index."""

    def __init__(self, http: aiohttp.ClientSession, keys: Sequence[str]) -> None:
        super().__init__(http, keys[0])
        self.clients = [Client(http, key) for key in keys]

    async def send(self, base_url: str, spec: RequestSpec) -> Result:
        return await self.clients[spec.index % len(self.clients)].send(base_url, spec)


async def cost_part(opts: TenantsOptions, common: Common) -> dict[str, Any]:
    """Gateway CPU per streamed request: the unified key alone, 50 named keys with limits
    counted in the process, and the same counted in Redis; arms alternating."""
    gw_core, fleet_core = cores(common)
    named = [f"sk-bench-key-{i:02d}-0123456789" for i in range(opts.cost_keys)]
    keys = {"keys": [{"name": f"k{i:02d}", "key": k, **UNREACHED} for i, k in enumerate(named)]}
    cpu: dict[str, list[tuple[float, int]]] = {}
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                (1.0, 1.0), max_num_seqs=64, seed=common.seed, instant=True, core=fleet_core
            )
        )
        url = await stack.enter_async_context(redis_process())
        shared = {"shared": {"redis_url": url, "namespace": "cost"}}
        setups: dict[str, tuple[dict[str, Any] | None, dict[str, dict[str, Any]] | None]] = {
            "one key": (None, None),
            "50 keys": (keys, None),
            "one key, redis": (None, shared),
            "50 keys, redis": (keys, shared),
        }
        arms = {
            arm: await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy="least_busy",
                    max_num_seqs=64,
                    core=gw_core,
                    source=common.gateway_dir,
                    channel=channel,
                    extra=extra,
                )
            )
            for arm, (channel, extra) in setups.items()
        }
        http = await stack.enter_async_context(session())
        clients = {
            arm: ManyKeys(http, named) if channel else Client(http, harness.KEY)
            for arm, (channel, _) in setups.items()
        }
        specs = make_workload(opts.cost_requests, COST_MIX, common.seed)
        for arm, gw in arms.items():  # warm each: connections, code paths, Redis scripts
            await run_closed(
                clients[arm], specs[:200], lambda s, w, u=gw.base_url: u,
                concurrency=opts.cost_concurrency, label=f"warm-up: {arm}", limit=common.limit,
            )  # fmt: skip
        for _ in range(opts.cost_rounds):
            for arm, gw in arms.items():
                before = harness.cpu_seconds(gw.pid)
                run = await run_closed(
                    clients[arm], specs, lambda s, w, u=gw.base_url: u,
                    concurrency=opts.cost_concurrency, label=f"cost: {arm}", limit=common.limit,
                )  # fmt: skip
                done = sum(1 for r in run.results if r.ok)
                cpu.setdefault(arm, []).append((harness.cpu_seconds(gw.pid) - before, done))
    per = {
        arm: 1000 * sum(c for c, _ in runs) / max(1, sum(n for _, n in runs))
        for arm, runs in cpu.items()
    }
    one, shared_one = per["one key"], per["one key, redis"]
    return {
        "cpu_ms_per_request": per,
        "over_one_key": {arm: value / one if one else None for arm, value in per.items()},
        # What the keys' Redis script adds, beside the shared view both arms run.
        "redis_keys_over_redis_one_key": per["50 keys, redis"] / shared_one if shared_one else None,
        "rounds": {arm: [list(r) for r in runs] for arm, runs in cpu.items()},
    }


# ---------------------------------------------------------------- the scenario


async def tenants(opts: TenantsOptions, common: Common) -> dict[str, Any]:
    pin_self(common)
    body: dict[str, Any] = {"options": asdict(opts)}
    body["limits"] = {
        "with_redis": await limits_setup(opts, common, shared=True),
        "without_redis": await limits_setup(opts, common, shared=False),
    }
    if opts.cost_requests:
        say(f"cost: {opts.cost_rounds} rounds of {opts.cost_requests} streams per arm")
        body["cost"] = await cost_part(opts, common)
    _print(body, opts)
    say(f"wrote {write_json(common, 'tenants', body)}")
    return body


def _print(body: dict[str, Any], opts: TenantsOptions) -> None:
    for setup in body["limits"].values():
        say(f"\n{setup['label']} ({opts.replicas} replicas, {setup['span_s']:g} s):")
        say("  key        admitted       due     ratio  steady  refused (headers ok)  per replica")
        for name, key in setup["keys"].items():
            steady = key["steady"]["ratio"] if key["steady"] else None
            parts = " ".join(f"{r['share_of_limit']:.2f}" for r in key["per_replica"])
            say(
                f"  {name:<9} {key['admitted']:>9} {key['due']:>9.0f} {key['ratio']:>8.4f} "
                f"{'-' if steady is None else f'{steady:.4f}':>7} "
                f"{key['refused']:>6} ({key['refusals_with_openai_headers']})  {parts}"
            )
    cost = body.get("cost")
    if cost:
        say("\ngateway CPU per streamed request:")
        for arm, value in cost["cpu_ms_per_request"].items():
            say(f"  {arm:<16} {value:.3f} ms  ({cost['over_one_key'][arm]:.3f}x one key)")
        say(
            f"  50 keys over one key, both with Redis: {cost['redis_keys_over_redis_one_key']:.3f}x"
        )
