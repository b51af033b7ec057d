"""Pure tests of the simulator's waiting queues: vLLM's fcfs and priority orders."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.sim.sim_engine import ApiError, SimConfig, parse_priority
from gateway.sim.sim_queue import FcfsQueue, PriorityQueue, waiting_queue


@dataclass(eq=False)
class Item:
    priority: int
    arrival: int


def drain(queue: FcfsQueue[Item] | PriorityQueue[Item]) -> list[Item]:
    return [queue.pop() for _ in range(len(queue))]


@given(st.lists(st.integers(-3, 3), max_size=30))
def test_priority_queue_serves_lowest_priority_then_earliest(priorities: list[int]) -> None:
    """Items leave by (priority, arrival), as vLLM's Request.__lt__ orders its heap."""
    queue: PriorityQueue[Item] = PriorityQueue()
    items = [Item(p, i) for i, p in enumerate(priorities)]
    for item in items:
        queue.add(item)
    assert list(queue) == sorted(items, key=lambda it: (it.priority, it.arrival))
    assert drain(queue) == sorted(items, key=lambda it: (it.priority, it.arrival))


@given(st.lists(st.integers(-3, 3), max_size=30))
def test_fcfs_queue_ignores_priority(priorities: list[int]) -> None:
    """Under fcfs the order is arrival alone, whatever the priorities."""
    queue: FcfsQueue[Item] = FcfsQueue()
    items = [Item(p, i) for i, p in enumerate(priorities)]
    for item in items:
        queue.add(item)
    assert drain(queue) == items


def test_remove_keeps_the_order_of_the_rest() -> None:
    """A request aborted while waiting leaves; the others keep their order."""
    queue: PriorityQueue[Item] = PriorityQueue()
    a, b, c = Item(1, 0), Item(0, 1), Item(0, 2)
    for item in (a, b, c):
        queue.add(item)
    queue.remove(b)
    assert repr(queue) == "PriorityQueue(waiting=2, head=(0, 2))"
    assert drain(queue) == [c, a]
    with pytest.raises(ValueError, match="not in the queue"):
        queue.remove(b)


def test_policies_by_name_and_default() -> None:
    """The queue is chosen by the policy's name; fcfs is vLLM's default and ours."""
    assert SimConfig().scheduling_policy == "fcfs"
    assert isinstance(waiting_queue("fcfs"), FcfsQueue)
    assert isinstance(waiting_queue("priority"), PriorityQueue)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        SimConfig(scheduling_policy="sjf")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "expected"),
    [({}, 0), ({"priority": 5}, 5), ({"priority": -2}, -2), ({"priority": "3"}, 3)],
)
def test_priority_field_is_read_as_vllm_validates_it(
    body: dict[str, object], expected: int
) -> None:
    """Absent is 0; an integer or an integer string is taken (pydantic's lax int)."""
    assert parse_priority(body) == expected


@pytest.mark.parametrize("value", ["high", 1.5, None, 2**63, [1]])
def test_a_bad_priority_is_a_400(value: object) -> None:
    """A priority that is no 64-bit integer is refused with 400, naming the field."""
    with pytest.raises(ApiError) as caught:
        parse_priority({"priority": value})
    assert caught.value.status == 400
    assert caught.value.message.startswith("priority: ")
