"""Persistent batch and step inputs, without a model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloom.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.step_inputs import build_sampling_metadata, pack, prepare_step, unpack

BLOCK = 4
VOCAB = 50


def make_batch(max_num_seqs: int = 8, max_model_len: int = 32) -> InputBatch:
    return InputBatch(max_num_seqs, max_model_len, BLOCK, VOCAB, torch.device("cpu"))


def add(batch: InputBatch, req_id: str, n: int, **params: object) -> int:
    prompt = [(hash(req_id) + i) % VOCAB for i in range(n)]
    blocks = list(range(1, -(-n // BLOCK) + 1))
    return batch.add_request(req_id, prompt, SamplingParams(**params), blocks, 0)  # type: ignore[arg-type]


def check_dense(batch: InputBatch) -> None:
    assert batch.num_slots == batch.num_reqs
    assert sorted(batch.req_id_to_index.values()) == list(range(batch.num_reqs))
    for req_id, slot in batch.req_id_to_index.items():
        assert batch.req_ids[slot] == req_id


def test_add_remove_condense_keeps_state_with_the_request() -> None:
    batch = make_batch()
    for i, n in enumerate([3, 5, 7, 9, 11]):
        add(batch, f"r{i}", n, temperature=0.1 * (i + 1), seed=i, top_k=i)
    before = {r: (batch.get_token_ids(r), batch.get_block_ids(r)) for r in ("r3", "r4")}
    gen4 = batch.generators[batch.req_id_to_index["r4"]]
    batch.remove_request("r1")
    batch.remove_request("r0")
    assert batch.remove_request("unknown") is None
    batch.condense()
    check_dense(batch)
    assert set(batch.req_id_to_index) == {"r2", "r3", "r4"}
    for req_id, (tokens, blocks) in before.items():
        assert batch.get_token_ids(req_id) == tokens
        assert batch.get_block_ids(req_id) == blocks
    slot4 = batch.req_id_to_index["r4"]
    assert batch.temperature[slot4] == pytest.approx(0.5)
    assert batch.top_k[slot4] == 4
    assert batch.generators[slot4] is gen4
    assert len(batch.generators) == 3


def test_new_requests_fill_holes_before_appending() -> None:
    batch = make_batch()
    for i in range(4):
        add(batch, f"r{i}", 4)
    batch.remove_request("r1")
    slot = add(batch, "new", 6)
    assert slot == 1
    batch.condense()
    check_dense(batch)
    assert batch.num_reqs == 4


def test_condense_with_holes_at_the_end() -> None:
    batch = make_batch()
    for i in range(5):
        add(batch, f"r{i}", 4)
    for r in ("r4", "r3", "r1"):
        batch.remove_request(r)
    batch.condense()
    check_dense(batch)
    assert set(batch.req_id_to_index) == {"r0", "r2"}


def test_full_batch_and_too_long_prompt_raise() -> None:
    batch = make_batch(max_num_seqs=2, max_model_len=8)
    add(batch, "a", 4)
    add(batch, "b", 4)
    with pytest.raises(ValueError, match="max_num_seqs"):
        add(batch, "c", 4)
    batch.remove_request("a")
    with pytest.raises(ValueError, match="max_model_len"):
        add(batch, "c", 9)


def test_preempt_and_resume_keeps_prompt_params_and_generator() -> None:
    batch = make_batch()
    add(batch, "a", 6, temperature=0.7, seed=3)
    add(batch, "b", 5)
    slot_a = batch.req_id_to_index["a"]
    prompt = batch.get_token_ids("a")
    generator = batch.generators[slot_a]
    batch.append_token(np.array([slot_a]), np.array([42]))
    batch.preempt_request("a")
    batch.condense()
    assert "a" not in batch.req_id_to_index and batch.is_stashed("a")
    assert not batch.generators.get(batch.req_id_to_index["b"])

    batch.resume_request("a", output_token_ids=[42, 43], block_ids=[7, 8, 9], num_computed_tokens=0)
    slot_a = batch.req_id_to_index["a"]
    assert batch.get_token_ids("a") == prompt + [42, 43]
    assert batch.num_prompt_tokens[slot_a] == 6
    assert batch.get_block_ids("a") == [7, 8, 9]
    assert batch.generators[slot_a] is generator
    assert batch.temperature[slot_a] == pytest.approx(0.7)
    assert not batch.is_stashed("a")

    batch.preempt_request("a")
    batch.remove_request("a")  # aborted while preempted: the stash goes too
    assert not batch.is_stashed("a")
    with pytest.raises(ValueError, match="never preempted"):
        batch.resume_request("a", [], [1], 0)


def test_block_table_appends_and_overflow() -> None:
    batch = make_batch(max_model_len=12)  # at most 3 blocks of 4
    slot = batch.add_request("a", [1, 2, 3], SamplingParams(), [5], 0)
    batch.append_block_ids(slot, [9])
    batch.append_block_ids(slot, [])
    batch.append_block_ids(slot, [2])
    assert batch.get_block_ids("a") == [5, 9, 2]
    with pytest.raises(ValueError, match="blocks"):
        batch.append_block_ids(slot, [3])


def output(
    new: list[NewRequestData],
    cached: CachedRequestData,
    num_scheduled: dict[str, int],
    spec: dict[str, list[int]] | None = None,
) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new,
        scheduled_cached_reqs=cached,
        num_scheduled_tokens=num_scheduled,
        total_num_scheduled_tokens=sum(num_scheduled.values()),
        scheduled_spec_decode_tokens=spec or {},
        num_common_prefix_blocks=0,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )


def test_step_inputs_for_mixed_prefill_chunk_and_decode() -> None:
    batch = make_batch()
    # "p": prompt of 10, 4 computed (prefix hit), 6 scheduled -> completes, samples.
    batch.add_request("p", list(range(10, 20)), SamplingParams(), [3, 4, 5], 4)
    # "c": prompt of 9, chunk of 5 from 0 -> partial, no sample.
    batch.add_request("c", list(range(30, 39)), SamplingParams(), [6, 7, 8], 0)
    # "d": decoding: 6 tokens, 5 computed, 1 scheduled.
    slot_d = batch.add_request("d", [1, 2, 3, 4, 5], SamplingParams(), [9, 10], 4)
    batch.append_token(np.array([slot_d]), np.array([6]))
    batch.num_computed_tokens[slot_d] = 5
    so = output([], CachedRequestData(), {"p": 6, "c": 5, "d": 1})
    step = prepare_step(batch, so)

    assert step.req_ids == ["d", "p", "c"]  # decodes first
    assert step.query_lens.tolist() == [1, 6, 5]
    assert step.seq_lens.tolist() == [6, 10, 5]
    assert step.input_ids.tolist() == [6, *range(14, 20), *range(30, 35)]
    assert step.positions.tolist() == [5, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]
    expected_slots = [10 * 4 + 1] + [
        b * 4 + p % 4 for b, p in zip([4, 4, 4, 4, 5, 5], range(4, 10), strict=True)
    ]
    expected_slots += [6 * 4 + 0, 6 * 4 + 1, 6 * 4 + 2, 6 * 4 + 3, 7 * 4 + 0]
    assert step.slot_mapping.tolist() == expected_slots
    assert step.block_table.dtype == torch.int32
    assert step.block_table.tolist() == [[9, 10, 0], [3, 4, 5], [6, 7, 8]]
    assert step.sample_idx.tolist() == [0, 1]
    assert step.logits_indices.tolist() == [0, 6]
    assert step.query_start is None and step.kernel_seq_lens is None

    kernel_step = prepare_step(batch, so, kernel_metadata=True)
    assert kernel_step.query_start is not None and kernel_step.kernel_seq_lens is not None
    assert kernel_step.query_start.dtype == kernel_step.kernel_seq_lens.dtype == torch.int32
    assert kernel_step.query_start.tolist() == [0, 1, 7, 12]
    assert kernel_step.kernel_seq_lens.tolist() == [6, 10, 5]


def test_packed_arrays_unpack_to_their_shapes_and_dtype() -> None:
    """What goes to a GPU in one copy comes back as each array, in its shape."""
    table = np.arange(6, dtype=np.int32).reshape(2, 3)[:, :2]  # not contiguous
    starts = np.array([0, 1, 4], dtype=np.int64)
    lens = np.array([7, 9], dtype=np.int64)
    packed = torch.from_numpy(pack([table, starts, lens], np.int32))
    assert packed.dtype == torch.int32
    views = unpack(packed, [table, starts, lens])
    assert [v.tolist() for v in views] == [[[0, 1], [3, 4]], [0, 1, 4], [7, 9]]
    assert all(v.data_ptr() >= packed.data_ptr() for v in views)  # views, no copies


def test_step_inputs_with_draft_tokens() -> None:
    batch = make_batch()
    slot = batch.add_request("s", [1, 2, 3, 4], SamplingParams(), [1, 2], 3)
    batch.add_request("t", [5, 6, 7], SamplingParams(), [3], 2)
    so = output([], CachedRequestData(), {"s": 3, "t": 1}, spec={"s": [40, 41]})
    step = prepare_step(batch, so)
    assert step.req_ids == ["t", "s"]
    assert step.input_ids.tolist() == [7, 4, 40, 41]
    assert step.positions.tolist() == [2, 3, 4, 5]
    assert step.logits_indices.tolist() == [0, 1, 2, 3]
    assert step.rows_per_sample.tolist() == [1, 3]
    assert step.row_slots.tolist() == [1, slot, slot, slot]
    assert step.row_offsets.tolist() == [0, 0, 1, 2]
    assert step.drafts == {1: [40, 41]}
    assert batch.num_tokens[slot] == 4  # drafts are not tokens of the request yet


def test_sampling_metadata_penalties_count_drafts_before_each_row() -> None:
    batch = make_batch()
    slot = batch.add_request(
        "s",
        [1, 2, 3],
        SamplingParams(frequency_penalty=1.0, repetition_penalty=1.2, logprobs=2),
        [1, 2],
        3,
        output_token_ids=[9],
    )
    batch.add_request("g", [4, 5], SamplingParams(temperature=0.0), [3], 1)
    batch.token_ids[slot, 4:6] = [11, 12]  # drafts written by prepare_step
    md = build_sampling_metadata(batch, np.array([slot, slot, slot, 1]), np.array([0, 1, 2, 0]))
    assert md.output_token_ids is not None and md.prompt_token_ids is not None
    outputs = [[t for t in row if t != VOCAB] for row in md.output_token_ids.tolist()]
    assert outputs == [[9], [9, 11], [9, 11, 12], []]
    prompts = [[t for t in row if t != VOCAB] for row in md.prompt_token_ids.tolist()]
    assert prompts == [[1, 2, 3]] * 3 + [[4, 5]]
    assert md.num_logprobs == [2, 2, 2, -1]
    assert not md.all_greedy and not md.all_random
    assert md.top_k is None and md.top_p is None and md.min_p is None


def _banned(batch: InputBatch, slots: list[int], offsets: list[int]) -> list[tuple[int, int]]:
    md = build_sampling_metadata(batch, np.array(slots), np.array(offsets))
    if md.banned_rows is None:
        return []
    assert md.banned_token_ids is not None
    return sorted(zip(md.banned_rows.tolist(), md.banned_token_ids.tolist(), strict=True))


def test_sampling_metadata_bans_the_stopping_ids_until_min_tokens() -> None:
    batch = make_batch()
    stops = frozenset({7, 0, VOCAB + 3})  # an id outside the vocabulary cannot be sampled
    batch.add_request("a", [1], SamplingParams(min_tokens=2), [1], 0, stopping_token_ids=stops)
    batch.add_request("b", [1], SamplingParams(min_tokens=2), [2], 0)  # nothing stops it
    batch.add_request(
        "c", [1], SamplingParams(min_tokens=1), [3], 0, output_token_ids=[5], stopping_token_ids={0}
    )
    assert _banned(batch, [0, 1, 2], [0, 0, 0]) == [(0, 0), (0, 7)]
    # Row offsets count drafts before the row: a's third row has 2 outputs before it.
    assert _banned(batch, [0, 0, 0], [0, 1, 2]) == [(0, 0), (0, 7), (1, 0), (1, 7)]
    # The set survives preemption and slot moves.
    batch.preempt_request("a")
    batch.condense()
    slot = batch.resume_request("a", [], [4], 0)
    assert slot != 0 and batch.stopping_token_ids[slot] == (0, 7)
    assert _banned(batch, [slot], [0]) == [(0, 0), (0, 7)]
    batch.remove_request("b")
    batch.remove_request("c")
    batch.condense()
    assert batch.req_id_to_index == {"a": 0} and batch.stopping_token_ids[0] == (0, 7)


def test_plain_rows_follow_their_request_and_skip_the_optional_metadata() -> None:
    batch = make_batch()
    add(batch, "gone", 3)
    add(batch, "plain", 3)
    add(batch, "asks", 3, logprobs=1)
    batch.remove_request("gone")
    batch.condense()  # "asks" moves into slot 0
    assert batch.plain[: batch.num_reqs].tolist() == [False, True]
    plain = build_sampling_metadata(batch, np.array([1]), np.array([0]))
    assert plain.no_penalties and plain.banned_rows is None and plain.num_logprobs is None
    both = build_sampling_metadata(batch, np.array([0, 1]), np.array([0, 0]))
    assert both.num_logprobs == [1, -1]
