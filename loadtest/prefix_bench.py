"""The `prefix` benchmark: prefix-cache affinity against the fronts a user would pick instead.

Every setup gets a fresh simulated fleet with vLLM's prefix cache on and the same seeded
requests: the gateway with `round_robin`, `least_busy` or `least_time` (affinity on, its
default; `<strategy>/no-affinity` sets `[dispatch] prefix_index_blocks = 0`), and the
baselines of loadtest/baselines.py (`sticky`, `nginx`, `vllm-router`). Five scenarios,
after issue 9's targets:

- `uniform`: 32 groups of 4,000-token prefixes, 200-token suffixes, uniform choice, four
  equal instances, Poisson at `load` of the warm capacity;
- `zipf`: the same groups drawn by Zipf(1.1), speeds 1, 1, 1, 0.4, `zipf_load` of it;
- `saturation`: the uniform groups in a closed loop of `concurrency` clients;
- `conversations`: users in multi-turn conversations re-sending their history, thinking
  between turns, more of them than one instance's cache holds, for a fixed time;
- `even`: four equal instances, no shared prefixes, the cache off, `compare`'s default
  mix at 75% of capacity: `least_time` with affinity on and off.

Each instance's cache holds `cache_blocks` blocks of 16 tokens (4,000: 64k tokens, half of
the 32 groups' prefixes). After each run the instances' own counters
(`vllm:prefix_cache_hits_total / queries_total`) give the hit rate, per instance and
fleet-wide, and `vllm:request_success_total` each instance's share.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_engine import SimConfig
from loadtest import baselines, compare, harness, report
from loadtest.loadgen import (
    TEMPLATE_TOKENS,
    Client,
    Mix,
    RequestSpec,
    instance_label,
    make_workload,
    run_closed,
    run_open,
    session,
)
from loadtest.prefix_report import plot_cdf, plot_hits, print_scenario, verdicts
from loadtest.scenarios import (
    Common,
    cores,
    fleet_names,
    pin_self,
    plot_path,
    relabel,
    say,
    summarize,
    write_json,
)
from loadtest.workloads import (
    ConversationMix,
    PrefixMix,
    make_conversations,
    make_prefix_workload,
    run_conversations,
)

SCENARIOS = ("uniform", "zipf", "saturation", "conversations", "even")
GATEWAY = ("round_robin", "least_busy", "least_time")
NO_AFFINITY = "no-affinity"


@dataclass(frozen=True)
class PrefixOptions:
    scenarios: tuple[str, ...] = SCENARIOS
    # uniform, zipf. The gateway sizes each index from the instance's vllm:cache_config_info,
    # so `least_time/index-1000` (the index sized by hand to the 64k-token caches) is now
    # what `least_time` does by itself; it stays available as a setup, not a default.
    setups: tuple[str, ...] = (
        *GATEWAY,
        "sticky",
        "nginx",
        "vllm-router",
    )
    max_num_seqs: int = 16
    cache_blocks: int = 4000  # per instance: 64k tokens, 16 of the 32 prefixes
    prefix: PrefixMix = field(default_factory=PrefixMix)  # 32 x 4,000 + 200 tokens
    load: float = 0.5  # uniform: share of the warm capacity
    duration: float = 40.0  # seconds of open-loop arrivals
    zipf: float = 1.1
    zipf_speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 0.4)
    zipf_load: float = 0.85
    saturation_setups: tuple[str, ...] = (
        "round_robin",
        "least_time",
        "sticky",
    )
    concurrency: int = 64
    saturation_requests: int = 768
    # Users who think between turns, more live conversations than one instance's cache
    # holds (loadtest/README.md, `prefix`, says why these figures).
    conversations: ConversationMix = field(
        default_factory=lambda: ConversationMix(
            turns=10, user_tokens=(300, 900), users=192, think_s=5.0, requests_per_user=40
        )
    )
    conversation_duration: float = 60.0  # seconds the users send requests
    conversation_cache_blocks: int = 16000  # per instance: 256k tokens
    conversation_setups: tuple[str, ...] = (
        f"least_busy/{NO_AFFINITY}",
        "least_busy",
        "least_time",
        "sticky",
    )
    even_setups: tuple[str, ...] = (f"least_time/{NO_AFFINITY}", "least_time")
    even_load: float = 0.75
    even_mix: Mix = field(default_factory=Mix)
    clients: int = 16


def cached_prefix_tokens(mix: PrefixMix, block_size: int) -> int:
    """Tokens of a request a cache holding its group's prefix can skip: whole blocks only."""
    return (TEMPLATE_TOKENS + mix.prefix_tokens) // block_size * block_size


def prefix_capacity(
    speeds: Sequence[float], mix: PrefixMix, sim: SimConfig, *, warm: bool
) -> float:
    """Requests/s the fleet serves at full batches, from the simulator's timing model.

    As `compare.capacity`, but a warm request prefills only what its group's cached prefix
    leaves (the suffix and the prefix's partial last block): what a router that always
    finds the prefix cached gets. Cold is no cache at all. The warm figure is the one the
    loads are set against, so that every setup sees the same arrivals and a router that
    loses hits pays for them in queueing.
    """
    seqs = sim.max_num_seqs
    step = sim.decode_s_per_token * (1 + sim.decode_slowdown_per_seq * (seqs - 1))
    prefill = mix.mean_prompt_tokens() - (cached_prefix_tokens(mix, sim.block_size) if warm else 0)
    per_request = prefill / sim.prefill_tokens_per_s + mix.mean_max_tokens() * step / seqs
    return sum(speeds) / per_request


def live_history(specs: Sequence[RequestSpec]) -> float:
    """The prompt tokens the users' conversations hold at a moment, on average: each
    user's prompts (template included), averaged over the requests it sends."""
    users: dict[int, list[int]] = defaultdict(list)
    for spec in specs:
        users[spec.user if spec.user >= 0 else spec.conversation].append(
            spec.prompt_tokens + TEMPLATE_TOKENS
        )
    return sum(sum(p) / len(p) for p in users.values())


def hit_ceiling(specs: Sequence[RequestSpec], cached: int) -> float:
    """The best fleet hit rate a workload allows: each group's first request misses, every
    later one finds `cached` tokens of its prefix (its own suffix is never cached)."""
    seen: set[int] = set()
    hits = 0
    for spec in specs:
        hits += cached if spec.group in seen else 0
        seen.add(spec.group)
    return hits / sum(s.prompt_tokens + TEMPLATE_TOKENS for s in specs)


async def scrape(urls: Sequence[str], names: dict[str, str]) -> dict[str, Any]:
    """Each instance's prefix-cache counters and finished requests, and the fleet's sums."""
    per: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession() as http:
        for url in urls:
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            totals: dict[str, float] = defaultdict(float)
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    totals[sample.name] += sample.value
            queries = totals["vllm:prefix_cache_queries_total"]
            hits = totals["vllm:prefix_cache_hits_total"]
            per[names[instance_label(url)]] = {
                "requests": int(totals["vllm:request_success_total"]),
                "query_tokens": int(queries),
                "hit_tokens": int(hits),
                "hit_rate": hits / queries if queries else None,
            }
    queries = sum(v["query_tokens"] for v in per.values())
    hits = sum(v["hit_tokens"] for v in per.values())
    return {
        "hit_rate": hits / queries if queries else None,
        "query_tokens": queries,
        "hit_tokens": hits,
        "instances": dict(sorted(per.items())),
    }


def _dispatch(variant: str) -> dict[str, Any] | None:
    """The [dispatch] keys of a gateway setup's variant: no-affinity, index-N, or none."""
    if variant == NO_AFFINITY:
        return {"prefix_index_blocks": 0}
    if variant.startswith("index-"):
        return {"prefix_index_blocks": int(variant.removeprefix("index-"))}
    if variant:
        raise ValueError(f"unknown variant {variant!r}: no-affinity or index-<blocks>")
    return None


async def gateway_metrics(url: str) -> str:
    """The gateway's /metrics, with the harness's key."""
    headers = {"Authorization": f"Bearer {harness.KEY}"}
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics", headers=headers) as resp:
        return await resp.text()


async def gateway_estimate(url: str) -> dict[str, Any]:
    """What the gateway's index estimated: prompt tokens sent, and of those cached."""
    return estimate_of(await gateway_metrics(url))


def estimate_of(text: str) -> dict[str, Any]:
    """`gateway_estimate` of a /metrics text already read."""
    totals: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] += sample.value
    queries = totals["gateway_prefix_query_tokens_total"]
    hits = totals["gateway_prefix_estimated_hit_tokens_total"]
    return {
        "query_tokens": int(queries),
        "hit_tokens": int(hits),
        "hit_rate": hits / queries if queries else None,
    }


def quantiles(values: Sequence[float], points: int = 101) -> list[float]:
    """`points` evenly spaced nearest-rank quantiles (0..100%) of values, for a CDF."""
    ordered = sorted(values)
    if not ordered:
        return []
    n = len(ordered)
    return [ordered[min(n - 1, max(0, math.ceil(q / (points - 1) * n) - 1))] for q in range(points)]


async def run_setup(
    setup: str,
    kind: str,
    specs: Sequence[RequestSpec],
    speeds: Sequence[float],
    cache_blocks: int,
    opts: PrefixOptions,
    common: Common,
) -> report.Summary | None:
    """One fresh fleet, one fresh front, one run of `kind` (open, closed, conversations)."""
    base, _, variant = setup.partition("/")
    if base in baselines.BASELINES and (why := baselines.missing(base)):
        say(f"skipped {setup}: {why}")
        return None
    if base not in baselines.BASELINES and base not in GATEWAY:
        raise ValueError(f"unknown setup {setup!r}")
    gw_core, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                speeds,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                prefix_cache_blocks=cache_blocks,
            )
        )
        names = fleet_names(fleet.urls, speeds)
        if base in baselines.BASELINES:
            front = baselines.front(base, fleet.urls, core=gw_core, seed=common.seed)
            base_url = (await stack.enter_async_context(front)) + "/v1"
        else:
            gw = await stack.enter_async_context(
                harness.gateway_process(
                    fleet.urls,
                    strategy=base,
                    max_num_seqs=opts.max_num_seqs,
                    core=gw_core,
                    source=common.gateway_dir,
                    # The [slo] defaults, unlike `compare`: they set how long a request may
                    # queue, and the baselines queue without bound.
                    dispatch=_dispatch(variant),
                )
            )
            base_url = gw.base_url
        client = Client(await stack.enter_async_context(session()), harness.KEY)
        label = f"{kind}: {setup}"
        if kind == "open":
            run = await run_open(
                client, specs, lambda s, w: base_url, label=label, limit=common.limit
            )
        elif kind == "closed":
            run = await run_closed(
                client,
                specs,
                lambda s, w: base_url,
                concurrency=opts.concurrency,
                label=label,
                limit=common.limit,
            )
        else:
            run = await run_conversations(
                client,
                specs,
                lambda s, w: base_url,
                label=label,
                limit=common.limit,
                duration=opts.conversation_duration,
            )
        cache = await scrape(fleet.urls, names)
        if base in GATEWAY:
            cache["gateway_estimate"] = await gateway_estimate(gw.url)
    summary = relabel(summarize(run, common), names)
    ttfts = [r.ttft for r in run.results if r.ok and r.ttft is not None]
    return {**summary, "label": setup, "cache": cache, "ttft_quantiles_s": quantiles(ttfts)}


async def _scenario(
    name: str, opts: PrefixOptions, common: Common
) -> tuple[dict[str, Any], dict[str, report.Summary]]:
    """The workload of scenario `name`, through each of its setups."""
    sim = SimConfig(max_num_seqs=opts.max_num_seqs)
    equal = (1.0, 1.0, 1.0, 1.0)
    info: dict[str, Any] = {}
    cache_blocks = opts.cache_blocks
    setups: Sequence[str] = opts.setups
    kind = "open"
    if name in ("uniform", "zipf", "saturation"):
        mix = (
            opts.prefix
            if name != "zipf"
            else PrefixMix(**{**asdict(opts.prefix), "zipf": opts.zipf})
        )
        speeds = opts.zipf_speeds if name == "zipf" else equal
        warm = prefix_capacity(speeds, mix, sim, warm=True)
        info["capacity_req_per_s"] = {
            "warm": warm,
            "cold": prefix_capacity(speeds, mix, sim, warm=False),
        }
        if name == "saturation":
            kind, setups = "closed", opts.saturation_setups
            specs = make_prefix_workload(opts.saturation_requests, mix, common.seed)
            info["concurrency"] = opts.concurrency
        else:
            load = opts.zipf_load if name == "zipf" else opts.load
            rate = load * warm
            count = max(1, round(rate * opts.duration))
            specs = make_prefix_workload(count, mix, common.seed, rate=rate, clients=opts.clients)
            info |= {"load": load, "rate_req_per_s": rate}
        info["mix"] = asdict(mix)
        info["hit_rate_ceiling"] = hit_ceiling(specs, cached_prefix_tokens(mix, sim.block_size))
    elif name == "conversations":
        kind, setups, speeds = "conversations", opts.conversation_setups, equal
        cache_blocks = opts.conversation_cache_blocks
        specs = make_conversations(opts.conversations, common.seed)
        info["mix"] = asdict(opts.conversations)
        info["duration_s"] = opts.conversation_duration
        info["live_history_tokens"] = live_history(specs)
    elif name == "even":
        setups, speeds, cache_blocks = opts.even_setups, equal, 0
        cap = compare.capacity(speeds, opts.even_mix, sim)
        rate = opts.even_load * cap
        count = max(1, round(rate * opts.duration))
        specs = make_workload(count, opts.even_mix, common.seed, rate=rate, clients=opts.clients)
        info |= {"capacity_req_per_s": cap, "load": opts.even_load, "rate_req_per_s": rate}
        info["mix"] = asdict(opts.even_mix)
    else:
        raise ValueError(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    info |= {"kind": kind, "speeds": list(speeds), "cache_blocks": cache_blocks}
    info["requests"] = len(specs)
    say(f"\n== {name}: {kind}, {len(specs)} requests, speeds {list(speeds)} ==")
    runs: dict[str, report.Summary] = {}
    for setup in setups:
        summary = await run_setup(setup, kind, specs, speeds, cache_blocks, opts, common)
        if summary is not None:
            runs[setup] = summary
    return info, runs


async def prefix(opts: PrefixOptions, common: Common) -> dict[str, Any]:
    """Every scenario in `opts.scenarios`, every setup; the JSON, the tables, the plots."""
    pin_self(common)
    scenarios: dict[str, Any] = {}
    for name in opts.scenarios:
        info, runs = await _scenario(name, opts, common)
        scenarios[name] = {**info, "runs": runs}
        print_scenario(name, scenarios[name])
    body: dict[str, Any] = {"options": asdict(opts), "scenarios": scenarios}
    body["targets"] = verdicts(scenarios)
    say(f"wrote {write_json(common, 'prefix', body)}")
    say(json.dumps(body["targets"], indent=2))
    if plot_path(common, "prefix-ttft.png"):
        plot_cdf(scenarios, common.out / "prefix-ttft.png")
    if plot_path(common, "prefix-hits.png"):
        plot_hits(scenarios, common.out / "prefix-hits.png")
    return body
