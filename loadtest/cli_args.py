"""The flags of `python -m loadtest`: one subparser per scenario, with the argument groups
several share (common, workload mix, shared-prefix workloads) and the comma-list types."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest import kv_bench, prefix_bench
from loadtest.helpfmt import HelpFormatter
from loadtest.lanes import bench as lanes_bench
from loadtest.loadgen import SEED_MIX
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


def _retries(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--retries",
        type=int,
        default=0,
        metavar="N",
        help="send a refused or failed request again up to N times, as the OpenAI SDK does"
        " (its default: 2), timed from its first attempt (default: 0, a refusal is lost)",
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


def _kv(p: argparse.ArgumentParser) -> None:
    defaults = kv_bench.KvOptions()
    p.add_argument(
        "--cases",
        type=_names,
        default=kv_bench.CASES,
        help=f"any of {','.join(kv_bench.CASES)} (default: all, in that order)",
    )
    p.add_argument(
        "--arms",
        type=_names,
        default=",".join(kv_bench.ARMS),
        help="comma-separated; `@qN` sets an arm's max_queue_per_instance (exact@q0)",
    )
    p.add_argument(
        "--duration", type=float, default=defaults.duration, help="seconds of arrivals per arm"
    )
    p.add_argument("--load", type=float, default=defaults.load, help="share of warm capacity")
    p.add_argument(
        "--cache-blocks", type=int, default=defaults.cache_blocks, help="per instance, 16 tokens"
    )
    p.add_argument(
        "--evict-cache-blocks",
        type=int,
        default=defaults.evict_cache_blocks,
        help="evict: per instance (a 4,000-token prefix is 250 blocks)",
    )
    p.add_argument(
        "--bypass-share",
        type=float,
        default=defaults.bypass_share,
        help="bypass: share of the requests sent straight to a random instance",
    )
    p.add_argument("--replicas", type=int, default=defaults.replicas, help="replicas: fronts")
    p.add_argument(
        "--restart-retries",
        type=int,
        default=defaults.restart_retries,
        help="restart: the client's retries, as the OpenAI SDK's max_retries",
    )
    p.add_argument(
        "--no-aa", action="store_true", help="uniform: run approx once (noise floor: --noise)"
    )
    p.add_argument(
        "--noise", type=float, default=defaults.noise, help="uniform: the least noise floor"
    )
    p.add_argument(
        "--cost-load", type=float, default=defaults.cost_load, help="cost: share of warm capacity"
    )
    p.add_argument(
        "--cost-duration",
        type=float,
        default=defaults.cost_duration,
        help="cost: seconds of arrivals per arm and round",
    )
    p.add_argument(
        "--cost-rounds", type=int, default=defaults.cost_rounds, help="cost: rounds per arm"
    )
    _common(p)


def build_parser(description: str | None) -> argparse.ArgumentParser:
    """`python -m loadtest`'s parser; `description` heads its --help."""
    parser = argparse.ArgumentParser(
        prog="python -m loadtest", description=description, formatter_class=HelpFormatter
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
    _retries(p)
    _common(p)

    p = sub.add_parser(
        "lanes", help="issue 10's mix: short prompts kept out of long prefills", **fmt
    )
    defaults = lanes_bench.LanesOptions()
    p.add_argument(
        "--setups",
        type=_names,
        default=defaults.setups,
        help="strategy[:flag+flag][@ref][#N] or a baseline, comma-separated (flags, refs and"
        " repeats: loadtest/lanes/bench.py)",
    )
    p.add_argument("--speeds", type=_floats, default=defaults.speeds, help=SPEEDS_HELP)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs, help=SEQS_HELP)
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults.max_num_batched_tokens,
        help="tokens each simulated instance batches in one step",
    )
    p.add_argument("--loads", type=_floats, default=defaults.loads, help="shares of capacity")
    p.add_argument(
        "--capacity",
        choices=("measured", "estimate"),
        default=defaults.capacity,
        help="what the loads are shares of: compare's estimate, or measured with every card"
        " kept full straight to it (about 40 s more)",
    )
    p.add_argument("--duration", type=float, default=defaults.duration, help="seconds per load")
    p.add_argument("--name", default=defaults.name, help="report file name")
    g = p.add_argument_group("workload mix (default: the issue's)")
    g.add_argument("--long-share", type=float, default=SEED_MIX.long_share, help="share above 4096")
    g.add_argument(
        "--short-tokens",
        type=_range,
        default=SEED_MIX.short_tokens,
        metavar="LO-HI",
        help="short prompts",
    )
    g.add_argument(
        "--long-tokens",
        type=_range,
        default=SEED_MIX.long_tokens,
        metavar="LO-HI",
        help="long prompts",
    )
    g.add_argument(
        "--max-tokens",
        type=_range,
        default=SEED_MIX.max_tokens,
        metavar="LO-HI",
        help="output tokens",
    )
    _retries(p)
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

    _kv(sub.add_parser("kv", help="the exact prefix index (KV events) vs the inferred one", **fmt))

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

    p = sub.add_parser(
        "priority",
        help="an interactive and a batch key at 2x capacity, with and without classes",
        **fmt,
    )
    p.add_argument("--speeds", type=_floats, default=(1.0, 1.0, 1.0, 1.0), help=SPEEDS_HELP)
    p.add_argument("--max-num-seqs", type=int, default=8, help=SEQS_HELP)
    p.add_argument(
        "--decode-s-per-token", type=float, default=0.02, help="the instances' decode step, s"
    )
    p.add_argument("--load", type=float, default=2.0, help="x capacity, both keys together")
    p.add_argument("--chat-share", type=float, default=0.25, help="the interactive key's share")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per arm")
    p.add_argument(
        "--capacity", type=float, help="req/s of the fleet (default: measured, ~25 s more)"
    )
    p.add_argument("--short-tokens", type=_range, default="100-400", metavar="LO-HI")
    p.add_argument("--max-tokens", type=_range, default="32-64", metavar="LO-HI")
    _common(p)

    p = sub.add_parser(
        "fairness",
        help="keys competing for a saturated fleet: a flood beside a calm key, shares, 50 keys",
        **fmt,
    )
    p.add_argument("--speeds", type=_floats, default=(1.0, 1.0), help=SPEEDS_HELP)
    p.add_argument("--max-num-seqs", type=int, default=4, help=SEQS_HELP)
    p.add_argument(
        "--decode-s-per-token", type=float, default=0.02, help="the instances' decode step, s"
    )
    p.add_argument("--flood-streams", type=int, default=48, help="the flood key's, kept going")
    p.add_argument("--calm-interval", type=float, default=0.3, help="s between calm requests")
    p.add_argument("--share-streams", type=int, default=16, help="per key, in the shares part")
    p.add_argument("--many-keys", type=int, default=50, help="keys in the many-keys part")
    p.add_argument("--many-load", type=float, default=1.5, help="x capacity, all keys together")
    p.add_argument("--warmup", type=float, default=5.0, help="s before each window")
    p.add_argument("--duration", type=float, default=30.0, help="s each window measures")
    p.add_argument(
        "--fronts",
        type=lambda v: tuple(v.split(",")),
        default=("ours", "ours (one key)", "vllm-router-rr", "vllm-router"),
        help="comma-separated",
    )
    p.add_argument(
        "--parts",
        type=lambda v: tuple(v.split(",")),
        default=("neighbour", "shares", "many"),
        help="comma-separated",
    )
    p.add_argument("--short-tokens", type=_range, default="100-400", metavar="LO-HI")
    p.add_argument("--max-tokens", type=_range, default="32-64", metavar="LO-HI")
    _common(p)

    p = sub.add_parser(
        "tenants", help="named keys' limits over replicas with and without Redis; their cost", **fmt
    )
    p.add_argument("--replicas", type=int, default=4, help="gateway processes")
    p.add_argument("--window", type=float, default=120.0, help="seconds each key is driven")
    p.add_argument("--overdrive", type=float, default=3.0, help="times each key's limit")
    p.add_argument("--cost-requests", type=int, default=2000, help="per arm and round; 0 skips")
    p.add_argument("--cost-rounds", type=int, default=3, help="alternating rounds of the arms")
    _common(p)
    return parser
