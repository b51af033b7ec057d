"""What the scheduler holds of a placed request, and the error for one it does not hold.

A placed request counts on its instance (in flight, prefill work, long places) from
`take` until `leave`; `end_prefill` gives back what only its prefill held. The counters
are taken and given back here only, so they cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import InstanceState, Lane, Ticket


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
        if self.long_place:
            self.state.long_running -= 1
        self.state.inflight -= 1
