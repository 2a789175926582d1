"""Replaying a scheduler trace through the real ``Scheduler``, with no model.

``replay`` re-runs a trace exactly as recorded: each request reaches the
scheduler before the step it reached it in the recording, each abort and
prefix-cache reset happens where it did, and each request is fed the
(anonymised) tokens it generated; every ``schedule()`` must then decide what
the recorded step decided, or ``ReplayMismatch`` says where they part. It
gives the recorded run's timings and each step's shape beside its measured
duration, which the cost model is fitted to.

``simulate`` runs the same requests under another configuration or arrival
rate: arrivals come at their (rescaled) times, and a simulated clock advances
by the cost model's prediction for each step the scheduler decides.

A request is given ``max_tokens`` equal to the output it had, so it finishes
after as many tokens as it did (stop strings, EOS and length caps all look
alike to the scheduler). Speculative decoding is not modelled: drafts depend
on the text, which a trace does not keep.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import msgspec

from tokenloom.config import LoRAConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.core.sched.step_stats import batch_composition
from tokenloom.core.sched.trace import Trace, TraceArrival, TraceConfig
from tokenloom.lora_request import LoRARequest
from tokenloom.outputs import ModelRunnerOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams
from tokenloom.simulator.cost_model import CostModel, StepShape, step_shape

_TOKEN_MASK = 0x7FFFFFFF
# Finishes that end a request after the tokens it had, whatever the configuration.
_COMPLETED = ("stop", "length")


class ReplayMismatch(AssertionError):
    """A replayed step decided differently from the recorded one."""


@dataclass
class RequestTiming:
    """One request's life in a run (seconds on the run's clock; None: never happened)."""

    index: int
    arrival: float
    added: float
    num_prompt_tokens: int
    # Its latencies count: it completed in the trace (stop or length).
    completed: bool
    first_scheduled: float | None = None
    first_token: float | None = None
    finish: float | None = None
    num_output_tokens: int = 0
    num_preemptions: int = 0
    # Prompt tokens found in the prefix cache when it was first scheduled.
    num_cached_tokens: int = 0


@dataclass
class StepRecord:
    """One step of a run: when it started, how long it took, what it held, the state after."""

    start: float
    duration: float
    shape: StepShape
    num_prefill_tokens: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preempted: int


@dataclass
class RunResult:
    """A run (the recorded one, replayed, or a simulated one) and its config."""

    config: TraceConfig
    requests: list[RequestTiming]
    steps: list[StepRecord]
    rate_scale: float = 1.0


@dataclass
class Replay:
    """An exact replay: the recorded run's timings, and what the cost model is fitted to."""

    run: RunResult
    shapes: list[StepShape] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    # Between a step's end and the next one's start, while requests remained.
    gaps: list[float] = field(default_factory=list)

    def fit_cost_model(self) -> CostModel:
        gaps = sorted(self.gaps)
        gap = gaps[len(gaps) // 2] if gaps else 0.0
        return CostModel.fit(self.shapes, self.durations, step_gap_s=gap)


def check_replayable(trace: Trace) -> None:
    """``ValueError`` for traces whose decisions depend on what a trace does not keep."""
    if trace.config.num_speculative_tokens:
        raise ValueError(
            "the trace was recorded with speculative decoding, which the simulator does not "
            "model (drafts depend on the text)"
        )
    with_images = sum(1 for arrival in trace.arrivals if arrival.images)
    if with_images:
        raise ValueError(
            f"{with_images} of the trace's requests have images, whose vision encoder work "
            "the simulator does not model"
        )


class _Runner:
    """Drives a ``Scheduler`` over a trace's requests, feeding them their recorded tokens,
    and keeps each request's timing."""

    def __init__(self, trace: Trace, config: TraceConfig, exact: bool) -> None:
        lora_config = LoRAConfig(max_loras=config.max_loras) if config.max_loras else None
        self.scheduler = Scheduler(
            config.scheduler_config(),
            config.cache_config(),
            config.max_model_len,
            lora_config=lora_config,
        )
        self.trace = trace
        self.exact = exact
        self.timings: dict[int, RequestTiming] = {}
        self.steps: list[StepRecord] = []
        # Prior output + output of each request, anonymised as recorded.
        self._tokens: dict[int, list[int]] = {}
        self._prior: dict[int, int] = {}

    def max_tokens(self, arrival: TraceArrival) -> int | None:
        """Output the request gets before it finishes (None: until aborted or the end)."""
        finish = self.trace.finish_of(arrival.index)
        total = len(arrival.prior_output) + len(finish.output)
        if finish.finish in _COMPLETED or finish.finish == "ignored":
            return max(total, 1)
        if self.exact:
            return None  # it ends where it was aborted, or with the trace
        return max(total, 1) if total else None

    def add(self, arrival: TraceArrival, arrival_time: float, added: float) -> None:
        index = arrival.index
        finish = self.trace.finish_of(index)
        self._tokens[index] = arrival.prior_output + finish.output
        self._prior[index] = len(arrival.prior_output)
        lora = (
            LoRARequest(f"adapter-{arrival.lora_int_id}", arrival.lora_int_id)
            if arrival.lora_int_id
            else None
        )
        request = Request(
            str(index),
            arrival.prompt,
            SamplingParams(max_tokens=self.max_tokens(arrival), ignore_eos=True),
            arrival_time=arrival_time,
            priority=arrival.priority,
            lora_request=lora,
            tenant=arrival.tenant,
            tenant_weight=arrival.tenant_weight,
            prior_output_token_ids=arrival.prior_output,
        )
        self.timings[index] = RequestTiming(
            index=index,
            arrival=arrival_time,
            added=added,
            num_prompt_tokens=len(arrival.prompt),
            completed=finish.finish in _COMPLETED,
        )
        self.scheduler.add_request(request)

    def abort(self, index: int, now: float) -> None:
        req_id = str(index)
        if req_id not in self.scheduler.requests:
            return
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)
        timing = self.timings[index]
        if timing.finish is None:
            timing.finish = now

    def _next_token(self, request: Request) -> int:
        index = int(request.request_id)
        tokens = self._tokens[index]
        k = len(request.output_token_ids)
        if k < len(tokens):
            return tokens[k]
        # Beyond what the trace kept (a request cut off by the end of the recording).
        return hash((index, k, "fresh")) & _TOKEN_MASK

    def schedule(self, start: float) -> tuple[SchedulerOutput, ModelRunnerOutput, StepShape]:
        """Schedule one step beginning at ``start``, and what the model would return."""
        output = self.scheduler.schedule()
        requests = self.scheduler.requests
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        num_sampling = 0
        for req_id in output.num_scheduled_tokens:
            request = requests[req_id]
            req_ids.append(req_id)
            if request.num_computed_tokens >= request.num_tokens:
                sampled.append([self._next_token(request)])
                num_sampling += 1
            else:
                sampled.append([])
            timing = self.timings[int(req_id)]
            if timing.first_scheduled is None:
                timing.first_scheduled = start
                timing.num_cached_tokens = request.num_cached_tokens
        runner_output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )
        return output, runner_output, step_shape(output, num_sampling)

    def complete(
        self,
        output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        shape: StepShape,
        start: float,
        end: float,
    ) -> None:
        """Apply a scheduled step's tokens; it ran from ``start`` to ``end``."""
        scheduler = self.scheduler
        for req_id in output.preempted_req_ids:
            self.timings[int(req_id)].num_preemptions += 1
        for outputs in scheduler.update_from_output(output, runner_output).values():
            for out in outputs.outputs:
                timing = self.timings[int(out.request_id)]
                if out.new_token_ids and timing.first_token is None:
                    timing.first_token = end
                timing.num_output_tokens += len(out.new_token_ids)
                if out.finish_reason is not None and timing.finish is None:
                    timing.finish = end
        num_running, num_waiting = scheduler.get_request_counts()
        self.steps.append(
            StepRecord(
                start=start,
                duration=end - start,
                shape=shape,
                num_prefill_tokens=batch_composition(output)[0],
                num_running=num_running,
                num_waiting=num_waiting,
                kv_cache_usage=scheduler.kv_cache_manager.usage,
                num_preempted=len(output.preempted_req_ids),
            )
        )

    def result(self, config: TraceConfig, rate_scale: float) -> RunResult:
        timings = [self.timings[i] for i in sorted(self.timings)]
        return RunResult(config, timings, self.steps, rate_scale)


def replay(trace: Trace) -> Replay:
    """Replay ``trace`` under its own configuration; ``ReplayMismatch`` at the first step
    that decides differently from the recording."""
    check_replayable(trace)
    runner = _Runner(trace, trace.config, exact=True)
    adds: dict[int, list[TraceArrival]] = defaultdict(list)
    for arrival in trace.arrivals:
        adds[arrival.add_step].append(arrival)
    aborts: dict[int, list[int]] = defaultdict(list)
    for index, finish in trace.finishes.items():
        if finish.finish == "abort":
            aborts[finish.step].append(index)
    resets = defaultdict(list)
    for reset in trace.resets:
        resets[reset.step].append(reset)
    result = Replay(run=RunResult(trace.config, [], []))
    previous_end: float | None = None
    for recorded in trace.steps:
        i = recorded.index
        for arrival in adds.pop(i, ()):
            runner.add(arrival, arrival.arrival_time, arrival.add_time)
        for index in aborts.pop(i, ()):
            runner.abort(index, trace.finishes[index].time)
        for reset in resets.pop(i, ()):
            runner.scheduler.reset_prefix_cache(reset.reset_running_requests)
        if previous_end is not None:
            result.gaps.append(recorded.start - previous_end)
        end = recorded.start + recorded.duration
        output, runner_output, shape = runner.schedule(recorded.start)
        runner.complete(output, runner_output, shape, recorded.start, end)
        replayed = [(int(r), n) for r, n in output.num_scheduled_tokens.items()]
        expected = list(zip(recorded.reqs, recorded.tokens, strict=True))
        preempted = sorted(int(r) for r in output.preempted_req_ids)
        if replayed != expected or preempted != sorted(recorded.preempted):
            raise ReplayMismatch(
                f"step {i}: recorded (request, tokens) {expected[:16]} preempted "
                f"{sorted(recorded.preempted)}; replayed {replayed[:16]} preempted {preempted}"
            )
        result.shapes.append(runner.steps[-1].shape)
        result.durations.append(recorded.duration)
        # Requests remained, so the core went straight on to the next step.
        previous_end = end if runner.scheduler.has_requests() else None
    result.run = runner.result(trace.config, 1.0)
    return result


def simulate(
    trace: Trace,
    cost_model: CostModel,
    config: TraceConfig | None = None,
    rate_scale: float = 1.0,
) -> RunResult:
    """The trace's requests under ``config`` (default: the trace's), arriving ``rate_scale``
    times as fast, with each step lasting what ``cost_model`` predicts."""
    check_replayable(trace)
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise ValueError(f"rate_scale must be a positive number, got {rate_scale}")
    config = config or trace.config
    runner = _Runner(trace, config, exact=False)
    first = min((a.arrival_time for a in trace.arrivals), default=0.0)
    step_ends = {step.index: step.start + step.duration for step in trace.steps}
    # (time, order, kind, payload): arrivals at their rescaled times, each keeping the
    # delay it had before reaching the scheduler; aborts of requests that never got a
    # token, as long after their arrival as they were. The core reads new requests
    # between steps, so a request that arrived during a step was added when it ended:
    # only the delay after that end is the front end's, the rest the simulated steps
    # decide.
    events: list[tuple[float, int, str, TraceArrival]] = []
    for arrival in trace.arrivals:
        arrived = first + (arrival.arrival_time - first) / rate_scale
        step_end = step_ends.get(arrival.add_step - 1, arrival.arrival_time)
        front_end_delay = arrival.add_time - max(arrival.arrival_time, step_end)
        added = arrived + max(front_end_delay, 0.0)
        events.append((added, arrival.index, "add", arrival))
        finish = trace.finish_of(arrival.index)
        if finish.finish == "abort" and runner.max_tokens(arrival) is None:
            events.append(
                (added + max(finish.time - arrival.add_time, 0.0), arrival.index, "abort", arrival)
            )
    events.sort(key=lambda e: (e[0], e[1], e[2] != "add"))
    scheduler = runner.scheduler
    gap = cost_model.step_gap_s
    clock = events[0][0] if events else 0.0
    e = 0
    while True:
        while e < len(events) and events[e][0] <= clock:
            when, index, kind, arrival = events[e]
            if kind == "add":
                arrived = first + (arrival.arrival_time - first) / rate_scale
                runner.add(arrival, arrived, when)
            else:
                runner.abort(index, clock)
            e += 1
        if not scheduler.has_requests():
            if e >= len(events):
                break
            clock = events[e][0]
            continue
        output, runner_output, shape = runner.schedule(clock)
        end = clock + cost_model.step_seconds(shape)
        runner.complete(output, runner_output, shape, clock, end)
        clock = end + gap
        stalled = (
            output.total_num_scheduled_tokens == 0
            and not output.finished_req_ids
            and not output.preempted_req_ids
        )
        if stalled:
            if e >= len(events):
                raise RuntimeError(
                    "the simulated scheduler can make no progress and nothing else will arrive"
                )
            clock = max(clock, events[e][0])
    return runner.result(config, rate_scale)


def with_overrides(config: TraceConfig, **overrides: object) -> TraceConfig:
    """``config`` with the given fields replaced (None values are left alone)."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    unknown = sorted(set(changes) - set(TraceConfig.__struct_fields__))
    if unknown:
        raise ValueError(f"not a scheduler trace setting: {', '.join(unknown)}")
    return msgspec.structs.replace(config, **changes) if changes else config
