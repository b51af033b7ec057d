"""The engine's waiting queue under vLLM's two scheduling policies, chosen by name.

vLLM v1 (`vllm/v1/core/sched/request_queue.py`): `FCFSRequestQueue` is a deque served in
arrival order; `PriorityRequestQueue` is a heap of requests ordered by `Request.__lt__`
(`vllm/v1/request.py`): the lower `priority` first, then the earlier arrival. Under fcfs
the priority travels with the request and nothing reads it.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from .sim_engine import SchedulingPolicy


class Waiter(Protocol):
    """What the queues read of a request: its priority and its arrival number."""

    @property
    def priority(self) -> int: ...

    @property
    def arrival(self) -> int: ...


T = TypeVar("T", bound=Waiter)


class FcfsQueue(Generic[T]):
    """First come, first served; the priority is ignored."""

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()

    def add(self, item: T) -> None:
        self._items.append(item)

    def pop(self) -> T:
        return self._items.popleft()

    def remove(self, item: T) -> None:
        self._items.remove(item)

    def clear(self) -> None:
        self._items.clear()

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"FcfsQueue(waiting={len(self._items)})"


class PriorityQueue(Generic[T]):
    """The lowest (priority, arrival) first, as vLLM's PriorityRequestQueue.

    The arrival number is unique per engine, so two entries never compare equal and the
    order is deterministic (vLLM breaks a tie of arrival times on the request id).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, T]] = []

    def add(self, item: T) -> None:
        heapq.heappush(self._heap, (item.priority, item.arrival, item))

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def remove(self, item: T) -> None:
        kept = [entry for entry in self._heap if entry[2] is not item]
        if len(kept) == len(self._heap):
            raise ValueError("not in the queue")  # as deque.remove
        self._heap = kept
        heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[T]:
        """In the order they would be served."""
        return (entry[2] for entry in sorted(self._heap, key=lambda e: (e[0], e[1])))

    def __repr__(self) -> str:
        head = self._heap[0][:2] if self._heap else None
        return f"PriorityQueue(waiting={len(self._heap)}, head={head})"


_QUEUES: dict[SchedulingPolicy, Callable[[], FcfsQueue[Any] | PriorityQueue[Any]]] = {
    "fcfs": FcfsQueue,
    "priority": PriorityQueue,
}


def waiting_queue(policy: SchedulingPolicy) -> FcfsQueue[T] | PriorityQueue[T]:
    """An empty waiting queue for vLLM's --scheduling-policy `policy`."""
    return _QUEUES[policy]()
