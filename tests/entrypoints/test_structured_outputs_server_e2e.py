"""Structured outputs and tool calling on the real server, through the official ``openai`` client.

One server (default model) for the module. The client is used unchanged:
``chat.completions.parse`` with a Pydantic model, ``tools`` with
``tool_choice="required"``, a named function and ``auto``, each whole and
streamed (the stream must reassemble to the whole reply), cut by
``max_tokens`` inside a call, and the 400s for constraints that cannot be
compiled.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from .reply_utils import openai_reply_whole_and_streamed
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
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
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


def _check_calls(calls: list[tuple[str, str]], names: set[str]) -> None:
    """Every returned call is one of ``names`` with arguments that validate."""
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_choice_required(client: openai.OpenAI, parallel: bool) -> None:
    content, _, calls, finish = openai_reply_whole_and_streamed(
        client,
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=80,
        temperature=0,
    )
    assert content is None
    _check_calls(calls, {"get_weather", "get_time"})
    if parallel:
        # Nothing bounds the number of parallel calls, and a small model may go
        # on calling until max_tokens: then the reply says so, and only the
        # finished calls are returned.
        assert finish in ("tool_calls", "length") and calls
    else:
        assert finish == "tool_calls" and len(calls) == 1


BOOK = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "maxLength": 30},
        "destination": {"type": "string", "maxLength": 30},
        "date": {"type": "string", "maxLength": 20},
    },
    "required": ["origin", "destination", "date"],
    "additionalProperties": False,
}
FLIGHTS = [{"type": "function", "function": {"name": "book_flight", "parameters": BOOK}}]


@pytest.mark.parametrize("max_tokens", [12, 45, 100])
def test_max_tokens_cut_inside_a_forced_call(client: openai.OpenAI, max_tokens: int) -> None:
    """The reported case: calls cut by max_tokens are not calls, and the reply says length."""
    content, _, calls, finish = openai_reply_whole_and_streamed(
        client,
        model=MODEL,
        messages=[{"role": "user", "content": "Book flights from Oslo to Paris, Rome and Nice."}],
        tools=FLIGHTS,
        tool_choice="required",
        max_tokens=max_tokens,
        temperature=0,
    )
    assert content is None
    for name, arguments in calls:
        assert name == "book_flight"
        jsonschema.validate(json.loads(arguments), BOOK)
    if max_tokens == 12:  # not even the first call can finish in 12 tokens
        assert (calls, finish) == ([], "length")
    else:  # the model may have ended the list, or been cut in some call
        assert finish == "length" or (finish == "tool_calls" and calls)


def test_max_tokens_cut_inside_a_named_call(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0,
    )
    assert openai_reply_whole_and_streamed(client, max_tokens=4, **kwargs) == (
        None,
        None,
        [],
        "length",
    )
    _, _, calls, finish = openai_reply_whole_and_streamed(client, max_tokens=60, **kwargs)
    assert finish == "tool_calls" and len(calls) == 1
    _check_calls(calls, {"get_weather"})


def test_named_tool_choice(client: openai.OpenAI) -> None:
    _, _, calls, finish = openai_reply_whole_and_streamed(
        client,
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=60,
        temperature=0,
    )
    assert finish == "tool_calls" and len(calls) == 1
    _check_calls(calls, {"get_time"})


def test_auto_answers_with_text_or_calls_that_hold_up(client: openai.OpenAI) -> None:
    """The default model may or may not call a tool: whatever it returns validates."""
    content, _, calls, finish = openai_reply_whole_and_streamed(
        client, model=MODEL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0
    )
    _check_calls(calls, {"get_weather", "get_time"})
    assert finish in ("stop", "length", "tool_calls")
    assert (finish == "tool_calls") == (bool(calls) and finish != "length")
    assert content or calls


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
