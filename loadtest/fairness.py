"""The `fairness` scenario: keys competing for a saturated fleet (issue 41).

A fleet of continuous-batching simulated instances (`--speeds`, `--max-num-seqs` slots,
`--decode-s-per-token`), short prompts, streamed answers; every part runs on a fresh fleet
and front, one after the other. The fronts, side by side in one run:

    ours             the gateway with named keys, as a user configures tenants: fair share
                     on, `max_queue_per_instance` at its named-keys default
    ours (one key)   the gateway with every client on the unnamed key: one key, so the
                     queue is first come, first served, and instances queue 32 each
    vllm-router-rr, vllm-router
                     vLLM's Rust router, round_robin and cache_aware: no queue of its own,
                     every request waits in an instance's queue
    ours@q2          ours with `max_queue_per_instance = 2` set (the named-keys default is 0)
    ours@r4          four replicas of ours sharing a view through a throwaway Redis, each
                     client's streams spread over them; ours@r4s with `strict_caps`;
                     ours@r2p (pinned) each key through one replica, the keys dealt
                     round the replicas in order (the flood through the first, the calm
                     key through the second)

Parts:

    neighbour   `flood` keeps `--flood-streams` streams going (retrying 429s as the OpenAI
                SDK does, after Retry-After); `calm` sends one request every
                `--calm-interval` s, never retried. Each front: calm alone, flood alone,
                both. The calm key's TTFT p50/p90/p99 and refusals; the flood's output
                tokens in the measured window, alone and beside the calm key.
    shares      three keys of shares 1, 1 and 2 (named keys only on ours), each keeping
                `--share-streams` streams going: output tokens per key in the window,
                the ratios and Jain's index of the equal pair.
    many        `--many-keys` keys, Zipf request rates (exponent 1) summing to `--many-load`
                x the fleet's capacity (the flood-alone rate on ours): every key's p90 TTFT
                against the calm key's alone value, and the gateway's CPU per request,
                ours against ours (one key).

Each part warms for `--warmup` s, then measures `--duration` s; a request counts in the
window when it finished inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import shutil
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from loadtest import baselines, harness, report
from loadtest.loadgen import (
    Client,
    Mix,
    RequestSpec,
    Result,
    Route,
    Run,
    make_workload,
    run_closed,
    run_open,
)
from loadtest.loadgen import session as client_session
from loadtest.replicas_setup import redis_process
from loadtest.scenarios import Common, cores, pin_self, say, slo_block, write_json

OURS, ONE_KEY = "ours", "ours (one key)"
FRONTS = (OURS, ONE_KEY, "vllm-router-rr", "vllm-router")
PARTS = ("neighbour", "shares", "many")
MIX = Mix(long_share=0.0, short_tokens=(100, 400), max_tokens=(32, 64))
SHARES = {"a": 1.0, "b": 1.0, "c": 2.0}
SDK_RETRIES = 2  # the OpenAI SDK's default


def key_of(name: str) -> str:
    return f"sk-bench-{name}-0123456789"


@dataclass(frozen=True)
class FairnessOptions:
    speeds: tuple[float, ...] = (1.0, 1.0)
    max_num_seqs: int = 4
    decode_s_per_token: float = 0.02
    flood_streams: int = 48
    calm_interval: float = 0.3
    share_streams: int = 16
    many_keys: int = 50
    many_load: float = 1.5
    warmup: float = 5.0
    duration: float = 30.0
    fronts: tuple[str, ...] = FRONTS
    parts: tuple[str, ...] = PARTS
    mix: Mix = MIX


@dataclass
class Front:
    """One front before a fresh fleet: its base URLs (ending in /v1, one per gateway
    replica) and, on ours, the gateways' process ids and logs."""

    name: str
    base_urls: list[str]
    gateway_pids: list[int] = field(default_factory=list)
    gateway_logs: list[Path] = field(default_factory=list)
    pinned: list[str] | None = None  # each key through one replica: the keys, in order

    def route(self, key: str) -> Route:
        """Spread over the replicas by the loop's worker (an open loop's: its client); on
        a pinned front, `key`'s one replica."""
        urls = self.base_urls
        if self.pinned is not None:
            url = urls[self.pinned.index(key) % len(urls)]
            return lambda spec, worker: url
        return lambda spec, worker: urls[worker % len(urls)]

    def cpu_seconds(self) -> float:
        return sum(harness.tree_cpu_seconds(pid) for pid in self.gateway_pids)

    def refusals(self, key: str) -> dict[str, int]:
        """Why the gateways refused `key`'s requests, from their access lines (ours only)."""
        reasons: Counter[str] = Counter()
        for log in self.gateway_logs:
            for line in log.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if event.get("event") != "request" or event.get("key") != key:
                        continue
                    if event.get("refused"):
                        reasons[event["refused"]] += 1
                    elif event.get("status", 200) >= 400:
                        reasons[f"status_{event['status']}"] += 1
        return dict(reasons)

    def key(self, name: str) -> str:
        """The key a client `name` sends: its own on ours, the unnamed one on one key."""
        named = self.name.startswith(OURS) and self.name != ONE_KEY
        return key_of(name) if named else harness.KEY


def variant(name: str) -> tuple[int | None, int]:
    """A front name's variant of ours: "ours@q2" sets `max_queue_per_instance` 2 (the
    named-keys default's test), "ours@r4" runs 4 replicas sharing a view through Redis
    ("ours@r4s" with strict caps, "ours@r2p" each key pinned to one).
    Returns (queue, replicas)."""
    _, _, spec = name.partition("@")
    if spec.startswith("q"):
        return int(spec[1:]), 1
    if spec.startswith("r"):
        return None, int(spec[1:].rstrip("ps"))
    return None, 1


@contextlib.asynccontextmanager
async def front(
    name: str, opts: FairnessOptions, common: Common, keys: dict[str, float]
) -> AsyncIterator[Front]:
    """A fresh fleet and `name` before it; on ours, `keys` named with their shares."""
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                opts.speeds,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                decode_s_per_token=opts.decode_s_per_token,
            )
        )
        if not name.startswith(OURS):
            url = await stack.enter_async_context(
                baselines.front(name, fleet.urls, core=gw_core, seed=common.seed)
            )
            yield Front(name, [url + "/v1"])
            return
        named = [{"name": k, "key": key_of(k), "share": s} for k, s in keys.items()]
        queue, replicas = variant(name)
        extra: dict[str, dict[str, Any]] = {}
        if replicas > 1:
            redis = await stack.enter_async_context(redis_process())
            extra["shared"] = {"redis_url": redis, "namespace": "bench"}
            if "s" in name.partition("@r")[2]:  # "ours@r4s": strict caps (leases in Redis)
                extra["shared"]["strict_caps"] = True
        gateways = [
            await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy="least_busy",
                    max_num_seqs=opts.max_num_seqs,
                    core=gw_core,
                    source=common.gateway_dir,
                    slo=slo_block(common),
                    dispatch=None if queue is None else {"max_queue_per_instance": queue},
                    channel={"keys": named} if name != ONE_KEY else None,
                    extra=extra,
                )
            )
            for _ in range(replicas)
        ]
        if replicas > 1:
            await asyncio.sleep(1.0)  # a few publish rounds: every replica sees the others
        yield Front(
            name,
            [g.base_url for g in gateways],
            [g.pid for g in gateways],
            [g.log for g in gateways],
            list(keys) if "p" in name.partition("@r")[2] else None,
        )


def endless(seed: int, mix: Mix, count: int = 100_000) -> list[RequestSpec]:
    """More requests than any closed loop sends in a window."""
    return make_workload(count, mix, seed)


def paced(seed: int, mix: Mix, interval: float, count: int) -> list[RequestSpec]:
    """`count` requests, one every `interval` s."""
    specs = make_workload(count, mix, seed)
    return [
        RequestSpec(s.index, i * interval, s.prompt_tokens, s.max_tokens, s.client)
        for i, s in enumerate(specs)
    ]


def poisson(seed: int, mix: Mix, rate: float, span: float) -> list[RequestSpec]:
    """A key's Poisson arrivals at `rate` over `span` seconds, its first one drawn too (not
    at 0: fifty keys starting together would be one burst)."""
    first = random.Random(seed).expovariate(rate)
    specs = make_workload(max(1, round(rate * span) + 1), mix, seed, rate=rate)
    shifted = [
        RequestSpec(s.index, s.at + first, s.prompt_tokens, s.max_tokens, s.client) for s in specs
    ]
    return [s for s in shifted if s.at < span] or shifted[:1]


def in_window(results: Sequence[Result], start: float, end: float) -> list[Result]:
    """The answers that finished inside [start, end]."""
    return [
        r for r in results if r.ok and r.latency is not None and start <= r.sent + r.latency <= end
    ]


def tokens(results: Sequence[Result]) -> int:
    return sum(r.tokens for r in results)


def ttft_report(results: Sequence[Result]) -> dict[str, Any]:
    statuses = Counter(r.status for r in results)
    ok = [r.ttft for r in results if r.ok and r.ttft is not None]
    return {
        "sent": len(results),
        "ok": len(ok),
        "refused": statuses[429] + statuses[503],
        "other": sum(n for s, n in statuses.items() if s not in (200, 429, 503)),
        "ttft_s": report.percentiles(ok),
    }


async def _closed(
    client: Client, route: Route, seed: int, mix: Mix, streams: int, limit: float
) -> Run:
    specs = endless(seed, mix)
    return await run_closed(client, specs, route, concurrency=streams, label="closed", limit=limit)


async def _calm(client: Client, route: Route, opts: FairnessOptions, seed: int) -> Run:
    """The calm key: after the warm-up, one request every `calm_interval` s."""
    await asyncio.sleep(opts.warmup)
    specs = paced(seed, opts.mix, opts.calm_interval, round(opts.duration / opts.calm_interval))
    return await run_open(client, specs, route, label="calm", limit=opts.duration + 30)


async def neighbour_arm(
    name: str, arm: str, opts: FairnessOptions, common: Common
) -> dict[str, Any]:
    """One arm of the noisy neighbour on a fresh fleet and front `name`."""
    async with (
        front(name, opts, common, {"flood": 1.0, "calm": 1.0}) as f,
        client_session() as http,
    ):
        say(f"neighbour, {name}: {arm}")
        flood = Client(http, f.key("flood"), retries=SDK_RETRIES)
        calm = Client(http, f.key("calm"))
        span = opts.warmup + opts.duration
        flood_run, calm_run = await asyncio.gather(
            _closed(flood, f.route("flood"), common.seed, opts.mix, opts.flood_streams, span)
            if arm != "calm alone"
            else _nothing(),
            _calm(calm, f.route("calm"), opts, common.seed + 1)
            if arm != "flood alone"
            else _nothing(),
        )
        refused = {k: f.refusals(k) for k in ("flood", "calm")}
    entry: dict[str, Any] = {"refused_by_reason": refused}
    if flood_run is not None:
        t0 = flood_run.started + opts.warmup
        done = in_window(flood_run.results, t0, t0 + opts.duration)
        entry["flood_tokens"] = tokens(done)
        entry["flood_requests"] = len(done)
        entry["flood_statuses"] = dict(Counter(r.status for r in flood_run.results))
    if calm_run is not None:
        entry["calm"] = ttft_report(calm_run.results)
        entry["calm_tokens"] = tokens([r for r in calm_run.results if r.ok])
    return entry


async def _nothing() -> None:
    return None


async def neighbour(opts: FairnessOptions, common: Common) -> dict[str, Any]:
    """Per front: the calm key alone, the flood alone, both."""
    return {
        name: {
            arm: await neighbour_arm(name, arm, opts, common)
            for arm in ("calm alone", "flood alone", "both")
        }
        for name in opts.fronts
    }


def neighbour_targets(arms: dict[str, Any]) -> dict[str, Any]:
    """Issue 41's targets for the calm key beside the flood, on one front."""
    alone = arms["calm alone"]["calm"]["ttft_s"]["p90"]
    both = arms["both"]["calm"]
    p90 = both["ttft_s"]["p90"]
    flood_alone = arms["flood alone"]["flood_tokens"]
    floor = 0.9 * flood_alone - arms["both"]["calm_tokens"]
    return {
        "calm_p90_within_0.8s_of_alone": alone is not None
        and p90 is not None
        and p90 <= alone + 0.8,
        "calm_never_refused": both["refused"] == 0 and both["other"] == 0,
        "flood_keeps_0.9x_alone_less_calm": arms["both"]["flood_tokens"] >= floor,
        "calm_p90_alone_s": alone,
        "calm_p90_beside_flood_s": p90,
        "flood_tokens_floor": floor,
    }


async def shares(opts: FairnessOptions, common: Common) -> dict[str, Any]:
    """Three keys of shares 1, 1, 2, each keeping its streams going."""
    out: dict[str, Any] = {}
    for name in [f for f in opts.fronts if f.startswith(OURS) and "@q" not in f]:
        async with front(name, opts, common, SHARES) as f, client_session() as http:
            say(f"shares, {name}")
            span = opts.warmup + opts.duration
            runs = await asyncio.gather(
                *(
                    _closed(
                        Client(http, f.key(k), retries=SDK_RETRIES),
                        f.route(k),
                        common.seed + i,
                        opts.mix,
                        opts.share_streams,
                        span,
                    )
                    for i, k in enumerate(SHARES)
                )
            )
        t0 = min(r.started for r in runs) + opts.warmup
        got = {
            k: tokens(in_window(r.results, t0, t0 + opts.duration))
            for k, r in zip(SHARES, runs, strict=True)
        }
        a, b, c = got["a"], got["b"], got["c"]
        out[name] = {
            "tokens": got,
            "c_over_a": c / a if a else None,
            "c_over_b": c / b if b else None,
            "a_over_b": a / b if b else None,
            "jain_a_b": (a + b) ** 2 / (2 * (a * a + b * b)) if a or b else None,
        }
    return out


def shares_targets(entry: dict[str, Any]) -> dict[str, bool]:
    within = [
        entry[r] is not None and 0.85 * 2 <= entry[r] <= 1.15 * 2 for r in ("c_over_a", "c_over_b")
    ]
    return {
        "shares_1_1_2_within_15pct": all(within)
        and entry["a_over_b"] is not None
        and 0.85 <= entry["a_over_b"] <= 1.15,
        "equal_pair_jain_at_least_0.98": (entry["jain_a_b"] or 0) >= 0.98,
    }


def zipf_rates(keys: int, total: float) -> list[float]:
    """Request rates of `keys` keys by Zipf's law (exponent 1), summing to `total`."""
    weights = [1.0 / (i + 1) for i in range(keys)]
    scale = total / sum(weights)
    return [w * scale for w in weights]


def fair_level(rates: Sequence[float], capacity: float) -> float:
    """Max-min fairness' water level: a key asking less than it gets all it asks, every
    other key that level (inf when the fleet serves everyone)."""
    left, ordered = capacity, sorted(rates)
    for i, rate in enumerate(ordered):
        level = left / (len(ordered) - i)
        if rate > level:
            return level
        left -= rate
    return float("inf")


async def many(
    opts: FairnessOptions, common: Common, capacity: float, alone_p90: float | None
) -> dict[str, Any]:
    """`many_keys` keys at Zipf rates, ours against ours (one key): TTFT of the keys that
    ask less than their max-min fair share and of those that ask more, pooled; per-key
    p90 where a key sent enough; the gateway's CPU per request."""
    names = [f"k{i:02d}" for i in range(opts.many_keys)]
    rates = zipf_rates(opts.many_keys, opts.many_load * capacity)
    level = fair_level(rates, capacity)
    out: dict[str, Any] = {
        "rates": dict(zip(names, rates, strict=True)),
        "fair_level_req_per_s": level,
        "capacity_req_per_s": capacity,
        "alone_p90_s": alone_p90,
    }
    for name in [f for f in opts.fronts if f in (OURS, ONE_KEY)]:
        keys = dict.fromkeys(names, 1.0)
        async with front(name, opts, common, keys) as f, client_session() as http:
            say(f"many keys, {name}")
            cpu0 = f.cpu_seconds()
            jobs = []
            span = opts.warmup + opts.duration
            for i, (k, rate) in enumerate(zip(names, rates, strict=True)):
                specs = poisson(common.seed + 1000 + i, opts.mix, rate, span)
                client = Client(http, f.key(k))
                jobs.append(run_open(client, specs, f.route(k), label=k, limit=span + 60))
            runs = await asyncio.gather(*jobs)
            cpu = f.cpu_seconds() - cpu0
            reasons: dict[str, Counter[str]] = {"within": Counter(), "above": Counter()}
            for k, rate in zip(names, rates, strict=True):
                reasons["within" if rate < level else "above"].update(f.refusals(k))
        sent = sum(len(r.results) for r in runs)
        groups: dict[str, list[Result]] = {"within_fair_share": [], "above_fair_share": []}
        per_key = {}
        within = 0
        for k, rate, run in zip(names, rates, runs, strict=True):
            measured = [r for r in run.results if r.sent - run.started >= opts.warmup]
            groups["within_fair_share" if rate < level else "above_fair_share"] += measured
            per_key[k] = entry = ttft_report(measured)
            p90 = entry["ttft_s"]["p90"]
            within += alone_p90 is not None and p90 is not None and p90 <= alone_p90 + 0.8
        out[name] = {
            "groups": {g: ttft_report(results) for g, results in groups.items()},
            "keys": per_key,
            "refused_by_reason": {g: dict(c) for g, c in reasons.items()},
            "keys_with_p90": sum(e["ttft_s"]["p90"] is not None for e in per_key.values()),
            "keys_p90_within_0.8s_of_alone": within,
            "cpu_s": cpu,
            "requests": sent,
            "cpu_ms_per_request": 1000 * cpu / sent if sent else None,
        }
    return out


def many_targets(many: dict[str, Any]) -> dict[str, Any]:
    """Issue 41's targets for many keys, on ours: the keys that ask less than their fair
    share are served as if alone (p90 within 0.8 s) and never refused; CPU per request
    at most 1.05x one key's."""
    within = many[OURS]["groups"]["within_fair_share"]
    alone, p90 = many["alone_p90_s"], within["ttft_s"]["p90"]
    ratio = many.get("cpu_ratio")
    return {
        "within_fair_share_p90_within_0.8s_of_alone": alone is not None
        and p90 is not None
        and p90 <= alone + 0.8,
        "within_fair_share_never_refused": within["refused"] == 0 and within["other"] == 0,
        "cpu_per_request_at_most_1.05x_one_key": ratio is not None and ratio <= 1.05,
    }


async def fairness(opts: FairnessOptions, common: Common) -> dict[str, Any]:
    pin_self(common)
    fronts = []
    for name in opts.fronts:
        base = name.removesuffix("-rr")
        missing = baselines.missing(base) if not name.startswith(OURS) else None
        if variant(name)[1] > 1 and shutil.which("redis-server") is None:
            missing = "redis-server is not installed (apt-get install redis-server)"
        if missing:
            say(f"skipping {name}: {missing}")
            continue
        fronts.append(name)
    opts = FairnessOptions(**{**asdict(opts), "fronts": tuple(fronts), "mix": opts.mix})
    body: dict[str, Any] = {"options": asdict(opts)}
    if "neighbour" in opts.parts:
        body["neighbour"] = await neighbour(opts, common)
        body["neighbour_targets"] = {
            name: neighbour_targets(arms) for name, arms in body["neighbour"].items()
        }
    if "shares" in opts.parts:
        body["shares"] = await shares(opts, common)
        body["shares_targets"] = {name: shares_targets(e) for name, e in body["shares"].items()}
    if "many" in opts.parts and OURS in opts.fronts:
        ours = body.get("neighbour", {}).get(OURS)
        if ours is not None:
            capacity = ours["flood alone"]["flood_requests"] / opts.duration
            alone = ours["calm alone"]["calm"]["ttft_s"]["p90"]
        else:
            capacity = (
                sum(opts.speeds)
                * opts.max_num_seqs
                / (opts.mix.mean_max_tokens() * opts.decode_s_per_token)
            )
            alone = None
        body["many"] = await many(opts, common, capacity, alone)
        if ONE_KEY in body["many"]:
            ours_cpu = body["many"][OURS]["cpu_ms_per_request"]
            base_cpu = body["many"][ONE_KEY]["cpu_ms_per_request"]
            body["many"]["cpu_ratio"] = ours_cpu / base_cpu if ours_cpu and base_cpu else None
        body["many_targets"] = many_targets(body["many"])
    _print(body)
    say(f"wrote {write_json(common, 'fairness', body)}")
    return body


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{1000 * value:,.0f}"


def _print(body: dict[str, Any]) -> None:
    if "neighbour" in body:
        rows = []
        for name, arms in body["neighbour"].items():
            for arm, e in arms.items():
                calm = e.get("calm")
                t = calm["ttft_s"] if calm else {}
                rows.append(
                    [
                        name,
                        arm,
                        f"{_ms(t.get('p50'))} / {_ms(t.get('p90'))} / {_ms(t.get('p99'))}"
                        if calm
                        else "",
                        str(calm["refused"]) if calm else "",
                        str(e.get("flood_tokens", "")),
                    ]
                )
        headers = ["front", "arm", "calm TTFT p50/p90/p99 ms", "calm refused", "flood tokens"]
        say(report.table(headers, rows))
        for name, targets in body["neighbour_targets"].items():
            for target, met in targets.items():
                if isinstance(met, bool):
                    say(f"  {name}: {'met   ' if met else 'MISSED'} {target}")
    if "shares" in body:
        rows = [
            [name, str(e["tokens"]), f"{e['c_over_a'] or 0:.2f}", f"{e['jain_a_b'] or 0:.3f}"]
            for name, e in body["shares"].items()
        ]
        say(report.table(["front", "tokens a/b/c", "c / a", "Jain a, b"], rows))
    if "many" in body:
        rows = []
        for name in (OURS, ONE_KEY):
            for group, e in body["many"].get(name, {}).get("groups", {}).items():
                t = e["ttft_s"]
                p = f"{_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])}"
                rows.append([name, group, str(e["sent"]), str(e["refused"]), p])
        headers = ["front", "keys", "sent", "refused", "TTFT p50/p90/p99 ms"]
        say(report.table(headers, rows))
        for target, met in body.get("many_targets", {}).items():
            say(f"  many keys: {'met   ' if met else 'MISSED'} {target}")
        say(f"many keys, CPU per request ours / one key: {body['many'].get('cpu_ratio')}")
