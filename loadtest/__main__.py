"""`python -m loadtest <scenario> ...`: run, sweep, compare, lanes, prefix, kv, overload,
overhead, tenants, priority, fairness (see loadtest/README.md)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import replace
from typing import Any

from loadtest import (
    cli_args,
    compare,
    fairness,
    harness,
    kv_bench,
    overhead,
    overload_bench,
    prefix_bench,
    priority,
    scenarios,
    tenants,
)
from loadtest.lanes import bench as lanes_bench
from loadtest.loadgen import Mix
from loadtest.workloads import ConversationMix, PrefixMix


def _common_of(args: argparse.Namespace) -> scenarios.Common:
    return scenarios.Common(
        seed=args.seed,
        ttft_slo=args.ttft_slo,
        tpot_slo=args.tpot_slo,
        out=args.out,
        pin=not args.no_pin,
        limit=args.limit,
        gateway_ref=getattr(args, "gateway_ref", None),
        retries=getattr(args, "retries", 0),
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
                capacity=args.capacity,
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
        "kv": lambda: kv_bench.kv(
            kv_bench.KvOptions(
                cases=args.cases,
                arms=args.arms,
                duration=args.duration,
                load=args.load,
                cache_blocks=args.cache_blocks,
                evict_cache_blocks=args.evict_cache_blocks,
                bypass_share=args.bypass_share,
                replicas=args.replicas,
                restart_retries=args.restart_retries,
                aa=not args.no_aa,
                noise=args.noise,
                cost_load=args.cost_load,
                cost_duration=args.cost_duration,
                cost_rounds=args.cost_rounds,
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
        "priority": lambda: priority.priority(
            priority.PriorityOptions(
                speeds=args.speeds,
                max_num_seqs=args.max_num_seqs,
                decode_s_per_token=args.decode_s_per_token,
                load=args.load,
                chat_share=args.chat_share,
                duration=args.duration,
                capacity=args.capacity,
                mix=Mix(long_share=0.0, short_tokens=args.short_tokens, max_tokens=args.max_tokens),
            ),
            common,
        ),
        "fairness": lambda: fairness.fairness(
            fairness.FairnessOptions(
                speeds=args.speeds,
                max_num_seqs=args.max_num_seqs,
                decode_s_per_token=args.decode_s_per_token,
                flood_streams=args.flood_streams,
                calm_interval=args.calm_interval,
                share_streams=args.share_streams,
                many_keys=args.many_keys,
                many_load=args.many_load,
                warmup=args.warmup,
                duration=args.duration,
                fronts=args.fronts,
                parts=args.parts,
                mix=Mix(long_share=0.0, short_tokens=args.short_tokens, max_tokens=args.max_tokens),
            ),
            common,
        ),
        "tenants": lambda: tenants.tenants(
            tenants.TenantsOptions(
                replicas=args.replicas,
                window=args.window,
                overdrive=args.overdrive,
                cost_requests=args.cost_requests,
                cost_rounds=args.cost_rounds,
            ),
            common,
        ),
    }
    return jobs[args.scenario]()


def main(argv: Sequence[str] | None = None) -> int:
    args = cli_args.build_parser(__doc__).parse_args(argv)
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
