"""One step's model inputs, built from the persistent batch with numpy, no per-token loops.

``apply_deltas`` first brings the batch up to date with the SchedulerOutput.

The scheduled requests' new tokens are concatenated (decodes first, then
multi-token chunks, each group in slot order) into one flat ragged batch. A
request samples when this step brings it level with its tokens (plus drafts):
one logits row at its last token, or 1 + k rows ending there when it verifies
k draft tokens. A partial prefill samples nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.core.sched.output import SchedulerOutput
from tokenloom.request import stopping_token_ids
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.sampling_metadata import SamplingMetadata


@dataclass
class StepInputs:
    req_ids: list[str]  # scheduled requests, in forward order
    slots: np.ndarray  # [B] their slots
    query_lens: np.ndarray  # [B]
    seq_lens: np.ndarray  # [B] context after this step
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [B, max_blocks] int32, on the model's device
    # Sampling: requests that sample (indices into req_ids) and their logits rows.
    sample_idx: np.ndarray  # [S]
    rows_per_sample: np.ndarray  # [S] 1 + number of drafts
    logits_indices: torch.Tensor  # [R] positions in the flat batch
    row_slots: np.ndarray  # [R]
    row_offsets: np.ndarray  # [R] draft index of the row (0 for the first)
    drafts: dict[int, list[int]]  # batch index -> drafts being verified
    # The Triton kernel's metadata (``prepare_step(kernel_metadata=True)``), on the
    # model's device: query offsets [B + 1] and ``seq_lens`` as int32.
    query_start: torch.Tensor | None = None
    kernel_seq_lens: torch.Tensor | None = None


def apply_deltas(
    batch: InputBatch, scheduler_output: SchedulerOutput, eos_token_id: int | None
) -> None:
    """Bring the persistent batch in line with the scheduler's view of this step.

    ``eos_token_id`` only serves a ``NewRequestData`` built without
    ``stopping_token_ids``: they are derived from the same definition with it.
    """
    for req_id in scheduler_output.finished_req_ids:
        batch.remove_request(req_id)
    for req_id in scheduler_output.preempted_req_ids:
        batch.preempt_request(req_id)
    for new in scheduler_output.scheduled_new_reqs:
        stop_ids = new.stopping_token_ids
        if stop_ids is None:
            stop_ids = stopping_token_ids(new.sampling_params, eos_token_id)
        batch.add_request(
            new.req_id,
            new.prompt_token_ids,
            new.sampling_params,
            new.block_ids,
            new.num_computed_tokens,
            output_token_ids=new.output_token_ids,
            stopping_token_ids=stop_ids,
        )
    cached = scheduler_output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    index = batch.req_id_to_index
    for i, req_id in enumerate(cached.req_ids):
        block_ids = cached.new_block_ids[i]
        if req_id in resumed:
            batch.resume_request(
                req_id, cached.new_token_ids[i], block_ids or [], cached.num_computed_tokens[i]
            )
            continue
        slot = index[req_id]
        batch.num_computed_tokens[slot] = cached.num_computed_tokens[i]
        if block_ids:
            batch.append_block_ids(slot, block_ids)
    batch.condense()


def prepare_step(
    batch: InputBatch, scheduler_output: SchedulerOutput, kernel_metadata: bool = False
) -> StepInputs:
    """Flatten the scheduled tokens of ``batch`` (already updated with this step's
    deltas); with ``kernel_metadata``, the Triton kernel's int32 metadata too.

    The arrays go to the device in two copies (one per dtype, ``to_device_packed``)."""
    num_scheduled = scheduler_output.num_scheduled_tokens
    index = batch.req_id_to_index
    count = len(num_scheduled)
    slots = np.fromiter((index[r] for r in num_scheduled), dtype=np.int64, count=count)
    query_lens = np.fromiter(num_scheduled.values(), dtype=np.int64, count=count)
    order = np.lexsort((slots, query_lens > 1))
    slots, query_lens = slots[order], query_lens[order]
    scheduled_ids = list(num_scheduled)
    req_ids = [scheduled_ids[i] for i in order.tolist()]

    # Drafts are written after the request's tokens so they are read like any input.
    num_drafts = np.zeros(batch.max_num_seqs, dtype=np.int64)
    draft_lists: dict[int, list[int]] = {}
    for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
        if drafts:
            slot = index[req_id]
            batch.token_ids[slot, batch.num_tokens[slot] : batch.num_tokens[slot] + len(drafts)] = (
                drafts
            )
            num_drafts[slot] = len(drafts)
            draft_lists[slot] = drafts

    start = batch.num_computed_tokens[slots]
    seq_lens = start + query_lens
    cu_ends = np.cumsum(query_lens)
    total = int(cu_ends[-1])
    token_slot = np.repeat(slots, query_lens)
    positions = np.arange(total, dtype=np.int64) + np.repeat(
        start - (cu_ends - query_lens), query_lens
    )
    input_ids = batch.token_ids[token_slot, positions].astype(np.int64)
    bs = batch.block_size
    slot_mapping = (
        batch.block_table[token_slot, positions // bs].astype(np.int64) * bs + positions % bs
    )

    max_blocks = -(-int(seq_lens.max()) // bs)
    if slots[0] == 0 and np.array_equal(slots, np.arange(count)):
        table = batch.block_table[:count, :max_blocks]
    else:
        table = batch.block_table[:, :max_blocks][slots]

    drafts_of = num_drafts[slots]
    sample_idx = np.flatnonzero(seq_lens >= batch.num_tokens[slots] + drafts_of)
    rows_per_sample = 1 + drafts_of[sample_idx]
    last = cu_ends[sample_idx] - 1
    if draft_lists:
        num_rows = int(rows_per_sample.sum())
        group_first = np.cumsum(rows_per_sample) - rows_per_sample
        row_offsets = np.arange(num_rows, dtype=np.int64) - np.repeat(group_first, rows_per_sample)
        logits_indices = np.repeat(last - drafts_of[sample_idx], rows_per_sample) + row_offsets
        row_slots = np.repeat(slots[sample_idx], rows_per_sample)
    else:
        logits_indices = last
        row_slots = slots[sample_idx]
        row_offsets = np.zeros(len(sample_idx), dtype=np.int64)
    batch_pos = {int(s): i for i, s in enumerate(slots.tolist())} if draft_lists else {}

    device = batch.device
    input_ids_t, positions_t, slot_mapping_t, logits_indices_t = to_device_packed(
        [input_ids, positions, slot_mapping, logits_indices], np.int64, device
    )
    int32 = [table]
    if kernel_metadata:
        query_start = np.zeros(count + 1, dtype=np.int32)
        query_start[1:] = cu_ends
        int32 += [query_start, seq_lens]
    table_t, *kernel = to_device_packed(int32, np.int32, device)
    return StepInputs(
        req_ids=req_ids,
        slots=slots,
        query_lens=query_lens,
        seq_lens=seq_lens,
        input_ids=input_ids_t,
        positions=positions_t,
        slot_mapping=slot_mapping_t,
        block_table=table_t,
        sample_idx=sample_idx,
        rows_per_sample=rows_per_sample,
        logits_indices=logits_indices_t,
        row_slots=row_slots,
        row_offsets=row_offsets,
        drafts={batch_pos[s]: d for s, d in draft_lists.items()},
        query_start=kernel[0] if kernel else None,
        kernel_seq_lens=kernel[1] if kernel else None,
    )


def build_sampling_metadata(
    batch: InputBatch,
    row_slots: np.ndarray,
    row_offsets: np.ndarray,
) -> SamplingMetadata:
    """Gather the sampling parameters of each logits row; optional parts only when used.

    A row whose request has fewer than ``min_tokens`` outputs before it bans the
    request's stopping token ids (``InputBatch.stopping_token_ids``), the same
    set that finishes it in the scheduler.
    """
    device = batch.device
    vocab = batch.vocab_size
    temperature = batch.temperature[row_slots]
    # Few numpy calls where every row is greedy (temperature 0): after a decode
    # step's weights have streamed through the caches, each costs ~10 us.
    all_greedy = not temperature.any()
    metadata = SamplingMetadata(
        temperature=to_device(temperature, device),
        all_greedy=all_greedy,
        all_random=bool(temperature.all()) if not all_greedy else len(temperature) == 0,
    )
    if not all_greedy:
        random_rows = temperature != 0.0
        top_k = batch.top_k[row_slots]
        if bool((top_k[random_rows] < vocab).any()):
            metadata.top_k = to_device(top_k, device)
        top_p = batch.top_p[row_slots]
        if bool((top_p[random_rows] < 1.0).any()):
            metadata.top_p = to_device(top_p, device)
        min_p = batch.min_p[row_slots]
        if bool((min_p[random_rows] > 0.0).any()):
            metadata.min_p = to_device(min_p, device)
        generators = batch.generators
        if generators:
            metadata.generators = {
                row: generators[slot]
                for row, slot in enumerate(row_slots.tolist())
                if slot in generators
            }
    if bool(batch.plain[row_slots].all()):
        return metadata

    num_prompt = batch.num_prompt_tokens[row_slots]
    end = batch.num_tokens[row_slots] + row_offsets  # tokens before the sampled position
    presence = batch.presence_penalty[row_slots]
    frequency = batch.frequency_penalty[row_slots]
    repetition = batch.repetition_penalty[row_slots]
    use_repetition = bool((repetition != 1.0).any())
    if use_repetition or bool((presence != 0.0).any()) or bool((frequency != 0.0).any()):
        width = int(end.max())
        tokens = batch.token_ids[:, :width][row_slots].astype(np.int64)
        pos = np.arange(width)
        is_output = (pos >= num_prompt[:, None]) & (pos < end[:, None])
        metadata.output_token_ids = to_device(np.where(is_output, tokens, vocab), device)
        metadata.presence_penalties = to_device(presence, device)
        metadata.frequency_penalties = to_device(frequency, device)
        metadata.repetition_penalties = to_device(repetition, device)
        if use_repetition:
            p_width = int(num_prompt.max())
            in_prompt = pos[:p_width] < num_prompt[:, None]
            metadata.prompt_token_ids = to_device(
                np.where(in_prompt, tokens[:, :p_width], vocab), device
            )

    need_ban = batch.min_tokens[row_slots] > end - num_prompt
    if bool(need_ban.any()):
        stopping = batch.stopping_token_ids
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        for row in np.flatnonzero(need_ban).tolist():
            banned = stopping[int(row_slots[row])]
            ban_rows.extend([row] * len(banned))
            ban_ids.extend(banned)
        if ban_rows:
            metadata.banned_rows = torch.tensor(ban_rows, dtype=torch.long, device=device)
            metadata.banned_token_ids = torch.tensor(ban_ids, dtype=torch.long, device=device)

    num_logprobs = batch.num_logprobs[row_slots]
    if bool((num_logprobs >= 0).any()):
        metadata.num_logprobs = num_logprobs.tolist()
    return metadata


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """``array`` as a tensor on ``device``. To a GPU it goes through pinned memory
    (PyTorch's caching host allocator keeps it until the copy is done), so the copy
    runs asynchronously and the host goes on building the step."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def to_device_packed(
    arrays: list[np.ndarray], dtype: type[np.generic], device: torch.device
) -> list[torch.Tensor]:
    """``arrays`` as tensors of ``dtype`` on ``device``, each of its own shape. To a
    GPU they go in one copy (``pack``, then views of it): each copy costs the host
    a pinned allocation and a launch whatever its size, and a step has several."""
    if device.type == "cpu":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)) for a in arrays]
    return unpack(to_device(pack(arrays, dtype), device), arrays)


def pack(arrays: list[np.ndarray], dtype: type[np.generic]) -> np.ndarray:
    """The arrays' elements, flattened one after the other, as ``dtype``."""
    return np.concatenate([a.ravel() for a in arrays], dtype=dtype)


def unpack(packed: torch.Tensor, arrays: list[np.ndarray]) -> list[torch.Tensor]:
    """Views of ``packed`` (made by ``pack``) in the shapes of ``arrays``."""
    views = []
    at = 0
    for a in arrays:
        views.append(packed[at : at + a.size].view(a.shape))
        at += a.size
    return views
