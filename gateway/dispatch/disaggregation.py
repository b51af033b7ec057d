"""Prefill/decode disaggregation: whether a request goes in two hops, and where it prefills.

DistServe (arXiv 2401.09670) puts prefill and decode on different GPUs so that neither
slows the other: a prefill on an instance stalls every answer decoding there for as long
as it runs, and a decode step in a prefill batch delays every first token. vLLM does the
two hops with a KV connector: the prefill instance computes the prompt and holds its KV
blocks, the decode instance reads them instead of prefilling (the proxy's
`disaggregate.py` speaks the protocol).

Selective, as llm-d does it: the second hop is paid only by prompts whose prefill would
stall a decode instance. A prompt goes in two hops when the fleet has a prefill instance
up for it and its prefill on a decode instance, at the fastest prefill rate learned on
those cards, would take longer than the TPOT objective (it would hold every running answer
there past its time per token) and longer than moving its KV blocks (the decode hops'
learned transfer time per token). Until a rate is learned, the long-input threshold
stands in: a prompt over it goes in two hops.

The prefill instance is the one predicted to finish this prompt first: the uncached
prompt tokens ahead of it there (ours and the peers'), plus its own uncached part there
(its prefix cache counts), at the candidates' median learned prefill rate, or at its own
if it is a slow card.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .model import Hop, InstanceState, Ticket
from .speed import median


def split(
    prefill: Sequence[InstanceState],
    decode: Sequence[InstanceState],
    ticket: Ticket,
    now: float,
    *,
    tpot_objective: float,
    long_input_threshold: int,
    transfer_s_per_token: float | None,
) -> bool:
    """Whether `ticket` should be prefilled on one of `prefill` and decoded on `decode`.

    `prefill` and `decode` are the instances whose roles take each hop (up or not).
    """
    if ticket.hop is not Hop.WHOLE or not ticket.tokens:
        return False
    dedicated = [s for s in prefill if s.spec.role == "prefill"]
    if not any(s.available(now) and s.serves_model(ticket.model) for s in dedicated):
        return False  # no prefill instance up for it: it is served whole, as without roles
    takers = [s for s in decode if s.available(now) and s.serves_model(ticket.model)]
    if not takers:
        return False
    # Where its prompt is cached on a decode instance, only the rest would be prefilled.
    uncached = ticket.tokens - max(s.cached_tokens(ticket) for s in takers)
    # The fastest rate learned on these cards (alike, as a rule): a rate learned from a
    # first token holds its fixed costs too (a decode step, the hop), which only ever
    # lower it, most for the short prompts a decode instance serves whole. A decode
    # instance that learned only from those would have every short prompt split.
    rates = [s.speed.prefill_rate for s in (*takers, *dedicated) if s.speed.prefill_rate]
    rate = max(rates, default=None)
    if rate is None:
        return uncached > long_input_threshold
    local = uncached / rate
    transfer = uncached * transfer_s_per_token if transfer_s_per_token is not None else 0.0
    return local > tpot_objective and local > transfer


def predicted_prefill(state: InstanceState, ticket: Ticket, fleet_rate: float | None) -> float:
    """Seconds until `ticket`'s prompt would be computed on `state` (or, before any rate is
    known, its uncached tokens ahead and its own, which order the candidates alike)."""
    ahead = state.pending_prefill_tokens + state.peers.pending_prefill_tokens
    work = ahead + ticket.tokens - state.cached_tokens(ticket)
    # A card's own rate counts once it is a slow card (speed.py's verdict): rates learned
    # under load differ by noise, and ranking alike cards by it piles prompts on the one
    # that happened to look fastest (p99 TTFT 10 ms worse on the DistServe bench).
    rate = (state.speed.prefill_rate if state.speed.slow else None) or fleet_rate
    return work / (rate * state.spec.weight) if rate else work / state.spec.weight


def fastest_prefill(
    candidates: Sequence[InstanceState], ticket: Ticket, rng: random.Random
) -> InstanceState:
    """The candidate predicted to finish `ticket`'s prefill first (ties at random)."""
    fleet_rate = median(c.speed.prefill_rate for c in candidates)
    finish = {c.name: predicted_prefill(c, ticket, fleet_rate) for c in candidates}
    best = min(finish.values())
    ties = [c for c in candidates if finish[c.name] <= best * (1 + 1e-9) + 1e-12]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
