"""The 2P:1D arrangement across a range of calibrations around Figure 1, not at one point.

    python -m loadtest.disagg.calibration_range                # every point of RANGE, ~65 min
    python -m loadtest.disagg.calibration_range --points 0,7   # some of them
    python -m loadtest.disagg.calibration_range --model        # the points' model capacities

Where the split rule's decisions fall depends on where the simulator's prefill and transfer
costs sit: a rule that holds at the calibrated point may collapse beside it. Each point of
`calibration.RANGE` (a `Scale` whose colocated capacity stays within 20% of Figure 1's
1.6 rps in the model) gets a fresh fleet of three instances (two prefill, one decode), and:

vllm-router's PD mode (every prompt in two hops), the gateway with its defaults (roles
only) and the gateway with the workload's objectives (`[slo]` ttft 0.4, tpot 0.04), each
with its capacity by bisection over the same bracket (the model's estimate, the slower of
the two prefill instances together and the decode one, +-15%), so the fronts try the same
rates until their verdicts differ. Each records its points (attainment, p50/p99 TTFT), how
many prompts went in two hops (the decode instance's `sim:kv_transfers_total`), its
capacity over the router's and its p99 TTFT over the router's at the highest rate both
served.
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
ARRANGEMENTS = {a.name: a for a in bench.ARRANGEMENTS}


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


def _p99_at(result: dict[str, Any], rate: float) -> float | None:
    return next((p["p99_ttft_s"] for p in result["points"] if p["rate"] == rate), None)


async def measure_point(
    scale: calibration.Scale, *, duration: float, seed: int, steps: int
) -> dict[str, Any]:
    config = calibration.scaled(calibration.DISTSERVE_OPT13B, scale)
    capacities = model_capacities(config)
    bracket = router_bracket(capacities)
    point: dict[str, Any] = {
        "scale": dataclasses.asdict(scale),
        "preset": calibration.preset_dict(config),
        "model_rps_per_instance": capacities,
        "bracket_rps": [round(x, 3) for x in bracket],
    }
    for name in (ROUTER, *GATEWAYS):
        arrangement = dataclasses.replace(ARRANGEMENTS[name], bracket=bracket)
        result = await bench.measure(
            arrangement, duration=duration, seed=seed, steps=steps, config=config
        )
        point[name] = {**result, "two_hop": _two_hop(result)}
    router = point[ROUTER]
    for name in GATEWAYS:
        result = point[name]
        result["vs_router"] = (
            round(result["capacity_rps"] / router["capacity_rps"], 3)
            if router["capacity_rps"]
            else None
        )
        # p99 TTFT at the highest rate both served (the same bracket: the same rates).
        both = {p["rate"] for p in result["points"] if p["served"]} & {
            p["rate"] for p in router["points"] if p["served"]
        }
        if both:
            rate = max(both)
            ours, theirs = _p99_at(result, rate), _p99_at(router, rate)
            result["p99_ttft_vs_router"] = {
                "rate": rate,
                "ratio": round(ours / theirs, 3) if ours and theirs else None,
            }
    return point


def summary_line(index: int, point: dict[str, Any]) -> str:
    scale = calibration.Scale(**point["scale"])
    parts = [f"[{index}] {scale.label()}"]
    for name in (ROUTER, *GATEWAYS):
        result = point[name]
        part = f"{name.removeprefix('pd-2p1d-')} {result['per_instance_rps']:.2f}/instance"
        if "vs_router" in result:
            p99 = result.get("p99_ttft_vs_router", {}).get("ratio")
            part += f" (x{result['vs_router']}, p99 TTFT x{p99}, {result['two_hop']} two-hop)"
        parts.append(part)
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
    if args.out and not args.model:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
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
