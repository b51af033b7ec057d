"""The 2P:1D arrangement across a range of calibrations around Figure 1, not at one point.

    python -m loadtest.disagg.calibration_range                # every point of RANGE, ~40 min
    python -m loadtest.disagg.calibration_range --points 0,7   # some of them
    python -m loadtest.disagg.calibration_range --model        # the points' model capacities

Where the split rule's decisions fall depends on where the simulator's prefill and transfer
costs sit: a rule that holds at the calibrated point may collapse beside it. Each point of
`calibration.RANGE` (a `Scale` whose colocated capacity stays within 20% of Figure 1's
1.6 rps in the model) gets a fresh fleet of three instances (two prefill, one decode), and:

1. vllm-router's PD mode (every prompt in two hops): its capacity by bisection from the
   model's estimate (the slower of the two prefill instances together and the decode one);
2. the gateway with its defaults (roles only) and with the workload's objectives (`[slo]`
   ttft 0.4, tpot 0.04), each judged at the router's capacity: a gateway that serves that
   rate has a capacity at least the router's, to the bisection's resolution.

Each judged point records attainment, p50/p99 TTFT and how many prompts went in two hops
(the decode instance's `sim:kv_transfers_total`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadtest import harness
from loadtest.disagg import bench, calibration
from loadtest.helpfmt import HelpFormatter

ROUTER = "pd-2p1d-vllm-router"
GATEWAYS = ("pd-2p1d-gateway-defaults", "pd-2p1d-gateway")


def model_capacities(config: calibration.SimConfig) -> dict[str, float]:
    """Figure 1's three capacities (rps per instance) of `config` in the model, one seed."""
    return {
        setup.name: round(
            calibration.model_capacity(config, setup, 30.0, calibration.REPRESENTATIVE_SEED), 3
        )
        for setup in calibration.SETUPS
    }


def router_bracket(capacities: dict[str, float]) -> tuple[float, float]:
    """A first guess of 2P:1D's total capacity: its slower side, +-15%."""
    estimate = min(2 * capacities["prefill"], capacities["decode"])
    return 0.85 * estimate, 1.15 * estimate


def _two_hop(result: dict[str, Any]) -> int:
    return int(sum(c["kv_transfers_total"] for c in result["kv_counters"].values()))


async def measure_point(
    scale: calibration.Scale, *, duration: float, seed: int, steps: int
) -> dict[str, Any]:
    config = calibration.scaled(calibration.DISTSERVE_OPT13B, scale)
    capacities = model_capacities(config)
    arrangements = {a.name: a for a in bench.ARRANGEMENTS}
    router = dataclasses.replace(arrangements[ROUTER], bracket=router_bracket(capacities))
    found = await bench.measure(router, duration=duration, seed=seed, steps=steps, config=config)
    at = found["capacity_rps"]
    point: dict[str, Any] = {
        "scale": dataclasses.asdict(scale),
        "preset": calibration.preset_dict(config),
        "model_rps_per_instance": capacities,
        ROUTER: {**found, "two_hop": _two_hop(found)},
    }
    for name in GATEWAYS:
        if not at:
            point[name] = {"skipped": "the router served no rate"}
            continue
        result = await bench.measure(
            arrangements[name], duration=duration, seed=seed, steps=0, at=at, config=config
        )
        judged = result["points"][0]
        router_at = next(p for p in found["points"] if p["rate"] == round(at, 4))
        point[name] = {
            **result,
            "two_hop": _two_hop(result),
            "holds": bool(judged["served"]),
            "p99_ttft_vs_router": round(judged["p99_ttft_s"] / router_at["p99_ttft_s"], 3)
            if judged["p99_ttft_s"] and router_at["p99_ttft_s"]
            else None,
        }
    return point


def summary_line(index: int, point: dict[str, Any]) -> str:
    scale = calibration.Scale(**point["scale"])
    router = point[ROUTER]
    parts = [f"[{index}] {scale.label()}: router {router['per_instance_rps']:.2f}/instance"]
    for name in GATEWAYS:
        result = point[name]
        if "holds" in result:
            judged = result["points"][0]
            parts.append(
                f"{name.removeprefix('pd-2p1d-')} {judged['attainment']:.1%} within, "
                f"p99 TTFT x{result['p99_ttft_vs_router']}, {result['two_hop']} two-hop"
            )
    return "; ".join(parts)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    report: dict[str, Any] = {
        "protocol": {"duration_s": args.duration, "seed": args.seed, "steps": args.steps},
        "source": harness.source_state(),
        "points": {},
    }
    started = time.monotonic()
    for index in args.points:
        scale = calibration.RANGE[index]
        if args.model:
            config = calibration.scaled(calibration.DISTSERVE_OPT13B, scale)
            capacities = model_capacities(config)
            print(f"[{index}] {scale.label()}: {capacities}")
            continue
        point = await measure_point(scale, duration=args.duration, seed=args.seed, steps=args.steps)
        report["points"][str(index)] = point
        print(summary_line(index, point), flush=True)
        if args.out:  # after every point: a run cut short keeps what it measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2) + "\n")
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    return report


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.disagg.calibration_range",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("--model", action="store_true", help="the model's capacities only")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    parser.add_argument(
        "--seed", type=int, default=calibration.REPRESENTATIVE_SEED, help="schedule seed"
    )
    parser.add_argument("--steps", type=int, default=2, help="the router's bisection halvings")
    parser.add_argument(
        "--points",
        type=lambda text: [int(p) for p in text.split(",") if p],
        default=",".join(str(i) for i in range(len(calibration.RANGE))),
        help="which points of calibration.RANGE (indices)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("loadtest/results/disagg/calibration-range.json"),
        help="where the results go (JSON)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if bad := [i for i in args.points if not 0 <= i < len(calibration.RANGE)]:
        print(f"error: no such points {bad}; 0 to {len(calibration.RANGE) - 1}", file=sys.stderr)
        return 2
    asyncio.run(run(args))
    if not args.model:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
