"""A reasoning model through the real server and engine, with the official ``openai`` client.

The model is the scripted tiny Qwen3 (``scripted_model.py``): greedy, it
thinks "Checking the weather." between ``<think>`` tags, writes "Let me
look." and a Hermes call of get_weather for Paris. The server runs with
``--reasoning-parser qwen3 --enable-auto-tool-choice``. Every reply is
fetched whole and streamed, and the two must agree (``reply_utils``).
Structured outputs show that the grammar applies to the answer only: the
thinking could never match it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from .reply_utils import openai_reply_whole_and_streamed
from .scripted_model import ANSWER, CALL, THINKING
from .server_utils import RemoteServer

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "scripted"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}
]
CALLED = [("get_weather", json.dumps(CALL["arguments"]))]


@pytest.fixture(scope="module")
def server(
    scripted_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = [str(scripted_model_dir), "--served-model-name", MODEL, "--max-model-len", "512"]
    args += ["--num-blocks", "64", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.openai_client(timeout=120) as c:
        yield c


def _reply(client: openai.OpenAI, **kwargs: Any) -> Any:
    return openai_reply_whole_and_streamed(
        client, **{"model": MODEL, "messages": ASK, "temperature": 0, "max_tokens": 30, **kwargs}
    )


def test_thinking_and_answer_without_tools(client: openai.OpenAI) -> None:
    content, reasoning, calls, finish = _reply(client)
    assert reasoning == THINKING and finish == "stop" and calls == []
    assert content == ANSWER + "<tool_call>" + json.dumps(CALL) + "</tool_call>"


def test_thinking_then_a_tool_call(client: openai.OpenAI) -> None:
    assert _reply(client, tools=TOOLS) == (ANSWER, THINKING, CALLED, "tool_calls")


def test_enable_thinking_false(client: openai.OpenAI) -> None:
    kwargs = {"tools": TOOLS, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert _reply(client, **kwargs) == (ANSWER, None, CALLED, "tool_calls")


def test_max_tokens_cut(client: openai.OpenAI) -> None:
    # Inside the thinking: all of it is reasoning.
    assert _reply(client, tools=TOOLS, max_tokens=2) == (None, THINKING, [], "length")
    # Right after the call's opening tag: no call, the text stays content.
    assert _reply(client, tools=TOOLS, max_tokens=6) == (
        ANSWER + "<tool_call>",
        THINKING,
        [],
        "length",
    )


def test_structured_outputs_apply_after_the_thinking(client: openai.OpenAI) -> None:
    extra = {"structured_outputs": {"choice": ["yes", "no"]}}
    content, reasoning, calls, finish = _reply(client, extra_body=extra)
    assert reasoning == THINKING and content in ("yes", "no") and finish == "stop"
    extra = {"structured_outputs": {"json": WEATHER, "disable_any_whitespace": True}}
    content, reasoning, _, finish = _reply(client, extra_body=extra)
    assert reasoning == THINKING and finish == "stop"
    assert json.loads(content)["city"] in ("Paris", "Rome")


def test_forced_call_after_the_thinking(client: openai.OpenAI) -> None:
    content, reasoning, calls, finish = _reply(
        client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=100
    )
    assert (content, reasoning, finish) == (None, THINKING, "tool_calls")
    [(name, arguments)] = calls
    assert name == "get_weather" and json.loads(arguments)["city"] in ("Paris", "Rome")


def test_tokenize_a_chat_with_thinking_closed(server: RemoteServer) -> None:
    import httpx

    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}}
    r = httpx.post(server.url + "/tokenize", json={**body, "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["token_strs"][-4:] == ["<think>", "\n\n", "</think>", "\n\n"]
