"""Prompt validation happens before anything reaches the core, with clear messages."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.engine.input_processor import InputProcessor, eos_token_ids
from tokenloom.sampling_params import SamplingParams


@pytest.fixture()
def inputs(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, max_model_len=32, vocab_size=49152, eos_token_ids=[2, 0])


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 49152], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1] * 32, SamplingParams(max_tokens=None), "maximum context length"),
        ([1] * 20, SamplingParams(max_tokens=13), r"max_tokens \(13\)"),
        ([1, "a"], SamplingParams(), "list of integers"),
        (3.5, SamplingParams(), "string or a list"),
        ([1], SamplingParams(stop_token_ids=[50000]), "stop_token_ids"),
    ],
)
def test_invalid_prompts(
    inputs: InputProcessor, prompt: Any, params: SamplingParams, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        inputs.process("r", prompt, params)


def test_fits_exactly_and_unbounded_max_tokens(inputs: InputProcessor) -> None:
    inputs.process("a", [1] * 20, SamplingParams(max_tokens=12))
    inputs.process("b", [1] * 31, SamplingParams(max_tokens=None))


def test_eos_ids_and_stop_tokens(inputs: InputProcessor) -> None:
    _, (req,) = inputs.process("r", "hi", SamplingParams(stop_token_ids=[7]))
    assert req.eos_token_id == 2
    assert req.sampling_params.stop_token_ids == [7, 0]
    _, (req,) = inputs.process("r", "hi", SamplingParams(ignore_eos=True))
    assert req.sampling_params.stop_token_ids is None


def test_n_children_get_distinct_ids_and_seeds(inputs: InputProcessor) -> None:
    text, reqs = inputs.process("x", "hi", SamplingParams(n=3, seed=5), priority=2)
    assert text == "hi"
    assert [r.request_id for r in reqs] == ["0_x", "1_x", "2_x"]
    assert [r.sampling_params.seed for r in reqs] == [5, 6, 7]
    assert all(r.sampling_params.n == 1 and r.priority == 2 for r in reqs)
    assert len({r.arrival_time for r in reqs}) == 1


def test_chat_template(inputs: InputProcessor) -> None:
    text, ids = inputs.render_chat([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n") and "Hi" in text
    assert inputs.tokenizer.decode(ids) == text
    with pytest.raises(ValueError, match="content"):
        inputs.render_chat([{"role": "user"}])


def test_eos_token_ids_helper(tokenizer: Any) -> None:
    assert eos_token_ids([5], tokenizer) == [5, tokenizer.eos_token_id]
    assert eos_token_ids([tokenizer.eos_token_id], tokenizer) == [tokenizer.eos_token_id]
