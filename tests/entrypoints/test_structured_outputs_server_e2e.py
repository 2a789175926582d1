"""Structured outputs and tool calling on the real server, through the official ``openai`` client.

One server (default model) for the module. The client is used unchanged:
``chat.completions.parse`` with a Pydantic model, ``tools`` with
``tool_choice="required"`` and with a named function, streamed tool calls,
and the 400s for constraints that cannot be compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .server_utils import RemoteServer, metric_values

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                      "parameters": TIME}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in CET?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RemoteServer]:
    log = tmp_path_factory.mktemp("server") / "server.log"
    args = ["--max-model-len", "1024", "--num-blocks", "256", "--max-num-seqs", "8"]
    server = RemoteServer(args, log)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> Iterator[openai.OpenAI]:
    with server.openai_client(timeout=300) as c:
        yield c


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)
    population_millions: int = Field(ge=0, le=40)
    size: Literal["small", "medium", "large"]


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        max_completion_tokens=100,
        temperature=0,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, City), message.content
    assert completion.choices[0].finish_reason == "stop"


def _check_calls(calls: Any, names: set[str]) -> list[tuple[str, str]]:
    assert calls, "no tool calls"
    out = []
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        out.append((call.function.name, call.function.arguments))
    return out


def _streamed_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[list[tuple[str, str]], str]:
    """Reassemble streamed tool-call deltas: name first, then argument fragments."""
    calls: dict[int, list[str]] = {}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            if delta.id is not None:
                assert delta.index not in calls and delta.function and delta.function.name
                calls[delta.index] = [delta.function.name, ""]
            assert delta.function is not None
            calls[delta.index][1] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return [(name, args) for name, args in calls.values()], finish


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=80,
        temperature=0,
    )
    completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    calls = choice.message.tool_calls or []
    if parallel:
        # Nothing bounds the number of parallel calls, and a small model may go
        # on calling until max_tokens: every finished call must validate.
        assert choice.finish_reason in ("tool_calls", "length")
        if choice.finish_reason == "length":
            calls = calls[:-1]
    else:
        assert choice.finish_reason == "tool_calls" and len(calls) == 1
    checked = _check_calls(calls, {"get_weather", "get_time"})
    streamed, finish = _streamed_calls(client, **kwargs)
    assert finish == choice.finish_reason
    assert streamed[: len(checked)] == checked
    assert streamed == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
    ]


def test_named_tool_choice(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    completion = client.chat.completions.create(**kwargs)
    choice = completion.choices[0]
    assert _check_calls(choice.message.tool_calls, {"get_time"})
    streamed, _ = _streamed_calls(client, **kwargs)
    assert streamed == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
    ]


def test_tool_history_round_trip(client: openai.OpenAI) -> None:
    """A conversation with an assistant tool call and a tool result is rendered and answered."""
    messages: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]  # fmt: skip
    completion = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=20, temperature=0
    )
    assert completion.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions_with_structured_outputs_fields(client: openai.OpenAI) -> None:
    regex = r"[0-9]{3}-[0-9]{4}"
    completion = client.completions.create(
        model=MODEL,
        prompt="My phone number is ",
        max_tokens=20,
        temperature=0.8,
        extra_body={"structured_outputs": {"regex": regex}},
    )
    import re

    assert re.fullmatch(regex, completion.choices[0].text)
    completion = client.completions.create(
        model=MODEL,
        prompt="Is the sky blue? Answer: ",
        max_tokens=5,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert completion.choices[0].text in ("yes", "no")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "object",
                                                                      "properties": 3}}}},
         "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_invalid_constraints_are_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    assert info.value.param == param  # type: ignore[attr-defined]
    # The engine is undisturbed.
    ok = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
    assert ok.choices[0].finish_reason == "length"


def test_metrics_count_structured_requests(server: RemoteServer) -> None:
    values = metric_values(server.url)
    assert values["tokenloom:structured_output_requests_total{}"] >= 1
    assert values["tokenloom:structured_output_compile_time_seconds_count{}"] >= 1
    assert "tokenloom:structured_output_grammar_cache_hits_total{}" in values
