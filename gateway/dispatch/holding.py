"""What the scheduler holds of a placed request, and the error for one it does not hold.

A placed request counts on its instance (in flight, prefill work, long places) from
`take` until `leave`; `end_prefill` gives back what only its prefill held. The counters
are taken and given back here only, so they cannot drift apart.

The running bound (`max_long_running_per_instance`) holds long prompts back from a card
whose long answers would meet one prefill after another. It counts only the answers
a stall can hurt. Each long prefill there stalls an answer for the prefill's length,
and the answer's TPOT grows by that over its output tokens: a 0.3 s prefill adds 10 ms
to a 32-token answer and 2.4 ms to a 128-token one. An answer counts if the bound's
worth of stalls would take more than half its TPOT objective; one long enough to absorb
them is not protected by holding prompts back, and counting it only left cards idle of
prefill while long prompts waited (the benchmark page, `lanes`, "Round 7"). Its own
prefill stands for the stalls to come, since the long prompts behind it are of its kind.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import InstanceState, Lane, Ticket


def counts_toward_running_bound(
    bound: int, stall: float | None, max_tokens: int, tpot_objective: float
) -> bool:
    """Whether a long answer counts toward a running bound of `bound` on its card:
    `bound` stalls of `stall` seconds (its own prefill there; None: not known yet) over
    its `max_tokens` (0: not known) would take over half its TPOT objective. Unknown
    counts, as the bound did before.

    >>> counts_toward_running_bound(4, 0.3, 32, 0.05)   # 4 x 9.4 ms: over 25 ms
    True
    >>> counts_toward_running_bound(4, 0.3, 128, 0.05)  # 4 x 2.3 ms: absorbs them
    False
    """
    if stall is None or max_tokens <= 0:
        return True
    return bound * stall / max_tokens > tpot_objective / 2


class UnknownTicket(KeyError):
    """A ticket id the scheduler does not hold (released twice, or never assigned)."""


@dataclass
class Held:
    """A request on an instance: whether it is still in prefill, and the work ahead of it."""

    state: InstanceState
    ticket: Ticket
    prefilling: bool = True
    ahead: int = 0  # uncached prompt tokens in prefill there (ours, peers') when it was sent
    uncached: int = 0  # its own prompt tokens not in the instance's prefix cache
    long_place: bool = False  # holds one of the instance's max_long_per_instance places
    counts_running: bool = True  # counts toward max_long_running_per_instance there

    @property
    def departs_at_prefill(self) -> bool:
        """A long request on a shared instance lets the next one in when its prefill ends
        (`max_long_per_instance`); every other request when it leaves its slot."""
        return self.ticket.lane is Lane.LONG and self.state.spec.lane == "any"

    def take(self) -> None:
        """It is placed: its instance counts it."""
        state = self.state
        state.inflight += 1
        state.assigned_total += 1
        state.pending_prefill_tokens += self.uncached
        if self.long_place:
            state.long_prefilling += 1
            if self.counts_running:
                state.long_running += 1

    def end_prefill(self) -> None:
        """Its first token came (or it left before): its prefill work and place are free."""
        self.prefilling = False
        self.state.pending_prefill_tokens -= self.uncached
        if self.long_place:
            self.state.long_prefilling -= 1

    def leave(self) -> None:
        """It left its instance; `end_prefill` came first (the scheduler records a
        departure there that this cannot)."""
        assert not self.prefilling, "end_prefill before leave"
        if self.long_place and self.counts_running:
            self.state.long_running -= 1
        self.state.inflight -= 1
