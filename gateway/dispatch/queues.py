"""The gateway's own queues: what waits, in which order, and until when.

A request waits in the FIFO of its lane, model, hop and class: requests for one model
never hold up those for another, which other instances serve, nor a prompt waiting for a
prefill instance one that a decode instance may serve whole. Retries wait apart, each
for an untried instance (in one FIFO, one could head its lane and block requests an idle
instance could run). Each waiting ticket has the time its wait runs out, and the FIFOs'
heads go out earliest-limit-first: an interactive request (whose wait is short) before a
batch one that came earlier, until the batch one's longer wait nears its end and it goes
first. So batch is delayed by at most its own limit, never starved.

Within a FIFO the head is chosen between keys: the oldest request of the key that goes
first by fair share (fairness.py), so one key's flood never stands in front of another
key's request. Within a key the order is arrival order. Only the scheduler uses this.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from .model import Hop, Lane, Priority, Ticket

QueueKey = tuple[Lane, str | None, Hop, Priority]
_RETRIES = None  # where a retry waits, in `_where`


class WaitQueues:
    def __init__(self) -> None:
        # Insertion-ordered dicts: FIFO with O(1) removal of a ticket whose client left.
        self._fifos: dict[QueueKey, dict[int, Ticket]] = {}
        # The same tickets by key, each key's in arrival order; keys by their oldest.
        self._by_key: dict[QueueKey, dict[str, dict[int, Ticket]]] = {}
        self._key_count: dict[str, int] = {}  # new requests waiting, per key
        self._retries: dict[int, Ticket] = {}
        self._where: dict[int, QueueKey | None] = {}
        self._wait_until: dict[int, float] = {}
        self._fifo_count = {lane: 0 for lane in Lane}
        self._retry_count = {lane: 0 for lane in Lane}

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, ticket_id: object) -> bool:
        return ticket_id in self._where

    def __iter__(self) -> Iterator[Ticket]:
        yield from self._retries.values()
        for fifo in self._fifos.values():
            yield from fifo.values()

    def waiting_before(self, ticket: Ticket, wait_until: float) -> bool:
        """Whether a request waits for the places a new `ticket` (waiting until
        `wait_until`) wants, which it may not overtake: of its lane, model and hop, one
        whose wait runs out no later (every one of its class; a batch one only near its
        limit, for an interactive ticket)."""
        lane, model, hop = ticket.lane, ticket.model, ticket.hop
        for priority in Priority:
            fifo = self._fifos.get((lane, model, hop, priority))
            if fifo and self._wait_until[next(iter(fifo))] <= wait_until:
                return True
        return False

    def fifo_length(self, lane: Lane) -> int:
        """New requests of `lane` waiting, over all models (the gateway queue bound's count)."""
        return self._fifo_count[lane]

    def waiting_keys(self) -> Iterable[str]:
        """The keys with new requests waiting (in any FIFO)."""
        return self._key_count.keys()

    def key_counts(self) -> dict[str, int]:
        """New requests waiting, per key."""
        return dict(self._key_count)

    def keys_for(self, lane: Lane, model: str | None, hop: Hop, priority: Priority) -> list[str]:
        """The keys with requests waiting for `lane`, `model` and `hop` in `priority`'s class."""
        return list(self._by_key.get((lane, model, hop, priority), ()))

    def key_length_for(
        self, key: str, lane: Lane, model: str | None, hop: Hop, priority: Priority
    ) -> int:
        """`key`'s requests waiting for `lane`, `model` and `hop` in `priority`'s class."""
        own = self._by_key.get((lane, model, hop, priority), {}).get(key)
        return len(own) if own else 0

    def retry_count(self) -> int:
        return len(self._retries)

    def length_for(
        self,
        lane: Lane,
        model: str | None,
        hop: Hop = Hop.WHOLE,
        priority: Priority = Priority.INTERACTIVE,
    ) -> int:
        """What waits for `lane`, `model` and `hop` in `priority`'s class: its FIFO and
        its retries."""
        fifo = self._fifos.get((lane, model, hop, priority))
        retries = sum(
            1
            for t in self._retries.values()
            if t.lane is lane and t.model == model and t.hop is hop and t.priority is priority
        )
        return (len(fifo) if fifo else 0) + retries

    def batch_length(self, lane: Lane) -> int:
        """New batch requests of `lane` waiting, over all models (told to the peers)."""
        return sum(
            len(fifo)
            for (of_lane, _, _, priority), fifo in self._fifos.items()
            if of_lane is lane and priority is Priority.BATCH
        )

    def length(self, lane: Lane) -> int:
        """Everything of `lane` that waits: new requests and retries."""
        return self._fifo_count[lane] + self._retry_count[lane]

    def add(self, ticket: Ticket, wait_until: float) -> int:
        """Queue `ticket` until `wait_until` at the latest; return its position (1-based)."""
        if ticket.exclude:
            queue, where = self._retries, _RETRIES
            self._retry_count[ticket.lane] += 1
        else:
            where = (ticket.lane, ticket.model, ticket.hop, ticket.priority)
            queue = self._fifos.setdefault(where, {})
            self._fifo_count[ticket.lane] += 1
            self._by_key.setdefault(where, {}).setdefault(ticket.key, {})[ticket.id] = ticket
            self._key_count[ticket.key] = self._key_count.get(ticket.key, 0) + 1
        queue[ticket.id] = ticket
        self._where[ticket.id] = where
        self._wait_until[ticket.id] = wait_until
        return len(queue)

    def remove(self, ticket_id: int) -> Ticket | None:
        """Take a ticket out (placed, rejected or its client left); None if it is not here."""
        if ticket_id not in self._where:
            return None
        where = self._where.pop(ticket_id)
        del self._wait_until[ticket_id]
        if where is _RETRIES:
            ticket = self._retries.pop(ticket_id)
            self._retry_count[ticket.lane] -= 1
            return ticket
        fifo = self._fifos[where]
        ticket = fifo.pop(ticket_id)
        if not fifo:
            del self._fifos[where]  # models come and go; keep no empty FIFOs
        self._fifo_count[ticket.lane] -= 1
        keys = self._by_key[where]
        own = keys[ticket.key]
        del own[ticket_id]
        if not own:
            del keys[ticket.key]
            if not keys:
                del self._by_key[where]
        if self._key_count[ticket.key] == 1:
            del self._key_count[ticket.key]
        else:
            self._key_count[ticket.key] -= 1
        return ticket

    def get(self, ticket_id: int) -> Ticket | None:
        """The waiting ticket `ticket_id` (None: it is not here)."""
        if ticket_id not in self._where:
            return None
        where = self._where[ticket_id]
        return self._retries[ticket_id] if where is _RETRIES else self._fifos[where][ticket_id]

    def wait_until(self, ticket_id: int) -> float | None:
        return self._wait_until.get(ticket_id)

    def retries(self) -> list[Ticket]:
        return list(self._retries.values())

    def fifos(self) -> list[tuple[QueueKey, list[Ticket]]]:
        return [(key, list(fifo.values())) for key, fifo in self._fifos.items()]

    def heads(self, count: Callable[[str], float]) -> list[Ticket]:
        """Who may be placed next: every retry, then each FIFO's head, the one whose wait
        runs out first first (then the oldest). A FIFO's head is the oldest request of its
        key with the least `count` (fairness.py), the key with the oldest request on a tie."""
        firsts = []
        for keys in self._by_key.values():
            firsts.append(_fair_head(keys, count))
        firsts.sort(key=self._due)
        return [*self._retries.values(), *firsts]

    def _due(self, ticket: Ticket) -> tuple[float, int]:
        return self._wait_until[ticket.id], ticket.id

    def __repr__(self) -> str:
        fifos = " ".join(f"{lane.value}={n}" for lane, n in self._fifo_count.items())
        return f"<WaitQueues {fifos} retries={len(self._retries)}>"


def _fair_head(keys: dict[str, dict[int, Ticket]], count: Callable[[str], float]) -> Ticket:
    """The oldest ticket of the key with the least count (the older head on a tie)."""
    if len(keys) == 1:
        (own,) = keys.values()
        return next(iter(own.values()))
    best: Ticket | None = None
    rank = (0.0, 0)
    for key, own in keys.items():
        head = next(iter(own.values()))
        mine = (count(key), head.id)
        if best is None or mine < rank:
            best, rank = head, mine
    assert best is not None
    return best
