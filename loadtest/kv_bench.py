"""The `kv` benchmark: the gateway's exact prefix-cache index, read from vLLM's KV cache
events (issue 43), against its inferred one and vllm-router's, where inferring goes wrong.

Every arm of a case gets a fresh simulated fleet (four equal instances, the prefix cache
on, each instance publishing its KV events on its own ports) and the same seeded requests
of `prefix`'s uniform workload (32 groups of 4,000-token prefixes):

- `exact`: the gateway (`least_time`) with each instance's `kv_events` in settings.json;
- `approx`: the same gateway without them: the index it infers from what it sent;
- `vllm-router`: vLLM's router, `cache_aware` (skipped where it is not installed);
- a gateway arm marked `@qN` (`exact@q0`) runs with `max_queue_per_instance = N`.

Cases, after the places docs/serving.md says the inferred index goes wrong:

- `evict`: caches that hold about 0.3 of the groups' prefixes each, so the instances evict;
- `bypass`: `bypass_share` of the requests go straight to a random instance, past the front;
  the figures are those of the requests through the front;
- `replicas`: `replicas` gateways without `[shared]` before the one fleet, the requests
  spread round robin over them; for vllm-router as many routers, each on its own;
- `restart`: the front is stopped and started again (same config, same port) at half the
  run; the client retries as the OpenAI SDK does, `restart_retries` times, timed from the
  first try, and what still fails is counted failed;
- `uniform`: `prefix`'s uniform case, the check that the exact index costs nothing where
  the inferred one is right; `approx` runs twice, and the two give the noise floor;
- `cost`: gateway CPU per request (the process tree's) with and without KV events, both
  before one fleet, rounds alternating, prompts of about 2,000 tokens in one group.

The oracle is what the instances found cached: each answer's
`prompt_tokens_details.cached_tokens` (the simulator runs with vLLM's
`--enable-prompt-tokens-details`) over the requests through the front, which equals their
own `vllm:prefix_cache_hits_total / queries_total` where every request went through it. The
gateway's estimate is its `gateway_prefix_estimated_hit_tokens_total / query_tokens_total`
(what its index said was cached where it placed each request), summed over the replicas,
and for `restart` over both lives of the gateway and after the restart alone. In `bypass`
the instances' counters hold the bypassing requests too: only the per-request figures judge.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_engine import SimConfig
from loadtest import baselines, harness, report
from loadtest.kv_report import APPROX, EXACT, REPEAT, print_case, verdicts
from loadtest.loadgen import Client, RequestSpec, Result, Route, Run, run_open, session
from loadtest.prefix_bench import (
    cached_prefix_tokens,
    estimate_of,
    gateway_metrics,
    hit_ceiling,
    prefix_capacity,
    scrape,
)
from loadtest.scenarios import (
    Common,
    cores,
    fleet_names,
    pin_self,
    relabel,
    say,
    summarize,
    write_json,
)
from loadtest.workloads import PrefixMix, make_prefix_workload

CASES = ("evict", "bypass", "replicas", "restart", "uniform", "cost")
ROUTER = "vllm-router"
ARMS = (EXACT, APPROX, ROUTER)
EQUAL = (1.0, 1.0, 1.0, 1.0)
# Stopping is part of the restart case, and of every run's teardown: no grace for a load
# balancer to notice (the listener closes at once; what runs is still drained).
_GATEWAY = {"drain_delay": 0}
_SETTLE = 0.5  # seconds after a cost round before reading CPU: its last events arrive


@dataclass(frozen=True)
class KvOptions:
    cases: tuple[str, ...] = CASES
    arms: tuple[str, ...] = ARMS
    strategy: str = "least_time"
    max_num_seqs: int = 16
    prefix: PrefixMix = field(default_factory=PrefixMix)  # 32 x 4,000 + 200 tokens
    load: float = 0.5  # share of the warm capacity, every case but cost
    duration: float = 30.0  # seconds of open-loop arrivals per arm
    cache_blocks: int = 4000  # per instance: 64k tokens, 16 of the 32 prefixes (as prefix)
    # evict: per instance about 9.6 of the 32 prefixes (250 blocks each), 0.3 of them.
    evict_cache_blocks: int = 2400
    bypass_share: float = 0.3
    replicas: int = 4
    restart_retries: int = 5  # the client's, in restart: 0.5 + 1 + 2 + 4 + 8 s of backoff
    aa: bool = True  # uniform: approx twice, for the noise floor
    noise: float = 0.05  # uniform: the least noise floor a verdict allows
    cost_mix: PrefixMix = field(
        default_factory=lambda: PrefixMix(
            groups=1, prefix_tokens=1800, suffix_tokens=200, max_tokens=(32, 64)
        )
    )
    cost_load: float = 0.25  # share of the warm capacity of cost_mix
    cost_duration: float = 10.0  # seconds of arrivals per arm and round
    cost_rounds: int = 3
    clients: int = 16


@dataclass(frozen=True)
class Front:
    """One running front: where it listens, and for the gateway its process."""

    url: str  # without /v1
    pid: int | None = None  # the gateway's; None for a baseline

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def gateway(self) -> bool:
        return self.pid is not None


def _always(url: str) -> Route:
    """A route that sends every request to `url` (a restarted front keeps its port)."""
    return lambda spec, worker: url


def _base(arm: str) -> str:
    """The arm without its marks: `approx#2` (a repeat) and `exact@q0` are `approx`, `exact`."""
    return arm.partition("#")[0].partition("@")[0]


def _queue_mark(arm: str) -> dict[str, Any] | None:
    """`exact@q0`: the arm with `max_queue_per_instance = 0`, every request held in the
    gateway's queue until an instance has a running slot free (placed at its turn)."""
    mark = arm.partition("#")[0].partition("@")[2]
    if not mark:
        return None
    if not (mark.startswith("q") and mark[1:].isdigit()):
        raise ValueError(f"unknown mark {mark!r} in arm {arm!r}: only @qN")
    return {"max_queue_per_instance": int(mark[1:])}


@contextlib.asynccontextmanager
async def front(
    arm: str,
    fleet: harness.FleetProc,
    opts: KvOptions,
    common: Common,
    port: int | None = None,
) -> AsyncIterator[Front]:
    """The front of `arm` before `fleet`, on `port` (a free one by default)."""
    gw_core, _ = cores(common)
    base = _base(arm)
    if base in baselines.BASELINES:
        async with baselines.front(
            base, fleet.urls, core=gw_core, seed=common.seed, port=port
        ) as url:
            yield Front(url)
        return
    if base not in (EXACT, APPROX):
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")
    async with harness.gateway_process(
        fleet.urls,
        strategy=opts.strategy,
        max_num_seqs=opts.max_num_seqs,
        core=gw_core,
        source=common.gateway_dir,
        # The [slo] defaults, as prefix: the baselines queue without bound.
        gateway=_GATEWAY,
        dispatch=_queue_mark(arm),
        instance_fields=fleet.kv_event_fields() if base == EXACT else None,
        port=port,
    ) as gw:
        yield Front(gw.url, gw.pid)


_KV_COUNTERS = {
    "gateway_kv_event_batches_total": "batches",
    "gateway_kv_events_total": "events",
    "gateway_kv_event_gaps_total": "gaps",
    "gateway_kv_event_replays_total": "replays",
    "gateway_kv_event_replay_failures_total": "replay_failures",
    "gateway_kv_index_stale_total": "stale",
}


async def gateway_kv(url: str) -> dict[str, Any]:
    """The gateway's KV events indexes: each instance's state and blocks, and the event
    counters summed over the instances (all empty for a gateway without KV events)."""
    return kv_of(await gateway_metrics(url))


def kv_of(text: str) -> dict[str, Any]:
    """`gateway_kv` of a /metrics text already read."""
    out: dict[str, Any] = {"state": {}, "blocks": {}} | dict.fromkeys(_KV_COUNTERS.values(), 0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gateway_kv_index_state" and sample.value == 1:
                out["state"][sample.labels["server"]] = sample.labels["state"]
            elif sample.name == "gateway_kv_index_blocks":
                out["blocks"][sample.labels["server"]] = int(sample.value)
            elif sample.name in _KV_COUNTERS:
                out[_KV_COUNTERS[sample.name]] += int(sample.value)
    return out


async def gateway_figures(fronts: Sequence[Front], names: dict[str, str]) -> list[dict[str, Any]]:
    """Each gateway's hit estimate and KV events indexes (instances named by `names`)."""
    out = []
    for f in fronts:
        if f.gateway:
            text = await gateway_metrics(f.url)  # one scrape: the estimate and the indexes
            kv = kv_of(text)
            for key in ("state", "blocks"):
                kv[key] = dict(sorted((names.get(k, k), v) for k, v in kv[key].items()))
            out.append({"estimate": estimate_of(text), "kv": kv})
    return out


def _rate(query_tokens: int, hit_tokens: int) -> dict[str, Any]:
    return {
        "query_tokens": query_tokens,
        "hit_tokens": hit_tokens,
        "hit_rate": hit_tokens / query_tokens if query_tokens else None,
    }


def summed_estimate(gateways: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The gateways' estimates as one: their query and estimated hit tokens summed."""
    if not gateways:
        return None
    estimates = [g["estimate"] for g in gateways]
    return _rate(sum(e["query_tokens"] for e in estimates), sum(e["hit_tokens"] for e in estimates))


def per_request_truth(results: Sequence[Result]) -> dict[str, Any] | None:
    """The hit rate of these requests from their answers' usage, where every ok answer
    said how much of its prompt was cached; else None."""
    ok = [r for r in results if r.ok]
    if not ok or any(r.cached_tokens is None or r.prompt_tokens is None for r in ok):
        return None
    return _rate(sum(r.prompt_tokens or 0 for r in ok), sum(r.cached_tokens or 0 for r in ok))


def _delta(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    return _rate(
        after["query_tokens"] - before["query_tokens"], after["hit_tokens"] - before["hit_tokens"]
    )


def _error(estimated: dict[str, Any] | None, true: dict[str, Any] | None) -> float | None:
    if not estimated or not true or estimated["hit_rate"] is None or true["hit_rate"] is None:
        return None
    return float(abs(estimated["hit_rate"] - true["hit_rate"]))


def bypassing(
    specs: Sequence[RequestSpec], share: float, instances: int, seed: int
) -> dict[int, int]:
    """The requests that go straight to an instance, and to which: index -> instance."""
    rng = random.Random(f"{seed}-bypass")
    out: dict[int, int] = {}
    for spec in specs:
        if rng.random() < share:
            out[spec.index] = rng.randrange(instances)
    return out


def part(run: Run, specs: Sequence[RequestSpec], keep: Callable[[int], bool]) -> Run:
    """The requests of `run` whose index `keep` takes, as a run of its own (same span)."""
    sub = Run(run.label, [r for r in run.results if keep(r.index)], run.started, run.ended)
    sub.last_sent = run.last_sent
    sub.unfinished = sum(1 for s in specs if keep(s.index)) - len(sub.results)
    return sub


async def _restarted(
    start: Callable[[int], contextlib.AbstractAsyncContextManager[Front]],
    client: Client,
    specs: Sequence[RequestSpec],
    fleet_urls: Sequence[str],
    names: dict[str, str],
    stack: contextlib.AsyncExitStack,
    *,
    label: str,
    at: float,
    common: Common,
) -> tuple[Run, list[Front], dict[str, Any]]:
    """One open loop through a front that is stopped `at` s in and started again on the
    same port; what the first life estimated, and the fleet's counters between the lives.

    The fleet is read once the first front has exited: every request it placed has then
    been served, and none reaches an instance until the second is up.
    """
    port = harness.free_port()
    first_life = contextlib.AsyncExitStack()
    stack.push_async_callback(first_life.aclose)
    first = await first_life.enter_async_context(start(port))
    task = asyncio.create_task(
        run_open(client, specs, _always(first.base_url), label=label, limit=common.limit)
    )
    try:
        await asyncio.sleep(at)
        before = await gateway_figures([first], names)
        stopped = time.perf_counter()
        await first_life.aclose()
        fleet_before = await scrape(fleet_urls, names)
        second = await stack.enter_async_context(start(port))
        gap = time.perf_counter() - stopped
        run = await task
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    info = {"at_s": at, "gap_s": gap, "before": {"fleet": fleet_before, "gateways": before}}
    return run, [second], info


def _restart_figures(
    info: dict[str, Any], cache: dict[str, Any], after: list[dict[str, Any]]
) -> dict[str, Any]:
    """Estimate against truth before the restart, after it, and over the whole run."""
    before_fleet = info["before"]["fleet"]
    before_est = summed_estimate(info["before"]["gateways"])
    after_est = summed_estimate(after)
    after_true = _delta(cache, before_fleet)
    before_true = _rate(before_fleet["query_tokens"], before_fleet["hit_tokens"])
    out = {
        "at_s": info["at_s"],
        "gap_s": info["gap_s"],
        "before": {"true": before_true, "estimated": before_est,
                   "error": _error(before_est, before_true),
                   "gateways": info["before"]["gateways"]},
        "after": {"true": after_true, "estimated": after_est,
                  "error": _error(after_est, after_true)},
    }  # fmt: skip
    return out


async def run_arm(
    case: str,
    arm: str,
    specs: Sequence[RequestSpec],
    cache_blocks: int,
    opts: KvOptions,
    common: Common,
) -> report.Summary | None:
    """One fresh fleet, the arm's front(s), one open loop of `specs` as `case` sends it."""
    if _base(arm) in baselines.BASELINES and (why := baselines.missing(_base(arm))):
        say(f"skipped {arm}: {why}")
        return None
    _, fleet_core = cores(common)
    label = f"{case}: {arm}"
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                EQUAL,
                max_num_seqs=opts.max_num_seqs,
                seed=common.seed,
                core=fleet_core,
                prefix_cache_blocks=cache_blocks,
                kv_events=True,
                # Each answer's cached tokens: the front's own requests' hit rate, apart from
                # traffic that went around it (bypass).
                prompt_tokens_details=True,
            )
        )
        names = fleet_names(fleet.urls, EQUAL)
        retries = opts.restart_retries if case == "restart" else 0
        client = Client(await stack.enter_async_context(session()), harness.KEY, retries=retries)
        restart: dict[str, Any] | None = None
        bypass: dict[int, int] = {}
        if case == "restart":
            run, fronts, restart = await _restarted(
                lambda port: front(arm, fleet, opts, common, port),
                client, specs, fleet.urls, names, stack,
                label=label, at=opts.duration / 2, common=common,
            )  # fmt: skip
        else:
            count = opts.replicas if case == "replicas" else 1
            fronts = [
                await stack.enter_async_context(front(arm, fleet, opts, common))
                for _ in range(count)
            ]
            if case == "bypass":
                bypass = bypassing(specs, opts.bypass_share, len(fleet.urls), common.seed)
            direct = [u + "/v1" for u in fleet.urls]
            spread = [f.base_url for f in fronts]

            def route(spec: RequestSpec, worker: int) -> str:
                if spec.index in bypass:
                    return direct[bypass[spec.index]]
                return spread[spec.index % len(spread)]  # round robin over the replicas

            run = await run_open(client, specs, route, label=label, limit=common.limit)
        cache = await scrape(fleet.urls, names)
        gateways = await gateway_figures(fronts, names)
    through = part(run, specs, lambda i: i not in bypass)
    summary = relabel(summarize(through, common), names)
    lives = gateways if restart is None else restart["before"]["gateways"] + gateways
    estimated = summed_estimate(lives)
    front_truth = per_request_truth(through.results)
    # The counters are the truth wherever every request went through the front.
    true = front_truth or (None if bypass else _rate(cache["query_tokens"], cache["hit_tokens"]))
    summary |= {
        "label": arm,
        "cache": cache,
        "index": {
            "true": true,
            "true_from": "answers" if front_truth else ("instances" if true else None),
            "estimated": estimated,
            "error": _error(estimated, true),
            "gateways": gateways,
        },
    }
    if bypass:
        summary["bypassed"] = summarize(part(run, specs, lambda i: i in bypass), common)
    if restart is not None:
        summary["restart"] = _restart_figures(restart, cache, gateways)
    return summary


def _case_specs(
    name: str, opts: KvOptions, common: Common
) -> tuple[dict[str, Any], list[RequestSpec]]:
    sim = SimConfig(max_num_seqs=opts.max_num_seqs)
    warm = prefix_capacity(EQUAL, opts.prefix, sim, warm=True)
    rate = opts.load * warm
    count = max(1, round(rate * opts.duration))
    specs = make_prefix_workload(count, opts.prefix, common.seed, rate=rate, clients=opts.clients)
    cache_blocks = opts.evict_cache_blocks if name == "evict" else opts.cache_blocks
    info = {
        "speeds": list(EQUAL),
        "cache_blocks": cache_blocks,
        "mix": asdict(opts.prefix),
        "capacity_req_per_s": {
            "warm": warm,
            "cold": prefix_capacity(EQUAL, opts.prefix, sim, warm=False),
        },
        "load": opts.load,
        "rate_req_per_s": rate,
        "requests": len(specs),
        "hit_rate_ceiling": hit_ceiling(specs, cached_prefix_tokens(opts.prefix, sim.block_size)),
    }
    if name == "bypass":
        info["bypass_share"] = opts.bypass_share
    if name == "replicas":
        info["replicas"] = opts.replicas
        info["router_replicas"] = opts.replicas  # one vllm-router per gateway, none shared
    if name == "restart":
        info["client_retries"] = opts.restart_retries
    return info, specs


def case_arms(name: str, opts: KvOptions) -> list[str]:
    """The arms a case runs: uniform runs approx a second time for its noise floor."""
    arms = list(opts.arms)
    if name == "uniform" and opts.aa and APPROX in arms:
        arms.insert(arms.index(APPROX) + 1, REPEAT)
    return arms


async def run_case(name: str, opts: KvOptions, common: Common) -> dict[str, Any]:
    """The seeded requests of case `name` through each of its arms."""
    info, specs = _case_specs(name, opts, common)
    say(f"\n== {name}: {len(specs)} requests at {info['rate_req_per_s']:.1f}/s ==")
    runs: dict[str, report.Summary] = {}
    for arm in case_arms(name, opts):
        summary = await run_arm(name, arm, specs, info["cache_blocks"], opts, common)
        if summary is not None:
            runs[arm] = summary
    return {**info, "runs": runs}


def _rebased(specs: Sequence[RequestSpec]) -> list[RequestSpec]:
    """The specs with their arrivals counted from the first one's."""
    start = specs[0].at if specs else 0.0
    return [replace(s, at=s.at - start) for s in specs]


async def cost_case(opts: KvOptions, common: Common) -> dict[str, Any]:
    """Gateway CPU per request with KV events and without, both before one fleet, rounds
    alternating (exact approx, approx exact, ...), each round new requests of the mix."""
    arms = (EXACT, APPROX)
    mix = opts.cost_mix
    sim = SimConfig(max_num_seqs=opts.max_num_seqs)
    rate = opts.cost_load * prefix_capacity(EQUAL, mix, sim, warm=True)
    per_round = max(1, round(rate * opts.cost_duration))
    say(f"\n== cost: {opts.cost_rounds} rounds of {per_round} requests at {rate:.1f}/s ==")
    specs = make_prefix_workload(
        per_round * len(arms) * opts.cost_rounds, mix, common.seed, rate=rate,
        clients=opts.clients,
    )  # fmt: skip
    chunks = iter(_rebased(specs[i : i + per_round]) for i in range(0, len(specs), per_round))
    rounds: dict[str, list[tuple[float, int]]] = defaultdict(list)
    _, fleet_core = cores(common)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(
            harness.fleet_process(
                EQUAL, max_num_seqs=opts.max_num_seqs, seed=common.seed, core=fleet_core,
                prefix_cache_blocks=opts.cache_blocks, kv_events=True,
            )
        )  # fmt: skip
        fronts = {a: await stack.enter_async_context(front(a, fleet, opts, common)) for a in arms}
        client = Client(await stack.enter_async_context(session()), harness.KEY)
        for n in range(opts.cost_rounds):
            for arm in arms if n % 2 == 0 else arms[::-1]:
                gw = fronts[arm]
                assert gw.pid is not None
                before = harness.tree_cpu_seconds(gw.pid)
                run = await run_open(
                    client, next(chunks), _always(gw.base_url), label=f"cost: {arm}",
                    limit=common.limit,
                )  # fmt: skip
                await asyncio.sleep(_SETTLE)
                done = sum(1 for r in run.results if r.ok)
                rounds[arm].append((harness.tree_cpu_seconds(gw.pid) - before, done))
        kv = await gateway_kv(fronts[EXACT].url)
    per = {
        arm: 1000 * sum(c for c, _ in rounds[arm]) / max(1, sum(n for _, n in rounds[arm]))
        for arm in arms
    }
    return {
        "mix": asdict(mix),
        "rate_req_per_s": rate,
        "requests_per_round": per_round,
        "rounds": {arm: [list(r) for r in rounds[arm]] for arm in arms},
        "cpu_ms_per_request": per,
        "exact_over_approx": per[EXACT] / per[APPROX] if per[APPROX] else None,
        "kv": kv,
    }


def _kv_accepted(opts: KvOptions, common: Common) -> KvOptions:
    """`opts` without the exact arm when the gateway under test does not take kv_events."""
    if EXACT not in opts.arms:
        return opts
    fields = {"kv_events": {"endpoint": "tcp://*:5557", "topic": harness.KV_EVENTS_TOPIC}}
    why = harness.gateway_accepts(common.gateway_dir, instance_fields=fields)
    if why is None:
        return opts
    say(f"skipped {EXACT}: the gateway under test does not take kv_events ({why})")
    return replace(opts, arms=tuple(a for a in opts.arms if a != EXACT))


async def kv(opts: KvOptions, common: Common) -> dict[str, Any]:
    """Every case in `opts.cases`, every arm; the JSON and the tables."""
    unknown = set(opts.cases) - set(CASES)
    if unknown:
        raise ValueError(f"unknown cases {sorted(unknown)}; known: {', '.join(CASES)}")
    pin_self(common)
    opts = _kv_accepted(opts, common)
    cases: dict[str, Any] = {}
    for name in opts.cases:
        if name == "cost":
            if EXACT not in opts.arms:
                say("skipped cost: it needs the exact arm")
                continue
            cases[name] = await cost_case(opts, common)
        else:
            cases[name] = await run_case(name, opts, common)
        print_case(name, cases[name])
    body: dict[str, Any] = {"options": asdict(opts), "cases": cases}
    body["targets"] = verdicts(cases, opts.noise)
    say(f"wrote {write_json(common, 'kv', body)}")
    return body
