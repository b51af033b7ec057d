"""Disaggregated against colocated, on three simulated GPUs calibrated to DistServe's Figure 1.

    python -m loadtest.disagg.bench                  # about 9 minutes
    python -m loadtest.disagg.bench --arrangements pd-2p1d-vllm-router

Every arrangement runs three `DISTSERVE_OPT13B` instances (one fleet process, the KV
connector on) and finds the highest total rate at which at least 90% of requests meet
Figure 1's objectives (TTFT 0.4 s, TPOT 0.04 s, timed at the client, through the front),
by bisection; per instance is that total over three, as DistServe counts per GPU.

- `pd-2p1d-vllm-router`: two prefill instances and one decode instance behind vllm-router's
  PD mode, one Poisson stream to the router (DistServe's 2:1 split: 10 rps in all, 3.3 per
  GPU, if the decode instance is the limit and the hops cost nothing);
- `colocated-3-direct`: three `both` instances, each with its own Poisson stream, no front
  (DistServe's colocated 1.6 rps per GPU, by construction);
- `colocated-3-vllm-router`: the same instances behind vllm-router, round robin, one stream;
- `pd-2p1d-gateway`, `colocated-3-gateway`: the same two arrangements behind the gateway
  (`least_busy`; the roles in its settings, so it disaggregates selectively).

The `mixed-*` arrangements send half short prompts (128 tokens) and half long ones (4,608,
over the gateway's 4,096-token long-input threshold), alternately, 64 output tokens each:
short ones judged by Figure 1's objectives, long ones by a 2 s TTFT (their prefill alone
takes about 1 s here) and the same TPOT. Pure colocation (`mixed-colocated-3-*`), pure
disaggregation (`mixed-pd-2p1d-vllm-router`: every prompt in two hops) and the gateway's
selective disaggregation (`mixed-pd-2p1d-gateway`: a prompt whose prefill would stall the
decode instance past the TPOT objective goes in two hops, the rest whole).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim.sim_engine import SimConfig
from loadtest import baselines, harness
from loadtest.disagg import calibration, loadgen
from loadtest.disagg.fronts import FRONTS, GATEWAYS, Instance, Role, direct
from loadtest.disagg.schedule import arrivals
from loadtest.disagg.search import Bisection, search_async
from loadtest.disagg.slo import FIGURE_1, Outcome, Slo, meets
from loadtest.helpfmt import HelpFormatter


@dataclass(frozen=True)
class Arrangement:
    name: str
    roles: tuple[Role, ...]
    front: str  # a key of FRONTS
    separate_streams: bool  # each instance its own stream, straight to it (no front)
    bracket: tuple[float, float]  # the first guess of the total capacity, rps
    mixed: bool = False  # the mixed workload (short and long prompts), else Figure 1's


# The mixed workload: request i's prompt, alternately short and long, and its objectives.
MIXED_TOKENS = (128, 4608)
MIXED_SLOS = (FIGURE_1, Slo(ttft=2.0, tpot=FIGURE_1.tpot))


def prompt_tokens(arrangement: Arrangement, index: int, short: int = MIXED_TOKENS[0]) -> int:
    """Request `index`'s prompt size: Figure 1's, or the mix's short (`short` tokens) and
    long ones alternately."""
    if not arrangement.mixed:
        return loadgen.PROMPT_TOKENS
    return short if index % 2 == 0 else MIXED_TOKENS[1]


def met(arrangement: Arrangement, outcomes: Sequence[Outcome]) -> float:
    """The share of one stream's requests (in index order) within their objectives."""
    if not outcomes:
        return 0.0
    if not arrangement.mixed:
        return sum(meets(o, FIGURE_1) for o in outcomes) / len(outcomes)
    return sum(meets(o, MIXED_SLOS[i % 2]) for i, o in enumerate(outcomes)) / len(outcomes)


ARRANGEMENTS = (
    Arrangement(
        "pd-2p1d-vllm-router",
        ("prefill", "prefill", "decode"),
        front="vllm-router-pd",
        separate_streams=False,
        bracket=(8.0, 12.0),
    ),
    Arrangement(
        "colocated-3-direct",
        ("both",) * 3,
        front="direct",
        separate_streams=True,
        bracket=(4.2, 5.4),
    ),
    Arrangement(
        "colocated-3-vllm-router",
        ("both",) * 3,
        front="vllm-router",
        separate_streams=False,
        bracket=(4.5, 6.5),
    ),
    Arrangement(
        "pd-2p1d-gateway",
        ("prefill", "prefill", "decode"),
        front="gateway",
        separate_streams=False,
        bracket=(8.0, 12.0),
    ),
    Arrangement(
        "pd-2p1d-gateway-defaults",
        ("prefill", "prefill", "decode"),
        front="gateway-defaults",
        separate_streams=False,
        bracket=(8.0, 12.0),
    ),
    Arrangement(
        "colocated-3-gateway",
        ("both",) * 3,
        front="gateway",
        separate_streams=False,
        bracket=(4.5, 6.5),
    ),
    Arrangement(
        "mixed-colocated-3-gateway",
        ("both",) * 3,
        front="gateway",
        separate_streams=False,
        bracket=(1.0, 2.0),
        mixed=True,
    ),
    Arrangement(
        "mixed-colocated-3-vllm-router",
        ("both",) * 3,
        front="vllm-router",
        separate_streams=False,
        bracket=(1.0, 2.0),
        mixed=True,
    ),
    Arrangement(
        "mixed-pd-2p1d-vllm-router",
        ("prefill", "prefill", "decode"),
        front="vllm-router-pd",
        separate_streams=False,
        bracket=(1.0, 2.0),
        mixed=True,
    ),
    Arrangement(
        "mixed-pd-2p1d-gateway",
        ("prefill", "prefill", "decode"),
        front="gateway",
        separate_streams=False,
        bracket=(1.25, 2.5),
        mixed=True,
    ),
)


async def _kv_counters(http: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with http.get(url + "/metrics") as resp:
        text = await resp.text()
    wanted = ("sim:kv_produced_total", "sim:kv_transfers_total", "sim:kv_fallbacks_total")
    samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return {name.removeprefix("sim:"): samples.get(name, 0.0) for name in wanted}


async def measure(
    arrangement: Arrangement,
    *,
    duration: float,
    seed: int,
    steps: int,
    at: float | None = None,
    short: int = MIXED_TOKENS[0],
    config: SimConfig = calibration.DISTSERVE_OPT13B,
    source: Path | None = None,
) -> dict[str, Any]:
    """One arrangement's capacity on a fresh fleet of `config` instances and its front (or,
    with `at`, its verdict and latencies at that one total rate: arrangements compared at
    the same load); `source`: the gateway package our fronts run (None: this one)."""
    points: dict[float, dict[str, Any]] = {}
    speeds = [1.0] * len(arrangement.roles)
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(calibration.sim_fleet(config, speeds, seed))
        http = await stack.enter_async_context(loadgen.session())
        instances = [Instance(u, r) for u, r in zip(fleet.urls, arrangement.roles, strict=True)]
        if arrangement.separate_streams:
            targets = [await stack.enter_async_context(direct([i])) for i in instances]
        else:
            if arrangement.front in GATEWAYS:
                started = GATEWAYS[arrangement.front](instances, source)
            else:
                started = FRONTS[arrangement.front](instances)
            targets = [await stack.enter_async_context(started)]

        async def served(rate: float) -> bool:
            share = rate / len(targets)
            streams = [
                (
                    arrivals(share, duration, calibration.stream_seed(seed, i)),
                    loadgen.one_leg(
                        http,
                        url,
                        loadgen.OUTPUT_TOKENS,
                        f"{arrangement.name}-{i}",
                        lambda index: prompt_tokens(arrangement, index, short),
                    ),
                )
                for i, url in enumerate(targets)
            ]
            results = await loadgen.run_streams(streams, limit=duration + 60)
            pooled = [o for outcomes in results for o in outcomes]
            share_met = sum(met(arrangement, o) * len(o) for o in results) / max(1, len(pooled))
            ttfts = sorted(o.ttft for o in pooled if o.ttft is not None)
            p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
            p50 = ttfts[len(ttfts) // 2] if ttfts else None
            errors = sum(o.error is not None for o in pooled)
            points[rate] = {
                "requests": len(pooled),
                "attainment": share_met,
                "errors": errors,
                "p50_ttft_s": None if p50 is None else round(p50, 4),
                "p99_ttft_s": None if p99 is None else round(p99, 4),
            }
            print(
                f"  {arrangement.name}: {rate:6.3f} rps ({rate / 3:.3f}/instance), "
                f"{len(pooled)} requests, {share_met:.1%} within, {errors} errors",
                file=sys.stderr,
                flush=True,
            )
            return share_met >= FIGURE_1.attainment

        if at is not None:
            found = Bisection(at / 2, at, 0)
            found.tried.append((at, await served(at)))
        else:
            found = await search_async(served, Bisection(*arrangement.bracket, steps))
        counters = {i.url: await _kv_counters(http, i.url) for i in instances}
    return {
        "roles": list(arrangement.roles),
        "front": arrangement.front if not arrangement.separate_streams else "direct, per instance",
        "capacity_rps": round(found.capacity, 3),
        "per_instance_rps": round(found.capacity / len(arrangement.roles), 3),
        "points": [
            {"rate": round(rate, 4), "served": ok, **points[rate]} for rate, ok in found.tried
        ],
        "kv_counters": counters,
    }


async def run(args: argparse.Namespace, source: Path | None) -> dict[str, Any]:
    config = calibration.scaled(calibration.DISTSERVE_OPT13B, args.scale)
    report: dict[str, Any] = {
        "preset": calibration.preset_dict(config),
        "scale": dataclasses.asdict(args.scale),
        "gateway_ref": args.gateway_ref,
        "objectives": {"ttft_s": FIGURE_1.ttft, "tpot_s": FIGURE_1.tpot, "attainment": 0.9},
        "protocol": {
            "duration_s": args.duration,
            "seed": args.seed,
            "steps": args.steps,
            "at_rps": args.at,
            "mixed_tokens": [args.short_tokens, MIXED_TOKENS[1]],
        },
        "arrangements": {},
    }
    started = time.monotonic()
    for arrangement in ARRANGEMENTS:
        if arrangement.name not in args.arrangements:
            continue
        try:
            result = await measure(
                arrangement,
                duration=args.duration,
                seed=args.seed,
                steps=args.steps,
                at=args.at,
                short=args.short_tokens,
                config=config,
                source=source,
            )
        except baselines.Unavailable as exc:
            print(f"{arrangement.name}: skipped, {exc}", flush=True)
            continue
        report["arrangements"][arrangement.name] = result
        print(f"{arrangement.name}: {json.dumps(result)}", flush=True)
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.disagg.bench",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument(
        "--seed", type=int, default=calibration.REPRESENTATIVE_SEED, help="schedule seed"
    )
    parser.add_argument("--steps", type=int, default=3, help="bisection halvings per arrangement")
    parser.add_argument(
        "--at", type=float, default=None, help="judge only this total rate (rps), no search"
    )
    parser.add_argument(
        "--short-tokens", type=int, default=MIXED_TOKENS[0], help="the mix's short prompts"
    )
    parser.add_argument(
        "--scale",
        type=calibration.Scale.parse,
        default=calibration.Scale(),
        help="a calibration around the preset, e.g. prefill=1.5,transfer=3,decode=1.2",
    )
    parser.add_argument(
        "--gateway-ref",
        default=None,
        help="run our gateway as committed at this git ref (default: the working tree)",
    )
    parser.add_argument(
        "--arrangements",
        type=lambda text: [a for a in text.split(",") if a],
        default=",".join(a.name for a in ARRANGEMENTS),
        help="which arrangements to measure",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("loadtest/results/disagg/bench.json"),
        help="where the results go (JSON)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if unknown := set(args.arrangements) - {a.name for a in ARRANGEMENTS}:
        print(f"error: unknown arrangements {sorted(unknown)}", file=sys.stderr)
        return 2
    with harness.exported_gateway(args.gateway_ref) as source:
        report = asyncio.run(run(args, source))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
