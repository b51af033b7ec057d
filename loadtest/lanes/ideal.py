"""The long prompts' TTFT on an ideal fleet: how low a front could bring it (issue 10).

    python -m loadtest.lanes.ideal --seeds 1,2,3,4 --loads 0.75,1 [REPORT.json ...]

For a `lanes` workload (the same requests `lanes` sends at a seed and load), the fleet
is taken at its best: every card busy whenever there is work, every step's decode batch
full (`compare.request_cost`'s price, as the capacity estimate), the short prompts and
every decode served in the gaps between long prefills with no time lost, and each long
prompt sent, oldest first, to the card where its prefill would end soonest, no network
and no step boundary in between. What is left is the queueing the arrivals themselves
build: the long prompts' prefill is 83% of issue 10's mix, and at 100% of capacity the
long prompts queue whenever they come faster than the fleet prefills them.

So the figures are what a front that serves the short prompts first and refuses
nothing, as the recommended setup does, could reach at best: the short prompts' work
(their prefill and every answer's decode) takes its share `f` of each card's time,
evenly, and the long prefills run on what is left. A model, not a proof: a real card
that takes no short prompt (the slow one, under least_time) gives the long ones more
than `1 - f` of its time and another card less, so a sitting can land a little below
it. A front goes well below it only by making the short prompts wait for the long ones
(their work then lands after the burst), or by refusing.

With reports of `lanes` sittings at the same seeds and loads, it also prints each
sitting's bound for the long p99 (half the best baseline's) and where the ideal fleet and
our setups sit against it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import baselines, compare, report
from loadtest.helpfmt import HelpFormatter
from loadtest.lanes import bench, targets
from loadtest.loadgen import Mix, RequestSpec


@dataclass(frozen=True)
class Ideal:
    """The long prompts' TTFTs on the ideal fleet, and the share the rest took."""

    ttfts: list[float]  # sorted
    rest_share: float  # `f`: the cards' time the short prompts and every decode take

    def percentile(self, q: int) -> float:
        """Nearest-rank, as every report's (nan with too few samples for it)."""
        value = report.percentiles(self.ttfts)[f"p{q}"]
        return math.nan if value is None else value


def ideal(specs: Sequence[RequestSpec], speeds: Sequence[float], sim: SimConfig) -> Ideal:
    """The ideal fleet's TTFT for every long request of `specs` (see the module doc)."""
    if not specs:
        return Ideal([], 0.0)
    span = max(s.at for s in specs) or 1.0  # the arrivals' span (one at 0: a second)
    rest = sum(compare.request_cost(0 if s.long else s.tokens, s.max_tokens, sim) for s in specs)
    # Past the fleet's whole time the long prompts would never start: keep 1% for them.
    share = min(0.99, rest / (span * sum(speeds)))
    free = [0.0] * len(speeds)
    ttfts = []
    for spec in sorted((s for s in specs if s.long), key=lambda s: s.at):
        prefill = spec.tokens / sim.prefill_tokens_per_s
        ends = [
            max(free[i], spec.at) + prefill / (speed * (1 - share))
            for i, speed in enumerate(speeds)
        ]
        card = min(range(len(speeds)), key=ends.__getitem__)
        free[card] = ends[card]
        ttfts.append(ends[card] - spec.at)
    return Ideal(sorted(ttfts), share)


def workload_ideal(seed: int, load: float, duration: float, opts: bench.LanesOptions) -> Ideal:
    """The ideal fleet on the requests `lanes` sends at `seed` and `load` (of the estimate)."""
    opts = dataclasses.replace(opts, duration=duration)
    specs = bench.workload(opts, load * bench.estimate(opts), seed)
    return ideal(specs, opts.speeds, SimConfig(max_num_seqs=opts.max_num_seqs))


def sittings(paths: Sequence[Path]) -> list[dict[str, Any]]:
    """Per report and load: its seed, duration, fleet and mix, the bound for the long p99
    (half the best baseline's) and every gateway setup's long p99; loads without a
    baseline or measured on a capacity other than the estimate are left out."""
    out = []
    for path, body in targets.read_reports(paths):
        if body.get("options", {}).get("capacity", "estimate") != "estimate":
            continue
        for load, runs in body["loads"].items():
            theirs = [
                p99
                for run in targets.baselines_of(runs)
                if (p99 := run.get("long_ttft_s", {}).get("p99"))
            ]
            if not theirs:
                continue
            ours = {
                name: run["long_ttft_s"]["p99"]
                for name, run in runs.items()
                if targets.front(name) not in baselines.BASELINES
                and run.get("long_ttft_s", {}).get("p99")
            }
            out.append(
                {
                    "report": path.name,
                    "seed": body["common"]["seed"],
                    "load": float(load),
                    "duration": body["options"]["duration"],
                    "bound": 0.5 * min(theirs),
                    "ours": ours,
                    "opts": _options(body["options"]),
                }
            )
    return out


def _options(saved: dict[str, Any]) -> bench.LanesOptions:
    """The fleet and mix a report's sitting ran (as `lanes` wrote its options)."""
    mix = {k: tuple(v) if isinstance(v, list) else v for k, v in saved["mix"].items()}
    return bench.LanesOptions(
        speeds=tuple(saved["speeds"]), max_num_seqs=saved["max_num_seqs"], mix=Mix(**mix)
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.lanes.ideal", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument(
        "reports",
        nargs="*",
        type=Path,
        default=[],
        help="lanes reports (JSON) to compare (default: none)",
    )
    parser.add_argument("--seeds", default="1,2,3,4", help="the workloads' seeds, comma-separated")
    parser.add_argument("--loads", default="0.75,1", help="shares of the capacity estimate")
    parser.add_argument(
        "--duration",
        type=float,
        default=90.0,
        help="seconds of arrivals per seed and load (a report's sittings keep their own)",
    )
    args = parser.parse_args(argv)
    opts = bench.LanesOptions()
    print("seed  load  rest share  long p50 / p99 TTFT on the ideal fleet, ms")
    for seed in (int(s) for s in args.seeds.split(",")):
        for load in (float(x) for x in args.loads.split(",")):
            fleet = workload_ideal(seed, load, args.duration, opts)
            p50, p99 = fleet.percentile(50), fleet.percentile(99)
            print(
                f"{seed:>4}  {load:>4.0%}  {fleet.rest_share:>10.3f}  "
                f"{p50 * 1e3:>8,.0f} / {p99 * 1e3:,.0f}"
            )
    rows = sittings(args.reports)
    if rows:
        print("\nreport, load: bound (half the best baseline's long p99); ideal; ours, ms")
    for row in rows:
        fleet = workload_ideal(row["seed"], row["load"], row["duration"], row["opts"])
        p99 = fleet.percentile(99)
        ours = ", ".join(
            f"{name} {value * 1e3:,.0f} ({value / p99:.2f}x ideal)"
            for name, value in sorted(row["ours"].items())
        )
        verdict = "above" if p99 > row["bound"] else "below"
        print(
            f"{row['report']} {row['load']:.0%}: bound {row['bound'] * 1e3:,.0f}; "
            f"ideal {p99 * 1e3:,.0f} ({verdict}, {p99 / row['bound']:.2f}x); {ours}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
