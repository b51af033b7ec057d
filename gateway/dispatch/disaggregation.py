"""Prefill/decode disaggregation: whether a request goes in two hops, and where it prefills.

DistServe (arXiv 2401.09670) puts prefill and decode on different GPUs so that neither
slows the other: a prefill on an instance stalls every answer decoding there for as long
as it runs, and a decode step in a prefill batch delays every first token. vLLM does the
two hops with a KV connector: the prefill instance computes the prompt and holds its KV
blocks, the decode instance reads them instead of prefilling (the proxy's
`disaggregate.py` speaks the protocol).

Selective, as llm-d does it, and judged on what each path costs everyone it touches, in
seconds of delay:

- whole on a decode instance: its prefill there, paid by the request itself and by every
  request on that instance (each running answer stalls for it, each waiting one starts
  later), at least one: an idle decode instance does not stay idle, and the next request
  to arrive waits behind the prefill: `prefill x (1 + max(1, requests there))`;
- two hops: its predicted finish on the best prefill instance (the work queued there, then
  its own) plus moving its KV blocks; only the request pays it. The decode instance's own
  queue is not in it: a request served whole waits there too.

A prompt goes in two hops when that is the cheaper, and when more than `MIN_SPLIT_TOKENS`
of it would be computed (a prompt of a block or two moves no time worth a hop). The rule
feeds back the right way: serving whole loads the decode instance, which makes the next
whole dearer; splitting loads the prefill instances, which makes the next split dearer.
So with prefill instances that have room nearly every prompt splits, and only when the
prefill side is the bottleneck (its queue longer than the stall a whole prefill would
cause) does the decode instance take the overflow. Before any prefill rate is learned, the
same comparison runs in tokens, with the transfer unknown (free).

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

# Prompt tokens to compute at most for a request to stay whole whatever the loads: vLLM's
# connectors move full KV blocks only (16 tokens by default), and a prompt of a block or
# two costs its decode instance less than a hop costs the request.
VLLM_BLOCK_TOKENS = 16
MIN_SPLIT_TOKENS = 2 * VLLM_BLOCK_TOKENS


def _takes(state: InstanceState, ticket: Ticket, now: float) -> bool:
    return state.available(now) and state.serves_model(ticket.model)


def decode_load(state: InstanceState, now: float, stale_after: float) -> float:
    """Requests on a decode instance that a prefill there would hold up: every gateway
    process's in flight, or what a fresh scrape says runs and waits there, if more (traffic
    from elsewhere stalls as much)."""
    report = state.fresh_report(now, stale_after)
    own = float(state.total_inflight)
    return own if report is None else max(own, report.running + report.waiting)


def split(
    prefill: Sequence[InstanceState],
    decode: Sequence[InstanceState],
    ticket: Ticket,
    now: float,
    *,
    transfer_s_per_token: float | None,
    stale_after: float,
) -> bool:
    """Whether `ticket` should be prefilled on one of `prefill` and decoded on `decode`.

    `prefill` and `decode` are the instances whose roles take each hop (up or not).
    """
    if ticket.hop is not Hop.WHOLE or not ticket.tokens:
        return False
    dedicated = [s for s in prefill if s.spec.role == "prefill" and _takes(s, ticket, now)]
    takers = [s for s in decode if _takes(s, ticket, now)]
    if not dedicated or not takers:
        return False  # no prefill instance up for it: it is served whole, as without roles
    # Where its prompt is cached on a decode instance, only the rest would be prefilled.
    uncached = min(ticket.tokens - s.cached_tokens(ticket) for s in takers)
    if uncached <= MIN_SPLIT_TOKENS:
        return False
    # The fastest rate learned on these cards (alike, as a rule): a rate learned from a
    # first token holds its fixed costs too (a decode step, the hop), which only ever
    # lower it, most for the short prompts a decode instance serves whole.
    rates = [s.speed.prefill_rate for s in (*takers, *dedicated) if s.speed.prefill_rate]
    rate = max(rates, default=None)
    # The decode instance the strategy would weigh first: the least loaded.
    load = max(1.0, min(decode_load(s, now, stale_after) for s in takers))
    whole = uncached / rate if rate else float(uncached)
    fleet_rate = median(s.speed.prefill_rate for s in dedicated) or rate
    finish = min(predicted_prefill(s, ticket, fleet_rate) for s in dedicated)
    transfer = uncached * transfer_s_per_token if rate and transfer_s_per_token else 0.0
    return finish + transfer < whole * (1 + load)


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
