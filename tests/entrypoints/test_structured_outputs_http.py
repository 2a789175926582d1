"""Structured outputs and tool calling over HTTP, against the model-free fake engine.

What the server must do on its own: turn each way of asking for a constraint
into ``SamplingParams.structured_outputs``, refuse bad ones with a 400 naming
the field, show tools to the template, and turn generated text into OpenAI
tool calls (whole, or as stream deltas that add up to the same calls).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tokenloom.entrypoints.openai.server import build_app

from .fake_engine import FakeAsyncLLM
from .test_app_fake_engine import assert_error, events

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}


@pytest.fixture
def engine() -> FakeAsyncLLM:
    engine = FakeAsyncLLM()
    engine.max_model_len = 4096  # room for the tool replies
    return engine


@pytest.fixture
async def client(engine: FakeAsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(engine, enable_auto_tool_choice=True)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        yield c


@pytest.mark.parametrize(
    ("extra", "kind", "value"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         "json", SCHEMA),
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"structured_outputs": {"regex": "[ab]+"}}, "regex", "[ab]+"),
        ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
        ({"guided_json": SCHEMA}, "json", SCHEMA),
        ({"guided_json": json.dumps(SCHEMA)}, "json", json.dumps(SCHEMA)),
        ({"guided_regex": "a+"}, "regex", "a+"),
        ({"guided_choice": ["p", "q"]}, "choice", ["p", "q"]),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
    ],
)  # fmt: skip
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
async def test_every_way_of_asking_becomes_structured_outputs(
    client: httpx.AsyncClient,
    engine: FakeAsyncLLM,
    extra: dict[str, Any],
    kind: str,
    value: Any,
    endpoint: str,
) -> None:
    if endpoint == "chat":
        r = await client.post("/v1/chat/completions", json={**CHAT, **extra})
    else:
        r = await client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    constraint = engine.params[-1].structured_outputs
    assert constraint is not None and constraint.kind == kind
    assert getattr(constraint, kind) == value


async def test_text_format_and_no_fields_add_no_constraint(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    r = await client.post(
        "/v1/chat/completions", json={**CHAT, "response_format": {"type": "text"}}
    )
    assert r.status_code == 200
    assert engine.params[-1].structured_outputs is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"regex": "[z-a]"}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"guided_grammar": "root ::= undefined"}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"tools": [WEATHER],
          "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)  # fmt: skip
async def test_bad_constraints_are_400_naming_the_field(
    client: httpx.AsyncClient, engine: FakeAsyncLLM, extra: dict[str, Any], param: str
) -> None:
    r = await client.post("/v1/chat/completions", json={**CHAT, **extra})
    assert_error(r, 400, param)
    assert engine.started == []
    # Nothing is disturbed: the next request runs.
    r = await client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200


async def test_tools_reach_the_template_unless_tool_choice_is_none(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
    tools = engine.chat_options[-1].tools
    assert tools is not None and tools[0]["function"]["name"] == "get_weather"
    await client.post(
        "/v1/chat/completions", json={**CHAT, "tools": [WEATHER], "tool_choice": "none"}
    )
    assert engine.chat_options[-1].tools is None
    assert engine.params[-1].structured_outputs is None


async def test_tool_history_is_accepted(client: httpx.AsyncClient, engine: FakeAsyncLLM) -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}  # fmt: skip
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "cold"},
    ]
    r = await client.post(
        "/v1/chat/completions", json={"messages": messages, "tools": [WEATHER], "max_tokens": 3}
    )
    assert r.status_code == 200, r.text
    sent = engine.conversations[-1]
    assert sent[1]["tool_calls"] == [call] and sent[2]["tool_call_id"] == "c1"


HERMES_REPLY = (
    'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
REQUIRED_REPLY = '[{"name":"get_weather","parameters":{"city":"Oslo"}}]'


@pytest.mark.parametrize(
    ("tool_choice", "reply", "content"),
    [
        (None, HERMES_REPLY, "Checking."),
        ("required", REQUIRED_REPLY, None),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city":"Oslo"}', None),
    ],
)
async def test_tool_calls_whole_and_streamed(
    client: httpx.AsyncClient,
    engine: FakeAsyncLLM,
    tool_choice: Any,
    reply: str,
    content: str | None,
) -> None:
    engine.reply = reply
    body: dict[str, Any] = {**CHAT, "max_tokens": 200, "tools": [WEATHER]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == content
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}

    r = await client.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [e for e in events(r.text) if e != "[DONE]"]
    calls: dict[int, dict[str, Any]] = {}
    streamed_content = ""
    for chunk in chunks:
        delta = chunk["choices"][0]["delta"]
        streamed_content += delta.get("content") or ""
        for part in delta.get("tool_calls", []):
            if "id" in part:  # the first fragment: id, type and name
                assert part["type"] == "function" and part["function"]["name"]
                calls[part["index"]] = {"name": part["function"]["name"], "arguments": ""}
            calls[part["index"]]["arguments"] += part["function"].get("arguments", "")
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert list(calls.values()) == [
        {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in message["tool_calls"]
    ]
    assert (streamed_content or None) == content


async def test_auto_without_a_call_is_plain_content(
    client: httpx.AsyncClient, engine: FakeAsyncLLM
) -> None:
    engine.reply = "No tools needed."
    r = await client.post("/v1/chat/completions", json={**CHAT, "tools": [WEATHER]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": "No tools needed."}


async def test_openapi_documents_the_new_fields(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    completion = schemas["CompletionRequest"]["properties"]
    for name in ("response_format", "structured_outputs", "guided_json", "guided_regex",
                 "guided_choice", "guided_grammar"):  # fmt: skip
        assert name in chat and name in completion
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        assert name in chat
    assert "schema" in schemas["JsonSchemaResponseFormat"]["properties"]
    assert "json" in schemas["StructuredOutputsRequest"]["properties"]
    assert "tool_calls" in schemas["ChatResponseMessage"]["properties"]
    assert "tool_calls" in schemas["DeltaMessage"]["properties"]
