"""`python -m loadtest <scenario> ...`: run, sweep, compare, prefix, overload, overhead (see
loadtest/README.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest import (
    compare,
    harness,
    lanes_bench,
    overhead,
    overload_bench,
    prefix_bench,
    scenarios,
)
from loadtest.helpfmt import HelpFormatter
from loadtest.loadgen import SEED_MIX, Mix
from loadtest.workloads import ConversationMix, PrefixMix

SPEEDS_HELP = "simulated instances' relative speeds, one instance each"
SEQS_HELP = "sequences each simulated instance (and the gateway) runs at once"


def _floats(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,1,0.4, got {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in _floats(text))


def _names(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("common")
    g.add_argument("--seed", type=int, default=1, help="workload and simulator seed")
    g.add_argument("--ttft-slo", type=float, default=1.0, help="TTFT objective, s (goodput)")
    g.add_argument("--tpot-slo", type=float, default=0.05, help="TPOT objective, s (goodput)")
    g.add_argument("--out", type=Path, default="loadtest/results", help="report folder")
    g.add_argument("--no-pin", action="store_true", help="do not pin processes with taskset")
    g.add_argument("--limit", type=float, default=300.0, help="seconds any one run may take")
    g.add_argument(
        "--gateway-ref",
        help="run the gateway as committed at this git ref, e.g. HEAD (default: the working tree)",
    )


def _mix(p: argparse.ArgumentParser, long_share: float, max_tokens: str) -> None:
    g = p.add_argument_group("workload mix (tokens, ~4 UTF-8 bytes each)")
    g.add_argument("--long-share", type=float, default=long_share, help="share above 4096")
    g.add_argument(
        "--short-tokens", type=_range, default="200-1000", metavar="LO-HI", help="short prompts"
    )
    g.add_argument(
        "--long-tokens", type=_range, default="5000-8000", metavar="LO-HI", help="long prompts"
    )
    g.add_argument(
        "--max-tokens", type=_range, default=max_tokens, metavar="LO-HI", help="output tokens"
    )


def _shared(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "shared-prefix workloads (instead of the mix; see loadtest/workloads.py)"
    )
    g.add_argument(
        "--prefix-groups",
        type=int,
        default=0,
        metavar="G",
        help="G groups sharing a fixed prefix, one picked per request (default: 0, off)",
    )
    g.add_argument(
        "--prefix-tokens",
        type=int,
        default=PrefixMix.prefix_tokens,
        metavar="P",
        help=f"tokens of each group's prefix (default: {PrefixMix.prefix_tokens})",
    )
    g.add_argument(
        "--suffix-tokens",
        type=int,
        default=PrefixMix.suffix_tokens,
        metavar="S",
        help=f"unique tokens after the prefix (default: {PrefixMix.suffix_tokens})",
    )
    g.add_argument(
        "--zipf",
        type=float,
        default=PrefixMix.zipf,
        metavar="s",
        help="group popularity 1/(g+1)**s; 0 picks uniformly (default: 0)",
    )
    g.add_argument(
        "--conversations",
        type=int,
        default=0,
        metavar="C",
        help="C multi-turn conversations re-sending their history (default: 0, off);"
        " --requests is then ignored",
    )
    g.add_argument(
        "--turns",
        type=int,
        default=ConversationMix.turns,
        metavar="T",
        help=f"turns per conversation (default: {ConversationMix.turns})",
    )
    g.add_argument(
        "--turn-tokens",
        type=_range,
        default="-".join(map(str, ConversationMix.user_tokens)),
        metavar="LO-HI",
        help="tokens of each new user message",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest", description=__doc__, formatter_class=HelpFormatter
    )
    sub = parser.add_subparsers(dest="scenario", required=True)
    fmt = {"formatter_class": HelpFormatter}

    p = sub.add_parser("run", help="one load against any OpenAI-compatible base URL", **fmt)
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8080/v1")
    p.add_argument("--key", required=True, help="API key sent as a Bearer token")
    p.add_argument("--model", default="sim-model", help="model named in every request")
    p.add_argument("--requests", type=int, default=100, help="requests in the run")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="closed loop: requests in flight (the mode unless --rate is given)",
    )
    mode.add_argument(
        "--rate",
        type=float,
        help="open loop: Poisson arrivals per second (default: off, closed loop)",
    )
    _mix(p, 0.2, "32-128")
    _shared(p)
    _common(p)

    p = sub.add_parser(
        "sweep", help="TTFT and TPOT against concurrency, through the gateway", **fmt
    )
    p.add_argument("--speeds", type=_floats, default="1,1,1,0.4", help=SPEEDS_HELP)
    p.add_argument("--levels", type=_ints, default="1,2,4,8,16", help="concurrency levels")
    p.add_argument(
        "--requests-per-client", type=int, default=16, help="requests per level and client"
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help=SEQS_HELP)
    p.add_argument("--strategy", default="least_busy", help="the gateway's dispatch strategy")
    _mix(p, 0.0, "64")
    _common(p)

    p = sub.add_parser("compare", help="strategies and no gateway on a one-slow-card fleet", **fmt)
    p.add_argument(
        "--strategies", type=_names, default="round_robin,least_busy", help="strategies to run"
    )
    p.add_argument("--speeds", type=_floats, default="1,1,1,0.4", help=SPEEDS_HELP)
    p.add_argument("--max-num-seqs", type=int, default=16, help=SEQS_HELP)
    p.add_argument("--load", type=float, default=0.75, help="open loop: share of capacity")
    p.add_argument("--duration", type=float, default=40.0, help="open loop: seconds")
    p.add_argument("--concurrency", type=int, default=16, help="closed loop (0: skip)")
    p.add_argument("--closed-requests", type=int, default=160, help="closed loop: requests")
    p.add_argument(
        "--closed-long-share", type=float, default=1.0, help="closed loop: share above 4096"
    )
    p.add_argument("--clients", type=int, default=16, help="pinned clients in the baseline")
    p.add_argument("--no-independent", action="store_true", help="skip the no-gateway baseline")
    p.add_argument("--ladder", type=_floats, help="extra loads, e.g. 0.5,0.75,1 (default: none)")
    p.add_argument("--ladder-duration", type=float, default=20.0, help="seconds per ladder load")
    _mix(p, 0.2, "32-128")
    _common(p)

    p = sub.add_parser(
        "lanes", help="issue 10's mix: short prompts kept out of long prefills", **fmt
    )
    defaults = lanes_bench.LanesOptions()
    p.add_argument("--setups", type=_names, default=defaults.setups, help="strategy[:shared],...")
    p.add_argument("--speeds", type=_floats, default=defaults.speeds)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--loads", type=_floats, default=defaults.loads, help="shares of capacity")
    p.add_argument("--duration", type=float, default=defaults.duration, help="seconds per load")
    p.add_argument("--name", default=defaults.name, help="report file name")
    g = p.add_argument_group("workload mix (default: the issue's)")
    g.add_argument("--long-share", type=float, default=SEED_MIX.long_share)
    g.add_argument("--short-tokens", type=_range, default=SEED_MIX.short_tokens)
    g.add_argument("--long-tokens", type=_range, default=SEED_MIX.long_tokens)
    g.add_argument("--max-tokens", type=_range, default=SEED_MIX.max_tokens)
    _common(p)

    p = sub.add_parser(
        "prefix", help="prefix-cache affinity vs sticky, nginx and vllm-router", **fmt
    )
    p.add_argument(
        "--scenarios",
        type=_names,
        default=prefix_bench.SCENARIOS,
        help=f"any of {','.join(prefix_bench.SCENARIOS)} (default: all, in that order)",
    )
    p.add_argument(
        "--setups",
        type=_names,
        default=prefix_bench.PrefixOptions.setups,
        help="setups of the uniform and zipf scenarios (a strategy, strategy/no-affinity,"
        " sticky, nginx, vllm-router)",
    )
    p.add_argument("--load", type=float, default=0.5, help="uniform: share of warm capacity")
    p.add_argument("--zipf-load", type=float, default=0.85, help="zipf: share of warm capacity")
    p.add_argument("--duration", type=float, default=40.0, help="open loop: seconds")
    p.add_argument("--concurrency", type=int, default=64, help="saturation: closed loop")
    p.add_argument("--saturation-requests", type=int, default=768)
    talk = prefix_bench.PrefixOptions().conversations
    p.add_argument("--users", type=int, default=talk.users, help="conversations: users")
    p.add_argument("--turns", type=int, default=talk.turns, help="conversations: per conversation")
    p.add_argument(
        "--think", type=float, default=talk.think_s, help="conversations: mean think time, s"
    )
    p.add_argument(
        "--conversation-duration",
        type=float,
        default=prefix_bench.PrefixOptions.conversation_duration,
        help="conversations: seconds the users send requests",
    )
    p.add_argument("--cache-blocks", type=int, default=4000, help="per instance, 16 tokens each")
    p.add_argument(
        "--conversation-cache-blocks",
        type=int,
        default=prefix_bench.PrefixOptions.conversation_cache_blocks,
        help="conversations: per instance, 16 tokens each",
    )
    _common(p)

    p = sub.add_parser("overload", help="admission control at 1x-10x capacity, on and off", **fmt)
    p.add_argument("--speeds", type=_floats, default=(1.0, 1.0, 1.0, 0.4))
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--loads", type=_floats, default=(1.0, 2.0, 5.0, 10.0), help="x capacity")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals per load")
    p.add_argument("--strategy", default="least_busy")
    p.add_argument("--request-timeout", type=float, default=120.0, help="the gateway's")
    p.add_argument("--max-queue-per-instance", type=int, help="default: the gateway's (32)")
    _mix(p, 0.2, "32-128")
    _common(p)

    p = sub.add_parser("overhead", help="the gateway's added latency, CPU and memory", **fmt)
    p.add_argument("--idle-requests", type=int, default=400, help="per arm, concurrency 1")
    p.add_argument("--requests", type=int, default=3000, help="loaded run")
    p.add_argument("--concurrency", type=int, default=32, help="loaded run")
    p.add_argument("--streams", type=int, default=2000, help="open streams for the memory run")
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy run")
    p.add_argument(
        "--front-requests", type=int, default=3000, help="per front, fleet and concurrency"
    )
    p.add_argument(
        "--no-fronts", action="store_true", help="skip the side-by-side nginx/vllm-router part"
    )
    _common(p)
    return parser


def _common_of(args: argparse.Namespace) -> scenarios.Common:
    return scenarios.Common(
        seed=args.seed,
        ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo,
        out=args.out,
        pin=not args.no_pin,
        limit=args.limit,
        gateway_ref=getattr(args, "gateway_ref", None),
    )


def _mix_of(args: argparse.Namespace, long_share: float | None = None) -> Mix:
    return Mix(
        long_share=args.long_share if long_share is None else long_share,
        short_tokens=args.short_tokens,
        long_tokens=args.long_tokens,
        max_tokens=args.max_tokens,
    )


def _prefix_of(args: argparse.Namespace) -> PrefixMix | None:
    if not args.prefix_groups:
        return None
    return PrefixMix(
        groups=args.prefix_groups,
        prefix_tokens=args.prefix_tokens,
        suffix_tokens=args.suffix_tokens,
        zipf=args.zipf,
        max_tokens=args.max_tokens,
    )


def _conversations_of(args: argparse.Namespace) -> ConversationMix | None:
    if not args.conversations:
        return None
    return ConversationMix(
        conversations=args.conversations,
        turns=args.turns,
        user_tokens=args.turn_tokens,
        max_tokens=args.max_tokens,
    )


def _job(args: argparse.Namespace, common: scenarios.Common) -> Coroutine[Any, Any, Any]:
    jobs: dict[str, Callable[[], Coroutine[Any, Any, Any]]] = {
        "run": lambda: scenarios.run_once(
            scenarios.RunOptions(
                base_url=args.base_url,
                key=args.key,
                model=args.model,
                requests=args.requests,
                concurrency=None if args.rate else args.concurrency,
                rate=args.rate,
                mix=_mix_of(args),
                prefix=_prefix_of(args),
                conversations=_conversations_of(args),
            ),
            common,
        ),
        "sweep": lambda: scenarios.sweep(
            scenarios.SweepOptions(
                speeds=args.speeds,
                levels=args.levels,
                requests_per_client=args.requests_per_client,
                max_num_seqs=args.max_num_seqs,
                strategy=args.strategy,
                mix=_mix_of(args),
            ),
            common,
        ),
        "compare": lambda: compare.compare(
            compare.CompareOptions(
                strategies=args.strategies,
                speeds=args.speeds,
                max_num_seqs=args.max_num_seqs,
                load=args.load,
                duration=args.duration,
                concurrency=args.concurrency,
                closed_requests=args.closed_requests,
                closed_mix=_mix_of(args, args.closed_long_share),
                mix=_mix_of(args),
                independent=not args.no_independent,
                clients=args.clients,
                ladder=args.ladder or (),
                ladder_duration=args.ladder_duration,
            ),
            common,
        ),
        "lanes": lambda: lanes_bench.lanes(
            lanes_bench.LanesOptions(
                setups=args.setups,
                speeds=args.speeds,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                loads=args.loads,
                duration=args.duration,
                mix=_mix_of(args),
                name=args.name,
            ),
            common,
        ),
        "prefix": lambda: prefix_bench.prefix(
            prefix_bench.PrefixOptions(
                scenarios=args.scenarios,
                setups=args.setups,
                load=args.load,
                zipf_load=args.zipf_load,
                duration=args.duration,
                concurrency=args.concurrency,
                saturation_requests=args.saturation_requests,
                conversations=replace(
                    prefix_bench.PrefixOptions().conversations,
                    users=args.users,
                    turns=args.turns,
                    think_s=args.think,
                ),
                conversation_duration=args.conversation_duration,
                cache_blocks=args.cache_blocks,
                conversation_cache_blocks=args.conversation_cache_blocks,
            ),
            common,
        ),
        "overload": lambda: overload_bench.overload(
            overload_bench.OverloadOptions(
                speeds=args.speeds,
                max_num_seqs=args.max_num_seqs,
                loads=args.loads,
                duration=args.duration,
                mix=_mix_of(args),
                strategy=args.strategy,
                request_timeout=args.request_timeout,
                max_queue_per_instance=args.max_queue_per_instance,
            ),
            common,
        ),
        "overhead": lambda: overhead.overhead(
            overhead.OverheadOptions(
                idle_requests=args.idle_requests,
                requests=args.requests,
                concurrency=args.concurrency,
                streams=args.streams,
                profile=not args.no_profile,
                fronts=not args.no_fronts,
                front_requests=args.front_requests,
            ),
            common,
        ),
    }
    return jobs[args.scenario]()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    common = _common_of(args)
    common = replace(common, gateway_ref=harness.pin_ref(common.gateway_ref))
    try:
        with harness.exported_gateway(common.gateway_ref) as folder:
            asyncio.run(_job(args, replace(common, gateway_dir=folder)))
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
