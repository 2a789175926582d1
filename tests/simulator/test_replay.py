"""Recording a scheduler trace in the engine core and replaying it exactly (no model).

The core runs a fake model whose random tokens end requests at EOS, over a
small KV cache, so steps mix prefills, chunks, decodes, prefix hits and
preemptions; requests arrive and are aborted between steps, and the prefix
cache is reset once. The replay must decide every step as recorded.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgspec
import pytest

from tokenloom.config import CacheConfig, SchedulerConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.core.sched.trace import (
    TRACE_VERSION,
    TraceArrival,
    TraceConfig,
    TraceFinish,
    TraceHeader,
    TraceStep,
    anonymize,
    read_trace,
)
from tokenloom.engine.core import EngineCore
from tokenloom.engine.messages import EngineCoreRequest
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.simulator.cost_model import CostModel
from tokenloom.simulator.replay import ReplayMismatch, replay, simulate, with_overrides

EOS = 0


class RandomTokens:
    """A model runner that reads the scheduler's requests to know which ones sample, and
    gives them random tokens in [0, 50): EOS (0) ends a request about every 50 tokens."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self.num_blocks = num_blocks
        self.max_model_len = 512
        self.rng = random.Random(seed)
        self.scheduler: Scheduler | None = None

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.scheduler is not None
        requests = self.scheduler.requests
        req_ids = list(scheduler_output.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([self.rng.randrange(50)] if done else [])
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def remove_lora(self, lora_int_id: int) -> bool:
        return False


def record(path: Path, seed: int = 0, policy: str = "fcfs") -> dict[str, int]:
    """Run a random workload on a fake-model core recording to ``path``; the prefix-cache
    hit (tokens) of each request, as the core reported it."""
    rng = random.Random(seed)
    scheduler_config = SchedulerConfig(
        max_num_seqs=6,
        max_num_batched_tokens=48,
        long_prefill_token_threshold=20,
        policy=policy,  # type: ignore[arg-type]
        record_trace=str(path),
    )
    runner = RandomTokens(num_blocks=48, seed=seed)
    core = EngineCore(runner, CacheConfig(block_size=4, num_blocks=48), scheduler_config)
    runner.scheduler = core.scheduler
    shared = [rng.randrange(1, 1000) for _ in range(24)]
    live: list[str] = []
    cached: dict[str, int] = {}
    for i in range(60):
        for _ in range(rng.choice((0, 0, 1, 2))):
            prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(3, 60))]
            if rng.random() < 0.4:
                prompt = shared[: rng.randrange(8, 25)] + prompt
            params = SamplingParams(max_tokens=rng.randrange(1, 40))
            req_id = f"req-{i}-{len(live)}"
            tenant = rng.randrange(3)  # weighed under the fair policy
            core.add_request(
                EngineCoreRequest(
                    req_id,
                    prompt,
                    params,
                    EOS,
                    arrival_time=time.time(),
                    priority=rng.randrange(3),
                    tenant=f"team-{tenant}",
                    tenant_weight=1.0 + tenant,
                )
            )
            live.append(req_id)
        if live and rng.random() < 0.08:
            core.abort_requests([live.pop(rng.randrange(len(live)))])
        if i == 30:
            core.reset_prefix_cache()
        step(core, cached)
    while core.has_work():
        step(core, cached)
    core.shutdown()
    return cached


def step(core: EngineCore, cached: dict[str, int]) -> None:
    result = core.step()
    if result is not None:
        for output in result.outputs.outputs:
            cached[output.request_id] = output.num_cached_tokens


@pytest.mark.parametrize("policy", ["fcfs", "priority", "fair"])
def test_replay_reproduces_every_step(tmp_path: Path, policy: str) -> None:
    path = tmp_path / "trace.jsonl"
    record(path, policy=policy)
    trace = read_trace(path)
    # Tenants keep only which is which, and their weights.
    tenants = {(a.tenant, a.tenant_weight) for a in trace.arrivals}
    assert {t for t, _ in tenants} == {"t0", "t1", "t2"} and len(tenants) == 3
    assert trace.config.max_num_seqs == 6 and trace.config.num_blocks == 48
    assert len(trace.finishes) == len(trace.arrivals) > 30
    kinds = {f.finish for f in trace.finishes.values()}
    assert {"stop", "length", "abort"} <= kinds
    assert any(step.preempted for step in trace.steps), "the workload never preempted"
    assert trace.resets

    result = replay(trace)

    assert len(result.run.steps) == len(trace.steps)
    # The replay fed every request exactly the tokens it generated.
    outputs = {t.index: t.num_output_tokens for t in result.run.requests}
    for index, finish in trace.finishes.items():
        if finish.finish in ("stop", "length"):
            assert outputs[index] == len(finish.output)
    # Prefix hits happened, so the anonymised tokens kept the shared prefixes.
    assert sum(1 for r in result.run.requests if r.num_preemptions) > 0
    assert result.durations == [s.duration for s in trace.steps]


def test_replay_under_another_config_is_caught(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    record(path)
    lines = path.read_bytes().splitlines()
    header = msgspec.json.decode(lines[0], type=TraceHeader)
    header.config.max_num_seqs = 5
    lines[0] = msgspec.json.encode(header)
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ReplayMismatch, match="step"):
        replay(read_trace(path))


def test_anonymized_prefixes_match_exactly_where_the_real_ones_do() -> None:
    a = anonymize([5, 6, 7, 8])
    b = anonymize([5, 6, 9, 8])
    assert a[:2] == b[:2]
    assert a[2] != b[2] and a[3] != b[3]  # the same token after a difference differs too
    assert anonymize([5, 6, 7, 8]) == a


def test_prefix_hits_survive_anonymisation(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    cached = record(path)
    trace = read_trace(path)
    run = replay(trace).run
    replayed = {trace.arrivals[r.index].request_id: r.num_cached_tokens for r in run.requests}
    hits = {req_id: n for req_id, n in cached.items() if n > 0}
    assert len(hits) > 5
    assert {req_id: replayed[req_id] for req_id in cached} == cached


def test_simulating_the_same_config_with_the_fitted_costs_runs_every_request(
    tmp_path: Path,
) -> None:
    path = tmp_path / "trace.jsonl"
    record(path)
    trace = read_trace(path)
    exact = replay(trace)
    model = exact.fit_cost_model()
    run = simulate(trace, model)
    completed = [r for r in run.requests if r.completed]
    assert completed and all(r.finish is not None for r in completed)
    by_index = {r.index: r for r in exact.run.requests}
    for r in completed:
        assert r.num_output_tokens == by_index[r.index].num_output_tokens


def test_simulated_settings_change_what_the_scheduler_does(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    record(path)
    trace = read_trace(path)
    model = replay(trace).fit_cost_model()
    one_at_a_time = simulate(trace, model, with_overrides(trace.config, max_num_seqs=1))
    assert max(s.shape.requests for s in one_at_a_time.steps) == 1
    roomy = simulate(trace, model, with_overrides(trace.config, num_blocks=4096))
    assert sum(r.num_preemptions for r in roomy.requests) == 0
    tight = simulate(trace, model, with_overrides(trace.config, num_blocks=24))
    assert sum(r.num_preemptions for r in tight.requests) > 0
    for run in (one_at_a_time, roomy, tight):
        assert all(r.finish is not None for r in run.requests if r.completed)


def test_rate_scale_compresses_the_arrivals(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    record(path)
    trace = read_trace(path)
    model = replay(trace).fit_cost_model()
    normal = simulate(trace, model)
    twice = simulate(trace, model, rate_scale=2.0)
    first = normal.requests[0].arrival
    for a, b in zip(normal.requests, twice.requests, strict=True):
        assert b.arrival - first == pytest.approx((a.arrival - first) / 2)
    with pytest.raises(ValueError, match="rate_scale"):
        simulate(trace, model, rate_scale=0.0)
    with pytest.raises(ValueError, match="not a scheduler trace setting"):
        with_overrides(trace.config, max_num_sequences=3)


def test_a_request_that_arrived_during_a_step_waits_for_the_simulated_steps_only(
    tmp_path: Path,
) -> None:
    """Recorded: request 1 arrived 0.1 s into a 1 s step and reached the scheduler when
    it ended. Simulated with 10 ms steps, it is added 1 ms (the front end's own delay)
    after its arrival, not the recorded 0.9 s wait."""
    config = TraceConfig(
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        policy="fcfs",
        block_size=4,
        num_blocks=32,
        enable_prefix_caching=False,
        max_model_len=128,
    )
    prompts = [anonymize(list(range(1, 9))), anonymize(list(range(20, 28)))]
    records = [
        TraceHeader(version=TRACE_VERSION, start_time=0.0, config=config),
        TraceArrival(
            index=0, request_id="a", arrival_time=0.0, add_time=0.0, add_step=0, prompt=prompts[0]
        ),
        TraceStep(index=0, start=0.0, duration=1.0, reqs=[0], tokens=[8]),
        TraceArrival(
            index=1, request_id="b", arrival_time=0.1, add_time=1.001, add_step=1, prompt=prompts[1]
        ),
        TraceStep(index=1, start=1.001, duration=1.0, reqs=[0, 1], tokens=[1, 8]),
        TraceFinish(index=0, output=[1, 2], finish="length", time=2.0, step=1),
        TraceFinish(index=1, output=[3], finish="length", time=2.0, step=1),
    ]
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(msgspec.json.encode(r) + b"\n" for r in records))
    trace = read_trace(path)
    model = CostModel(
        coefficients=(0.01, 0.0, 0.0, 0.0, 0.0), step_gap_s=0.0, relative_error=0.0, num_steps=2
    )
    run = simulate(trace, model)
    late = next(r for r in run.requests if r.index == 1)
    assert late.added - late.arrival == pytest.approx(0.001)
    assert late.first_token is not None and late.first_token - late.arrival < 0.05


def test_an_earlier_trace_is_kept_beside_the_new_one(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    record(path, seed=1)
    first = path.read_bytes()
    record(path, seed=2)
    assert (tmp_path / "trace.jsonl.prev").read_bytes() == first
    assert path.read_bytes() != first


def test_a_trace_with_images_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    record(path)
    lines = path.read_bytes().splitlines()
    at = next(i for i, line in enumerate(lines) if b'"type":"arrival"' in line)
    arrival = msgspec.json.decode(lines[at], type=TraceArrival)
    arrival.images = 2
    lines[at] = msgspec.json.encode(arrival)
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match="1 of the trace's requests have images"):
        replay(read_trace(path))
