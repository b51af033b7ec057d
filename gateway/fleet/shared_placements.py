"""The prefix placements stream: where this process placed prompts that were not cached
yet, told to every other process through one Redis stream, and theirs read into our
prefix index, so that replicas agree where a prefix lives instead of each caching it
somewhere else.

    <namespace>:placements   a stream of {p: process, d: [[instance, [block hash, ...]], ...]}

Each round appends what this process placed since the last (one entry), and reads what
the others appended since the last entry it read. A push (shared.py) tells the others at
once; its placements reach the stream with the next round, in that round's one entry, for
a process that joins later: on joining, a process reads back the newest `CATCH_UP`
placements made before it started. An entry is untrusted (shared_codec.py bounds it): a
bad one is counted and skipped.

May import: `gateway.dispatch`, `gateway.fleet.dispatcher`, `gateway.fleet.shared_codec`,
`gateway.fleet.shared_link`.
"""

from __future__ import annotations

import json
from collections import deque
from typing import Any

from gateway.dispatch.instances import MAX_PLACEMENTS
from gateway.fleet.dispatcher import Dispatcher
from gateway.fleet.shared_codec import Refused, parse_placements
from gateway.fleet.shared_link import SharedLink, text

STREAM_MAXLEN = 20_000  # placements kept in the stream (approximately: Redis trims lazily)
CATCH_UP = 500  # placements a new process reads back from before it started

_Placed = list[tuple[str, tuple[int, ...]]]


class PlacementStream:
    """Our placements into the stream, the others' out of it into the dispatcher."""

    def __init__(self, link: SharedLink, dispatcher: Dispatcher, namespace: str = "gateway"):
        self.link = link
        self.dispatcher = dispatcher
        self._stream = f"{namespace}:placements"
        self._stream_at: str | None = None  # the last placement read
        # Placements the pushes told the others, for the next round to append to the
        # stream in one entry: one stream write a round rather than one a push, and a
        # round reads back one entry of its own rather than a dozen. Only a process that
        # joins later reads the stream for them, and a round later is soon enough.
        self._unstreamed: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=MAX_PLACEMENTS)

    def to_send(self) -> _Placed:
        """What this round appends: the pushes' placements, and those made since."""
        placements = [*self._unstreamed, *self.dispatcher.take_placements()]
        self._unstreamed.clear()  # sent with this round, or lost with it if Redis fails
        return placements

    def pushed(self, placements: _Placed) -> None:
        """_Placed a push told the others: the stream gets them with the next round."""
        self._unstreamed.extend(placements)

    async def join(self) -> None:
        """Before the first round's read: the others' placements from before we started."""
        if self._stream_at is None:
            await self._catch_up()

    def append(self, pipe: Any, placements: _Placed) -> None:
        """Ours, as one entry, into the round's pipeline."""
        entry = {"p": self.link.process_id, "d": json.dumps(placements)}
        pipe.xadd(self._stream, entry, maxlen=STREAM_MAXLEN, approximate=True)

    def read(self, pipe: Any) -> None:
        """The entries since the last one read, into the round's pipeline (for `learn`)."""
        pipe.xread({self._stream: self._stream_at or "0-0"}, count=1000)

    async def _catch_up(self) -> None:
        """On joining, read the newest placements the others made before we started."""
        recent: list[Any] = list(
            await self.link.redis.xrevrange(self._stream, count=CATCH_UP) or ()
        )
        self._stream_at = "0-0"
        self.learn([[self._stream, recent[::-1]]])

    def learn(self, streams: Any) -> None:
        """_Placed other processes made: into our prefix indexes."""
        for _, entries in streams or ():
            for entry_id, fields in entries:
                self._stream_at = text(entry_id)
                if text(fields.get(b"p", b"")) == self.link.process_id:
                    continue
                try:
                    learned = parse_placements(fields[b"d"])
                except (KeyError, ValueError) as exc:
                    self.link.failed(exc.reason if isinstance(exc, Refused) else "malformed", exc)
                    continue
                self.dispatcher.learn_placements(learned)

    def __repr__(self) -> str:
        return f"<PlacementStream at={self._stream_at} unstreamed={len(self._unstreamed)}>"
