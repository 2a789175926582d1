"""Waiting-request queues behind one interface, chosen by the scheduling policy.

The scheduler only ever asks for the head (``peek``/``pop``), puts preempted
requests back in front (``prepend``), and removes aborted requests in batches
(``remove``); iteration yields the order in which requests would be served.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tokenloom.request import Request


class RequestQueue(ABC):
    """The order in which waiting requests are admitted."""

    @abstractmethod
    def add(self, request: Request) -> None:
        """Queue a request behind the ones already waiting (in policy order)."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the head. Raises IndexError when empty."""

    @abstractmethod
    def peek(self) -> Request:
        """Return the head without removing it. Raises IndexError when empty."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Put a request back in front (a preempted one resumes before new arrivals)."""

    @abstractmethod
    def remove(self, requests: Iterable[Request]) -> None:
        """Remove the given requests; those not queued are ignored. One pass, any count."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """Requests in the order they would be served."""

    def __bool__(self) -> bool:
        return len(self) > 0


class FCFSRequestQueue(RequestQueue):
    """First come, first served: a deque in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def peek(self) -> Request:
        if not self._queue:
            raise IndexError("peek from an empty request queue")
        return self._queue[0]

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        if gone:
            self._queue = deque(r for r in self._queue if r not in gone)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)


class PriorityRequestQueue(RequestQueue):
    """Lowest ``(priority, arrival_time)`` first; exact ties go to the earlier ``add``.

    ``prepend`` is ``add``: a preempted request's place follows from its key.
    """

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._counter), request)
        heapq.heappush(self._heap, entry)

    def pop(self) -> Request:
        if not self._heap:
            raise IndexError("pop from an empty request queue")
        return heapq.heappop(self._heap)[3]

    def peek(self) -> Request:
        if not self._heap:
            raise IndexError("peek from an empty request queue")
        return self._heap[0][3]

    def prepend(self, request: Request) -> None:
        self.add(request)

    def remove(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        if gone:
            self._heap = [entry for entry in self._heap if entry[3] not in gone]
            heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap, key=lambda e: e[:3]))

    def __bool__(self) -> bool:
        return bool(self._heap)


def create_request_queue(policy: str) -> RequestQueue:
    """The queue for a ``SchedulerConfig.policy`` value."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue()
    raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
