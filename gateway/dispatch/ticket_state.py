"""A ticket's life in the scheduler, as a state table (in the manner of h11's `_state.py`).

    new --queued--> queued --placed--> prefilling --first token--> decoding --left--> released
     |                                    ^   |                                          ^
     `---------------placed---------------'   `-----------left, with no first token------'

    new or queued --refused--> rejected           queued --its client left--> cancelled

A ticket is new until the scheduler decides on it: it is placed on an instance, queued, or
refused. A queued one is placed when room comes, refused (its wait ran out, no instance is
left for it, shutdown), or cancelled (its client left). A placed one is prefilling until
its first token comes, then decoding; it is released when it leaves its instance, done,
failed or cancelled, with or without a first token. Released, rejected and cancelled are
final: the scheduler forgets the ticket.

`MOVES` is the whole table; `move` is the one way a ticket changes state, and it raises
`IllegalMove` on any move the table does not hold (a ticket placed twice, a prefill ended
after its ticket left). Only a new ticket may be submitted: the scheduler refuses a live
one with `IllegalMove` too, before any move.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class TicketState(enum.Enum):
    NEW = "new"  # submitted, not decided yet (or forgotten: the scheduler keeps no past)
    QUEUED = "queued"  # waiting in the gateway queue
    PREFILLING = "prefilling"  # placed on an instance; no first token yet
    DECODING = "decoding"  # its first token came
    RELEASED = "released"  # it left its instance
    REJECTED = "rejected"  # refused: it never reached an instance
    CANCELLED = "cancelled"  # its client left while it waited


_S = TicketState

MOVES: Mapping[TicketState, frozenset[TicketState]] = {
    _S.NEW: frozenset({_S.QUEUED, _S.PREFILLING, _S.REJECTED}),
    _S.QUEUED: frozenset({_S.PREFILLING, _S.REJECTED, _S.CANCELLED}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.RELEASED}),
    _S.DECODING: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
    _S.REJECTED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalMove(RuntimeError):
    """A ticket was moved where the state table does not allow: a bug in the scheduler, or
    in what its caller asked of it."""


def move(ticket_id: int, current: TicketState, to: TicketState) -> TicketState:
    """`to`, if ticket `ticket_id` may go there from `current`; else `IllegalMove`."""
    allowed = MOVES[current]
    if to not in allowed:
        may = ", ".join(sorted(s.value for s in allowed)) or "nowhere (it is final)"
        raise IllegalMove(
            f"ticket {ticket_id} cannot go from {current.value} to {to.value}; "
            f"from {current.value} it may go to: {may}"
        )
    return to
