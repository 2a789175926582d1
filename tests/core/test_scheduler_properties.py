"""Property tests: long random workloads against the scheduler's invariants.

Random prompt lengths with shared prefixes, arrivals over time, random aborts,
random EOS, draft tokens with random acceptance, small caches that force
preemption, every policy (with priority aging, and tenants of several
weights for the fair one), chunking on and off. Each step is cross-checked by
the Harness (budget, max_num_seqs, only RUNNING requests scheduled, the fake
runner's block tables and computed counts equal the scheduler's); at the end
every request got exactly the tokens the runner produced for it, and nothing
leaked.
"""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.utils import FakeRunner, Harness, assert_no_leaks, make_request, make_scheduler
from tokenloom.request import Request, RequestStatus

EOS = 3
VOCAB = 40


@st.composite
def workloads(draw: st.DrawFn) -> dict:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    chunked = draw(st.booleans())
    max_prompt = draw(st.integers(4, 48))
    config = {
        "policy": draw(st.sampled_from(["fcfs", "priority", "fair"])),
        "priority_aging_s": draw(st.sampled_from([0.0, 0.0, 0.5, 4.0])),
        "fair_burst_tokens": draw(st.sampled_from([0, 16, 8192])),
        "enable_chunked_prefill": chunked,
        "block_size": block_size,
        # From "barely one request" to "plenty".
        "num_blocks": draw(st.integers(2, 4 + 3 * max_prompt // block_size)),
        "max_num_batched_tokens": draw(st.integers(1 if chunked else max_prompt, 96)),
        "max_num_seqs": draw(st.integers(1, 8)),
        "long_prefill_token_threshold": draw(st.sampled_from([0, 0, 3, 16])),
        "enable_prefix_caching": draw(st.booleans()),
        "num_speculative_tokens": draw(st.sampled_from([0, 0, 2, 4])),
        "max_model_len": draw(st.integers(max_prompt // 2 + 1, 2 * max_prompt + 40)),
        "log_stats": True,
    }
    requests = draw(
        st.lists(
            st.tuples(
                st.integers(0, 3),  # shared prefix id
                st.integers(1, max_prompt),  # prompt length
                st.integers(1, 24),  # max_tokens
                st.integers(0, 3),  # priority
                st.integers(0, 30),  # arrival step
                st.booleans(),  # uses EOS
                st.integers(0, 3),  # min_tokens
                st.integers(0, 2),  # tenant
            ),
            min_size=1,
            max_size=24,
        )
    )
    weights = draw(st.lists(st.sampled_from([0.5, 1.0, 3.0]), min_size=3, max_size=3))
    return {
        "config": config,
        "requests": requests,
        "weights": weights,
        "seed": draw(st.integers(0, 2**16)),
    }


def _build(spec: tuple, index: int, weights: list[float]) -> Request:
    prefix_id, length, max_tokens, priority, _arrival, eos, min_tokens, tenant = spec
    prefix = [1000 * (prefix_id + 1) + i for i in range(length)]
    tail_start = length // 2 if prefix_id else length  # half of the prompt is shared
    prompt = prefix[:tail_start] + [50_000 + 100 * index + i for i in range(length - tail_start)]
    return make_request(
        f"r{index}",
        prompt,
        max_tokens=max_tokens,
        priority=priority,
        arrival_time=float(index),
        eos_token_id=EOS if eos else None,
        min_tokens=min(min_tokens, max_tokens),
        tenant=f"t{tenant}",
        tenant_weight=weights[tenant],
    )


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(workloads())
def test_random_workloads_keep_every_invariant(workload: dict) -> None:
    rng = random.Random(workload["seed"])
    runner = FakeRunner(
        token_source=lambda _rid: rng.randrange(VOCAB),
        accept=lambda _rid, drafts: rng.randint(0, len(drafts)),
    )
    scheduler = make_scheduler(**workload["config"])
    h = Harness(scheduler, runner)
    pending = sorted(
        (
            (spec[4], i, _build(spec, i, workload["weights"]))
            for i, spec in enumerate(workload["requests"])
        ),
        key=lambda item: (item[0], item[1]),
    )
    requests = {request.request_id: request for _, _, request in pending}
    aborted: set[str] = set()
    num_spec = workload["config"]["num_speculative_tokens"]
    preemptions = stat_preemptions = 0

    step = 0
    while pending or scheduler.has_requests():
        while pending and pending[0][0] <= step:
            h.add(pending.pop(0)[2])
        if scheduler.requests and rng.random() < 0.05:
            victim = rng.choice(sorted(scheduler.requests))
            aborted.add(victim)
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        if num_spec:
            scheduler.update_draft_token_ids(
                {
                    r.request_id: [rng.randrange(VOCAB) for _ in range(rng.randint(0, num_spec))]
                    for r in scheduler.running
                    if r.num_output_tokens > 0 and rng.random() < 0.7
                }
            )
        so = h.schedule()
        assert not (set(so.num_scheduled_tokens) & aborted)
        preemptions += len(so.preempted_req_ids)
        if rng.random() < 0.05 and so.num_scheduled_tokens:
            # An abort between schedule() and update_from_output().
            victim = rng.choice(sorted(so.num_scheduled_tokens))
            aborted.add(victim)
            scheduler.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
        result = h.run(so)
        for outputs in result.values():
            if outputs.scheduler_stats is not None:
                stat_preemptions += outputs.scheduler_stats.num_preemptions
        step += 1
        assert step < 20_000, "no progress"

    assert stat_preemptions == preemptions
    for req_id, request in requests.items():
        assert request.is_finished()
        emitted = h.tokens(req_id)
        given_tokens = runner.given.get(req_id, [])
        # Exactly what the runner produced, minus tokens cut after a stop.
        assert emitted == request.output_token_ids == given_tokens[: len(emitted)]
        if req_id in aborted:
            continue
        final = h.finished[req_id]
        status = request.status
        assert final.finish_reason == request.get_finished_reason()
        if status == RequestStatus.FINISHED_STOPPED:
            assert len(emitted) >= request.sampling_params.min_tokens
            assert emitted[-1] == EOS
        elif status == RequestStatus.FINISHED_LENGTH_CAPPED:
            assert (
                len(emitted) == request.max_tokens or request.num_tokens >= scheduler.max_model_len
            )
        else:
            assert status == RequestStatus.FINISHED_IGNORED
            assert final.new_token_ids == []
        if len(given_tokens) > len(emitted):
            assert status == RequestStatus.FINISHED_STOPPED or status.name.endswith("CAPPED")
    assert_no_leaks(scheduler)
