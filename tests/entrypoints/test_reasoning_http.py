"""Reasoning models over HTTP against the fake engine: thinking in ``reasoning_content``.

The fake engine writes a scripted reply; the chat template is Qwen3's in
miniature (``enable_thinking: false`` closes the thinking in the prompt) or
DeepSeek-R1's (the prompt opens it). Whole and streamed replies must agree
(``reply_utils``), with and without tools.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app

from .fake_engine import FakeAsyncLLM
from .reply_utils import reply_whole_and_streamed
from .test_structured_outputs_http import WEATHER

QWEN3_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
R1_TEMPLATE = (
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:<think>\n{% endif %}"
)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 500}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _engine(template: str) -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.max_model_len = 4096
    engine.tokenizer.chat_template = template
    return engine


async def _client(engine: FakeAsyncLLM, parser: str) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, reasoning_parser=parser, enable_auto_tool_choice=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.fixture
def qwen3() -> FakeAsyncLLM:
    return _engine(QWEN3_TEMPLATE)


@pytest.fixture
async def client(qwen3: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    async for c in _client(qwen3, "qwen3"):
        yield c


async def test_thinking_comes_apart_from_the_answer(
    client: httpx.AsyncClient, qwen3: FakeAsyncLLM
) -> None:
    qwen3.reply = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
    assert await reply_whole_and_streamed(client, CHAT) == (
        "Hello there!",
        "The user greets me. I greet back.",
        [],
        "stop",
    )


async def test_thinking_cut_by_max_tokens(client: httpx.AsyncClient, qwen3: FakeAsyncLLM) -> None:
    qwen3.reply = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello there!"
    assert await reply_whole_and_streamed(client, {**CHAT, "max_tokens": 20}) == (
        None,
        "The user gre",
        [],
        "length",
    )


async def test_enable_thinking_false(client: httpx.AsyncClient, qwen3: FakeAsyncLLM) -> None:
    """The template closed the thinking: the whole reply is the answer, even one that
    looks like thinking."""
    qwen3.reply = "<think>not thinking</think>Hello!"
    body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
    assert await reply_whole_and_streamed(client, body) == (qwen3.reply, None, [], "stop")
    assert qwen3.rendered[-1].text.endswith("<think>\n\n</think>\n\n")
    # A model that did not think (optional thinking, no tag) answers in content.
    qwen3.reply = "Hello!"
    assert await reply_whole_and_streamed(client, CHAT) == ("Hello!", None, [], "stop")


async def test_thinking_then_a_tool_call(client: httpx.AsyncClient, qwen3: FakeAsyncLLM) -> None:
    qwen3.reply = "<think>I need the weather.</think>\n\nLet me check.\n" + CALL
    content, reasoning, calls, finish = await reply_whole_and_streamed(
        client, {**CHAT, "tools": [WEATHER]}
    )
    assert (content, reasoning, finish) == ("Let me check.", "I need the weather.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})]
    # A call written inside the thinking is thinking, not a call.
    qwen3.reply = "<think>maybe " + CALL + "</think>No call needed."
    content, reasoning, calls, finish = await reply_whole_and_streamed(
        client, {**CHAT, "tools": [WEATHER]}
    )
    assert (content, calls, finish) == ("No call needed.", [], "stop")
    assert reasoning == "maybe " + CALL


async def test_forced_calls_after_thinking(client: httpx.AsyncClient, qwen3: FakeAsyncLLM) -> None:
    qwen3.reply = '<think>Oslo it is.</think>[{"name":"get_weather","parameters":{"city":"Oslo"}}]'
    body = {**CHAT, "tools": [WEATHER], "tool_choice": "required"}
    content, reasoning, calls, finish = await reply_whole_and_streamed(client, body)
    assert (content, reasoning, finish) == (None, "Oslo it is.", "tool_calls")
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Oslo"})]


async def test_deepseek_r1_thinks_from_the_prompt() -> None:
    engine = _engine(R1_TEMPLATE)
    engine.reply = "\nFirst, 2 + 2.\n</think>\n\n4"
    async for client in _client(engine, "deepseek_r1"):
        assert await reply_whole_and_streamed(client, CHAT) == ("4", "First, 2 + 2.", [], "stop")
        # Cut before the end tag: all reasoning.
        assert await reply_whole_and_streamed(client, {**CHAT, "max_tokens": 8}) == (
            None,
            "First,",
            [],
            "length",
        )


async def test_without_a_reasoning_parser_thinking_is_content(qwen3: FakeAsyncLLM) -> None:
    qwen3.reply = "<think>x</think>y"
    app = build_app(qwen3)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert await reply_whole_and_streamed(client, CHAT) == (
            "<think>x</think>y",
            None,
            [],
            "stop",
        )
