from __future__ import annotations

from pathlib import Path

import pytest

from tokenloom.chat_templates import load_bundled_template, template_renders_tools
from tokenloom.entrypoints.openai.tool_parsers import HermesToolParser, ToolCallChecker, settle

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path: Path):
    from tokenloom.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def _render(tokenizer, messages, tools=None) -> str:  # type: ignore[no-untyped-def]
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=load_bundled_template(),
        tokenize=False,
        add_generation_prompt=True,
    )


def test_default_model_template_ignores_tools(tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert not template_renders_tools(tokenizer.chat_template)
    assert template_renders_tools(load_bundled_template())


def test_tools_and_tool_history_are_rendered(tokenizer) -> None:  # type: ignore[no-untyped-def]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
                {"id": "2", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "tool_call_id": "1", "content": "20C"},
        {"role": "tool", "tool_call_id": "2", "content": "25C"},
    ]  # fmt: skip
    text = _render(tokenizer, messages, TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n")
    assert '<tools>\n{"name": "get_weather"' in text
    assert text.endswith("<|im_start|>assistant\n")
    # Both results go back in one user turn, in order.
    assert text.count("<|im_start|>user") == 2
    assert text.index("20C") < text.index("25C")
    # The assistant's calls are rendered in the format the hermes parser reads.
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    checker = ToolCallChecker({"get_weather": TOOLS[0]["function"]["parameters"]}, parallel=True)  # type: ignore[index]
    calls = settle(HermesToolParser(), checker, turn, final=True).calls
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_weather", '{"city": "Rome"}'),
    ]


def test_without_tools_it_is_plain_chatml(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = _render(tokenizer, [{"role": "user", "content": "hi"}])
    assert "<tools>" not in text
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
