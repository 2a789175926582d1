"""Async scheduling in the scheduler: a step is scheduled before the previous
one's tokens are known, with a placeholder for each of them.

The loop below is the engine core's (``EngineCore._step_pipelined``): schedule
step n+1, then apply step n's output. The fake model samples a fixed token per
request and position, so the outputs must equal a synchronous run's."""

from __future__ import annotations

from tests.core.utils import assert_no_leaks, make_request, make_scheduler
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.outputs import ModelRunnerOutput


def token_for(req_id: str, position: int) -> int:
    return (hash(req_id) + 7 * position) % 500 + 10


def schedule(scheduler: Scheduler) -> tuple[SchedulerOutput, dict[str, int]]:
    """A step, and the position each request that samples in it samples at: those
    it brings level with their tokens (placeholders included)."""
    known = {
        r.request_id: len(r.all_token_ids) + r.num_output_placeholders
        for r in (*scheduler.running, *scheduler.waiting)
    }
    so = scheduler.schedule()
    sampling = {}
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        if request.num_computed_tokens >= known[req_id]:
            sampling[req_id] = request.num_computed_tokens
    return so, sampling


def output(so: SchedulerOutput, sampling: dict[str, int]) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[token_for(r, sampling[r])] if r in sampling else [] for r in req_ids],
    )


def run(scheduler: Scheduler, pipelined: bool) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    in_flight = None
    while scheduler.has_requests() or in_flight is not None:
        current = in_flight or schedule(scheduler)
        in_flight = schedule(scheduler) if pipelined and scheduler.has_requests() else None
        for outs in scheduler.update_from_output(current[0], output(*current)).values():
            for out in outs.outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def requests():
    return [make_request(f"r{i}", 5 + 7 * i, max_tokens=3 + 2 * i) for i in range(6)]


def test_a_step_is_scheduled_on_the_previous_steps_placeholders() -> None:
    scheduler = make_scheduler(async_scheduling=True)
    scheduler.add_request(make_request("a", 6, max_tokens=3))
    first, _ = schedule(scheduler)
    assert first.num_scheduled_tokens == {"a": 6}
    # The prompt's token is not known yet: the next step decodes its placeholder.
    second, _ = schedule(scheduler)
    assert second.num_scheduled_tokens == {"a": 1}
    assert scheduler.requests["a"].num_output_placeholders == 2
    scheduler.update_from_output(first, output(first, {"a": 6}))
    assert scheduler.requests["a"].num_output_placeholders == 1
    assert scheduler.requests["a"].output_token_ids == [token_for("a", 6)]


def test_pipelined_outputs_equal_synchronous_ones() -> None:
    sync = make_scheduler(max_num_batched_tokens=24)
    for request in requests():
        sync.add_request(request)
    expected = run(sync, pipelined=False)
    pipelined = make_scheduler(max_num_batched_tokens=24, async_scheduling=True)
    for request in requests():
        pipelined.add_request(request)
    assert run(pipelined, pipelined=True) == expected
    assert {r: len(t) for r, t in expected.items()} == {f"r{i}": 3 + 2 * i for i in range(6)}
    assert_no_leaks(pipelined)


def test_preemption_drops_the_in_flight_token_and_recomputes_it() -> None:
    # 12 blocks of 4 tokens: the six requests cannot all run to the end at once.
    sync = make_scheduler(num_blocks=12, max_num_batched_tokens=24)
    for request in requests():
        sync.add_request(request)
    expected = run(sync, pipelined=False)
    scheduler = make_scheduler(num_blocks=12, max_num_batched_tokens=24, async_scheduling=True)
    added = requests()
    for request in added:
        scheduler.add_request(request)
    got = run(scheduler, pipelined=True)
    assert sum(r.num_preemptions for r in added) > 0
    assert got == expected
    assert_no_leaks(scheduler)
