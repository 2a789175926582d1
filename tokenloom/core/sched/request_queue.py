"""Waiting-request queues behind one interface, chosen by the scheduling policy.

The scheduler only ever asks for the head (``peek``/``pop``), puts preempted
requests back in front (``prepend``), and removes aborted requests in batches
(``remove``); iteration yields the order in which requests would be served.
The queue also carries its policy's preemption choices: which running
request gives way when blocks run out (``pick_victim``), and whether a
waiting request may take a running one's place (``reclaim_victim``).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tokenloom.config import SchedulerConfig
from tokenloom.core.sched.fair_share import FairShare, TenantShare
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

    def pick_victim(self, running: list[Request]) -> int:
        """Index in ``running`` of the request to preempt when blocks run out: by
        default the last one (``running`` is in admission order but under the fair
        policy, which keeps it in arrival order and picks by its own rule)."""
        return len(running) - 1

    def reclaim_victim(
        self, request: Request, running: list[Request], candidates: int
    ) -> int | None:
        """Index (below ``candidates``) of a running request to preempt so that the
        waiting ``request``, short of seats or blocks, can be admitted; by default
        None: it waits for running requests to finish."""
        return None


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

    With ``aging_s`` > 0 a waiting request's priority improves by one level per
    ``aging_s`` seconds of waiting: at any moment the order is by
    ``priority - (now - arrival_time) / aging_s``, which is the order of
    ``priority + arrival_time / aging_s`` whatever ``now`` is, so keys never need
    updating. A request that arrived ``d`` seconds after another with ``p``
    levels better priority goes first only while ``d < p * aging_s``: nothing
    waits forever behind a stream of better-priority arrivals.

    ``prepend`` is ``add``: a preempted request's place follows from its key.
    The preemption victim is the running request with the worst key.
    """

    def __init__(self, aging_s: float = 0.0) -> None:
        if not aging_s >= 0:
            raise ValueError(f"priority_aging_s must be >= 0, got {aging_s!r}")
        self.aging_s = aging_s
        self._heap: list[tuple[float, float, int, Request]] = []
        self._counter = itertools.count()

    def key(self, request: Request) -> tuple[float, float]:
        """Serving order: lower first."""
        if self.aging_s:
            return request.priority + request.arrival_time / self.aging_s, request.arrival_time
        return request.priority, request.arrival_time

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*self.key(request), next(self._counter), request))

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

    def pick_victim(self, running: list[Request]) -> int:
        key = self.key
        return max(range(len(running)), key=lambda i: key(running[i]))


class FairRequestQueue(RequestQueue):
    """One FIFO queue per tenant; the head is the first request of the waiting tenant
    with the lowest virtual time (ties: the earlier arrival). See ``fair_share``.

    A request's tenant must have joined ``fair`` (``FairShare.join``) before it is
    queued. Iteration shows the order if each request were charged its tokens
    as it is admitted.
    """

    def __init__(self, fair: FairShare) -> None:
        self.fair = fair
        self._len = 0

    def _head_share(self) -> TenantShare:
        queued = self.fair.queued
        if len(queued) == 1:
            for share in queued.values():
                return share
        best: TenantShare | None = None
        for share in queued.values():
            if (
                best is None
                or share.vtime < best.vtime
                or (
                    share.vtime == best.vtime
                    and share.waiting[0].arrival_time < best.waiting[0].arrival_time
                )
            ):
                best = share
        if best is None:
            raise IndexError("empty request queue")
        return best

    def _queue_of(self, request: Request) -> TenantShare:
        share = self.fair.tenants[request.tenant]
        self.fair.queued[share.name] = share
        self._len += 1
        share.queued_tokens += request.num_tokens
        return share

    def add(self, request: Request) -> None:
        self._queue_of(request).waiting.append(request)

    def prepend(self, request: Request) -> None:
        self._queue_of(request).waiting.appendleft(request)

    def pop(self) -> Request:
        share = self._head_share()
        request = share.waiting.popleft()
        share.queued_tokens -= request.num_tokens
        if not share.waiting:
            del self.fair.queued[share.name]
        self._len -= 1
        return request

    def peek(self) -> Request:
        return self._head_share().waiting[0]

    def remove(self, requests: Iterable[Request]) -> None:
        gone = set(requests)
        if not gone:
            return
        queued = self.fair.queued
        for share in list(queued.values()):
            kept = deque(r for r in share.waiting if r not in gone)
            self._len -= len(share.waiting) - len(kept)
            share.waiting = kept
            share.queued_tokens = sum(r.num_tokens for r in kept)
            if not kept:
                del queued[share.name]

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        shares = list(self.fair.queued.values())
        vtimes = [share.vtime for share in shares]
        positions = [0] * len(shares)
        for _ in range(self._len):
            best = -1
            for i, share in enumerate(shares):
                if positions[i] == len(share.waiting):
                    continue
                if best < 0 or (vtimes[i], share.waiting[positions[i]].arrival_time) < (
                    vtimes[best],
                    shares[best].waiting[positions[best]].arrival_time,
                ):
                    best = i
            request = shares[best].waiting[positions[best]]
            positions[best] += 1
            vtimes[best] += request.num_tokens / shares[best].weight
            yield request

    def pick_victim(self, running: list[Request]) -> int:
        return self.fair.pick_victim(running)

    def reclaim_victim(
        self, request: Request, running: list[Request], candidates: int
    ) -> int | None:
        return self.fair.reclaim_victim(request, running, candidates)


def create_request_queue(
    policy: str,
    *,
    priority_aging_s: float = SchedulerConfig.priority_aging_s,
    fair_burst_tokens: int = SchedulerConfig.fair_burst_tokens,
) -> RequestQueue:
    """The queue for a ``SchedulerConfig.policy`` value (its other fields: the options)."""
    if policy == "fcfs":
        return FCFSRequestQueue()
    if policy == "priority":
        return PriorityRequestQueue(priority_aging_s)
    if policy == "fair":
        return FairRequestQueue(FairShare(fair_burst_tokens))
    raise ValueError(f"policy must be 'fcfs', 'priority' or 'fair', got {policy!r}")
