"""Builders the prefix-affinity tests share: a scheduler with every instance up, prompt
text, and tickets that carry a prompt's blocks."""

from __future__ import annotations

import random

from gateway.dispatch import STRATEGIES, InstanceSpec, Lane, Limits, Scheduler, Ticket
from gateway.dispatch.affinity import prompt_blocks

FAR = 1e9  # a deadline no test reaches


def make(
    *specs: InstanceSpec | str, strategy: str = "least_time", limits: Limits | None = None
) -> Scheduler:
    """A scheduler over `specs` with every instance probed up once."""
    limits = limits or Limits()
    sched = Scheduler(
        [s if isinstance(s, InstanceSpec) else InstanceSpec(s) for s in specs],
        STRATEGIES[strategy](limits.metrics_stale_after),
        limits,
    )
    rng = random.Random(0)
    for state in sched.instances.states:
        sched.probe(state.name, True, 0.0, rng)
    return sched


def text(seed: int, size: int) -> bytes:
    """`size` bytes of prompt text, different for each seed from the first byte on."""
    return random.Random(seed).randbytes(size)


def tk(
    i: int,
    prompt: bytes = b"",
    *,
    tokens: int | None = None,
    lane: Lane = Lane.SHORT,
    model: str | None = None,
) -> Ticket:
    """A ticket for `prompt` (its tokens at the gateway's 4 bytes a token unless given)."""
    return Ticket(
        i,
        lane,
        FAR,
        tokens=len(prompt) // 4 if tokens is None else tokens,
        model=model,
        prefix=prompt_blocks(prompt),
    )
