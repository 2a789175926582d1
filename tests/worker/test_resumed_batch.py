"""A request resumed after an engine crash joins the batch with its earlier output:
penalties and min_tokens count that output, and a seeded request's random stream
continues after the draws it already made."""

from __future__ import annotations

import numpy as np
import torch

from tokenloom.sampling_params import SamplingParams
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.sampler import apply_penalties, draw_uniform
from tokenloom.worker.step_inputs import build_sampling_metadata

VOCAB = 50
PROMPT = [1, 2, 3]


def make_batch() -> InputBatch:
    return InputBatch(4, 64, 4, VOCAB, torch.device("cpu"))


def add(batch: InputBatch, req_id: str, params: SamplingParams, outputs: list[int]) -> int:
    num_tokens = len(PROMPT) + len(outputs)
    return batch.add_request(
        req_id, PROMPT, params, [1, 2], num_tokens, output_token_ids=outputs, stopping_token_ids=[9]
    )


def test_penalties_count_the_earlier_output() -> None:
    batch = make_batch()
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    slot = add(batch, "r", params, [7, 7, 8])
    metadata = build_sampling_metadata(batch, np.array([slot]), np.array([0]))
    logits = apply_penalties(torch.zeros(1, VOCAB), metadata)[0]
    assert logits[7].item() == -0.5 - 2 * 0.25
    assert logits[8].item() == -0.5 - 0.25
    assert logits[PROMPT[0]].item() == 0.0  # prompt tokens are not output
    assert int((logits != 0).sum()) == 2


def test_min_tokens_counts_the_earlier_output() -> None:
    batch = make_batch()
    params = SamplingParams(min_tokens=5)
    short = add(batch, "short", params, [4, 4, 4])  # output 4 comes next: stop ids banned
    done = add(batch, "done", params, [4, 4, 4, 4, 4])  # output 6 next: allowed
    metadata = build_sampling_metadata(batch, np.array([short, done]), np.array([0, 0]))
    assert metadata.banned_rows is not None and metadata.banned_token_ids is not None
    assert metadata.banned_rows.tolist() == [0]
    assert metadata.banned_token_ids.tolist() == [9]


def test_seeded_stream_continues_after_the_earlier_draws() -> None:
    params = SamplingParams(temperature=0.8, seed=1234)
    fresh = make_batch()
    slot = add(fresh, "r", params, [])
    whole = [draw(fresh.generators[slot]) for _ in range(10)]
    for done in (1, 4, 9):
        resumed = make_batch()
        slot = add(resumed, "r", params, [5] * done)
        rest = [draw(resumed.generators[slot]) for _ in range(10 - done)]
        assert rest == whole[done:]


def test_a_greedy_request_gets_no_generator() -> None:
    batch = make_batch()
    add(batch, "r", SamplingParams(temperature=0.0, seed=3), [5, 5])
    assert batch.generators == {}


def draw(generator: torch.Generator) -> float:
    """One sampled position's draw, as the sampler takes it for a seeded row."""
    return float(draw_uniform(1, {0: generator}, None, torch.device("cpu"))[0])
