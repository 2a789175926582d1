"""Prompt validation happens before anything reaches the core, with clear messages."""

from __future__ import annotations

from typing import Any

import pytest

from tokenloom.engine.input_processor import InputProcessor, eos_token_ids
from tokenloom.engine.protocol import ChatOptions
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


def test_tenant_reaches_every_child_and_bad_weights_are_refused(inputs: InputProcessor) -> None:
    _, reqs = inputs.process("x", "hi", SamplingParams(n=2), tenant="team-a", tenant_weight=3)
    assert [(r.tenant, r.tenant_weight) for r in reqs] == [("team-a", 3.0), ("team-a", 3.0)]
    _, (req,) = inputs.process("y", "hi", SamplingParams())
    assert (req.tenant, req.tenant_weight) == ("", 1.0)
    for weight in (0, -1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(ValueError, match="tenant_weight"):
            inputs.process("z", "hi", SamplingParams(), tenant_weight=weight)
    with pytest.raises(ValueError, match="tenant must be a string"):
        inputs.process("z", "hi", SamplingParams(), tenant=3)  # type: ignore[arg-type]


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


def test_chat_goes_through_the_engine_template(tokenizer: Any) -> None:
    inputs = InputProcessor(
        tokenizer,
        64,
        49152,
        [2],
        chat_template="{% for m in messages %}[{{ m.content }}]{% endfor %}",
    )
    rendered = inputs.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.text == "[Hi]"
    assert rendered.token_ids == tokenizer.encode("[Hi]", add_special_tokens=False)
    # A request's own template wins over the engine's.
    own = inputs.render_chat(
        [{"role": "user", "content": "Hi"}], ChatOptions(chat_template="<{{ messages[0].role }}>")
    )
    assert own.text == "<user>"


def test_model_template_by_default(inputs: InputProcessor) -> None:
    rendered = inputs.render_chat([{"role": "user", "content": "Hi"}])
    assert rendered.text.endswith("<|im_start|>assistant\n") and "Hi" in rendered.text
    assert inputs.tokenizer.decode(rendered.token_ids) == rendered.text
    with pytest.raises(ValueError, match=r"^messages\[0\]\.role"):
        inputs.render_chat([{"content": "Hi"}])


@pytest.mark.parametrize("prompt", ["caf\udce9", "\ud83d alone", "x" * 1000 + "\udfff"])
def test_lone_surrogates_in_a_prompt_are_refused(inputs: InputProcessor, prompt: str) -> None:
    with pytest.raises(ValueError, match="^prompt contains a lone surrogate"):
        inputs.process("r", prompt, SamplingParams())
    _, (ok,) = inputs.process("r", "caf\u00e9 \U0001f642", SamplingParams(max_tokens=4))
    assert ok.prompt_token_ids


def test_logprobs_above_max_logprobs_are_refused(tokenizer: Any) -> None:
    inputs = InputProcessor(tokenizer, 32, 49152, [2], max_logprobs=5)
    inputs.process("ok", "hi", SamplingParams(logprobs=5, max_tokens=4))
    with pytest.raises(ValueError, match=r"^logprobs \(6\) exceeds .*5 \(max_logprobs\)"):
        inputs.process("r", "hi", SamplingParams(logprobs=6, max_tokens=4))
    default = InputProcessor(tokenizer, 32, 49152, [2])
    default.process("ok", "hi", SamplingParams(logprobs=20, max_tokens=4))
    with pytest.raises(ValueError, match="^logprobs"):
        default.process("r", "hi", SamplingParams(logprobs=21, max_tokens=4))


def test_eos_token_ids_helper(tokenizer: Any) -> None:
    assert eos_token_ids([5], tokenizer) == [5, tokenizer.eos_token_id]
    assert eos_token_ids([tokenizer.eos_token_id], tokenizer) == [tokenizer.eos_token_id]


@pytest.mark.parametrize("text", ["hello world", "<|im_start|>user\nhi<|im_end|>", "émoji 🎉 中文"])
def test_text_prompts_tokenize_as_the_tokenizer_does(
    inputs: InputProcessor, tokenizer: Any, text: str
) -> None:
    assert inputs.tokenize(text) == (text, tokenizer.encode(text))


def test_an_overlong_text_prompt_is_refused_with_its_true_length(
    inputs: InputProcessor, tokenizer: Any
) -> None:
    text = "the quick brown fox " * 500
    with pytest.raises(ValueError, match=rf"^prompt is {len(tokenizer.encode(text))} tokens"):
        inputs.tokenize(text)
