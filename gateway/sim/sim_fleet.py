"""Start a fleet of simulated vLLM instances, in-process or from the command line (loopback)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import signal
import sys
from collections.abc import Sequence

from .sim_engine import KV_EVENTS_ENCODINGS, SCHEDULING_POLICIES
from .sim_vllm import SimConfig, SimInstance

__all__ = ["main", "start_fleet", "stop_fleet"]


def _require_loopback(host: str) -> None:
    # The simulators are a test fixture: they must never be reachable from another machine.
    if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"refusing to listen on non-loopback host {host!r}")


async def start_fleet(
    configs: Sequence[SimConfig],
    host: str = "127.0.0.1",
    ports: Sequence[int] | None = None,
) -> list[SimInstance]:
    """Start one instance per config (port 0 or no ports: free ports); all or none start."""
    _require_loopback(host)
    if ports is not None and len(ports) != len(configs):
        raise ValueError(f"{len(configs)} configs but {len(ports)} ports")
    instances: list[SimInstance] = []
    try:
        for index, config in enumerate(configs):
            instance = SimInstance(config)
            await instance.start(host, ports[index] if ports is not None else 0)
            instances.append(instance)
    except BaseException:
        await stop_fleet(instances)
        raise
    return instances


async def stop_fleet(instances: Sequence[SimInstance]) -> None:
    """Stop all instances (concurrently)."""
    await asyncio.gather(*(instance.stop() for instance in instances))


def _parse_speeds(text: str) -> list[float]:
    try:
        speeds = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad speed list {text!r}") from exc
    if not speeds or any(speed <= 0 for speed in speeds):
        raise argparse.ArgumentTypeError("speeds must be positive numbers, e.g. 1,1,0.4")
    return speeds


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each flag's help, unless the help gives its own."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        return text if "(default" in text else super()._get_help_string(action)


def _build_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run simulated vLLM instances on 127.0.0.1 until Ctrl-C.",
        formatter_class=_Help,
    )
    parser.add_argument(
        "--speeds",
        type=_parse_speeds,
        default="1",  # a string default goes through type=, and --help shows it as typed
        help="comma-separated relative speeds, one instance each",
    )
    parser.add_argument(
        "--base-port", type=int, default=8000, help="first port; instance i gets base+i (0: any)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="loopback address to bind")
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        default=SimConfig.max_num_seqs,
        help="sequences each instance runs at once (vLLM's --max-num-seqs)",
    )
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="requests each instance queues before answering 503 (default: unbounded)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=SimConfig.max_num_batched_tokens,
        help="token budget per engine step, decodes and prefill chunks (vLLM's flag)",
    )
    parser.add_argument(
        "--scheduling-policy",
        choices=SCHEDULING_POLICIES,
        default=SimConfig.scheduling_policy,
        help="the order waiting requests start in (vLLM's flag): arrival, or the request's "
        "`priority` (lower first) then arrival",
    )
    parser.add_argument("--model", default=SimConfig.model, help="model name the instances serve")
    parser.add_argument("--api-key", default=None, help="key the instances require (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="instance i gets seed+i")
    parser.add_argument(
        "--instant", action="store_true", help="answer at once, no timing model (default: off)"
    )
    parser.add_argument(
        "--decode-slowdown",
        type=float,
        default=SimConfig.decode_slowdown_per_seq,
        help="fraction a decode step slows per extra running sequence (0: evenly paced tokens)",
    )
    parser.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=SimConfig.prefill_tokens_per_s,
        help="prompt tokens a card of speed 1 prefills per second",
    )
    parser.add_argument(
        "--decode-s-per-token",
        type=float,
        default=SimConfig.decode_s_per_token,
        help="seconds of a decode step with one running sequence, at speed 1",
    )
    parser.add_argument(
        "--prefix-cache-blocks",
        type=int,
        default=0,
        help="model vLLM's automatic prefix cache with this many KV blocks per instance (0: off)",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=SimConfig.block_size,
        help="tokens per KV block (vLLM's default)",
    )
    parser.add_argument(
        "--answer-tokens-median",
        type=int,
        default=SimConfig.answer_tokens_median,
        help="median length of an answer that ends on its own (requests with ignore_eos run "
        "to max_tokens)",
    )
    parser.add_argument(
        "--kv-transfer",
        action="store_true",
        help="every instance runs vLLM's NixlConnector as kv_both: prefill/decode "
        "disaggregation through kv_transfer_params (default: off)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=SimConfig.kv_bytes_per_token,
        help="KV cache bytes per token, for the transfer time (OPT-13B fp16)",
    )
    parser.add_argument(
        "--kv-link-bytes-per-s",
        type=float,
        default=SimConfig.kv_link_bytes_per_s,
        help="bytes/s a decode instance reads KV blocks at (PCIe 4.0 x16)",
    )
    parser.add_argument(
        "--kv-hold-timeout",
        type=float,
        default=SimConfig.kv_hold_timeout_s,
        help="seconds a prefill instance holds unread KV blocks (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=0,
        help="publish vLLM's KV cache events (--kv-events-config, ZMQ): instance i on port "
        "P+2i, its replay on P+2i+1, topic kv-events; needs --prefix-cache-blocks (0: off)",
    )
    parser.add_argument(
        "--kv-events-encoding",
        choices=KV_EVENTS_ENCODINGS,
        default=SimConfig.kv_events_encoding,
        help="the events' msgpack form: current vLLM's maps, or older vLLM's arrays",
    )
    parser.add_argument(
        "--kv-events-drop-every",
        type=int,
        default=SimConfig.kv_events_drop_every,
        help="lose every Nth event batch on the wire (still replayable), for tests (0: none)",
    )
    parser.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage says the prompt tokens found in the prefix cache (vLLM's flag)",
    )
    return parser


def kv_endpoints(port: int, index: int) -> tuple[str | None, str | None]:
    """The KV event and replay endpoints of instance `index` of a fleet publishing from
    `port` (0: none); `*` binds the fleet's host."""
    if port == 0:
        return None, None
    return f"tcp://*:{port + 2 * index}", f"tcp://*:{port + 2 * index + 1}"


async def _run(args: argparse.Namespace) -> None:
    kv_events = [kv_endpoints(args.kv_events_port, i) for i in range(len(args.speeds))]
    configs = [
        SimConfig(
            model=args.model,
            speed=speed,
            max_num_seqs=args.max_num_seqs,
            max_waiting=args.max_waiting,
            max_num_batched_tokens=args.max_num_batched_tokens,
            scheduling_policy=args.scheduling_policy,
            api_key=args.api_key,
            instant=args.instant,
            decode_slowdown_per_seq=args.decode_slowdown,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_s_per_token=args.decode_s_per_token,
            seed=args.seed + index,
            prefix_cache_blocks=args.prefix_cache_blocks,
            block_size=args.block_size,
            kv_transfer=args.kv_transfer,
            kv_bytes_per_token=args.kv_bytes_per_token,
            kv_link_bytes_per_s=args.kv_link_bytes_per_s,
            kv_hold_timeout_s=args.kv_hold_timeout,
            answer_tokens_median=args.answer_tokens_median,
            # vLLM's limit for a request that names none: the rest of the context.
            default_max_tokens=None,
            kv_events_encoding=args.kv_events_encoding,
            kv_events_drop_every=args.kv_events_drop_every,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            kv_events_endpoint=events,
            kv_events_replay_endpoint=replay,
        )
        for index, (speed, (events, replay)) in enumerate(zip(args.speeds, kv_events, strict=True))
    ]
    ports = None if args.base_port == 0 else [args.base_port + i for i in range(len(configs))]
    instances = await start_fleet(configs, host=args.host, ports=ports)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signum, stop.set)
    try:
        for instance in instances:
            print(instance.url, flush=True)
        await stop.wait()
    finally:
        await stop_fleet(instances)


def main(argv: Sequence[str] | None = None, prog: str = "python -m gateway.sim.sim_fleet") -> int:
    """CLI entry point; returns the process exit status."""
    args = _build_parser(prog).parse_args(argv)
    try:
        _require_loopback(args.host)
        asyncio.run(_run(args))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
