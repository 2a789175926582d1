"""The engine core: a scheduler and a model runner, stepped together.

One ``step()`` is schedule -> execute -> update: the scheduler decides how
many tokens each request gets, the runner runs one forward pass over them, and
the scheduler applies the sampled tokens. With speculative decoding the runner
then proposes drafts, which go to the scheduler for the next step. The core
knows nothing of text; it
runs in the caller's process (``LLM``, tests) or in its own (``core_proc``).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from typing import TYPE_CHECKING, Protocol, cast

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.core.kv_cache.events import KVCacheEvent
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.core.sched.scheduler import Scheduler
from tokenloom.core.sched.step_stats import StepObserver
from tokenloom.core.sched.trace import TraceConfig, TraceRecorder, trace_path
from tokenloom.engine.messages import CoreOutputs, EngineCoreRequest
from tokenloom.outputs import EngineCoreOutputs, ModelRunnerOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.structured_output.manager import GrammarOutput, StructuredOutputManager

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

    from tokenloom.executor.multiproc import MultiprocExecutor
    from tokenloom.kv_transfer.base import KVConnectorBase

logger = logging.getLogger(__name__)

_EMPTY_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


class PendingRunnerOutput(Protocol):
    """A launched step's output (async scheduling): ``get()`` waits for it."""

    def get(self) -> ModelRunnerOutput: ...


class AsyncModelRunner(Protocol):
    """A runner that serves async scheduling (``ModelRunner``; not the tensor-parallel
    executor)."""

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> PendingRunnerOutput:
        """Launch one step and return before it finishes."""
        ...


@dataclasses.dataclass
class _LaunchedStep:
    scheduler_output: SchedulerOutput
    output: ModelRunnerOutput | PendingRunnerOutput
    started: float


# There is one front end, and it is client 0.
_CLIENT_INDEX = 0


class ModelRunnerProtocol(Protocol):
    """What the core needs from a model runner (``worker.model_runner.ModelRunner``)."""

    # KV cache blocks it allocated (including a reserved null block) and its context length.
    num_blocks: int
    max_model_len: int

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run one step; must see every SchedulerOutput, also those with no tokens.

        ``grammar_output`` (only passed when some structured request samples)
        masks those requests' logits before sampling.
        """
        ...

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop a LoRA adapter's weights; False if it had none."""
        ...

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts proposed after the latest step (only called with speculative decoding)."""
        ...


class EngineCore:
    """Steps a model runner (weights, KV cache) and the scheduler together.

    The runner is given, so tests can drive the core with a fake one;
    ``from_config`` builds the real ``ModelRunner``. ``max_model_len`` is the
    runner's context length capped to what the KV cache can hold for one
    request, so every admitted request can finish.

    ``structured_output_manager`` compiles the grammars of structured requests
    (``from_config`` gives one over the model's tokenizer); without one they
    are refused. Each step, the bitmask of the structured requests that sample
    is built here, between schedule and execute; unstructured steps skip it.

    ``kv_connector``: the scheduler side of a KV connector (``from_config``
    builds the one ``CacheConfig.kv_transfer_config`` names, beside the
    runner's worker side); with one, the runner sees every step, so that
    transfers finishing while nothing is scheduled are reported.
    """

    def __init__(
        self,
        runner: ModelRunnerProtocol,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None,
        structured_output_manager: StructuredOutputManager | None = None,
        engine_index: int = 0,
        data_parallel_size: int = 1,
        kv_connector: KVConnectorBase | None = None,
    ) -> None:
        """``engine_index`` of ``data_parallel_size`` cores: names this core's trace file."""
        self.runner = runner
        self.num_blocks: int = runner.num_blocks
        self.cache_config = dataclasses.replace(cache_config, num_blocks=self.num_blocks)
        # One block may be reserved by the cache manager (a null block): leave it out.
        cache_tokens = (self.num_blocks - 1) * self.cache_config.block_size
        self.max_model_len: int = min(runner.max_model_len, cache_tokens)
        # Stats are always on in the core: the front end reads queue lengths from them.
        spec_config = scheduler_config.speculative_config
        self.structured_output_manager = structured_output_manager
        self.scheduler = Scheduler(
            scheduler_config,
            self.cache_config,
            self.max_model_len,
            log_stats=True,
            lora_config=lora_config,
            num_speculative_tokens=0 if spec_config is None else spec_config.num_speculative_tokens,
            structured_output_manager=structured_output_manager,
            # A vision-language model's runner says how large one image can be.
            max_tokens_per_mm_item=getattr(runner, "max_tokens_per_mm_item", 0),
            kv_connector=kv_connector,
        )
        self._speculative = spec_config is not None
        # Async scheduling: the step launched and not yet finished.
        self._async_scheduling = scheduler_config.async_scheduling
        self._in_flight: _LaunchedStep | None = None
        if self._async_scheduling and not hasattr(runner, "execute_model_async"):
            raise ValueError(f"async_scheduling: {type(runner).__name__} runs steps synchronously")
        # Requests scheduled but not yet reported: when they were first scheduled.
        self._first_scheduled: dict[str, float] = {}
        # Tokens the latest step scheduled (0: it could make no progress).
        self.last_num_scheduled_tokens = 0
        # Tensor-parallel workers, stopped with the core (set by ``from_config``).
        self.executor: MultiprocExecutor | None = None
        # Each step's batch and, a few times a second, a KV block map (the dashboard's).
        self._observer = StepObserver(self.scheduler.kv_cache_manager)
        self._recorder: TraceRecorder | None = None
        if scheduler_config.record_trace is not None:
            self._recorder = TraceRecorder(
                trace_path(scheduler_config.record_trace, engine_index, data_parallel_size),
                TraceConfig.of(
                    scheduler_config,
                    self.cache_config,
                    self.max_model_len,
                    self.scheduler.num_speculative_tokens,
                    lora_config.max_loras if lora_config is not None else 0,
                ),
            )

    @classmethod
    def from_config(
        cls,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None,
        engine_index: int = 0,
    ) -> EngineCore:
        """The core over the real ``ModelRunner`` (loads the weights; imports torch), or
        over a ``MultiprocExecutor`` of worker processes when
        ``model_config.parallel_config.tensor_parallel_size`` > 1. ``engine_index``:
        this core's data parallel rank."""
        from tokenloom.executor.multiproc import MultiprocExecutor
        from tokenloom.worker.model_runner import ModelRunner

        started = time.monotonic()
        runner: ModelRunner | MultiprocExecutor
        if model_config.parallel_config.tensor_parallel_size > 1:
            runner = MultiprocExecutor(model_config, cache_config, scheduler_config, lora_config)
        else:
            runner = ModelRunner(model_config, cache_config, scheduler_config, lora_config)
        model_path = runner.model_path

        def load_tokenizer() -> PreTrainedTokenizerFast:
            # On the first structured request, in the compile thread: transformers
            # takes resident memory that a core without such requests never needs.
            from tokenloom.model.tokenizer import load_tokenizer

            return load_tokenizer(model_path)

        structured = StructuredOutputManager(
            load_tokenizer,
            runner.arch.vocab_size,
            runner.eos_token_ids,
        )
        connector = None
        try:
            if isinstance(runner, ModelRunner) and runner.kv_cache_spec is not None:
                from tokenloom.kv_transfer.factory import create_connector

                assert runner.kv_connector is not None
                connector = create_connector(
                    cache_config, runner.kv_cache_spec, runner.kv_connector.info
                )
            core = cls(
                runner,
                cache_config,
                scheduler_config,
                lora_config,
                structured_output_manager=structured,
                engine_index=engine_index,
                data_parallel_size=model_config.parallel_config.data_parallel_size,
                kv_connector=connector,
            )
        except BaseException:
            structured.shutdown()
            if connector is not None:
                connector.shutdown()
            runner.shutdown()
            raise
        if isinstance(runner, MultiprocExecutor):
            core.executor = runner
        # Everything built so far lives as long as the engine: keep it out of the
        # collector's full passes, which otherwise walk it between steps.
        gc.collect()
        gc.freeze()
        logger.info(
            "engine core ready in %.1fs: %d KV blocks of %d tokens, max_model_len %d",
            time.monotonic() - started,
            core.num_blocks,
            core.cache_config.block_size,
            core.max_model_len,
        )
        return core

    def add_request(self, request: EngineCoreRequest) -> None:
        core_request = Request(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_request=request.lora_request,
            prior_output_token_ids=request.prior_output_token_ids,
            mm_features=request.mm_features,
            tenant=request.tenant,
            tenant_weight=request.tenant_weight,
            pooling_params=request.pooling_params,
        )
        self.scheduler.add_request(core_request)
        if self._recorder is not None:
            self._recorder.add(core_request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests now; their blocks are free when this returns."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            self._first_scheduled.pop(request_id, None)
        if self._recorder is not None:
            self._recorder.abort(request_ids)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an unloaded adapter's weights (the front end ensures no request uses it)."""
        return self.runner.remove_lora(lora_int_id)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or self._in_flight is not None

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget cached blocks (see ``Scheduler.reset_prefix_cache``); False if it could not."""
        done = self.scheduler.reset_prefix_cache(reset_running_requests)
        if self._recorder is not None:
            self._recorder.reset(reset_running_requests, done)
        return done

    def enable_kv_events(self) -> None:
        """Record KV cache events (blocks stored, evicted, cleared) for ``take_kv_events``."""
        self.scheduler.kv_cache_manager.enable_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.scheduler.kv_cache_manager.take_events()

    def make_stats_output(self) -> CoreOutputs:
        """No tokens, just the scheduler's state (after aborts, so gauges drop at once)."""
        return CoreOutputs(EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats()))

    def step(self) -> CoreOutputs | None:
        """Run one iteration; None when there is nothing to do.

        With async scheduling the next step is scheduled and launched before this
        one's output is awaited (``_step_pipelined``)."""
        if self._async_scheduling:
            return self._step_pipelined()
        if not self.scheduler.has_requests():
            return None
        return self._finish(self._launch())

    def _step_pipelined(self) -> CoreOutputs | None:
        """Keep one step running while the next is scheduled: launch step n+1 (its
        decodes read step n's tokens on the device), then wait for step n's output.
        While structured requests are in, each step waits for the previous one: their
        grammars advance with its tokens."""
        current = self._in_flight
        if current is None:
            if not self.scheduler.has_requests():
                return None
            current = self._launch()
        self._in_flight = None
        if self.scheduler.has_requests() and not self.scheduler.has_structured_requests:
            self._in_flight = self._launch()
        return self._finish(current)

    def _launch(self) -> _LaunchedStep:
        """Schedule a step and start it on the runner."""
        scheduler = self.scheduler
        started = time.perf_counter()
        scheduler_output = scheduler.schedule()
        self.last_num_scheduled_tokens = scheduler_output.total_num_scheduled_tokens
        now = time.time()
        for new_request in scheduler_output.scheduled_new_reqs:
            self._first_scheduled.setdefault(new_request.req_id, now)
        if (
            scheduler_output.total_num_scheduled_tokens == 0
            and not scheduler_output.finished_req_ids
            and not scheduler_output.preempted_req_ids
            and not scheduler_output.free_encoder_mm_hashes
            and scheduler_output.kv_connector_metadata is None
        ):
            return _LaunchedStep(scheduler_output, _EMPTY_RUNNER_OUTPUT, started)
        # Also with no tokens: the runner must hear about finished requests (and
        # encoder outputs it may drop).
        grammar_output = scheduler.get_grammar_bitmask(scheduler_output)
        if self._async_scheduling:
            return _LaunchedStep(
                scheduler_output,
                cast(AsyncModelRunner, self.runner).execute_model_async(
                    scheduler_output, grammar_output
                ),
                started,
            )
        if grammar_output is None:
            runner_output = self.runner.execute_model(scheduler_output)
        else:
            runner_output = self.runner.execute_model(scheduler_output, grammar_output)
        return _LaunchedStep(scheduler_output, runner_output, started)

    def _finish(self, launched: _LaunchedStep) -> CoreOutputs:
        """Wait for a launched step's output and apply it."""
        scheduler = self.scheduler
        scheduler_output, started = launched.scheduler_output, launched.started
        runner_output = launched.output
        if not isinstance(runner_output, ModelRunnerOutput):
            runner_output = runner_output.get()
        per_client = scheduler.update_from_output(scheduler_output, runner_output)
        if self._speculative:
            # Drafts for the requests that sampled, verified in the next step.
            drafts = self.runner.take_draft_token_ids()
            if drafts:
                scheduler.update_draft_token_ids(drafts)
        ended = time.perf_counter()
        outputs = per_client.get(_CLIENT_INDEX)
        if outputs is None:
            outputs = EngineCoreOutputs()
        stats = outputs.scheduler_stats
        if stats is not None:
            stats.step, stats.kv_block_map = self._observer.observe(
                scheduler_output, started, ended
            )
        if self._recorder is not None:
            self._recorder.step(scheduler_output, started, ended, outputs.finished_requests)
            if not scheduler.has_requests():  # idle: the trace so far is complete on disk
                self._recorder.flush()
        first_scheduled: dict[str, float] = {}
        for output in outputs.outputs:
            if output.new_token_ids or output.finished:
                when = self._first_scheduled.pop(output.request_id, None)
                if when is not None:
                    first_scheduled[output.request_id] = when
        return CoreOutputs(outputs, first_scheduled)

    def shutdown(self) -> None:
        if self._recorder is not None:
            self._recorder.close()
        self.scheduler.shutdown()
        if self.structured_output_manager is not None:
            self.structured_output_manager.shutdown()
        if self.executor is not None:
            self.executor.shutdown()
        elif (runner_shutdown := getattr(self.runner, "shutdown", None)) is not None:
            runner_shutdown()
