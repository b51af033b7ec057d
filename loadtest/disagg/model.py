"""The simulator's engine in virtual time: token times of a schedule in milliseconds.

A replica of `gateway.sim.sim_batching.Engine`'s step loop (FIFO admission into
max_num_seqs slots; each step's budget of max_num_batched_tokens, one token per decoding
sequence and the rest to prefill chunks in admission order; a step lasts its prefill
tokens / prefill_tokens_per_s plus, with any sequence decoding, decode_s_per_token x
(1 + decode_slowdown_per_seq x (decoding - 1)), over `speed`; tokens come out at the step's
end; a request that arrives during a step joins from the next one). No network, no event
loop overshoot, no prefix cache, no admission limit. `calibration.py` searches parameters
with it and then measures the real simulator, which lands within a few percent of it.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.sim.sim_engine import SimConfig


@dataclass(frozen=True)
class Arrival:
    """A request as the engine sees it: when it is submitted and what it needs."""

    at: float
    prompt_tokens: int
    max_tokens: int
    computed: int = 0  # prompt tokens whose KV came from elsewhere


@dataclass
class _Seq:
    prompt: int
    max_tokens: int
    prefilled: int
    generated: int = 0

    @property
    def in_decode(self) -> bool:
        return self.prefilled >= self.prompt

    @property
    def finished(self) -> bool:
        return self.in_decode and self.generated >= self.max_tokens


def token_times(config: SimConfig, arrivals: Sequence[Arrival]) -> list[list[float]]:
    """When each request's output tokens come out, in the order of `arrivals`."""
    order = sorted(range(len(arrivals)), key=lambda i: arrivals[i].at)
    pending = collections.deque(order)
    seqs = [
        _Seq(a.prompt_tokens, a.max_tokens, max(0, min(a.computed, a.prompt_tokens - 1)))
        for a in arrivals
    ]
    times: list[list[float]] = [[] for _ in arrivals]
    running: list[int] = []
    waiting: collections.deque[int] = collections.deque()

    def submit(index: int) -> None:
        if not waiting and len(running) < config.max_num_seqs:
            running.append(index)
        else:
            waiting.append(index)

    now = 0.0
    while pending or running or waiting:
        if not running and not waiting:  # idle: the loop starts with the next arrival
            now = max(now, arrivals[pending[0]].at)
            while pending and arrivals[pending[0]].at <= now:
                submit(pending.popleft())
        while waiting and len(running) < config.max_num_seqs:
            running.append(waiting.popleft())
        decoding = [i for i in running if seqs[i].in_decode]
        budget = config.max_num_batched_tokens - len(decoding)
        chunks: list[tuple[int, int]] = []
        for i in running:
            need = seqs[i].prompt - seqs[i].prefilled
            if need > 0 and budget > 0:
                take = min(need, budget)
                chunks.append((i, take))
                budget -= take
        step = sum(take for _, take in chunks) / config.prefill_tokens_per_s
        if decoding:
            step += config.decode_s_per_token * (
                1 + config.decode_slowdown_per_seq * (len(decoding) - 1)
            )
        now += step / config.speed
        while pending and arrivals[pending[0]].at <= now:
            submit(pending.popleft())
        for i in decoding:
            seqs[i].generated += 1
            times[i].append(now)
        for i, take in chunks:
            seqs[i].prefilled += take
            if seqs[i].in_decode and seqs[i].max_tokens > 0:
                seqs[i].generated += 1
                times[i].append(now)
        running = [
            i
            for i in running
            if not (seqs[i].in_decode and seqs[i].generated >= seqs[i].max_tokens)
        ]
    return times
