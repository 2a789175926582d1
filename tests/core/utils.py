"""Test helpers for the core: a fake model runner and a leak check. No model, no torch.

``FakeRunner`` turns a ``SchedulerOutput`` into a ``ModelRunnerOutput`` the way a
real runner with a persistent batch would: it mirrors every request's tokens,
progress and block table from the deltas alone, checks that the deltas agree
with what it already holds, and logs every token it hands out, so tests can
compare finished requests with what the "model" produced.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tokenloom.config import CacheConfig, LoRAConfig, SchedulerConfig
from tokenloom.core.sched.fair_share import FairShare
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.request_queue import FairRequestQueue
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.kv_transfer.base import KVConnectorBase
from tokenloom.lora_request import LoRARequest
from tokenloom.multimodal.inputs import MultiModalFeatureSpec
from tokenloom.outputs import EngineCoreOutput, EngineCoreOutputs, ModelRunnerOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output.manager import StructuredOutputManager


@dataclass
class MirroredRequest:
    """What the runner holds for one request between steps."""

    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int] = field(default_factory=list)


class FakeRunner:
    """A model runner without a model.

    A request samples once its scheduled tokens reach the end of its known
    tokens (a finished prefill or a decode); a partial prefill samples nothing.
    Tokens come from ``token_source(req_id)`` (random in ``[0, vocab)`` by
    default). Scheduled draft tokens are accepted per ``accept(req_id, drafts)``
    (all of them by default); accepted drafts plus one new token are returned.

    Images: it "encodes" the step's ``scheduled_encoder_inputs`` into its
    encoder cache (``encoded`` logs each identifier encoded, per step), drops
    ``free_encoder_mm_hashes``, and checks that every image a step's tokens
    reach is held, as the real runner needs.
    """

    def __init__(
        self,
        token_source: Callable[[str], int] | None = None,
        accept: Callable[[str, list[int]], int] | None = None,
        seed: int = 0,
        vocab: int = 1000,
    ) -> None:
        rng = random.Random(seed)
        self.token_source = token_source or (lambda _req_id: rng.randrange(vocab))
        self.accept = accept or (lambda _req_id, drafts: len(drafts))
        self.mirror: dict[str, MirroredRequest] = {}
        # Every token handed out per request, in order (before any stop trimming).
        self.given: dict[str, list[int]] = {}
        self.finished_seen: set[str] = set()
        # Prompts of every request seen, for rebuilding resumed requests.
        self.prompts: dict[str, list[int]] = {}
        self.steps = 0
        # Images of every request seen, the identifiers held, and those encoded per step.
        self.features: dict[str, list[MultiModalFeatureSpec]] = {}
        self.encoder_cache: set[str] = set()
        self.encoded: list[list[str]] = []

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.steps += 1
        for req_id in so.finished_req_ids:
            self.mirror.pop(req_id, None)
            self.finished_seen.add(req_id)
        for req_id in so.preempted_req_ids:
            self.mirror.pop(req_id, None)
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.mirror, f"{new.req_id} sent as new twice"
            # A request resumed after an engine crash brings its earlier output.
            self.mirror[new.req_id] = MirroredRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids),
                new.num_computed_tokens,
                list(new.block_ids),
            )
            if new.output_token_ids:
                self.given[new.req_id] = list(new.output_token_ids)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert req_id not in self.mirror, f"{req_id} resumed while still held"
                assert new_blocks is not None
                outputs = cached.new_token_ids[i]
                assert outputs == self.given.get(req_id, []), f"{req_id}: resumed outputs differ"
                prompt = self.prompts[req_id]
                self.mirror[req_id] = MirroredRequest(
                    prompt + list(outputs), cached.num_computed_tokens[i], list(new_blocks)
                )
                continue
            state = self.mirror[req_id]
            assert cached.new_token_ids[i] == [], f"{req_id}: running request got tokens"
            assert cached.num_computed_tokens[i] == state.num_computed_tokens, (
                f"{req_id}: scheduler says {cached.num_computed_tokens[i]} computed, "
                f"runner holds {state.num_computed_tokens}"
            )
            if new_blocks is not None:
                state.block_ids.extend(new_blocks)
        self._encode(so)

        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, num in so.num_scheduled_tokens.items():
            assert req_id not in self.finished_seen, f"{req_id} scheduled after it finished"
            state = self.mirror[req_id]
            drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            start = state.num_computed_tokens
            assert start + num - len(drafts) <= len(state.token_ids)
            tokens: list[int] = []
            if start + num - len(drafts) >= len(state.token_ids):
                accepted = self.accept(req_id, list(drafts))
                tokens = list(drafts[:accepted]) + [self.token_source(req_id)]
                state.num_computed_tokens = start + num - len(drafts) + accepted
                state.token_ids.extend(tokens)
                self.given.setdefault(req_id, []).extend(tokens)
            else:
                assert not drafts, f"{req_id}: drafts scheduled during a prefill"
                state.num_computed_tokens = start + num
            req_ids.append(req_id)
            sampled.append(tokens)
        return ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled)

    def remember(self, request: Request) -> None:
        self.prompts[request.request_id] = list(request.prompt_token_ids)
        self.features[request.request_id] = list(request.mm_features or ())

    def _encode(self, so: SchedulerOutput) -> None:
        """Drop freed encoder outputs, encode the scheduled ones, and check that each
        scheduled request finds every image its tokens reach."""
        for identifier in so.free_encoder_mm_hashes:
            assert identifier in self.encoder_cache, f"freed {identifier} was never encoded"
            self.encoder_cache.discard(identifier)
        encoded: list[str] = []
        for req_id, input_ids in so.scheduled_encoder_inputs.items():
            assert req_id in so.num_scheduled_tokens, f"{req_id}: encoded but not scheduled"
            for i in input_ids:
                encoded.append(self.features[req_id][i].identifier)
        self.encoder_cache.update(encoded)
        self.encoded.append(encoded)
        for req_id, num in so.num_scheduled_tokens.items():
            start = self.mirror[req_id].num_computed_tokens
            for feature in self.features.get(req_id, ()):
                position = feature.mm_position
                if position.offset < start + num and position.end > start:
                    assert feature.identifier in self.encoder_cache, (
                        f"{req_id}: tokens [{start}, {start + num}) reach "
                        f"{feature.identifier}, which the runner does not hold"
                    )


def make_scheduler(
    *,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
    priority_aging_s: float = 0.0,
    fair_burst_tokens: int = 8192,
    block_size: int = 4,
    num_blocks: int = 1000,
    enable_prefix_caching: bool = True,
    max_model_len: int = 4096,
    num_speculative_tokens: int = 0,
    log_stats: bool = False,
    lora_config: LoRAConfig | None = None,
    structured_output_manager: StructuredOutputManager | None = None,
    max_num_encoder_input_tokens: int | None = None,
    encoder_cache_size: int | None = None,
    enable_encoder_cache: bool = True,
    max_tokens_per_mm_item: int = 0,
    kv_connector: KVConnectorBase | None = None,
    async_scheduling: bool = False,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            async_scheduling=async_scheduling,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            long_prefill_token_threshold=long_prefill_token_threshold,
            policy=policy,  # type: ignore[arg-type]
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size,
            enable_encoder_cache=enable_encoder_cache,
            priority_aging_s=priority_aging_s,
            fair_burst_tokens=fair_burst_tokens,
        ),
        CacheConfig(
            block_size=block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=enable_prefix_caching,
        ),
        max_model_len=max_model_len,
        num_speculative_tokens=num_speculative_tokens,
        log_stats=log_stats,
        lora_config=lora_config,
        structured_output_manager=structured_output_manager,
        max_tokens_per_mm_item=max_tokens_per_mm_item,
        kv_connector=kv_connector,
    )


_arrival = [0.0]


def make_request(
    req_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int | None = 16,
    priority: int = 0,
    arrival_time: float | None = None,
    eos_token_id: int | None = None,
    client_index: int = 0,
    lora_request: LoRARequest | None = None,
    mm_features: list[MultiModalFeatureSpec] | None = None,
    tenant: str = "",
    tenant_weight: float = 1.0,
    **params: object,
) -> Request:
    """A request with ``prompt`` tokens (a count gives distinct-per-id tokens)."""
    if isinstance(prompt, int):
        base = 10_000 * (1 + sum(map(ord, req_id)))
        prompt = [base + i for i in range(prompt)]
    if arrival_time is None:
        _arrival[0] += 1.0
        arrival_time = _arrival[0]
    return Request(
        req_id,
        prompt,
        SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_id=eos_token_id,
        arrival_time=arrival_time,
        priority=priority,
        client_index=client_index,
        lora_request=lora_request,
        mm_features=mm_features,
        tenant=tenant,
        tenant_weight=tenant_weight,
    )


class Harness:
    """A scheduler driven by a FakeRunner, with per-step cross-checks."""

    def __init__(self, scheduler: Scheduler, runner: FakeRunner | None = None) -> None:
        self.scheduler = scheduler
        self.runner = runner or FakeRunner()
        self.outputs: dict[str, list[EngineCoreOutput]] = {}
        self.finished: dict[str, EngineCoreOutput] = {}

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.runner.remember(request)
            self.scheduler.add_request(request)

    def schedule(self) -> SchedulerOutput:
        so = self.scheduler.schedule()
        check_output(self.scheduler, so)
        return so

    def run(self, so: SchedulerOutput) -> dict[int, EngineCoreOutputs]:
        """Execute ``so`` on the fake runner and feed the result back."""
        mro = self.runner.execute(so)
        check_block_tables(self.scheduler, self.runner)
        result = self.scheduler.update_from_output(so, mro)
        for outs in result.values():
            for out in outs.outputs:
                self.outputs.setdefault(out.request_id, []).append(out)
                if out.finish_reason is not None:
                    assert out.request_id not in self.finished
                    self.finished[out.request_id] = out
        return result

    def step(self) -> SchedulerOutput:
        so = self.schedule()
        self.run(so)
        return so

    def step_outputs(self) -> dict[int, EngineCoreOutputs]:
        """One step; what update_from_output returned."""
        return self.run(self.schedule())

    def run_until_done(self, max_steps: int = 10_000) -> int:
        steps = 0
        while self.scheduler.has_requests():
            self.step()
            steps += 1
            assert steps <= max_steps, "scheduler made no progress"
        return steps

    def tokens(self, req_id: str) -> list[int]:
        return [t for out in self.outputs.get(req_id, []) for t in out.new_token_ids]


def fair_share_of(scheduler: Scheduler) -> FairShare | None:
    """The fair policy's accountant (None under the other policies)."""
    waiting = scheduler.waiting
    return waiting.fair if isinstance(waiting, FairRequestQueue) else None


def check_output(scheduler: Scheduler, so: SchedulerOutput) -> None:
    """Invariants every SchedulerOutput must hold."""
    config = scheduler.scheduler_config
    fair = fair_share_of(scheduler)
    if fair is not None:
        fair.check_integrity(scheduler.running)
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= config.max_num_batched_tokens
    assert len(so.num_scheduled_tokens) <= config.max_num_seqs
    assert len(scheduler.running) <= config.max_num_seqs
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    listed = [n.req_id for n in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
    assert sorted(listed) == sorted(so.num_scheduled_tokens)
    for req_id in so.num_scheduled_tokens:
        request = scheduler.requests[req_id]
        assert request.status == RequestStatus.RUNNING
        assert req_id not in so.finished_req_ids
    for req_id, drafts in so.scheduled_spec_decode_tokens.items():
        assert 0 < len(drafts) < so.num_scheduled_tokens[req_id] + 1


def check_block_tables(scheduler: Scheduler, runner: FakeRunner) -> None:
    """The runner's block tables, built from deltas only, match the manager's."""
    manager = scheduler.kv_cache_manager
    for req_id, state in runner.mirror.items():
        if req_id not in scheduler.requests:
            continue  # finished after it was scheduled; dropped next step
        assert state.block_ids == manager.get_block_ids(req_id), f"{req_id}: block table"


def assert_no_leaks(scheduler: Scheduler) -> None:
    """Nothing left: no requests, empty queues, every usable block free and unreferenced."""
    assert not scheduler.requests, f"requests left: {list(scheduler.requests)}"
    assert len(scheduler.waiting) == 0 and list(scheduler.waiting) == []
    assert scheduler.running == []
    assert not scheduler.has_unfinished_requests()
    fair = fair_share_of(scheduler)
    if fair is not None:
        fair.check_integrity([])
        assert not fair.active and not fair.queued
    manager = scheduler.kv_cache_manager
    manager.check_integrity()
    num_blocks = scheduler.cache_config.num_blocks
    assert num_blocks is not None and manager.num_free_blocks == num_blocks - 1
    assert manager.usage == 0.0
    assert all(block.ref_cnt == 0 for block in manager.block_pool.blocks)
    assert scheduler.reset_prefix_cache() is True
    encoder_cache = scheduler.encoder_cache_manager
    encoder_cache.check_integrity()
    assert encoder_cache.num_referenced == 0, f"encoder inputs held: {encoder_cache.cached}"
    assert encoder_cache.num_freeable_slots == encoder_cache.cache_size


def finish_all(scheduler: Scheduler, ids: Iterable[str] | None = None) -> None:
    """Abort whatever is left (for tests that stop midway)."""
    scheduler.finish_requests(
        list(ids if ids is not None else scheduler.requests), RequestStatus.FINISHED_ABORTED
    )


def scripted(scripts: dict[str, list[int]], default: int = 1) -> Callable[[str], int]:
    """A token source that emits each request's script in order, then ``default``."""
    positions: dict[str, int] = {}

    def source(req_id: str) -> int:
        i = positions.get(req_id, 0)
        positions[req_id] = i + 1
        script = scripts.get(req_id, [])
        return script[i] if i < len(script) else default

    return source
