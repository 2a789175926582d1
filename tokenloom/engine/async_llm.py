"""``AsyncLLM``: the asyncio front end the HTTP server is built on (``EngineClient``).

Prompts are tokenized and validated here, in a thread pool so that a huge
prompt never blocks the event loop, then sent to the engine core (its own
process by default). The core's token outputs come back through one
output-handler task that detokenizes them and hands each request's
``RequestOutput`` to the ``generate()`` call waiting for it. A consumer that
stops iterating (a client that disconnects) aborts its request in the core.

With the core in its own process, this process imports no torch: the model
path, arch config and tokenizer are all read by torch-free code. If that
process dies, a ``CoreSupervisor`` starts a new one and the requests in flight
resume on it (``recovery``); meanwhile the engine is degraded, not dead.
With data parallel, a dead core's requests resume on the other cores at once
while it restarts in the background (failover, ``tokenloom.engine.data_parallel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from tokenloom.engine.args import EngineArgs
from tokenloom.engine.core_client import AsyncInprocClient, InprocClient, MPClient
from tokenloom.engine.data_parallel.client import DPClient
from tokenloom.engine.exceptions import CoreDeadError, EngineDeadError
from tokenloom.engine.messages import CoreOutputs, EngineCoreRequest
from tokenloom.engine.output_processor import OutputT, RequestOutputCollector
from tokenloom.engine.protocol import ChatOptions, EngineClient, PromptType, RenderedChat
from tokenloom.engine.recovery import resumed_request
from tokenloom.engine.setup import EngineSetup
from tokenloom.engine.supervisor import CoreSupervisor, mp_client_starter
from tokenloom.lora_request import LoRARequest
from tokenloom.metrics.stats import IterationStats, StatLogger, engine_state
from tokenloom.multimodal.chat import remote_image_urls
from tokenloom.multimodal.media import fetch_url
from tokenloom.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput, SchedulerStats
from tokenloom.pooling.config import PoolerConfig
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

# Outputs detokenized between two yields to the event loop, so a step with
# thousands of requests does not stall other coroutines.
_OUTPUT_CHUNK = 256

# Threads that tokenize prompts and render chats, off the event loop.
_INPUT_THREADS = min(4, os.cpu_count() or 1)

AsyncClient = AsyncInprocClient | MPClient | DPClient


class AsyncLLM(EngineClient):
    """Serve many concurrent ``generate()`` streams from one engine core."""

    def __init__(
        self,
        setup: EngineSetup,
        client: AsyncClient,
        tokenizer: PreTrainedTokenizerFast,
        stat_loggers: list[StatLogger] | None = None,
        supervisor: CoreSupervisor[AsyncClient] | None = None,
    ) -> None:
        """``client`` reaches the core(s) built from ``setup``. ``supervisor``:
        restarts a dead core (None: a dead core is final)."""
        self.engine_args = setup.engine_args
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = setup.engine_args.get_served_model_name()
        self.data_parallel_size = setup.config.parallel_config.data_parallel_size
        self.max_model_len = client.max_model_len
        # None unless the engine runs the pooling runner (then it embeds, never generates).
        self.pooler_config: PoolerConfig | None = setup.config.model_config.pooler_config
        front_end = setup.front_end(tokenizer, self.max_model_len, helpers_in_subprocess=True)
        self.input_processor = front_end.input_processor
        self._input_executor = ThreadPoolExecutor(
            max_workers=_INPUT_THREADS, thread_name_prefix="tokenloom-input"
        )
        self.output_processor = front_end.output_processor
        self.stat_loggers: list[StatLogger] = front_end.stat_loggers + (stat_loggers or [])
        # Each core's latest scheduler snapshot, by engine index (data parallel: several).
        self._core_stats: dict[int, SchedulerStats] = {}
        self._dead: EngineDeadError | None = None
        self.supervisor = supervisor
        self._output_task: asyncio.Task[None] | None = None
        self._closed = False

    @classmethod
    def from_engine_args(
        cls,
        engine_args: EngineArgs,
        *,
        multiprocess: bool = True,
        stat_loggers: list[StatLogger] | None = None,
    ) -> AsyncLLM:
        """Build the engine: the core (own process unless ``multiprocess=False``) and tokenizer."""
        from tokenloom.engine.core import EngineCore

        config = engine_args.config
        data_parallel = config.parallel_config.data_parallel_size > 1
        if data_parallel and not multiprocess:
            raise ValueError("data_parallel_size > 1 runs each engine core in its own process")
        setup = EngineSetup.from_engine_args(engine_args)
        core_configs = setup.core_configs
        client: AsyncClient
        supervisor: CoreSupervisor[AsyncClient] | None = None
        if multiprocess:
            mp_client: MPClient | DPClient
            if data_parallel:
                mp_client = DPClient.launch(
                    *core_configs,
                    config.parallel_config,
                    config.load_balance_config,
                    config.recovery_config,
                )
            else:
                mp_client = MPClient(*core_configs)
            try:
                tokenizer = setup.load_tokenizer()  # while the core loads the weights
                mp_client.wait_until_ready()
            except BaseException:
                mp_client.shutdown()
                raise
            client = mp_client
            recovery = config.recovery_config
            if recovery.max_engine_restarts and not data_parallel:  # DP: a supervisor per core
                supervisor = CoreSupervisor(recovery, mp_client_starter(*core_configs))
        else:
            tokenizer = setup.load_tokenizer()
            client = AsyncInprocClient(InprocClient(EngineCore.from_config(*core_configs)))
        return cls(setup, client, tokenizer, stat_loggers, supervisor)

    # ------------------------------------------------------------------ state

    @property
    def engine_core_pid(self) -> int | None:
        return self.client.engine_core_pid

    @property
    def restarting(self) -> bool:
        """True while a dead core is being replaced: degraded, not dead."""
        return self._replacing or (isinstance(self.client, DPClient) and self.client.restarting)

    @property
    def _replacing(self) -> bool:
        """The one core is being replaced, or is gone and about to be (its process died a
        moment before the output handler's read fails): requests wait for the new one."""
        supervisor = self.supervisor
        if supervisor is None or self._dead is not None or self._closed:
            return False
        if supervisor.restarting:
            return True
        return supervisor.budget_left > 0 and not self.client.is_alive()

    @property
    def errored(self) -> bool:
        if self._dead is not None:
            return True
        return not self.restarting and not self.client.is_alive()

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self._dead or EngineDeadError()

    @property
    def latest_scheduler_stats(self) -> SchedulerStats | None:
        """The engine's current state over all its live cores (``engine_state``)."""
        return engine_state(self._core_stats.values())

    @property
    def num_running_requests(self) -> int:
        stats = self.latest_scheduler_stats
        return stats.num_running_reqs if stats is not None else 0

    @property
    def num_waiting_requests(self) -> int:
        stats = self.latest_scheduler_stats
        return stats.num_waiting_reqs if stats is not None else 0

    async def check_health(self) -> None:
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self) -> PreTrainedTokenizerFast:
        return self.tokenizer

    # ------------------------------------------------------------------ requests

    async def render_chat(
        self, messages: list[dict[str, Any]], options: ChatOptions
    ) -> RenderedChat:
        """Apply the chat template in the input thread pool.

        Raises ``ValueError`` starting with the field to blame (``messages``,
        ``chat_template``, ``chat_template_kwargs``, ...; a ``MediaError`` for a bad
        image), and ``EngineDeadError`` once the engine is gone. Images at http(s)
        URLs are downloaded here first, concurrently, without blocking the loop.
        """
        if self.errored or self._closed:
            raise self.dead_error
        limits = self.input_processor.media_limits
        remote = remote_image_urls(messages)
        fetched: dict[str, bytes] = {}
        if remote:
            contents = await asyncio.gather(
                *(fetch_url(url, param, limits) for param, url in remote)
            )
            fetched = {url: data for (_, url), data in zip(remote, contents, strict=True)}
        loop = asyncio.get_running_loop()
        render = functools.partial(self.input_processor.render_chat, messages, options, fetched)
        return await loop.run_in_executor(self._input_executor, render)

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        priority: int = 0,
        delta: bool = False,
        lora_request: LoRARequest | None = None,
        trace_headers: Mapping[str, str] | None = None,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream outputs of one request; the last has ``finished=True``.

        ``tenant`` and ``tenant_weight``: who sent it, for the fair policy.

        The prompt is tokenized and validated in the input thread pool. Raises
        ``ValueError`` (naming the field) for an invalid request, before
        anything is queued, and ``EngineDeadError`` when the engine dies.
        ``trace_headers``: the caller's W3C trace context, which the request's
        span continues (``--otlp-traces-endpoint``).
        """
        process = functools.partial(
            self.input_processor.process,
            request_id,
            prompt,
            sampling_params,
            priority=priority,
            lora_request=lora_request,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        run = self._run_request(request_id, process, RequestOutputCollector(delta), trace_headers)
        async with contextlib.aclosing(run) as outputs:  # closing us aborts it at once
            async for output in outputs:
                yield output

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None,
        request_id: str,
        *,
        priority: int = 0,
        tenant: str = "",
        tenant_weight: float = 1.0,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """The pooled output of one prompt (a pooling engine: ``--runner pooling``), as
        one final item. ``tenant`` and ``tenant_weight``: who sent it, for the fair
        policy. Raises ``ValueError`` (naming the field) for an invalid request and
        ``EngineDeadError`` when the engine dies."""
        process = functools.partial(
            self.input_processor.process_pooling,
            request_id,
            prompt,
            pooling_params,
            priority=priority,
            tenant=tenant,
            tenant_weight=tenant_weight,
        )
        collector: RequestOutputCollector[PoolingRequestOutput[PoolingOutput]]
        collector = RequestOutputCollector(delta=False)
        async with contextlib.aclosing(self._run_request(request_id, process, collector)) as run:
            async for output in run:
                yield output

    async def _run_request(
        self,
        request_id: str,
        process: Callable[[], tuple[str | None, list[EngineCoreRequest]]],
        collector: RequestOutputCollector[OutputT],
        trace_headers: Mapping[str, str] | None = None,
    ) -> AsyncGenerator[OutputT, None]:
        """Validate a request in the input thread pool (``process``), send it to the
        core and yield its outputs into ``collector`` until it finishes; a consumer
        that stops early aborts it."""
        if self.errored or self._closed:
            raise self.dead_error
        loop = asyncio.get_running_loop()
        text, requests = await loop.run_in_executor(self._input_executor, process)
        if self.errored or self._closed:  # it died while we tokenized
            raise self.dead_error
        self.output_processor.add_request(request_id, text, requests, collector, trace_headers)
        finished = False
        try:
            self._ensure_output_handler()
            if not self._replacing:  # else the new core gets it with the resumed ones
                self.client.add_requests(requests)
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort_now([request_id])

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Check an adapter against the base model (off the event loop); the core
        reads its weights when a request first uses it. Raises ``ValueError``."""
        loop = asyncio.get_running_loop()
        check = functools.partial(self.input_processor.check_adapter, lora_request)
        await loop.run_in_executor(self._input_executor, check)

    async def remove_lora(self, lora_int_id: int) -> None:
        """Tell the core to drop an adapter's weights (no request may still use it)."""
        self.client.remove_lora(lora_int_id)

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End requests now; their KV blocks are freed in the core right away."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._abort_now(ids)

    def _abort_now(self, request_ids: list[str]) -> None:
        core_ids = self.output_processor.abort_requests(request_ids)
        if core_ids and not self.errored and not self._replacing:
            self.client.abort_requests(core_ids)

    # ------------------------------------------------------------------ outputs

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        task = self._output_task
        if task is not None and not task.done() and task.get_loop() is loop:
            return
        self._output_task = loop.create_task(self._run_output_handler())

    async def _run_output_handler(self) -> None:
        while True:
            try:
                while True:
                    result = await self.client.get_output()
                    await self._process(result)
            except asyncio.CancelledError:
                raise
            except EngineDeadError as exc:
                if await self._recover(exc):
                    continue
                self._on_dead(exc)
            except Exception as exc:
                logger.exception("output handler failed")
                self._on_dead(EngineDeadError(f"engine output handling failed: {exc}"))
            return

    async def _recover(self, error: EngineDeadError) -> bool:
        """Replace a dead core and resume every request in flight on the new one.

        Requests that arrive meanwhile wait in the output processor and go with
        them; aborted ones are simply no longer there. A core that dies again
        during the replay lands here again, with the output streamed since.
        """
        if isinstance(error, CoreDeadError) and isinstance(self.client, DPClient):
            return not self._closed and self._fail_over(self.client, error)
        supervisor = self.supervisor
        if supervisor is None or self._closed:
            return False
        old = self.client
        client = await supervisor.restart(str(error), self._count_restart)
        old.shutdown()  # its process is gone; this frees its sockets
        if client is None:
            return False
        if self._closed:
            client.shutdown()
            return False
        self.client = client
        resumed = self.resumable_requests()
        logger.warning(
            "engine core restarted (pid %s); resuming %d requests",
            client.engine_core_pid,
            len(resumed),
        )
        client.add_requests(resumed)
        return True

    def _fail_over(self, client: DPClient, error: CoreDeadError) -> bool:
        """Resume a dead data-parallel core's requests on the live cores now, and restart
        it in the background. False once no core is left and none can restart."""
        engine = error.engine_index
        # Its requests are counted by the cores they go to; its own gauges read empty.
        self._core_stats.pop(engine, None)
        for stat_logger in self.stat_loggers:
            stat_logger.record(SchedulerStats(), IterationStats(engine_index=engine))
        resumed = self.resumable_requests(client.release_core(engine))
        restarting = client.restart_core(
            engine, str(error), functools.partial(self._count_restart, engine)
        )
        logger.warning(
            "%s; %d requests fail over to the other cores%s",
            error,
            len(resumed),
            ", it restarts meanwhile" if restarting else "",
        )
        client.resubmit(resumed, exclude_core=engine)
        return client.is_alive() or client.restarting

    def resumable_requests(
        self, core_request_ids: Collection[str] | None = None
    ) -> list[EngineCoreRequest]:
        """In-flight requests (those of ``core_request_ids``, e.g. a dead data-parallel
        core's) as requests that continue after their output so far on another core."""
        return [resumed_request(r) for r in self.output_processor.in_flight(core_request_ids)]

    def _count_restart(self, engine_index: int = 0) -> None:
        """One start attempt of core ``engine_index``, counted under its ``engine`` label."""
        stats = IterationStats(engine_index=engine_index, num_engine_restarts=1)
        for stat_logger in self.stat_loggers:
            stat_logger.record(None, stats)

    async def _process(self, result: CoreOutputs) -> None:
        outputs = result.outputs
        stats = IterationStats(engine_index=result.engine_index) if self.stat_loggers else None
        now = time.time()
        items = outputs.outputs
        for start in range(0, len(items), _OUTPUT_CHUNK):
            if start:
                await asyncio.sleep(0)
            processed = self.output_processor.process_outputs(
                items[start : start + _OUTPUT_CHUNK], now, stats, result.first_scheduled_times
            )
            if processed.reqs_to_abort:
                self.client.abort_requests(processed.reqs_to_abort)
        scheduler_stats = outputs.scheduler_stats
        if scheduler_stats is not None:
            self._core_stats[result.engine_index] = scheduler_stats
            step = scheduler_stats.step
            if step is not None and step.preempted_req_ids:
                self.output_processor.record_preemptions(step.preempted_req_ids, now)
        for stat_logger in self.stat_loggers:
            stat_logger.record(outputs.scheduler_stats, stats)

    def _on_dead(self, error: EngineDeadError) -> None:
        if self._dead is None:
            logger.error("engine core is dead: %s", error)
            self._dead = error
        self.output_processor.propagate_error(self._dead)

    def shutdown(self) -> None:
        """Stop the engine core; pending ``generate()`` calls raise ``EngineDeadError``."""
        if self._closed:
            return
        self._closed = True
        task = self._output_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        self.output_processor.propagate_error(EngineDeadError("the engine was shut down"))
        self._input_executor.shutdown(wait=False, cancel_futures=True)
        self.input_processor.shutdown()
        self.client.shutdown()
