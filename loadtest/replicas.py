"""`python -m loadtest.replicas`: several gateway replicas, sharing a view through Redis or not.

The scale-out issue's benchmark. One seeded workload (the seed's slow-card fleet: speeds
1, 1, 1, 0.4; half 200-token, half 6,000-token prompts; 32 output tokens; Poisson at 75%
of capacity) goes, side by side in one run, through

    1 replica                     the baseline
    N replicas, shared            each with `[shared] redis_url` on one real Redis
    N replicas, rounds only       the same with `push_interval = 0`: what the pushes add
    N replicas, not shared        what running several copies did before

for each strategy. The clients spread requests over the replicas round robin, as an L4
balancer would. Every setup gets a fresh fleet, fresh gateways (all pinned to the
gateway core, so N replicas get no more CPU than one) and a fresh Redis. The targets:
shared p99 TTFT at most 1.15x one replica's, output tokens/s at least 0.97x.

A third part measures what sharing costs: the gateway CPU per streamed request (closed
loop, 32 at once, instant instances) of one process with `[shared]` (publishing and
reading, with a second idle process in the view) against the same without, alternating
the arms so drift hits both (target: at most 5% more). `--only cost` runs it alone.

A second part runs the shared-prefix workload (32 groups of 4,000-token prefixes, the
simulator's prefix cache on, `least_time`) through 1 and N shared replicas and compares
the fleet's prefix-cache hit rate (target: N replicas at least 0.95x one's).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from gateway.sim.sim_engine import SimConfig
from loadtest import harness, plots, report
from loadtest.compare import capacity
from loadtest.helpfmt import HelpFormatter
from loadtest.loadgen import make_workload
from loadtest.replicas_setup import ReplicaOptions, cost_part, one_setup
from loadtest.scenarios import Common, pin_self, plot_path, say, write_json
from loadtest.workloads import PrefixMix, make_prefix_workload


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


async def replicas(opts: ReplicaOptions, common: Common) -> dict[str, Any]:
    pin_self(common)
    cap = capacity(opts.speeds, opts.mix, SimConfig(max_num_seqs=opts.max_num_seqs))
    rate = opts.load * cap
    count = max(1, round(rate * opts.duration))
    specs = make_workload(count, opts.mix, common.seed, rate=rate, clients=16)
    if opts.strategies:
        say(
            f"capacity {cap:.1f} req/s; open loop at {opts.load:.0%}: "
            f"{rate:.1f} req/s, {count} requests"
        )
    n = opts.replicas
    slow_card: dict[str, dict[str, Any]] = {}
    for strategy in opts.strategies:
        runs: dict[str, report.Summary] = {}
        setups = [
            ("1 replica", 1, False, True),
            (f"{n} replicas shared", n, True, True),
            (f"{n} replicas shared, rounds only", n, True, False),
            (f"{n} replicas not shared", n, False, True),
        ]
        if opts.baseline_twice:
            setups.append(("1 replica, again", 1, False, True))
        for label, replicas_, shared, push in setups:
            name = f"{strategy}: {label}"
            runs[label], _ = await one_setup(
                name,
                specs,
                strategy=strategy,
                replicas=replicas_,
                shared=shared,
                opts=opts,
                common=common,
                push=push,
            )
        one, many = runs["1 replica"], runs[f"{n} replicas shared"]
        slow_card[strategy] = {
            "runs": runs,
            "p99_ttft_shared_over_one": _ratio(many["ttft_s"]["p99"], one["ttft_s"]["p99"]),
            "tok_s_shared_over_one": _ratio(
                many["output_tokens_per_s"], one["output_tokens_per_s"]
            ),
            "p99_ttft_unshared_over_one": _ratio(
                runs[f"{n} replicas not shared"]["ttft_s"]["p99"], one["ttft_s"]["p99"]
            ),
            "p99_ttft_rounds_only_over_one": _ratio(
                runs[f"{n} replicas shared, rounds only"]["ttft_s"]["p99"], one["ttft_s"]["p99"]
            ),
            "tok_s_rounds_only_over_one": _ratio(
                runs[f"{n} replicas shared, rounds only"]["output_tokens_per_s"],
                one["output_tokens_per_s"],
            ),
            "p99_ttft_again_over_one": _ratio(
                runs["1 replica, again"]["ttft_s"]["p99"], one["ttft_s"]["p99"]
            )
            if "1 replica, again" in runs
            else None,
            "tok_s_unshared_over_one": _ratio(
                runs[f"{n} replicas not shared"]["output_tokens_per_s"], one["output_tokens_per_s"]
            ),
        }
    body: dict[str, Any] = {
        "options": asdict(opts),
        "capacity_req_per_s": cap,
        "slow_card": slow_card,
    }
    if opts.prefix:
        body["prefix"] = await _prefix_part(opts, common)
    if opts.cost_requests:
        body["cost"] = await cost_part(opts, common)
    # The cost part alone (`--only cost`) writes a file of its own, keeping the full run's.
    name = "replicas" if opts.strategies or opts.prefix else "replicas-cost"
    say(f"wrote {write_json(common, name, body)}")
    _print(body, n)
    if body["slow_card"] and plot_path(common, "replicas.png"):
        _plot(body, n, common.out / "replicas.png")
    return body


async def _prefix_part(opts: ReplicaOptions, common: Common) -> dict[str, Any]:
    mix = PrefixMix(groups=32, prefix_tokens=4000, suffix_tokens=200)
    equal = tuple(1.0 for _ in opts.speeds)
    sim = SimConfig(max_num_seqs=opts.max_num_seqs)
    # Each cache holds half of the 32 groups' prefixes (16 x 4,000 tokens, 16-token blocks).
    blocks = 16 * 4000 // 16
    per_request = (mix.mean_prompt_tokens() - mix.prefix_tokens) / sim.prefill_tokens_per_s
    per_request += mix.mean_max_tokens() * sim.decode_s_per_token * 1.3 / sim.max_num_seqs
    rate = 0.5 * len(equal) / per_request
    count = max(1, round(rate * opts.prefix_duration))
    specs = make_prefix_workload(count, mix, common.seed, rate=rate)
    say(f"shared-prefix part: {rate:.1f} req/s, {count} requests")
    prefix_opts = ReplicaOptions(speeds=equal, max_num_seqs=opts.max_num_seqs)
    out: dict[str, Any] = {}
    for label, replicas_ in (("1 replica", 1), (f"{opts.replicas} replicas shared", opts.replicas)):
        summary, hits = await one_setup(
            f"least_time prefix: {label}",
            specs,
            strategy="least_time",
            replicas=replicas_,
            shared=replicas_ > 1,
            opts=prefix_opts,
            common=common,
            prefix_cache_blocks=blocks,
        )
        out[label] = {"summary": summary, "hit_rate": hits}
    one, many = out["1 replica"], out[f"{opts.replicas} replicas shared"]
    out["hit_rate_shared_over_one"] = _ratio(many["hit_rate"]["fleet"], one["hit_rate"]["fleet"])
    out["p99_ttft_shared_over_one"] = _ratio(
        many["summary"]["ttft_s"]["p99"], one["summary"]["ttft_s"]["p99"]
    )
    return out


def _x(ratio: float | None, digits: int = 2) -> str:
    # None: a side had no value, e.g. no p99 from fewer than 100 samples
    return "n/a" if ratio is None else f"{ratio:.{digits}f}x"


def _print(body: dict[str, Any], n: int) -> None:
    for strategy, part in body["slow_card"].items():
        say(f"\n== slow-card fleet, {strategy} ==")
        say(report.seed_table(list(part["runs"].values())))
        for label, run in part["runs"].items():
            cpu = run.get("gateway_cpu")
            if cpu:
                say(
                    f"  {label}: gateway CPU {cpu['cpu_s']:.2f} s in {cpu['wall_s']:.1f} s "
                    f"({cpu['core_share']:.1%} of the gateway core)"
                )
        say(
            f"{n} shared / 1: p99 TTFT {_x(part['p99_ttft_shared_over_one'])} (target <= 1.15), "
            f"tok/s {_x(part['tok_s_shared_over_one'])} (target >= 0.97); "
            f"rounds only: {_x(part['p99_ttft_rounds_only_over_one'])}, "
            f"{_x(part['tok_s_rounds_only_over_one'])}; "
            f"not shared: {_x(part['p99_ttft_unshared_over_one'])}, "
            f"{_x(part['tok_s_unshared_over_one'])}"
            + (
                f"; 1 replica again: p99 TTFT {_x(part['p99_ttft_again_over_one'])}"
                if part.get("p99_ttft_again_over_one")
                else ""
            )
        )
    cost = body.get("cost")
    if cost:
        per = cost["cpu_ms_per_request"]
        say(
            f"\n== cost of the shared view ==\ngateway CPU per streamed request: "
            f"{per['local']:.3f} ms local, {per['shared']:.3f} ms shared: "
            f"{cost['shared_over_local']:.3f}x (target <= 1.05)"
        )
    prefix = body.get("prefix")
    if prefix:
        say("\n== shared-prefix workload, least_time ==")
        say(
            report.seed_table(
                [p["summary"] for k, p in prefix.items() if isinstance(p, dict) and "summary" in p]
            )
        )
        say(
            f"fleet hit rate {n} shared / 1: {_x(prefix['hit_rate_shared_over_one'], 3)} "
            f"(target >= 0.95); p99 TTFT {_x(prefix['p99_ttft_shared_over_one'])} (target <= 1.15)"
        )


def _plot(body: dict[str, Any], n: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    strategies = list(body["slow_card"])
    labels = list(body["slow_card"][strategies[0]]["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        runs = [body["slow_card"][s]["runs"][label] for s in strategies]
        p99 = [plots.value_or_nan(r["ttft_s"], "p99", 1000) for r in runs]
        tok = [r["output_tokens_per_s"] for r in runs]
        xs = [x + i * width for x in range(len(strategies))]
        axes[0].bar(xs, p99, width, label=label)
        axes[1].bar(xs, tok, width, label=label)
        for x, r in zip(xs, runs, strict=True):  # each bar's sample count; n/a with too few
            count = plots.n_of(r["ttft_s"])  # not `n`: that is the replicas, in the title
            text = f"n/a\n(n={count}<100)" if report.too_few(r["ttft_s"], "p99") else f"n={count}"
            axes[0].annotate(
                text,
                (x, 0),
                xycoords=("data", "axes fraction"),
                xytext=(0, 3),
                textcoords="offset points",
                ha="center",
                fontsize=6,
            )
    for ax, title in zip(axes, ("p99 TTFT, ms", "output tokens/s"), strict=True):
        ax.set_xticks(
            [x + width * (len(labels) - 1) / 2 for x in range(len(strategies))], strategies
        )
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"slow-card fleet, 75% of capacity: 1 vs {n} replicas (same CPU core)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m loadtest.replicas",
        description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter,
    )
    p.add_argument("--replicas", type=int, default=4, help="replicas in the shared setups")
    p.add_argument("--strategies", default="least_busy,least_time", help="strategies to run")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per setup")
    p.add_argument("--load", type=float, default=0.75, help="share of capacity")
    p.add_argument("--no-prefix", action="store_true", help="skip the shared-prefix part")
    p.add_argument(
        "--cost-requests",
        type=int,
        default=2000,
        help="streamed requests per arm and round of the cost part; 0 skips it",
    )
    p.add_argument(
        "--cost-rounds",
        type=int,
        default=3,
        help="rounds of the cost part (each runs both arms, alternating)",
    )
    p.add_argument(
        "--only",
        choices=("cost",),
        help="run this part alone (cost: a few minutes; writes replicas-cost.json)",
    )
    p.add_argument(
        "--baseline-twice",
        action="store_true",
        help="run the one-replica setup a second time, as the run's noise floor",
    )
    p.add_argument("--seed", type=int, default=1, help="workload and simulator seed")
    p.add_argument("--out", type=Path, default="loadtest/results", help="report folder")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes with taskset")
    p.add_argument(
        "--gateway-ref",
        help="run the gateway as committed at this git ref (default: the working tree)",
    )
    return p


def options(args: argparse.Namespace) -> ReplicaOptions:
    """The run the command line asks for (`--only cost`: the cost part and nothing else)."""
    only_cost = args.only == "cost"
    return ReplicaOptions(
        strategies=() if only_cost else tuple(s for s in args.strategies.split(",") if s),
        replicas=args.replicas,
        load=args.load,
        duration=args.duration,
        prefix=not (args.no_prefix or only_cost),
        prefix_duration=args.duration,
        cost_requests=args.cost_requests,
        cost_rounds=args.cost_rounds,
        baseline_twice=args.baseline_twice,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    opts = options(args)
    ref = harness.pin_ref(args.gateway_ref)
    with harness.exported_gateway(ref) as folder:
        common = Common(
            seed=args.seed,
            out=args.out,
            pin=not args.no_pin,
            gateway_ref=ref,
            gateway_dir=folder,
        )
        common.out.mkdir(parents=True, exist_ok=True)
        asyncio.run(replicas(opts, common))
    return 0


if __name__ == "__main__":
    sys.exit(main())
