"""The operator's drains: which instances are out of rotation, and since when.

`POST /admin/instances/{server}/drain` takes an instance out of rotation: it gets no new
request (what waits in the gateway queue goes elsewhere), and the requests it holds
finish. `.../resume` brings it back. The state is a table, name -> since (wall clock),
and exactly one place holds the table that every process applies:

- one process: its own;
- `--workers`: the supervisor's. The worker that got the order applies it at once and
  sends it up its pipe (`DrainOrder`); the supervisor sends the whole table to every
  worker (`DrainTable`), and to each worker it starts later;
- `[shared]`: Redis, a hash `{namespace}:drained`. The order is written there first (a
  store that does not take it changes nothing: 503), then applied here; every replica
  reads the entries of its instances each round, so the drain holds fleet-wide within a
  round and outlives a restart, until resumed.

Without `[shared]`, a drain lasts until resume, a reload that removes the instance, or a
restart. A name may be drained only while it is in the fleet; an entry for a name not in
it (a reload took it out) is ignored.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

from gateway.fleet.dispatcher import Dispatcher
from gateway.observe import log

_log = log.get("gateway.drains")


@dataclass(frozen=True)
class DrainOrder:
    """A worker to its supervisor: `name` drained since `since`, or resumed (None)."""

    name: str
    since: float | None


@dataclass(frozen=True)
class DrainTable:
    """The supervisor to its workers: every drained instance now, and since when."""

    drained: Mapping[str, float]


def ordered(table: Mapping[str, float], order: DrainOrder) -> dict[str, float]:
    """`table` with `order` applied."""
    out = dict(table)
    if order.since is None:
        out.pop(order.name, None)
    else:
        out[order.name] = order.since
    return out


def parse_since(raw: bytes | str | None) -> float | None:
    """A drain's time as read from the shared store: None if absent or not a time."""
    if raw is None:
        return None
    try:
        since = float(raw)
    except ValueError:
        return None
    return since if math.isfinite(since) and since >= 0 else None


class UnknownInstance(LookupError):
    """No instance of that name in the fleet."""


class Drains:
    """Takes orders (the admin routes) and tables (the supervisor, the shared store) and
    keeps the dispatcher's drained set equal to the table."""

    def __init__(self, dispatcher: Dispatcher, clock: Callable[[], float] = time.time) -> None:
        self.dispatcher = dispatcher
        self.clock = clock
        # Under --workers: sends an order up the pipe. With [shared]: writes it to Redis
        # (False: Redis did not take it). Set by the shell that has them.
        self.upward: Callable[[DrainOrder], None] | None = None
        self.store: Callable[[DrainOrder], Awaitable[bool]] | None = None

    async def order(self, name: str, drained: bool) -> DrainOrder | None:
        """Drain or resume `name`; the order as applied, None if the shared store would
        not take it (nothing changed). UnknownInstance if `name` is not in the fleet."""
        if name not in self.dispatcher.instance_names():
            raise UnknownInstance(name)
        table = self.dispatcher.drained
        since = table.get(name)
        if drained and since is None:
            since = self.clock()
        order = DrainOrder(name, since if drained else None)
        if self.store is not None and not await self.store(order):
            return None
        self.apply_table(ordered(table, order))
        if self.upward is not None:
            self.upward(order)
        _log.warning("instance_drained" if drained else "instance_resumed", server=name)
        return order

    def apply_table(self, table: Mapping[str, float]) -> None:
        """The table as its holder says it is now."""
        if table != self.dispatcher.drained:
            self.dispatcher.set_drained(table)
