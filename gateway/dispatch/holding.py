"""What the scheduler holds of a placed request, and the error for one it does not hold."""

from __future__ import annotations

from dataclasses import dataclass

from .model import InstanceState, Ticket


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
