"""Request models -> SamplingParams, and Python errors -> OpenAI error bodies (no model)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from pydantic import ValidationError

from tokenloom.entrypoints.openai.errors import (
    OpenAIError,
    from_validation_error,
    from_value_error,
)
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from tokenloom.entrypoints.openai.serving_base import SAMPLING_FIELDS
from tokenloom.sampling_params import SamplingParams


def test_completion_request_maps_every_sampling_field() -> None:
    request = CompletionRequest(
        prompt="hi",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        n=2,
        stop="x",
        stop_token_ids=[3],
        seed=11,
        presence_penalty=0.2,
        frequency_penalty=0.3,
        repetition_penalty=1.1,
        logprobs=2,
        ignore_eos=True,
        min_tokens=1,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
    )
    params = request.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.top_k) == (7, 0.5, 0.9, 5)
    assert (params.min_p, params.n, params.stop, params.stop_token_ids) == (0.1, 2, ["x"], [3])
    assert (params.seed, params.presence_penalty, params.frequency_penalty) == (11, 0.2, 0.3)
    assert (params.repetition_penalty, params.logprobs, params.ignore_eos) == (1.1, 2, True)
    assert (params.min_tokens, params.skip_special_tokens) == (1, False)
    assert params.include_stop_str_in_output


def test_completion_defaults_are_openai_defaults() -> None:
    params = CompletionRequest(prompt="hi").to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (16, 1.0, 1.0, 1)
    assert params.logprobs is None


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2], [[1, 2]]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_prompt_shapes_become_a_batch(prompt: object, expected: list[object]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == expected


def test_empty_prompt_batch_is_refused() -> None:
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(prompt=[]).prompts()
    assert info.value.param == "prompt"


def test_chat_token_limit_and_logprobs_mapping() -> None:
    request = ChatCompletionRequest(
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        max_completion_tokens=9,
        logprobs=True,
        top_logprobs=3,
    )
    params = request.to_sampling_params()
    assert params.max_tokens == 9
    assert params.logprobs == 3
    assert request.max_tokens_param == "max_completion_tokens"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert chat.to_sampling_params().max_tokens is None
    assert chat.to_sampling_params().logprobs is None


def test_top_logprobs_without_logprobs_is_refused() -> None:
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(OpenAIError) as info:
        request.to_sampling_params()
    assert info.value.param == "top_logprobs"


def test_text_content_parts_are_joined() -> None:
    request = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                }
            ]
        }
    )
    assert request.messages[0].to_template_dict() == {"role": "user", "content": "ab"}


def test_value_error_param_is_the_leading_field_name() -> None:
    try:
        CompletionRequest(prompt="x", top_p=2).to_sampling_params()
    except ValueError as exc:
        error = from_value_error(exc, SAMPLING_FIELDS, None)
    assert error.param == "top_p" and error.status == 400
    assert "top_p" in error.message
    renamed = from_value_error(
        ValueError("max_tokens must be >= 1"), {"max_tokens": "max_completion_tokens"}, None
    )
    assert renamed.param == "max_completion_tokens"
    unknown = from_value_error(ValueError("prompt is too long"), SAMPLING_FIELDS, "prompt")
    assert unknown.param == "prompt"


def test_validation_error_names_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "x", "stop": 123})
    error = from_validation_error(info.value)
    assert error.param == "stop"
    body = error.body()["error"]
    assert body["code"] == 400 and body["type"] == "BadRequestError" and body["param"] == "stop"
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"content": "no role"}]})
    assert from_validation_error(info.value).param == "messages[0].role"


@pytest.mark.parametrize(
    ("part", "param", "words"),
    [
        ({"type": "image_url"}, "messages[0].content[1].image_url", "Field required"),
        ({"type": "image_url", "image_url": {"url": 5}}, "messages[0].content[1].image_url.url", "string"),
        ({"type": "image_url", "image_url": {"url": "x", "detail": "max"}}, "messages[0].content[1].image_url.detail", "'auto'"),
        ({"type": "input_audio"}, "messages[0].content[1]", "input_audio"),
        ({"type": "text", "text": 5}, "messages[0].content[1].text", "string"),
    ],
)  # fmt: skip
def test_a_bad_content_part_is_named_with_what_is_wrong(part: dict, param: str, words: str) -> None:
    """Content is a string or a list of parts: a list's error is the one reported."""
    content = [{"type": "text", "text": "look"}, part]
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": content}]})
    error = from_validation_error(info.value)
    assert error.param == param
    assert words in error.message


def test_a_value_of_no_member_type_is_named_at_its_field() -> None:
    """A prompt of mixed ints and strings fits several list members: no guessing which."""
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": [1, "a"]})
    assert from_validation_error(info.value).param == "prompt"


# ---------------------------------------------- SamplingParams at the edges of its ranges


@pytest.mark.parametrize("seed", [-(2**63), 0, 2**63, 2**64 - 1])
def test_seed_takes_any_64_bit_value(seed: int) -> None:
    assert SamplingParams(seed=seed).seed == seed


@pytest.mark.parametrize("seed", [-(2**63) - 1, 2**64, 10**100, 1.5, True])
def test_seed_outside_64_bits_is_refused(seed: object) -> None:
    with pytest.raises(ValueError, match=r"^seed "):
        SamplingParams(seed=seed)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(SamplingParams) if f.type == "float"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 2**63),
        ("min_tokens", 2**63),
        ("top_k", 2**63),
        ("n", 2**63),
        ("logprobs", 2**63),
        ("stop_token_ids", [2**63]),
        ("temperature", 10**400),  # an int beyond the float range
    ],
)
def test_integers_must_fit_64_bits(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field} "):
        SamplingParams(**{field: value})


def test_huge_but_finite_values_within_range_are_kept() -> None:
    params = SamplingParams(max_tokens=2**63 - 1, temperature=1e300, top_k=2**63 - 1)
    assert params.max_tokens == 2**63 - 1 and params.temperature == 1e300


def test_dead_helpers_are_gone() -> None:
    assert not hasattr(SamplingParams, "greedy")
    assert not hasattr(SamplingParams, "top_k_enabled")


def test_n_above_128_is_refused_by_the_api_not_by_sampling_params() -> None:
    assert SamplingParams(n=1000).n == 1000  # offline users may ask for more
    with pytest.raises(OpenAIError) as info:
        CompletionRequest(prompt="x", n=129).to_sampling_params()
    assert info.value.param == "n"


def test_float_fields_are_stored_as_floats() -> None:
    params = SamplingParams(temperature=10**30, top_p=1, repetition_penalty=2)
    assert type(params.temperature) is float and params.temperature == 1e30
    assert type(params.top_p) is float and type(params.repetition_penalty) is float
