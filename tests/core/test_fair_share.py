"""The fair policy (tenants served by weight) and priority aging, step by step.

Each scenario runs a real Scheduler on the fake runner, compares the fair
policy with what FCFS (or priority without aging) does on the same input, and
ends with the leak check, which under the fair policy also checks the
tenants' books.
"""

from __future__ import annotations

import pytest

from tests.core.utils import (
    Harness,
    assert_no_leaks,
    fair_share_of,
    make_request,
    make_scheduler,
)
from tokenloom.core.sched.fair_share import EXPRESS_SPACING, FairShare
from tokenloom.core.sched.request_queue import FairRequestQueue, PriorityRequestQueue
from tokenloom.request import Request


def _first_scheduled(h: Harness, max_steps: int = 500) -> list[str]:
    """Run to the end; request ids in the order they were first scheduled."""
    order: list[str] = []
    for _ in range(max_steps):
        if not h.scheduler.has_requests():
            return order
        so = h.step()
        order += [new.req_id for new in so.scheduled_new_reqs]
    raise AssertionError("no progress")


def _queue(fair: FairShare, *requests: Request) -> FairRequestQueue:
    queue = FairRequestQueue(fair)
    for request in requests:
        fair.join(request)
        queue.add(request)
    return queue


# ---------------------------------------------------------------------- the queue


def test_fair_queue_alternates_tenants_by_weighted_tokens() -> None:
    a = [make_request(f"a{i}", 6, tenant="A") for i in range(4)]
    b = [make_request(f"b{i}", 6, tenant="B", tenant_weight=2.0) for i in range(4)]
    queue = _queue(FairShare(burst_tokens=0), *a, *b)
    # B is charged half as much per token: two of its requests per one of A's.
    assert [r.request_id for r in queue] == ["a0", "b0", "b1", "a1", "b2", "b3", "a2", "a3"]
    assert len(queue) == 8 and queue.peek() is a[0]


def test_fair_queue_pop_prepend_remove() -> None:
    fair = FairShare(burst_tokens=0)
    a0, a1 = make_request("a0", 4, tenant="A"), make_request("a1", 4, tenant="A")
    b0 = make_request("b0", 4, tenant="B")
    queue = _queue(fair, a0, a1, b0)
    assert queue.pop() is a0
    fair.admitted(a0, 4, [])  # A is now ahead: B's head comes first
    assert queue.peek() is b0
    queue.prepend(a0)  # preempted: back in front of its tenant's queue
    assert [r.request_id for r in queue] == ["b0", "a0", "a1"]
    queue.remove([a1, make_request("stranger", 4, tenant="A")])
    assert [r.request_id for r in queue] == ["b0", "a0"] and len(queue) == 2
    queue.remove([b0, a0])
    assert not queue and fair.queued == {}
    with pytest.raises(IndexError):
        queue.peek()
    with pytest.raises(IndexError):
        queue.pop()


def test_idle_tenant_returns_at_most_burst_tokens_ahead() -> None:
    fair = FairShare(burst_tokens=100)
    busy = make_request("busy", 4, tenant="A")
    fair.join(busy)
    fair.admitted(busy, 0, [])
    fair.charge_step(None, 10_000)  # A served alone for a long time
    idle = make_request("idle", 4, tenant="B", tenant_weight=4.0)
    fair.join(idle)
    a, b = fair.tenants["A"], fair.tenants["B"]
    # B did not bank A's solo time: it is 100 units of virtual time ahead (400 tokens
    # at weight 4), no more.
    assert a.vtime - b.vtime == pytest.approx(100)
    # A tenant that leaves while ahead keeps its lead held against it.
    fair.leave(idle, running=False)
    b.vtime = a.vtime + 50
    fair.join(idle)
    assert b.vtime == a.vtime + 50
    fair.leave(idle, running=False)
    fair.leave(busy, running=True)
    fair.check_integrity([])


def test_priority_aging_lets_an_old_request_pass_newer_better_ones() -> None:
    queue = PriorityRequestQueue(aging_s=2.0)
    old_low = make_request("old_low", 4, priority=3, arrival_time=0.0)
    # Three levels better, but 6 s later: even (3 * 2 s of aging), so arrival breaks the tie.
    even = make_request("even", 4, priority=0, arrival_time=6.0)
    newer = make_request("newer", 4, priority=0, arrival_time=5.0)
    later = make_request("later", 4, priority=0, arrival_time=7.0)
    for r in (later, even, old_low, newer):
        queue.add(r)
    assert [r.request_id for r in queue] == ["newer", "old_low", "even", "later"]
    # The victim is the request with the worst aged key.
    assert queue.pick_victim([old_low, newer, later]) == 2
    with pytest.raises(ValueError, match="priority_aging_s"):
        PriorityRequestQueue(aging_s=-1.0)


# ---------------------------------------------------------------------- the scheduler


def test_late_tenant_goes_before_the_flooding_tenants_backlog() -> None:
    """A floods; B's one request is admitted at the next free seat under the fair
    policy, after all of A's requests under FCFS."""
    orders = {}
    for policy in ("fcfs", "fair"):
        h = Harness(make_scheduler(policy=policy, max_num_seqs=2, block_size=4))
        h.add(*(make_request(f"a{i}", 8, max_tokens=3, tenant="A") for i in range(6)))
        h.step()
        h.add(make_request("b0", 8, max_tokens=3, tenant="B"))
        orders[policy] = _first_scheduled(h)
        assert_no_leaks(h.scheduler)
    assert orders["fcfs"] == ["a2", "a3", "a4", "a5", "b0"]
    assert orders["fair"][0] == "b0"


def test_tenant_below_its_share_takes_a_seat_from_one_above() -> None:
    h = Harness(make_scheduler(policy="fair", max_num_seqs=4, block_size=4))
    h.add(*(make_request(f"a{i}", 8, max_tokens=40, tenant="A") for i in range(8)))
    h.step()
    h.step()
    assert [r.request_id for r in h.scheduler.running] == ["a0", "a1", "a2", "a3"]
    h.add(make_request("b0", 8, max_tokens=40, tenant="B"))
    h.add(make_request("b1", 8, max_tokens=40, tenant="B"))
    so = h.step()
    # One seat per step: A's latest request gives way, and does not come back in this step.
    assert so.preempted_req_ids == {"a3"}
    assert [new.req_id for new in so.scheduled_new_reqs] == ["b0"]
    assert "a3" not in so.num_scheduled_tokens
    so = h.step()
    assert so.preempted_req_ids == {"a2"}
    assert "b1" in [new.req_id for new in so.scheduled_new_reqs]
    # Two seats each is the fair split: nobody takes a seat back and forth.
    for _ in range(30):
        so = h.step()
        assert not so.preempted_req_ids
        assert sorted(r.tenant for r in h.scheduler.running) == ["A", "A", "B", "B"]
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_prefill_chunk_is_capped_while_another_tenant_waits() -> None:
    steps = {}
    for policy in ("fcfs", "fair"):
        h = Harness(make_scheduler(policy=policy, max_num_batched_tokens=32, block_size=4))
        h.add(make_request("b0", 4, max_tokens=20, tenant="B"))
        h.add(make_request("long", 200, max_tokens=2, tenant="A"))
        for _ in range(3):
            assert set(h.step().num_scheduled_tokens) == {"long", "b0"}
        # B is busy (b0 decodes), so b1 shares the step with A's prompt.
        h.add(make_request("b1", 8, max_tokens=2, tenant="B"))
        steps[policy] = h.step().num_scheduled_tokens
        h.run_until_done()
        assert_no_leaks(h.scheduler)
    assert steps["fcfs"] == {"b0": 1, "long": 31}
    # A's chunk is capped at its half of the step, raised to what B's waiting
    # prompt leaves unused (32 - 8), so nothing of the budget is wasted.
    assert steps["fair"] == {"b0": 1, "long": 24, "b1": 7}


def test_a_tenant_back_from_idle_gets_a_step_to_itself() -> None:
    """A is busy; B sends one request after being idle. Under the fair policy its
    prompt runs alone in the next step (A's decodes and prompt chunk wait that one
    step), then the steps are shared again; FCFS fills the step with A's."""
    firsts = {}
    for policy in ("fcfs", "fair"):
        h = Harness(make_scheduler(policy=policy, max_num_batched_tokens=32, block_size=4))
        h.add(*(make_request(f"a{i}", 4, max_tokens=30, tenant="A") for i in range(3)))
        h.add(make_request("a_long", 200, max_tokens=2, tenant="A"))
        for _ in range(3):
            h.step()
        h.add(make_request("b_new", 8, max_tokens=3, tenant="B"))
        firsts[policy] = h.step().num_scheduled_tokens
        if policy == "fair":
            after = h.step().num_scheduled_tokens
            assert {"a0", "a1", "a2", "a_long"} <= set(after)
        h.run_until_done()
        assert_no_leaks(h.scheduler)
    assert firsts["fcfs"] == {"a0": 1, "a1": 1, "a2": 1, "a_long": 29}
    assert firsts["fair"] == {"b_new": 8}


def test_express_steps_are_spaced_out() -> None:
    """Idle tenants keep arriving, one per step: each still starts in the step after
    it arrived, alone at most once in EXPRESS_SPACING steps; the busy tenant runs in
    all the others."""
    h = Harness(make_scheduler(policy="fair", max_num_batched_tokens=64, block_size=4))
    h.add(*(make_request(f"a{i}", 4, max_tokens=60, tenant="A") for i in range(2)))
    h.step()
    a_ran, started = [], {}
    for step in range(13):
        h.add(make_request(f"n{step}", 4, max_tokens=1, tenant=f"T{step}"))
        scheduled = h.step().num_scheduled_tokens
        a_ran.append("a0" in scheduled)
        started.update({r: step for r in scheduled if r.startswith("n") and r not in started})
    # Express at the first arrival, then every EXPRESS_SPACING steps.
    assert [i for i, ran in enumerate(a_ran) if not ran] == list(range(0, 13, EXPRESS_SPACING))
    assert all(started[f"n{i}"] == i for i in range(13)), started
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_express_step_falls_back_to_a_shared_one_when_nothing_can_start() -> None:
    """B's prompt needs more blocks than A's running requests leave, and none of
    A's may give way (B would hold more than its share of seats): the step is an
    ordinary one, and B starts once blocks free up."""
    h = Harness(make_scheduler(policy="fair", block_size=4, num_blocks=12, max_num_seqs=2))
    h.add(make_request("a0", 16, max_tokens=8, tenant="A"))
    h.step()
    h.add(make_request("b0", 40, max_tokens=2, tenant="B"))
    so = h.step()
    assert so.num_scheduled_tokens == {"a0": 1}
    assert not so.preempted_req_ids
    h.run_until_done()
    assert_no_leaks(h.scheduler)


def test_preemption_victim_is_the_latest_start_in_virtual_time() -> None:
    """A's second request was admitted after A had been served for a while; B's,
    admitted later in time, starts earlier in virtual time (B was idle). When
    blocks run out FCFS preempts B's (the last admitted), the fair policy A's."""
    first_victims = {}
    for policy in ("fcfs", "fair"):
        h = Harness(make_scheduler(policy=policy, block_size=4, num_blocks=24))
        h.add(make_request("a_old", 8, max_tokens=30, tenant="A"))
        for _ in range(10):
            h.step()
        h.add(make_request("a_new", 8, max_tokens=30, tenant="A"))
        h.step()
        h.add(make_request("b", 8, max_tokens=30, tenant="B"))
        while not (preempted := h.step().preempted_req_ids):
            assert h.scheduler.has_requests()
        first_victims[policy] = preempted
        h.run_until_done()
        assert_no_leaks(h.scheduler)
    assert first_victims == {"fcfs": {"b"}, "fair": {"a_new"}}


def test_priority_aging_ends_starvation_by_a_stream_of_better_requests() -> None:
    """One seat, a better-priority request arriving every step: without aging the
    worse one waits for the stream to end; with it, about priority * aging_s."""
    admitted_at = {}
    for aging_s in (0.0, 2.0):
        h = Harness(make_scheduler(policy="priority", max_num_seqs=1, priority_aging_s=aging_s))
        h.add(make_request("low", 4, max_tokens=1, priority=5, arrival_time=0.0))
        for step in range(1, 40):
            h.add(make_request(f"hi{step}", 4, max_tokens=1, priority=0, arrival_time=step))
            so = h.step()
            if "low" in [new.req_id for new in so.scheduled_new_reqs]:
                admitted_at[aging_s] = step
                break
        h.run_until_done()
        assert_no_leaks(h.scheduler)
    assert 0.0 not in admitted_at
    # Five levels at 2 s each: the arrivals after t=10 no longer pass it.
    assert 10 <= admitted_at[2.0] <= 12


def test_one_tenant_fair_is_fcfs() -> None:
    """With a single tenant the fair policy makes FCFS's decisions, step for step."""
    outputs = {}
    for policy in ("fcfs", "fair"):
        h = Harness(
            make_scheduler(policy=policy, block_size=4, num_blocks=30, max_num_batched_tokens=24)
        )
        h.add(*(make_request(f"r{i}", 5 + 3 * i, max_tokens=6 + i, tenant="T") for i in range(8)))
        trace = []
        while h.scheduler.has_requests():
            so = h.step()
            trace.append((dict(so.num_scheduled_tokens), sorted(so.preempted_req_ids)))
        outputs[policy] = trace
        assert_no_leaks(h.scheduler)
    assert outputs["fair"] == outputs["fcfs"]
    # FCFS's victim is the last admitted, wherever its arrival put it in ``running``.
    fair = FairShare(burst_tokens=0)
    x, y = make_request("x", 4, tenant="T"), make_request("y", 4, tenant="T")
    running: list[Request] = []
    for request in (y, x):
        fair.join(request)
        fair.admitted(request, 4, running)
    assert running == [x, y] and fair.pick_victim(running) == 0


def test_running_requests_stay_in_arrival_order() -> None:
    """Weights 1 and 3 interleave the admissions (B's requests first), yet the
    running list keeps the order the requests arrived in, and a preempted
    request resumes in its place."""
    h = Harness(make_scheduler(policy="fair", max_num_seqs=6, block_size=4, num_blocks=40))
    h.add(*(make_request(f"a{i}", 8, max_tokens=20, tenant="A") for i in range(4)))
    h.add(
        *(make_request(f"b{i}", 8, max_tokens=20, tenant="B", tenant_weight=3.0) for i in range(4))
    )
    so = h.step()
    admitted = [new.req_id for new in so.scheduled_new_reqs]
    assert admitted[:4] == ["a0", "b0", "b1", "b2"]  # B is charged a third per token
    arrived = ["a0", "a1", "a2", "a3", "b0", "b1", "b2", "b3"]
    assert [r.request_id for r in h.scheduler.running] == [r for r in arrived if r in admitted]
    preempted: set[str] = set()
    while h.scheduler.has_requests():
        so = h.step()
        preempted |= so.preempted_req_ids
        arrivals = [r.arrival_time for r in h.scheduler.running]
        assert arrivals == sorted(arrivals)
    assert preempted  # the blocks ran out: victims left and came back in their places
    assert_no_leaks(h.scheduler)


def test_reclaimed_seat_is_the_tenants_latest_admission_not_its_last_in_running() -> None:
    fair = FairShare(burst_tokens=100)  # B joins behind A in virtual time
    a0, a1 = make_request("a0", 4, tenant="A"), make_request("a1", 4, tenant="A")
    b0 = make_request("b0", 4, tenant="B")
    running: list[Request] = []
    for request in (a1, a0):  # a0 (say, preempted and resumed) was admitted last
        fair.join(request)
        fair.admitted(request, 4, running)
    fair.join(b0)
    assert running == [a0, a1]
    assert fair.reclaim_victim(b0, running, candidates=2) == 0
    # Requests admitted in this step are not candidates: a0 stays, a1 gives way.
    assert fair.reclaim_victim(b0, running, candidates=1) == 1


def test_tenants_books_follow_aborts_and_finishes() -> None:
    h = Harness(make_scheduler(policy="fair", max_num_seqs=2, block_size=4))
    h.add(*(make_request(f"a{i}", 6, max_tokens=5, tenant="A") for i in range(3)))
    h.add(make_request("b0", 6, max_tokens=5, tenant="B", tenant_weight=3.0))
    h.step()
    fair = fair_share_of(h.scheduler)
    assert fair is not None
    assert {n: (s.num_requests, s.num_running) for n, s in fair.active.items()} == {
        "A": (3, 1),
        "B": (1, 1),
    }
    from tokenloom.request import RequestStatus

    h.scheduler.finish_requests(["a0", "a2"], RequestStatus.FINISHED_ABORTED)
    fair.check_integrity(h.scheduler.running)
    assert fair.active["A"].num_requests == 1 and fair.active["A"].num_running == 0
    h.run_until_done()
    assert_no_leaks(h.scheduler)
