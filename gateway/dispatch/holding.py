"""What the scheduler holds of a placed request, and the error for one it does not hold.

A placed request counts on its instance (in flight, prefill work, long places) from
`take` until `leave`; `end_prefill` gives back what only its prefill held, and `leave`
gives back the rest (its prefill's part too, if no first token came). The counters are
taken and given back here only, so they cannot drift apart; the ticket's state moves
with them, by the table in ticket_state.py (prefilling, decoding, released).
"""

from __future__ import annotations

from dataclasses import dataclass

from .model import InstanceState, Lane, Ticket
from .ticket_state import TicketState, move


class UnknownTicket(KeyError):
    """A ticket id the scheduler does not hold (released twice, or never assigned)."""


@dataclass
class Held:
    """A request on an instance: where it is in its life, and the work ahead of it."""

    state: InstanceState
    ticket: Ticket
    ahead: int = 0  # uncached prompt tokens in prefill there (ours, peers') when it was sent
    uncached: int = 0  # its own prompt tokens not in the instance's prefix cache
    long_place: bool = False  # holds one of the instance's max_long_per_instance places
    ticket_state: TicketState = TicketState.PREFILLING

    @property
    def prefilling(self) -> bool:
        """Placed, and no first token yet."""
        return self.ticket_state is TicketState.PREFILLING

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
        """Its first token came: its prefill work and place are free."""
        self.ticket_state = move(self.ticket.id, self.ticket_state, TicketState.DECODING)
        self._give_back_prefill()

    def leave(self) -> None:
        """It left its instance: everything it took there is given back."""
        prefilling = self.prefilling
        self.ticket_state = move(self.ticket.id, self.ticket_state, TicketState.RELEASED)
        if prefilling:
            self._give_back_prefill()
        if self.long_place:
            self.state.long_running -= 1
        self.state.inflight -= 1

    def _give_back_prefill(self) -> None:
        self.state.pending_prefill_tokens -= self.uncached
        if self.long_place:
            self.state.long_prefilling -= 1
