"""The waiting queues: FCFS and priority behind one interface."""

from __future__ import annotations

import pytest

from tests.core.utils import make_request
from tokenloom.core.sched.request_queue import (
    FCFSRequestQueue,
    PriorityRequestQueue,
    create_request_queue,
)


def test_create_request_queue_by_policy() -> None:
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    assert isinstance(create_request_queue("priority"), PriorityRequestQueue)
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("lifo")


def test_fcfs_order_prepend_remove() -> None:
    queue = FCFSRequestQueue()
    assert not queue and len(queue) == 0
    a, b, c, d = (make_request(x, 4) for x in "abcd")
    for r in (a, b, c):
        queue.add(r)
    assert [r.request_id for r in queue] == ["a", "b", "c"]
    assert queue.peek() is a and queue.pop() is a
    queue.prepend(d)
    assert [r.request_id for r in queue] == ["d", "b", "c"]
    queue.remove([b, a])  # a is not queued: ignored
    assert [r.request_id for r in queue] == ["d", "c"] and len(queue) == 2 and queue
    queue.pop(), queue.pop()
    with pytest.raises(IndexError):
        queue.peek()
    with pytest.raises(IndexError):
        queue.pop()


def test_priority_order_ties_by_arrival_then_insertion() -> None:
    queue = PriorityRequestQueue()
    late_high = make_request("late_high", 4, priority=0, arrival_time=5.0)
    early_low = make_request("early_low", 4, priority=1, arrival_time=1.0)
    early_high = make_request("early_high", 4, priority=0, arrival_time=2.0)
    twin_a = make_request("twin_a", 4, priority=2, arrival_time=3.0)
    twin_b = make_request("twin_b", 4, priority=2, arrival_time=3.0)
    for r in (late_high, early_low, twin_a, twin_b, early_high):
        queue.add(r)
    order = ["early_high", "late_high", "early_low", "twin_a", "twin_b"]
    assert [r.request_id for r in queue] == order
    assert queue.peek() is early_high
    queue.remove([late_high])
    assert [queue.pop().request_id for _ in range(len(queue))] == [
        "early_high", "early_low", "twin_a", "twin_b",
    ]  # fmt: skip
    assert not queue
    # prepend keeps policy order: a preempted request's key decides its place.
    queue.add(early_low)
    queue.prepend(twin_a)
    assert [r.request_id for r in queue] == ["early_low", "twin_a"]
    with pytest.raises(IndexError):
        PriorityRequestQueue().pop()
