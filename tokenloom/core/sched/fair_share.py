"""The fair policy's accountant: how much of the engine each tenant has had.

Each tenant (``Request.tenant``, weighted by ``Request.tenant_weight``) has a
virtual time: the tokens scheduled for its requests (prompt chunks, outputs
and drafts) divided by its weight. The fair policy serves the tenant with the
lowest virtual time first (weighted fair queueing on tokens served), so over
a busy period each tenant's tokens approach its weight's share of what the
engine served while it had requests.

The clock is the lowest virtual time among the tenants with requests; it
never goes back. A tenant with no requests is neither charged nor holds the
clock back. When it gets a request again its virtual time is raised to at
least ``clock - burst_tokens``: however long it was idle, it may be served at
most ``burst_tokens`` times its weight ahead of its share, and tenants that
arrive together start level. A tenant that leaves while ahead of the others
keeps that lead against it (its record stays until the clock passes it).

The scheduler asks it five things (see ``Scheduler``): which tenant's waiting
request comes next (``FairRequestQueue`` in ``request_queue.py``, over the
per-tenant queues kept here), how large a prefill chunk a tenant may take
while another tenant waits (``chunk_caps``: its weight's share of the step's
token budget), which running request to preempt when blocks run out
(``pick_victim``: the one that started last in virtual time, as in start-time
fair queueing: each running request keeps its tenant's virtual time at its
admission, so the request admitted most recently by the fair order gives
way, and the one admitted earliest always progresses), whether a waiting
request may take a seat from a tenant holding more than its share of the
running batch (``reclaim_victim``), and whether a tenant behind its share that
has just sent a request gets the next step to itself (``express_tenants``).
It keeps the scheduler's running list in arrival order (``admitted``). With
one tenant busy every answer is FCFS's (only a resumed request's place in the
running list differs), and charging a step costs O(1); with several, a step is
charged one token per running request of each tenant, corrected for the
requests that got more or none (``charge_running``), or recounted when it
preempted.

Everything a step reads is kept up to date as requests come and go rather
than recomputed per step: each tenant's running requests with their virtual
starts (in admission order, so its last one started last), its waiting
requests' token total, and its running count.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import deque
from operator import attrgetter

from tokenloom.request import Request, RequestStatus

_WAITING = RequestStatus.WAITING
# At most one step in this many is an express step.
EXPRESS_SPACING = 4
_arrival_time = attrgetter("arrival_time")


class TenantShare:
    """One tenant's account: weight, virtual time, live requests and waiting queue."""

    __slots__ = (
        "name", "weight", "vtime", "num_requests", "num_running", "running", "waiting",
        "queued_tokens",
    )  # fmt: skip

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        # Tokens served / weight (-inf until it first joins: the burst floor applies).
        self.vtime = -math.inf
        # Its requests in the scheduler (waiting, running or preempted), and those running.
        self.num_requests = 0
        self.num_running = 0
        # Its running requests in admission order -> (virtual start, admission number).
        self.running: dict[Request, tuple[float, int]] = {}
        # Its waiting requests, in the order it sent them (preempted ones in front),
        # and their tokens (kept by FairRequestQueue).
        self.waiting: deque[Request] = deque()
        self.queued_tokens = 0

    def __repr__(self) -> str:
        return (
            f"TenantShare({self.name!r}, weight={self.weight}, vtime={self.vtime:.1f}, "
            f"requests={self.num_requests}, running={self.num_running}, "
            f"waiting={len(self.waiting)})"
        )


class FairShare:
    """Virtual times of the tenants, and the fair policy's decisions that read them."""

    def __init__(self, burst_tokens: int) -> None:
        if burst_tokens < 0:
            raise ValueError(f"fair_burst_tokens must be >= 0, got {burst_tokens}")
        self.burst_tokens = burst_tokens
        # Tenants with requests, and idle ones still ahead of where a return would put them.
        self.tenants: dict[str, TenantShare] = {}
        # Tenants with requests in the scheduler.
        self.active: dict[str, TenantShare] = {}
        # Tenants with waiting requests (kept by FairRequestQueue).
        self.queued: dict[str, TenantShare] = {}
        # Admissions so far: orders running requests of different tenants.
        self.num_admitted = 0
        self.clock = 0.0
        # Steps scheduled since the last express step (``express_tenants``).
        self.steps_since_express = EXPRESS_SPACING

    # ------------------------------------------------------------------ membership

    def join(self, request: Request) -> None:
        """A request enters the scheduler; its tenant becomes busy if it was idle."""
        share = self.tenants.get(request.tenant)
        if share is None:
            share = self.tenants[request.tenant] = TenantShare(request.tenant, 1.0)
        share.weight = request.tenant_weight
        if not share.num_requests:
            self._advance_clock()
            floor = self.clock - self.burst_tokens
            if share.vtime < floor:
                share.vtime = floor
            self.active[share.name] = share
        share.num_requests += 1

    def admitted(self, request: Request, num_tokens: int, running: list[Request]) -> None:
        """A waiting request starts running with ``num_tokens`` scheduled; it takes its
        place in ``running``, which the fair policy keeps in arrival order (ties: in
        admission order).

        The policy's own decisions (victims, reclaimed seats, chunk caps) come from
        its books, not from the list's order, which only decides who comes first
        for the step's budget. In arrival order, the order the requests were made
        in, each step walks the requests' objects roughly in memory order, as
        under FCFS, instead of in the interleaving the tenants' weights gave their
        admissions, which misses the CPU caches far more at thousands of requests.
        """
        share = self.tenants[request.tenant]
        share.num_running += 1
        share.running[request] = (share.vtime, self.num_admitted)
        self.num_admitted += 1
        share.vtime += num_tokens / share.weight
        arrival = request.arrival_time
        if not running or running[-1].arrival_time <= arrival:
            running.append(request)
        else:
            running.insert(bisect_right(running, arrival, key=_arrival_time), request)

    def preempted(self, request: Request) -> None:
        share = self.tenants[request.tenant]
        share.num_running -= 1
        del share.running[request]

    def leave(self, request: Request, running: bool) -> None:
        """A request left the scheduler (finished, aborted or refused), from ``running``
        or not."""
        share = self.tenants[request.tenant]
        share.num_requests -= 1
        if running:
            share.num_running -= 1
            del share.running[request]
        if share.num_requests:
            return
        # Service while it was busy moves the clock even if it was busy alone.
        self._advance_clock()
        del self.active[share.name]
        if share.vtime <= self.clock - self.burst_tokens:
            del self.tenants[share.name]  # no lead to remember: a return starts at the floor

    def _advance_clock(self) -> None:
        if self.active:
            low = min(share.vtime for share in self.active.values())
            if low > self.clock:
                self.clock = low

    # ------------------------------------------------------------------ charging

    def charge(self, request: Request, num_tokens: int) -> None:
        share = self.tenants[request.tenant]
        share.vtime += num_tokens / share.weight

    def tally(self, num_scheduled: dict[str, int], requests: dict[str, Request]) -> dict[str, int]:
        """Tokens per busy tenant in ``num_scheduled``, counted one request at a time."""
        tokens = dict.fromkeys(self.active, 0)
        for req_id, num in num_scheduled.items():
            tokens[requests[req_id].tenant] += num
        return tokens

    def charge_step(self, tally: dict[str, int] | None, total: int) -> None:
        """Charge a step's tokens: ``tally`` per tenant, or (None: one tenant busy)
        all ``total`` of them to the busy tenant."""
        if tally is None:
            for share in self.active.values():
                share.vtime += total / share.weight
            return
        active = self.active
        for name, num in tally.items():
            share = active[name]
            share.vtime += num / share.weight

    def charge_running(self, extra: dict[str, int]) -> None:
        """Charge a step that preempted nobody: each busy tenant one token per running
        request, plus ``extra[tenant]`` (tokens beyond one per request; negative for
        requests that got none)."""
        if extra:
            for share in self.active.values():
                share.vtime += (share.num_running + extra.get(share.name, 0)) / share.weight
        else:
            for share in self.active.values():
                share.vtime += share.num_running / share.weight

    # ------------------------------------------------------------------ decisions

    def chunk_caps(self, token_budget: int) -> dict[str, int] | None:
        """The largest prefill chunk each tenant may take this step while another tenant
        has requests waiting: its weight's share of ``token_budget``, or more where the
        others' waiting prompts need less than the rest (the budget stays in use).
        None when nobody is capped (one busy tenant, or nobody waiting)."""
        active = self.active
        queued = self.queued
        if len(active) < 2 or not queued:
            return None
        # A tenant's demand: its waiting tokens up to the budget (0 when none wait).
        total_demand = 0
        for share in queued.values():
            total_demand += min(share.queued_tokens, token_budget)
        total_weight = 0.0
        for share in active.values():
            total_weight += share.weight
        caps = {}
        for name, share in active.items():
            others = total_demand - min(share.queued_tokens, token_budget)
            if others:
                fair = int(token_budget * share.weight / total_weight)
                caps[name] = max(1, fair, token_budget - others)
        return caps or None

    def express_tenants(self) -> set[str] | None:
        """Tenants whose waiting requests get the next step to themselves; None for a
        shared step.

        A tenant qualifies when it has nothing running, its next request is plain
        waiting (no grammar compiling, no KV loading), and its virtual time is below
        every tenant with requests running: it is behind its share, typically
        back from idle with the burst allowance. Its prompt would otherwise share
        a full step with the busy tenants' decodes and prefill chunks, so it waits
        for the step in flight and then a whole shared step; alone it waits for
        the step in flight and a step as short as its prompt. Busy tenants lose
        one step's progress, and an express step is an extra step, which costs
        its fixed overhead: at most one step in ``EXPRESS_SPACING`` is one
        (``steps_since_express``, kept by the scheduler), so the busy tenants'
        requests run in the others whatever the arrivals. A tenant that comes
        back sooner than that still goes first in the shared step.
        """
        if self.steps_since_express < EXPRESS_SPACING:
            return None
        # Queued tenants first: usually few, and usually none qualify.
        idle = [
            share
            for share in self.queued.values()
            if not share.num_running and share.waiting[0].status is _WAITING
        ]
        if not idle:
            return None
        lowest_busy = min(
            (share.vtime for share in self.active.values() if share.num_running), default=None
        )
        if lowest_busy is None:
            return None
        return {share.name for share in idle if share.vtime < lowest_busy} or None

    def pick_victim(self, running: list[Request]) -> int:
        """Index of the running request to preempt: the one with the latest virtual
        start, the later admitted on a tie (the last admitted when one tenant is busy)."""
        victim: Request | None = None
        if len(self.active) < 2:
            # FCFS's victim: the last admitted (``running`` is in arrival order).
            for share in self.active.values():
                victim = next(reversed(share.running), None)
        else:
            # The latest start; on a tie the later admission number. A resumed
            # request can start before its tenant's earlier admissions, so every
            # running request is looked at.
            latest = (-math.inf, -1)
            for share in self.active.values():
                for request, start in share.running.items():
                    if start > latest:
                        victim, latest = request, start
        assert victim is not None, "pick_victim with nothing running"
        if victim is running[-1]:
            return len(running) - 1
        return running.index(victim)

    def reclaim_victim(
        self, request: Request, running: list[Request], candidates: int
    ) -> int | None:
        """Index of a running request to preempt so that ``request``, blocked on
        seats or blocks, can run; None when it must wait. ``candidates``: how many
        running requests were not admitted in this step (only those may give way).

        A tenant's share of the running batch is ``len(running)`` times its
        weight over the busy tenants' total. ``request`` may take a seat when
        its tenant would still hold no more than its share, from the tenant
        furthest ahead in virtual time among those that would still hold at
        least theirs, so a seat never moves back and forth.
        """
        active = self.active
        if len(active) < 2:
            return None
        share = self.tenants[request.tenant]
        seats_per_weight = len(running) / sum(s.weight for s in active.values())
        if share.num_running + 1 > share.weight * seats_per_weight:
            return None
        victim: TenantShare | None = None
        for other in active.values():
            if (
                other is not share
                and other.vtime > share.vtime
                and other.num_running - 1 >= other.weight * seats_per_weight
                and (victim is None or other.vtime > victim.vtime)
            ):
                victim = other
        if victim is None:
            return None
        # A tenant's virtual starts never fall in admission order, so its last
        # admitted request has the latest start; those admitted in this step (the
        # last ``len(running) - candidates`` admissions) are not candidates.
        first_this_step = self.num_admitted - (len(running) - candidates)
        for request, (_, number) in reversed(victim.running.items()):
            if number < first_this_step:
                return running.index(request)
        return None

    def check_integrity(self, running: list[Request]) -> None:
        """The books agree with themselves and with ``running`` (for tests)."""
        counts: dict[str, int] = {}
        for request in running:
            counts[request.tenant] = counts.get(request.tenant, 0) + 1
        assert counts == {n: s.num_running for n, s in self.active.items() if s.num_running}
        for name, share in self.tenants.items():
            assert share.num_running == len(share.running)
            assert set(share.running) == {r for r in running if r.tenant == name}
            numbers = [number for _, number in share.running.values()]
            assert numbers == sorted(numbers), "a tenant's running requests by admission"
            assert share.queued_tokens == sum(r.num_tokens for r in share.waiting)
        previous = (-math.inf, -1)
        for request in running:
            _, number = self.tenants[request.tenant].running[request]
            key = (request.arrival_time, number)
            assert key > previous, "running is in arrival order, ties in admission order"
            previous = key
        for name, share in self.active.items():
            assert self.tenants[name] is share and share.num_requests > 0
        for name, share in self.queued.items():
            assert self.active[name] is share and share.waiting
        for share in self.tenants.values():
            assert share.num_requests >= 0 and (share.name in self.active) == bool(
                share.num_requests
            )
            assert len(share.waiting) + share.num_running <= share.num_requests
