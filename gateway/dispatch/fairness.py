"""Fair share of a saturated fleet between keys: the Virtual Token Counter.

When requests wait in the gateway's queue, the next free place goes to the waiting request
of the key that has received the least service so far, its own oldest first (Sheng et al.,
"Fairness in Serving Large Language Models", OSDI 2024). Service is counted in weighted
tokens: every prompt token at `PROMPT_WEIGHT`, every output token at `OUTPUT_WEIGHT` (the
paper's 1 and 2: a decoded token holds a running slot for a whole engine step, a prompt
token shares one chunked-prefill step with many). A key's count is its service divided by
its `share`, so a key with share 2 is served twice as much as a key with share 1 while both
wait.

Idleness is not banked. A key that starts waiting while others wait is lifted to the least
count among them; when nobody waits, to the count of the last key the queue served. So a
returning key goes first once, then takes turns; it does not get the fleet alone until it
has caught up with a day of someone else's traffic.

The counts are fleet-wide with a shared view: every process adds the service the others
published (`peers`), so replicas order by the same numbers within a push interval. The
lifts stay local: each process lifts the keys that start waiting in its own queue. A place
freed at one process is seen there first: it is left free for a while when another
process holds a lower-count key's request waiting (`owed_to_peers`), so that key is not
starved by a flood that comes through another replica.

Pure: the scheduler charges and asks; nothing here knows about time or I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

PROMPT_WEIGHT = 1.0
OUTPUT_WEIGHT = 2.0


class ServiceCounts:
    def __init__(self, shares: Mapping[str, float] | None = None) -> None:
        self.shares: Mapping[str, float] = dict(shares or {})
        self._own: dict[str, float] = {}  # weighted tokens served by this process
        self._placed: dict[str, int] = {}  # requests placed (prompts charged), per key
        # Their sums, kept as they grow: a key not yet placed costs every key's mean, which
        # `places_before` asks for each waiting key (a sum each time made it O(keys^2)).
        self._total_own = 0.0
        self._total_placed = 0
        self._lift: dict[str, float] = {}  # added to a key's count when it was lifted
        self.peers: Mapping[str, float] = {}  # the other processes' service, as published
        self._last_picked = 0.0  # the count of the key the queue picked last

    def apply(self, shares: Mapping[str, float]) -> None:
        """A reload's shares (`Limits.shares`): counts from now on divide by these."""
        self.shares = dict(shares)

    def share(self, key: str) -> float:
        """A key's share (1 unless configured)."""
        return self.shares.get(key, 1.0)

    def count(self, key: str) -> float:
        """A key's virtual count: fleet-wide weighted service over its share, plus its lift."""
        served = self._own.get(key, 0.0) + self.peers.get(key, 0.0)
        return served / self.share(key) + self._lift.get(key, 0.0)

    def charge(self, key: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        """Service given to `key` here: a prompt placed on an instance, an answer's tokens."""
        weighted = PROMPT_WEIGHT * prompt_tokens + OUTPUT_WEIGHT * output_tokens
        if weighted > 0:
            self._own[key] = self._own.get(key, 0.0) + weighted
            self._total_own += weighted
        if prompt_tokens:
            self._placed[key] = self._placed.get(key, 0) + 1
            self._total_placed += 1

    def arrive(self, key: str, waiting: Iterable[str]) -> None:
        """`key` starts waiting in the queue while the keys `waiting` wait (not `key`): lift
        it to the least of their counts, or to the last picked key's if nobody waits."""
        counts = [self.count(k) for k in waiting if k != key]
        floor = min(counts) if counts else self._last_picked
        behind = floor - self.count(key)
        if behind > 0:
            self._lift[key] = self._lift.get(key, 0.0) + behind

    def picked(self, key: str) -> None:
        """The queue's next place went to `key` (after its charge)."""
        self._last_picked = self.count(key)

    def places_before(self, key: str, waiting: Mapping[str, int]) -> float:
        """How many places go out until a new request of `key` has one (its own the last),
        with `waiting` requests queued per key: the turns of its own key's queue, and the
        turns of every other waiting key whose count stays at or below the count `key`
        will have when its last turn comes (each turn adds a key's usual cost over its
        share; a tie goes to the other, as if it came first). A key with nothing waiting
        counts as lifted, as `arrive` will lift it.

        >>> counts = ServiceCounts()
        >>> for _ in range(10):
        ...     counts.charge("flood", prompt_tokens=100)
        >>> counts.places_before("calm", {"flood": 40})  # lifted to the flood's count: 1 tie
        2.0
        >>> counts.places_before("flood", {"flood": 40, "calm": 1})  # its 41 and calm's 1
        42.0
        """
        own = waiting.get(key, 0)
        others = {k: n for k, n in waiting.items() if k != key and n > 0}
        count = self.count(key)
        if own == 0 and others:
            count = max(count, min(self.count(k) for k in others))
        last = count + own * self._step(key)
        turns = float(own + 1)
        for other, n in others.items():
            behind = last - self.count(other)
            if behind >= 0:
                turns += min(n, math.floor(behind / self._step(other)) + 1)
        return turns

    def owed_to_peers(self, key: str, peer_queued: Mapping[str, int]) -> int:
        """Requests the other processes hold waiting for keys whose count is more than one
        of `key`'s turns below `key`'s: in the fleet-wide order they go before `key`'s next
        request. A place freed here is
        seen here first, so without leaving them places a key whose requests all come
        through another process would wait behind this process's flood, however low its
        count (the shell leaves the places for `Limits.peer_yield` at most)."""
        # More than a turn: a peer's counts arrive a push late, its own key's here at once,
        # so two replicas each flooding an equal key would each see the other's as lower
        # and both leave their places idle.
        below = self.count(key) - self._step(key)
        return sum(
            n for k, n in peer_queued.items() if n > 0 and k != key and self.count(k) < below
        )

    def _step(self, key: str) -> float:
        """What one more request adds to `key`'s count: its mean weighted cost per request
        placed (every key's mean for a key not yet placed) over its share."""
        placed = self._placed.get(key, 0)
        if placed:
            cost = self._own.get(key, 0.0) / placed
        else:
            total = self._total_placed
            cost = self._total_own / total if total else 1.0
        return max(cost, 1e-9) / self.share(key)

    def own(self) -> dict[str, float]:
        """The weighted service this process gave each key (published; the metric)."""
        return dict(self._own)

    def __repr__(self) -> str:
        counts = " ".join(f"{k}={self.count(k):g}" for k in sorted(self._own))
        return f"<ServiceCounts {counts}>"
