from __future__ import annotations

import json
import random

import pytest

from tokenloom.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    ToolCallStreamer,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    tool_parser_names,
)
from tokenloom.entrypoints.openai.tool_parsers.base import scan_json_value
from tokenloom.entrypoints.openai.tool_parsers.constrained import (
    NamedToolParser,
    RequiredToolParser,
)

HERMES_TWO_CALLS = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and \\" inside"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": ["UTC", {"x": 1}]}}\n</tool_call>'
)


def _calls(parser: ToolParser, text: str) -> list[tuple[str | None, str]]:
    return [(c.name, c.arguments) for c in parser.parse(text, final=True).calls]


def _stream(parser: ToolParser, text: str, seed: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in random chunks; reassemble content and calls from the deltas."""
    rng = random.Random(seed)
    streamer = ToolCallStreamer(parser)
    content = ""
    calls: list[list[str]] = []
    end = 0
    while True:
        end = min(len(text), end + rng.randint(1, 7))
        final = end == len(text)
        new_content, deltas = streamer.update(text[:end], final=final)
        content += new_content
        for delta in deltas:
            if delta.name is not None:
                assert delta.index == len(calls), "names come first, in order"
                calls.append([delta.name, ""])
            assert delta.index < len(calls)
            calls[delta.index][1] += delta.arguments
        if final:
            return content, [(n, a) for n, a in calls]


def test_hermes_extracts_content_and_calls() -> None:
    parsed = HermesToolParser().parse(HERMES_TWO_CALLS, final=True)
    assert parsed.content == "Let me check both."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris", "note": 'a } and " inside'}),
        ("get_time", {"tz": ["UTC", {"x": 1}]}),
    ]
    assert all(c.complete for c in parsed.calls)


def test_hermes_without_calls_is_all_content() -> None:
    parsed = HermesToolParser().parse("  just text <tool", final=True)
    assert parsed.content == "just text <tool" and parsed.calls == []
    # While streaming, a possible start of a tag is held back.
    assert HermesToolParser().parse("just text <tool", final=False).content == "just text"


def test_hermes_accepts_keys_in_another_order_and_unclosed_tags() -> None:
    text = '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>'
    assert _calls(HermesToolParser(), text) == [("f", '{"a": 1}')]
    assert _calls(HermesToolParser(), '<tool_call>\n{"name": "g", "arguments": {}}') == [
        ("g", "{}")
    ]
    assert _calls(HermesToolParser(), "<tool_call>garbage</tool_call>") == []


@pytest.mark.parametrize("seed", range(20))
def test_hermes_stream_reassembles_to_the_final_parse(seed: int) -> None:
    content, calls = _stream(HermesToolParser(), HERMES_TWO_CALLS, seed)
    assert content == "Let me check both."
    assert calls == _calls(HermesToolParser(), HERMES_TWO_CALLS)


def test_streamed_arguments_arrive_before_the_call_closes() -> None:
    streamer = ToolCallStreamer(HermesToolParser())
    _, deltas = streamer.update('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert [(d.index, d.name, d.arguments) for d in deltas] == [(0, "f", '{"city": "Pa')]
    _, deltas = streamer.update('<tool_call>\n{"name": "f", "arguments": {"city": "Paris"}}')
    assert [(d.name, d.arguments) for d in deltas] == [(None, 'ris"}')]


REQUIRED = '[{"name":"a","parameters":{"x":[1,2]}},{"name":"b","parameters":{"s":"]},"}}]'


@pytest.mark.parametrize("seed", range(10))
def test_required_array_parses_and_streams(seed: int) -> None:
    assert _calls(RequiredToolParser(), REQUIRED) == [
        ("a", '{"x":[1,2]}'),
        ("b", '{"s":"]},"}'),
    ]
    content, calls = _stream(RequiredToolParser(), REQUIRED, seed)
    assert content == "" and calls == _calls(RequiredToolParser(), REQUIRED)


@pytest.mark.parametrize("seed", range(5))
def test_named_output_is_the_arguments(seed: int) -> None:
    text = '{"city":"Paris","days":3}'
    assert _calls(NamedToolParser("weather"), text) == [("weather", text)]
    assert _stream(NamedToolParser("weather"), text, seed)[1] == [("weather", text)]


def test_scan_json_value() -> None:
    assert scan_json_value('{"a": "}"} tail', 0) == (10, True)
    assert scan_json_value('{"a": [1, {', 0) == (11, False)
    assert scan_json_value('"x\\"y" rest', 0) == (6, True)
    assert scan_json_value("12", 0) == (0, False)
    assert scan_json_value("12}", 0) == (2, True)


def test_registry() -> None:
    assert "hermes" in tool_parser_names()
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")

    @register_tool_parser("test-only")
    class Mine(HermesToolParser):
        pass

    assert get_tool_parser("test-only") is Mine
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("test-only")(HermesToolParser)
