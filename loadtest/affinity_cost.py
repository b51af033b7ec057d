"""What prefix affinity costs the gateway per request: `python -m loadtest.affinity_cost`.

The issue's budget: hashing a 16k-token prompt (64 KiB of text) and scoring 16 instances
must cost well under a millisecond. This measures each step a request pays on the hot
path, with `timeit` (the median of repeats, per call), against full indexes:

- hash: `prompt_blocks(prompt_text(payload))`, as the proxy does for every request;
- score: `least_time` costs over 16 instances (each estimate a binary search of an index);
- least_busy: the same choice under `least_busy` (its affinity term);
- insert: recording the prompt in the chosen instance's index.

It also reports the memory of one full index (tracemalloc). A benchmark, not a test: the
figures depend on the machine and on what else runs there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import timeit
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

from gateway.dispatch import STRATEGIES, InstanceSpec, Lane, Limits, Scheduler, Ticket
from gateway.dispatch.affinity import (
    BLOCK_BYTES,
    DEFAULT_INDEX_BLOCKS,
    PrefixIndex,
    prompt_blocks,
    prompt_text,
)
from loadtest.helpfmt import HelpFormatter

BUDGET_US = 1000.0


def _payload(prompt_bytes: int, seed: int) -> dict[str, Any]:
    """A chat whose system prompt is `prompt_bytes` of ASCII text, and a short question."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(500)
    ]
    text = " ".join(rng.choice(words) for _ in range(prompt_bytes // 4))[:prompt_bytes]
    return {
        "model": "m",
        "messages": [
            {"role": "system", "content": text},
            {"role": "user", "content": "What does section 3 say?"},
        ],
    }


def _fleet(instances: int, index_blocks: int, blocks: tuple[int, ...], seed: int) -> Scheduler:
    """`instances` instances up, each index full of other prompts; one holds half this one."""
    limits = Limits(prefix_index_blocks=index_blocks)
    sched = Scheduler(
        [InstanceSpec(f"i{n}") for n in range(instances)],
        STRATEGIES["least_time"](limits.metrics_stale_after, None),
        limits,
    )
    rng = random.Random(seed)
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, rng)
        filler = [rng.getrandbits(64) for _ in range(index_blocks)]
        for start in range(0, len(filler), 256):
            state.cache.insert(filler[start : start + 256])
    sched.instances.states[0].cache.insert(blocks[: len(blocks) // 2])
    return sched


def _per_call_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    """The median over `repeat` runs of the time of one call, in microseconds."""
    runs = timeit.repeat(fn, number=number, repeat=repeat)
    return statistics.median(runs) / number * 1e6


def _index_bytes(blocks: int, seed: int) -> int:
    """Memory held by one index of `blocks` blocks."""
    rng = random.Random(seed)
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(blocks)
        index.insert(hashes)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert len(index) == blocks
    return after - before


def measure(
    *,
    prompt_bytes: int = 64 * 1024,
    instances: int = 16,
    index_blocks: int = DEFAULT_INDEX_BLOCKS,
    number: int = 200,
    repeat: int = 7,
    seed: int = 1,
) -> dict[str, float]:
    """Per-call costs in microseconds (hash, score, least_busy, insert, total) and index bytes."""
    payload = _payload(prompt_bytes, seed)
    blocks = prompt_blocks(prompt_text(payload))
    sched = _fleet(instances, index_blocks, blocks, seed)
    ticket = Ticket(1, Lane.LONG, 1e9, tokens=prompt_bytes // 4, max_tokens=256, prefix=blocks)
    least_time = sched.strategy
    least_busy = STRATEGIES["least_busy"](sched.limits.metrics_stale_after, None)
    states, rng = sched.instances.states, random.Random(seed)
    index = sched.instances.states[1].cache
    result = {
        "blocks": float(len(blocks)),
        "hash_us": _per_call_us(lambda: prompt_blocks(prompt_text(payload)), number, repeat),
        "score_us": _per_call_us(
            lambda: least_time.choose(states, states, ticket, 0.0, rng), number, repeat
        ),
        "least_busy_us": _per_call_us(
            lambda: least_busy.choose(states, states, ticket, 0.0, rng), number, repeat
        ),
        "insert_us": _per_call_us(lambda: index.insert(blocks), number, repeat),
    }
    result["total_us"] = result["hash_us"] + result["score_us"] + result["insert_us"]
    result["index_bytes"] = float(_index_bytes(index_blocks, seed))
    return result


def report(result: dict[str, float], index_blocks: int, instances: int) -> str:
    lines = [
        f"prompt: {result['blocks']:.0f} blocks of {BLOCK_BYTES} bytes; "
        f"{instances} instances, indexes of {index_blocks} blocks (median per call)",
        f"  hash prompt text      {result['hash_us']:8.1f} us",
        f"  least_time, {instances} inst.  {result['score_us']:8.1f} us",
        f"  least_busy, {instances} inst.  {result['least_busy_us']:8.1f} us",
        f"  index insert          {result['insert_us']:8.1f} us",
        f"  hash + score + insert {result['total_us']:8.1f} us  (budget {BUDGET_US:.0f} us: "
        f"{'within' if result['total_us'] < BUDGET_US else 'OVER'})",
        f"one full index: {result['index_bytes'] / 2**20:.2f} MiB "
        f"({result['index_bytes'] / index_blocks:.0f} bytes a block)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.affinity_cost", description=__doc__, formatter_class=HelpFormatter
    )
    parser.add_argument("--prompt-bytes", type=int, default=64 * 1024, help="prompt size")
    parser.add_argument("--instances", type=int, default=16, help="instances scored")
    parser.add_argument(
        "--index-blocks", type=int, default=DEFAULT_INDEX_BLOCKS, help="prefix index capacity"
    )
    parser.add_argument("--number", type=int, default=200, help="calls per timing run")
    parser.add_argument("--repeat", type=int, default=7, help="timing runs (the median is kept)")
    args = parser.parse_args(argv)
    if min(args.prompt_bytes, args.instances, args.index_blocks, args.number, args.repeat) < 1:
        parser.error("every count must be at least 1")
    result = measure(
        prompt_bytes=args.prompt_bytes,
        instances=args.instances,
        index_blocks=args.index_blocks,
        number=args.number,
        repeat=args.repeat,
    )
    print(report(result, args.index_blocks, args.instances))
    return 0


if __name__ == "__main__":
    sys.exit(main())
