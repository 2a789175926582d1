"""The reasoning gate as the front end sets it: from the parser's tags and the prompt's end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tokenloom.engine.input_processor import InputProcessor
from tokenloom.reasoning import get_reasoning_parser
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputsParams
from tokenloom.structured_output.reasoning_gate import ReasoningGate, ReasoningTokens


@pytest.fixture(scope="module")
def scripted_tokenizer(scripted_model_dir: Path) -> Any:
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(scripted_model_dir)


def test_a_model_without_the_tags_is_refused(tokenizer: Any, scripted_tokenizer: Any) -> None:
    qwen3 = get_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match=r"^reasoning_parser 'qwen3' needs '<think>' to be one"):
        ReasoningTokens.resolve(qwen3, tokenizer, len(tokenizer))
    # Tags the tokenizer has but the model's logits do not cover cannot be sampled.
    end = scripted_tokenizer.convert_tokens_to_ids("</think>")
    with pytest.raises(ValueError, match=r"needs '</think>' to be one token"):
        ReasoningTokens.resolve(qwen3, scripted_tokenizer, end)


@pytest.mark.parametrize(
    ("parser", "kwargs", "optional"),
    [
        ("qwen3", {}, True),  # the model may open with <think>, or answer at once
        ("deepseek_r1", {}, False),  # always thinks
        ("qwen3", {"enable_thinking": False}, None),  # the template closed the thinking
        ("deepseek_r1", {"enable_thinking": False}, None),
    ],
)
def test_the_gate_follows_the_end_of_the_prompt(
    scripted_tokenizer: Any, parser: str, kwargs: dict[str, Any], optional: bool | None
) -> None:
    inputs = InputProcessor(
        scripted_tokenizer, 512, len(scripted_tokenizer), [0], reasoning_parser=parser
    )
    think, end = (scripted_tokenizer.convert_tokens_to_ids(t) for t in ("<think>", "</think>"))
    prompt = scripted_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False, **kwargs
    )
    structured = StructuredOutputsParams(choice=["yes", "no"])
    _, [request] = inputs.process("r", prompt, SamplingParams(structured_outputs=structured))
    gate = request.sampling_params.structured_outputs.reasoning_gate  # type: ignore[union-attr]
    if optional is None:
        assert gate is None
    else:
        assert gate == ReasoningGate(end, think if optional else None)
    # Unstructured requests are left alone.
    _, [plain] = inputs.process("p", prompt, SamplingParams())
    assert plain.sampling_params.structured_outputs is None


def test_gate_ids_are_checked() -> None:
    with pytest.raises(ValueError, match="reasoning_gate.end_token_id must be a token id"):
        ReasoningGate(-1)


def test_the_engine_refuses_a_parser_its_model_lacks() -> None:
    """Before the weights load: the tokenizer says the model is no reasoning model."""
    from tokenloom import LLM

    with pytest.raises(ValueError, match=r"^reasoning_parser 'deepseek_r1' needs '<think>'"):
        LLM(reasoning_parser="deepseek_r1", max_model_len=256, num_blocks=32)
