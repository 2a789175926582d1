"""The runner's min_tokens ban and the scheduler's stop check use one stop set.

Requests go through the real scheduler into the persistent batch (the runner's
``apply_deltas``); at each position the tokens the sampler may not pick must be
exactly the tokens that would finish the request there, had they not been
ignored for min_tokens, and the ban must lift exactly when they stop counting
as ignored.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from tests.core.utils import assert_no_leaks, finish_all, make_scheduler
from tokenloom.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.step_inputs import apply_deltas, build_sampling_metadata

VOCAB = 12
EOS = 2

PARAMS = {
    "eos": (EOS, SamplingParams(min_tokens=3)),
    "ignore_eos": (EOS, SamplingParams(min_tokens=3, ignore_eos=True)),
    "stop_ids": (EOS, SamplingParams(min_tokens=3, stop_token_ids=[5, 9])),
    "stop_ids_ignore_eos": (
        EOS,
        SamplingParams(min_tokens=3, stop_token_ids=[EOS, 7], ignore_eos=True),
    ),
    "no_eos": (None, SamplingParams(min_tokens=3, stop_token_ids=[4])),
    "outside_vocab": (EOS, SamplingParams(min_tokens=3, stop_token_ids=[VOCAB + 1])),
}


def _stops_on(request: Request, token: int) -> bool:
    """Would ``token`` finish ``request`` as a stop, once min_tokens outputs exist?"""
    probe = copy.deepcopy(request)
    probe.append_output_token_ids([1] * probe.min_tokens, 10_000)  # 1 stops none of them
    assert probe.status == RequestStatus.RUNNING
    probe.append_output_token_ids([token], 10_000)
    return probe.status == RequestStatus.FINISHED_STOPPED


def _banned_by_row(batch: InputBatch, slots: list[int], offsets: list[int]) -> list[set[int]]:
    md = build_sampling_metadata(batch, np.array(slots), np.array(offsets))
    banned: list[set[int]] = [set() for _ in slots]
    if md.banned_rows is not None:
        assert md.banned_token_ids is not None
        for row, token in zip(md.banned_rows.tolist(), md.banned_token_ids.tolist(), strict=True):
            banned[row].add(token)
    return banned


def test_the_ban_is_the_scheduler_stop_set_and_lifts_with_min_tokens() -> None:
    scheduler = make_scheduler()
    requests = [
        Request(name, [3, 4, 6], params, eos_token_id=eos) for name, (eos, params) in PARAMS.items()
    ]
    for request in requests:
        scheduler.add_request(request)
    so = scheduler.schedule()
    batch = InputBatch(8, 64, 4, VOCAB, torch.device("cpu"))
    apply_deltas(batch, so, eos_token_id=None)  # the scheduler's records carry the set
    slots = [batch.req_id_to_index[r.request_id] for r in requests]

    for request, slot in zip(requests, slots, strict=True):
        stop_set = {t for t in range(VOCAB) if _stops_on(request, t)}
        # Row offsets 0..3 stand for 0..3 outputs before the sampled position.
        banned = _banned_by_row(batch, [slot] * 4, [0, 1, 2, 3])
        assert banned[:3] == [stop_set] * 3, request.request_id
        assert banned[3] == set(), request.request_id
        # And the scheduler ignores those tokens for exactly the first 3 outputs.
        probe = copy.deepcopy(request)
        ordered = sorted(stop_set) or [1]
        for i in range(3):
            probe.append_output_token_ids([ordered[i % len(ordered)]], 10_000)
            assert probe.status == RequestStatus.RUNNING
        probe.append_output_token_ids([ordered[0]], 10_000)
        stopped = probe.status == RequestStatus.FINISHED_STOPPED
        assert stopped == bool(stop_set), request.request_id
    assert {
        r.request_id: bool(_banned_by_row(batch, [s], [0])[0])
        for r, s in zip(requests, slots, strict=True)
    } == {
        "eos": True,
        "ignore_eos": False,
        "stop_ids": True,
        "stop_ids_ignore_eos": True,
        "no_eos": True,
        "outside_vocab": True,
    }
    finish_all(scheduler)
    scheduler.schedule()
    assert_no_leaks(scheduler)


@pytest.mark.parametrize("eos", [EOS, None])
def test_a_hand_built_record_derives_the_set_with_the_runner_eos(eos: int | None) -> None:
    params = SamplingParams(min_tokens=1, stop_token_ids=[7])
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r", [3, 4], params, [1], 0)],
        scheduled_cached_reqs=CachedRequestData(),
        num_scheduled_tokens={"r": 2},
        total_num_scheduled_tokens=2,
        scheduled_spec_decode_tokens={},
        num_common_prefix_blocks=0,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )
    batch = InputBatch(4, 32, 4, VOCAB, torch.device("cpu"))
    apply_deltas(batch, so, eos_token_id=eos)
    expected = Request("r", [3, 4], params, eos_token_id=eos).stopping_token_ids
    assert _banned_by_row(batch, [0], [0]) == [set(expected)]
    assert expected == ({7, EOS} if eos is not None else {7})
