"""The model runner: applies a SchedulerOutput to the persistent batch, runs one
forward pass over the flattened batch, samples, and reports the tokens.

It owns the model, the paged KV cache and the persistent batch. The same code
runs on CPU and CUDA (``ModelConfig.device``).

Speculative decoding (``SchedulerConfig.speculative_config``): drafts arrive
in ``scheduled_spec_decode_tokens`` and take 1 + k logits rows per request;
the ``Speculator`` verifies them (exact match, or rejection sampling for a
draft model's drafts: ``spec_decode/verifier.py``) and, after the step,
proposes the next drafts, which the engine core collects with
``take_draft_token_ids``.

With ``--runner pooling`` nothing samples: the ``PoolingRunner``
(``pooling_runner.py``) pools the final hidden states of each request whose
prompt the step completes into ``ModelRunnerOutput.pooler_output``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import psutil
import torch

from tokenloom.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig
from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.kv_transfer.base import KVCacheSpec
from tokenloom.model.arch_config import ModelArchConfig
from tokenloom.model.attention import AttentionMetadata
from tokenloom.model.dtype import resolve_kv_cache_dtype
from tokenloom.model.kv_cache import allocate_kv_caches, kv_cache_bytes_per_block
from tokenloom.model.lora import LoRAManager
from tokenloom.model_loader.loader import load_model
from tokenloom.ops.cpu_kernels import bind_threads_to_cores
from tokenloom.outputs import ModelRunnerOutput, TokenLogprobs
from tokenloom.pooling.config import resolve_pooler_config
from tokenloom.structured_output.manager import GrammarOutput
from tokenloom.worker.async_output import InFlightTokens, PendingOutput, copy_to_host
from tokenloom.worker.grammar_bitmask import apply_grammar_bitmask
from tokenloom.worker.host_malloc import keep_freed_memory, release_freed_memory
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.kv_connector.base import KVConnectorWorker
from tokenloom.worker.multimodal import MultiModalRunner
from tokenloom.worker.pooling_runner import PoolingRunner
from tokenloom.worker.sampler import Sampler, SamplerOutput
from tokenloom.worker.sampling_metadata import SamplingMetadata
from tokenloom.worker.spec_decode.speculator import Speculator
from tokenloom.worker.spec_decode.verifier import verify
from tokenloom.worker.step_inputs import (
    StepInputs,
    apply_deltas,
    build_sampling_metadata,
    prepare_step,
)

if TYPE_CHECKING:
    from tokenloom.distributed.shard import TPShard
    from tokenloom.worker.cuda.graphs import DecodeGraphs


class ModelRunner:
    """Public attributes: ``model``, ``forward_plan`` (what runs the forward pass:
    ``model_loader.forward_plan``), ``arch``, ``dtype``, ``kv_cache_dtype``, ``device``,
    ``max_model_len``,
    ``num_blocks`` (including the reserved null block 0), ``kv_caches``, ``input_batch``,
    ``eos_token_ids``; with a KV connector (``CacheConfig.kv_transfer_config``),
    ``kv_connector`` (its worker side) and ``kv_cache_spec`` (what it needs to know
    of the cache), else None.

    Unseeded random rows share one generator seeded with ``ModelConfig.seed``, so a
    run is reproducible given the same schedule; seeded requests have their own.

    ``req_id_to_index`` of the output is rebuilt only when the order of
    ``req_ids`` changed since the previous step (steady decoding keeps it), so
    consecutive outputs may share one mapping object: treat it as read-only.

    With ``shard`` it is one tensor-parallel rank (``distributed.worker``): the
    model and KV cache hold the rank's heads, the ranks agree on one block
    count, and every rank samples the same tokens from the gathered logits.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        lora_config: LoRAConfig | None = None,
        shard: TPShard | None = None,
    ) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.block_size = cache_config.block_size
        on_cpu = torch.device(model_config.device).type == "cpu"
        if on_cpu:
            bind_threads_to_cores()

        loaded = load_model(model_config, shard, float_weights=lora_config is not None)
        self.model = loaded.model
        self.forward_plan = loaded.plan
        self.arch = loaded.arch
        self.dtype = loaded.dtype
        self.device = loaded.device
        self.model_path = loaded.path
        self.max_model_len = resolve_max_model_len(model_config.max_model_len, self.arch)
        # The Triton kernel attends the batch (CUDA): metadata as device tensors.
        self.kernel_attention = self.forward_plan.attention == "triton"
        if self.kernel_attention and (
            self.block_size < 16 or self.block_size & (self.block_size - 1)
        ):
            raise ValueError(
                f"block_size must be a power of two >= 16 on CUDA, got {self.block_size}"
            )
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            cache_config.cache_dtype, loaded.weights_dtype, loaded.quantized
        )
        generator = torch.Generator(device=self.device)
        generator.manual_seed(model_config.seed)
        # The draft model (if any) loads before sizing, so its weights are already out
        # of the free memory and its KV cache is sized with the target's.
        self.speculator: Speculator | None = None
        spec_config = scheduler_config.speculative_config
        if spec_config is not None:
            self.speculator = Speculator(
                spec_config,
                model_config,
                self.arch.vocab_size,
                self.block_size,
                scheduler_config.max_num_seqs,
                self.max_model_len,
                generator,
            )
        if on_cpu:  # the load's temporaries go back before sizing; the steps' stay
            release_freed_memory()
            keep_freed_memory()
        self.num_blocks = self._num_kv_blocks()
        if shard is not None:
            from tokenloom.distributed.communication import all_reduce_min

            self.num_blocks = all_reduce_min(self.num_blocks, self.device)
        self.kv_caches = allocate_kv_caches(
            self.model.arch, self.num_blocks, self.block_size, self.kv_cache_dtype, self.device
        )
        if self.speculator is not None:
            self.speculator.allocate_kv_cache(self.num_blocks)
        self.decode_graphs: DecodeGraphs | None = None
        # Images (and multimodal positions) and pooling run eagerly: graphs replay text decodes.
        if (
            self.forward_plan.decoder == "graphs"
            and model_config.runner != "pooling"
            and self.arch.vision is None
        ):
            from tokenloom.worker.cuda.graphs import DecodeGraphs

            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.block_size,
                scheduler_config.max_num_seqs,
                self.max_model_len,
                self.device,
            )
            self.decode_graphs.capture()
        self.kv_cache_spec: KVCacheSpec | None = None
        self.kv_connector: KVConnectorWorker | None = None
        if cache_config.kv_transfer_config is not None:
            from tokenloom.worker.kv_connector.factory import create_worker_connector
            from tokenloom.worker.kv_connector.spec import kv_cache_spec

            self.kv_cache_spec = kv_cache_spec(
                self.model_path,
                model_config.quantization,
                self.dtype,
                self.kv_cache_dtype,
                self.block_size,
                self.kv_caches,
            )
            self.kv_connector = create_worker_connector(
                cache_config, self.kv_cache_spec, self.kv_caches
            )
        self.input_batch = InputBatch(
            max_num_seqs=scheduler_config.max_num_seqs,
            max_model_len=self.max_model_len,
            block_size=self.block_size,
            vocab_size=self.arch.vocab_size,
            device=self.device,
        )
        self.native_attention = loaded.attention_op
        self.sampler = Sampler(generator)
        self.eos_token_ids = tuple(self.arch.eos_token_ids)
        # The EOS id the engine gives its requests (for hand-built NewRequestData).
        self._eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None
        self._last_req_ids: list[str] = []
        # Async scheduling: the latest launched step's tokens, still on the device,
        # the output that will append them, and what it runs once they are here.
        self._in_flight: InFlightTokens | None = None
        self._unresolved: PendingOutput | None = None
        self._finish_launched: Callable[[ModelRunnerOutput], None] | None = None
        # LoRA: the adapter slots, and each request's adapter id (0: base model).
        self.lora_manager = LoRAManager(self.model, lora_config) if lora_config else None
        self._lora_ids: dict[str, int] = {}
        self._last_index: dict[str, int] = {}
        # Vision-language models: the encoder cache, and images into the inputs.
        self.multimodal: MultiModalRunner | None = None
        self.max_tokens_per_mm_item = 0
        if self.arch.vision is not None:
            self.multimodal = MultiModalRunner(
                self.model,
                self.arch,
                self.model_path,
                self.device,
                share=scheduler_config.enable_encoder_cache,
            )
            self.max_tokens_per_mm_item = self.multimodal.max_tokens_per_item
        # The pooling runner's side (--runner pooling): requests are pooled, never sampled.
        self.pooler: PoolingRunner | None = None
        if model_config.runner == "pooling":
            self.pooler = PoolingRunner(
                resolve_pooler_config(
                    model_config.pooler_config, self.model_path, self.arch.hidden_size
                )
            )

    def _num_kv_blocks(self) -> int:
        """Explicit ``num_blocks``, else ``memory_bytes`` or ``memory_fraction`` of free
        memory, capped at what ``max_num_seqs`` full-length requests could use (+1 for
        the null block).

        A draft model's KV cache shares the fraction: it holds a copy of every
        block (and its scratch blocks), so each block costs both models' bytes."""
        configured = self.cache_config.num_blocks
        if configured is not None:
            if configured < 2:
                raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {configured}")
            return configured
        # A tensor-parallel rank's blocks hold only its KV heads; but ranks on one CPU
        # share its memory, so there the budget is sized for every head.
        arch = self.arch if self.device.type == "cpu" else self.model.arch
        per_block = kv_cache_bytes_per_block(arch, self.block_size, self.kv_cache_dtype)
        if self.device.type == "cuda":
            free = torch.cuda.mem_get_info(self.device)[0]
            budget = self.cache_config.memory_bytes or self._gpu_kv_budget()
        else:
            free = psutil.virtual_memory().available
            budget = self.cache_config.memory_bytes or int(free * self.cache_config.memory_fraction)
        if self.speculator is not None:
            draft_fixed = self.speculator.kv_cache_bytes(0)  # linear in the block count
            per_block += self.speculator.kv_cache_bytes(1) - draft_fixed
            budget -= draft_fixed
        num_blocks = max(budget, 0) // per_block
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        num_blocks = min(num_blocks, self.scheduler_config.max_num_seqs * blocks_per_seq + 1)
        if num_blocks < 2:
            if self.cache_config.memory_bytes:
                given = f"memory_bytes={self.cache_config.memory_bytes}"
            elif self.device.type == "cuda":
                given = (
                    f"gpu_memory_utilization={self.cache_config.gpu_memory_utilization} "
                    "after the weights and a profiled step"
                )
            else:
                given = f"memory_fraction={self.cache_config.memory_fraction} of {free} free bytes"
            raise ValueError(
                f"not enough memory for the KV cache: {given} holds {num_blocks} "
                f"blocks of {per_block} bytes; raise it or set num_blocks"
            )
        return num_blocks

    def _gpu_kv_budget(self) -> int:
        """``gpu_memory_utilization`` of the GPU less the weights, the peak of the
        largest step (profiled) and the memory outside PyTorch."""
        from tokenloom.worker.cuda.memory import kv_cache_budget, profile_step_peak

        peak = profile_step_peak(
            self.model,
            self.arch,
            min(self.scheduler_config.max_num_batched_tokens, self.max_model_len),
            self.scheduler_config.max_num_seqs,
            self.block_size,
            self.kv_cache_dtype,
            self.device,
            use_kernel=self.kernel_attention,
        )
        return kv_cache_budget(self.cache_config.gpu_memory_utilization, peak, self.device)

    # ------------------------------------------------------------------ one step

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> ModelRunnerOutput:
        """Run the step the scheduler decided; tokens for the requests that sample.

        Must see every SchedulerOutput (also those with no tokens scheduled) so
        that finished and preempted requests leave the batch. The output lists
        the scheduled requests (decodes first); ``sampled_token_ids`` is empty
        for a partial prefill. ``grammar_output`` (structured requests) masks
        the logits of its requests before sampling; other rows are untouched.
        A KV connector's loads start before the step and its saves are queued
        after it; its report is the output's ``kv_connector_output``.
        """
        connector = self.kv_connector
        if connector is None:
            return self._execute_step(scheduler_output, grammar_output)
        metadata = scheduler_output.kv_connector_metadata
        connector.start_load_kv(scheduler_output, metadata)
        output = self._execute_step(scheduler_output, grammar_output)
        connector.save_kv(scheduler_output, metadata)
        output.kv_connector_output = connector.get_finished()
        return output

    def execute_model_async(
        self, scheduler_output: SchedulerOutput, grammar_output: GrammarOutput | None = None
    ) -> PendingOutput:
        """Launch the step and return at once (async scheduling, ``async_output``):
        the output's sampled tokens arrive with ``get()``. The next step may be
        launched before that, scheduled with placeholders for those tokens."""
        output = self._execute_step(scheduler_output, grammar_output, defer=True)
        finish, self._finish_launched = self._finish_launched, None
        pending = PendingOutput(output, finish)
        if finish is not None:
            self._unresolved = pending
        return pending

    def shutdown(self) -> None:
        """Stop the KV connector's threads and sockets (the rest goes with the process)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()

    def _execute_step(
        self,
        scheduler_output: SchedulerOutput,
        grammar_output: GrammarOutput | None,
        defer: bool = False,
    ) -> ModelRunnerOutput:
        started = time.perf_counter()
        speculator = self.speculator
        if speculator is not None:
            for req_id in scheduler_output.finished_req_ids:
                speculator.forget(req_id)
        apply_deltas(self.input_batch, scheduler_output, self._eos_token_id)
        if self.lora_manager is not None:
            self._track_adapters(scheduler_output)
        if self.multimodal is not None:
            self.multimodal.update(scheduler_output)
        if self.pooler is not None:
            self.pooler.update_requests(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return self._output([], [], None)
        step = prepare_step(self.input_batch, scheduler_output, self.kernel_attention)
        if self._in_flight is not None:
            self._feed_in_flight_tokens(step)
        if self.lora_manager is not None:
            lora_of = self._lora_ids
            ids = np.fromiter(
                (lora_of.get(r, 0) for r in step.req_ids), np.int64, len(step.req_ids)
            )
            self.lora_manager.prepare(np.repeat(ids, step.query_lens))
        with torch.inference_mode():
            attn_metadata = self._attention_metadata(step)
            embeds, positions = None, step.positions
            if self.multimodal is not None:
                embeds, positions = self.multimodal.prepare(step)
            if self.pooler is not None:
                output = self._pool(step, positions, embeds, attn_metadata, self.pooler)
            elif len(step.row_slots) == 0:
                self.model(
                    step.input_ids, positions, self.kv_caches, attn_metadata, inputs_embeds=embeds
                )
                output = self._output(step.req_ids, [[] for _ in step.req_ids], None)
            else:
                graphs = self.decode_graphs
                if (
                    graphs is not None
                    and embeds is None
                    and graphs.serves(len(step.req_ids), int(step.query_lens.max()))
                ):
                    assert attn_metadata.kernel is not None
                    hidden = graphs.run(
                        step.input_ids,
                        positions,
                        step.slot_mapping,
                        step.block_table,
                        attn_metadata.kernel.seq_lens,
                    ).index_select(0, step.logits_indices)
                else:
                    hidden = self.model(
                        step.input_ids,
                        positions,
                        self.kv_caches,
                        attn_metadata,
                        keep_rows=step.logits_indices,
                        inputs_embeds=embeds,
                    )
                logits = self.model.compute_logits(hidden)
                if grammar_output is not None:
                    # Draft rows too: verification then judges drafts by the
                    # masked target distribution.
                    rows = _logits_rows(step, grammar_output)
                    apply_grammar_bitmask(logits, grammar_output, rows)
                if self._unresolved is not None and self._needs_history(step.row_slots):
                    self._unresolved.get()  # penalties and min_tokens count every token
                metadata = build_sampling_metadata(
                    self.input_batch, step.row_slots, step.row_offsets
                )
                if step.drafts:
                    output = self._verify_drafts(step, logits, metadata)
                elif defer:
                    output = self._sample_deferred(step, logits, metadata)
                else:
                    output = self._sample(step, logits, metadata)
        if speculator is not None:
            sampled = np.fromiter((bool(t) for t in output.sampled_token_ids), bool)
            speculator.propose(
                self.input_batch,
                step.req_ids,
                step.slots,
                step.seq_lens - step.query_lens,
                step.seq_lens,
                sampled,
            )
            num_tokens = scheduler_output.total_num_scheduled_tokens
            if len(step.row_slots) == num_tokens:
                # The draft budget's cost fit sees whole decode steps (proposing
                # included), where every token is a logits row as a draft is:
                # prefill tokens cost less (no logits, no sampling).
                speculator.observe_step(num_tokens, time.perf_counter() - started)
        return output

    def _attention_metadata(self, step: StepInputs) -> AttentionMetadata:
        if not self.kernel_attention:
            return AttentionMetadata.build(
                step.query_lens.tolist(),
                step.seq_lens.tolist(),
                step.block_table,
                step.slot_mapping,
                self.block_size,
                native_op=self.native_attention,
            )
        assert step.query_start is not None and step.kernel_seq_lens is not None
        return AttentionMetadata.for_kernel(
            step.query_start,
            step.kernel_seq_lens,
            step.block_table,
            step.slot_mapping,
            self.block_size,
        )

    def _pool(
        self,
        step: StepInputs,
        positions: torch.Tensor,
        embeds: torch.Tensor | None,
        attn_metadata: AttentionMetadata,
        pooler: PoolingRunner,
    ) -> ModelRunnerOutput:
        """Run the step for pooling requests: the final hidden states of the rows the
        pooler reads, pooled for each request whose prompt completes."""
        keep = pooler.keep_rows(step)
        inputs = (step.input_ids, positions, self.kv_caches, attn_metadata)
        if keep is not None and len(keep) == 0:  # no row to read: write the KV cache only
            hidden = self.model(*inputs, inputs_embeds=embeds)[:0]
        else:
            hidden = self.model(*inputs, keep_rows=keep, inputs_embeds=embeds)
        pooled = pooler.pool(step, hidden)
        output = self._output(step.req_ids, [[] for _ in step.req_ids], None)
        output.pooler_output = pooled
        return output

    def _sample(
        self, step: StepInputs, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> ModelRunnerOutput:
        """One token per sampling request (no drafts this step)."""
        sampled = self.sampler(logits, metadata)
        tokens = sampled.sampled_token_ids.tolist()
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        for i, token in zip(step.sample_idx.tolist(), tokens, strict=True):
            sampled_ids[i] = [token]
        self.input_batch.append_token(step.row_slots, np.asarray(tokens, dtype=np.int32))
        logprobs = _request_logprobs(len(step.req_ids), step.sample_idx.tolist(), sampled)
        return self._output(step.req_ids, sampled_ids, logprobs)

    def _sample_deferred(
        self, step: StepInputs, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> ModelRunnerOutput:
        """``_sample`` with the tokens left on the device: the output's
        ``sampled_token_ids`` are filled, and the tokens appended to the batch, by
        the finish step ``execute_model_async`` hands to its ``PendingOutput``."""
        sampled = self.sampler(logits, metadata)
        tokens = sampled.sampled_token_ids
        sample_idx = step.sample_idx.tolist()
        req_ids = step.req_ids
        flight = InFlightTokens(tokens, {req_ids[i]: row for row, i in enumerate(sample_idx)})
        self._in_flight = flight
        host, copied = copy_to_host(tokens)
        batch = self.input_batch

        def finish(output: ModelRunnerOutput) -> None:
            if copied is not None:
                copied.synchronize()
            values = host.tolist()
            index = batch.req_id_to_index
            for i, token in zip(sample_idx, values, strict=True):
                output.sampled_token_ids[i] = [token]
                slot = index.get(req_ids[i])
                if slot is not None:  # not finished or preempted since
                    batch.append_tokens(slot, [token])
            if self._in_flight is flight:
                self._in_flight = None
            if self._unresolved is not None and self._unresolved.done:
                self._unresolved = None

        self._finish_launched = finish
        logprobs = _request_logprobs(len(req_ids), sample_idx, sampled)
        return self._output(req_ids, [[] for _ in req_ids], logprobs)

    def _feed_in_flight_tokens(self, step: StepInputs) -> None:
        """Requests whose last input is the token the previous step sampled, still
        on the device: copy it into ``step.input_ids`` there."""
        assert self._in_flight is not None
        known = self.input_batch.num_tokens[step.slots]
        self._in_flight.patch_inputs(
            step.input_ids, step.req_ids, np.cumsum(step.query_lens) - 1, step.seq_lens > known
        )

    def _needs_history(self, row_slots: np.ndarray) -> bool:
        """Whether sampling these rows reads their earlier output tokens."""
        batch = self.input_batch
        if batch.plain[row_slots].all():
            return False
        return bool(
            (batch.repetition_penalty[row_slots] != 1.0).any()
            or (batch.presence_penalty[row_slots] != 0.0).any()
            or (batch.frequency_penalty[row_slots] != 0.0).any()
            or (batch.min_tokens[row_slots] > 0).any()
        )

    def _verify_drafts(
        self,
        step: StepInputs,
        logits: torch.Tensor,
        metadata: SamplingMetadata,
    ) -> ModelRunnerOutput:
        """Kept drafts plus one token per sampling request, appended to the batch.

        Without a speculator (drafts fed by hand, as tests do) they are verified by
        exact match, which is exact whatever proposed them."""
        batch = self.input_batch
        sample_idx = step.sample_idx.tolist()
        req_ids = [step.req_ids[i] for i in sample_idx]
        drafts = [step.drafts.get(i, []) for i in sample_idx]
        if self.speculator is not None:
            kept, kept_logprobs = self.speculator.verify(
                logits, metadata, self.sampler, req_ids, drafts
            )
        else:
            verified = verify(logits, metadata, self.sampler, drafts)
            kept, kept_logprobs = verified.token_ids, verified.logprobs
        sampled_ids: list[list[int]] = [[] for _ in step.req_ids]
        logprobs: list[list[TokenLogprobs] | None] | None = None
        if kept_logprobs is not None:
            logprobs = [None] * len(step.req_ids)
        for g, i in enumerate(sample_idx):
            sampled_ids[i] = kept[g]
            batch.append_tokens(int(step.slots[i]), kept[g])
            if logprobs is not None and kept_logprobs is not None:
                logprobs[i] = kept_logprobs[g]
        return self._output(step.req_ids, sampled_ids, logprobs)

    def _track_adapters(self, scheduler_output: SchedulerOutput) -> None:
        """Remember each new request's adapter (registering it on first sight: the
        front end validated it) and forget finished requests."""
        assert self.lora_manager is not None
        for req_id in scheduler_output.finished_req_ids:
            self._lora_ids.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            lora = new.lora_request
            if lora is not None:
                self.lora_manager.add_adapter(lora)
                self._lora_ids[new.req_id] = lora.lora_int_id

    def remove_lora(self, lora_int_id: int) -> bool:
        """Drop an adapter's weights (no request may still use it)."""
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def take_draft_token_ids(self) -> dict[str, list[int]]:
        """Drafts proposed after the latest step, for ``Scheduler.update_draft_token_ids``."""
        if self.speculator is None:
            return {}
        return self.speculator.take_draft_token_ids()

    def _output(
        self,
        req_ids: list[str],
        sampled_ids: list[list[int]],
        logprobs: list[list[TokenLogprobs] | None] | None,
    ) -> ModelRunnerOutput:
        if req_ids != self._last_req_ids:
            self._last_req_ids = req_ids
            self._last_index = {r: i for i, r in enumerate(req_ids)}
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index=self._last_index,
            sampled_token_ids=sampled_ids,
            logprobs=logprobs,
        )


def _request_logprobs(
    num_reqs: int, sample_idx: list[int], sampled: SamplerOutput
) -> list[list[TokenLogprobs] | None] | None:
    """Each request's logprobs entry for its one sampled token (None: not asked)."""
    if sampled.logprobs is None:
        return None
    logprobs: list[list[TokenLogprobs] | None] = [None] * num_reqs
    for i, entry in zip(sample_idx, sampled.logprobs, strict=True):
        if entry is not None:
            logprobs[i] = [entry]
    return logprobs


def _logits_rows(step: StepInputs, grammar: GrammarOutput) -> dict[str, tuple[int, int]]:
    """(first logits row, number of rows) of each structured request that samples."""
    wanted = set(grammar.structured_output_request_ids)
    rows: dict[str, tuple[int, int]] = {}
    first = 0
    req_ids = step.req_ids
    for i, count in zip(step.sample_idx.tolist(), step.rows_per_sample.tolist(), strict=True):
        req_id = req_ids[i]
        if req_id in wanted:
            rows[req_id] = (first, count)
        first += count
    return rows


def resolve_max_model_len(requested: int | None, arch: ModelArchConfig) -> int:
    """The context length to serve: the model's own unless a smaller one is asked for."""
    limit = arch.max_position_embeddings
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) is larger than the model's maximum context "
            f"length ({limit})"
        )
    return requested
