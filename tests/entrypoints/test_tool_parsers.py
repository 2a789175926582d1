"""Tool-call parsers and the checks between them and the client.

Each parser (hermes, llama3_json, pythonic, and the two for grammar-forced
output) is fuzzed with hypothesis: well-formed calls with random text around
them parse to exactly those calls, and no split of any text into stream
deltas changes what is parsed (the streamed content and calls add up to the
whole response's).
"""

from __future__ import annotations

import json
import keyword
from typing import Any

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.entrypoints.openai.chat_reply import ReplyParser, ReplyStream
from tokenloom.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    PythonicToolParser,
    ToolCallChecker,
    ToolParser,
    get_tool_parser,
    register_tool_parser,
    settle,
    tool_parser_names,
)
from tokenloom.entrypoints.openai.tool_parsers.base import scan_json_value
from tokenloom.entrypoints.openai.tool_parsers.constrained import (
    NamedToolParser,
    RequiredToolParser,
)
from tokenloom.reasoning import StartPhase

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
    "additionalProperties": False,
}
FUNCTIONS: dict[str, Any] = {"get_weather": WEATHER, "get_time": None}
CHECKER = ToolCallChecker(FUNCTIONS, parallel=True)

Call = tuple[str, dict[str, Any]]


def _final(parser: ToolParser, text: str, checker: ToolCallChecker = CHECKER) -> Any:
    settled = settle(parser, checker, text, final=True)
    return settled.content, [(c.name, json.loads(c.arguments)) for c in settled.calls]


def _streamed(
    parser: ToolParser, text: str, cuts: list[int], checker: ToolCallChecker = CHECKER
) -> Any:
    """Feed ``text`` cut at ``cuts``; reassemble content and calls from the deltas."""
    stream = ReplyStream(ReplyParser(None, StartPhase.ANSWER, parser, checker))
    content = ""
    calls: list[Call] = []
    bounds = [0, *sorted({c for c in cuts if 0 < c < len(text)}), len(text)]
    for start, end in zip(bounds, bounds[1:], strict=False):
        delta = stream.feed(text[start:end], finished=end == len(text))
        assert not delta.reasoning
        content += delta.content
        for index, call in delta.calls:
            assert index == len(calls), "calls arrive whole, in order"
            calls.append((call.name, json.loads(call.arguments)))
    if len(text) == 0:
        delta = stream.feed("", finished=True)
        content += delta.content
    return content, calls


def _assert_split_stable(parser: ToolParser, text: str, cuts: list[int]) -> None:
    final = _final(parser, text)
    assert _streamed(parser, text, cuts) == final
    # Stronger: every prefix's view is a prefix of the final reply.
    for end in range(len(text) + 1):
        view = settle(parser, CHECKER, text[:end], final=False)
        assert final[0].startswith(view.content), (text[:end], view.content)
        seen = [(c.name, json.loads(c.arguments)) for c in view.calls]
        assert final[1][: len(seen)] == seen


# ---------------------------------------------------------------- strategies

_IDENT = st.from_regex(r"[a-z_][a-z0-9_]{0,6}", fullmatch=True).filter(
    lambda s: not keyword.iskeyword(s)
)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(10**6), 10**6)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
_ARGS = st.dictionaries(_IDENT, _VALUES, max_size=3)
_CALLS = st.lists(st.tuples(_IDENT, _ARGS), min_size=1, max_size=3)
# Text around calls: brackets, quotes and tag characters, never a whole tag.
_TEXT = st.text(alphabet=" \nab.!?{}[]()<>/\"':,", max_size=12)
_CUTS = st.lists(st.integers(0, 400), max_size=12)
_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _checker(calls: list[Call]) -> ToolCallChecker:
    return ToolCallChecker({name: None for name, _ in calls}, parallel=True)


def _hermes(calls: list[Call]) -> list[str]:
    return [
        "<tool_call>\n" + json.dumps({"name": n, "arguments": a}) + "\n</tool_call>"
        for n, a in calls
    ]


def _pythonic_call(name: str, args: dict[str, Any]) -> str:
    return name + "(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"


# Fragments of every format, to build texts that are hard to parse.
_FRAGMENTS = st.sampled_from(
    ["<tool_call>", "</tool_call>", "<|python_tag|>", "{", "}", "[", "]", "(", ")", ";", ",",
     '"', '{"name": "get_time", "arguments": {}}', '{"name": "get_weather", "parameters": ',
     '{"city": "Oslo"}', 'get_time()', 'get_weather(city="x")', "\n", " "]
)  # fmt: skip
_MESSY = st.lists(_FRAGMENTS | _TEXT, max_size=10).map("".join)

_PARSERS = [
    HermesToolParser(),
    Llama3JsonToolParser(),
    PythonicToolParser(),
    RequiredToolParser(),
    NamedToolParser("get_weather"),
]


@pytest.mark.parametrize("parser", _PARSERS, ids=lambda p: type(p).__name__)
@given(text=_MESSY, cuts=_CUTS)
@_SETTINGS
def test_no_split_of_any_text_changes_what_is_parsed(
    parser: ToolParser, text: str, cuts: list[int]
) -> None:
    _assert_split_stable(parser, text, cuts)


@given(calls=_CALLS, before=_TEXT, between=_TEXT, after=_TEXT, cuts=_CUTS)
@_SETTINGS
def test_hermes_calls_among_text(
    calls: list[Call], before: str, between: str, after: str, cuts: list[int]
) -> None:
    text = before + between.join(_hermes(calls)) + after
    checker = _checker(calls)
    content = (before + between * (len(calls) - 1) + after).strip()
    assert _final(HermesToolParser(), text, checker) == (content, calls)
    assert _streamed(HermesToolParser(), text, cuts, checker) == (content, calls)


@given(calls=_CALLS, tag=st.booleans(), after=_TEXT.filter(lambda t: ";" not in t), cuts=_CUTS)
@_SETTINGS
def test_llama3_json_calls_then_text(
    calls: list[Call], tag: bool, after: str, cuts: list[int]
) -> None:
    objects = [json.dumps({"name": n, "parameters": a}) for n, a in calls]
    text = ("<|python_tag|>" if tag else "") + "; ".join(objects) + after
    checker = _checker(calls)
    assert _final(Llama3JsonToolParser(), text, checker) == (after.strip(), calls)
    assert _streamed(Llama3JsonToolParser(), text, cuts, checker) == (after.strip(), calls)


@given(calls=_CALLS, after=_TEXT, cuts=_CUTS)
@_SETTINGS
def test_pythonic_calls_then_text(calls: list[Call], after: str, cuts: list[int]) -> None:
    text = "[" + ", ".join(_pythonic_call(n, a) for n, a in calls) + "]" + after
    checker = _checker(calls)
    assert _final(PythonicToolParser(), text, checker) == (after.strip(), calls)
    assert _streamed(PythonicToolParser(), text, cuts, checker) == (after.strip(), calls)


@pytest.mark.parametrize("parser", [Llama3JsonToolParser(), PythonicToolParser()])
@given(calls=_CALLS, before=_TEXT.filter(lambda t: t.strip()[:1] not in ("", "{", "[")))
@_SETTINGS
def test_text_before_calls_makes_an_answer_of_plain_content(
    parser: ToolParser, calls: list[Call], before: str
) -> None:
    """These formats are the whole output: text first means no calls."""
    if isinstance(parser, PythonicToolParser):
        body = "[" + ", ".join(_pythonic_call(n, a) for n, a in calls) + "]"
    else:
        body = "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    text = before + body
    assert _final(parser, text, _checker(calls)) == (text.strip(), [])


@given(
    args=st.lists(
        st.dictionaries(st.sampled_from(["city", "days", "x"]), _SCALARS, max_size=3),
        min_size=1,
        max_size=4,
    ),
    parallel=st.booleans(),
    cuts=_CUTS,
)
@_SETTINGS
def test_only_calls_that_validate_are_returned(
    args: list[dict[str, Any]], parallel: bool, cuts: list[int]
) -> None:
    calls = [("get_weather", a) for a in args]
    text = "\n".join(_hermes(calls))
    checker = ToolCallChecker(FUNCTIONS, parallel)
    valid = [c for c in calls if jsonschema.Draft202012Validator(WEATHER).is_valid(c[1])]
    content, returned = _final(HermesToolParser(), text, checker)
    assert returned == (valid if parallel else valid[:1])
    # A call that does not validate stays in the content, as the model wrote it.
    assert content.count("<tool_call>") == len(calls) - len(valid)
    assert _streamed(HermesToolParser(), text, cuts, checker) == (content, returned)


# ---------------------------------------------------------------- examples

HERMES_TWO_CALLS = (
    "Let me check both.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "note": "a } and \\" inside"}}\n'
    "</tool_call>\n<tool_call>\n"
    '{"name": "get_time", "arguments": {"tz": ["UTC", {"x": 1}]}}\n</tool_call>'
)


def test_hermes_extracts_content_and_calls() -> None:
    lenient = ToolCallChecker({"get_weather": None, "get_time": None}, parallel=True)
    assert _final(HermesToolParser(), HERMES_TWO_CALLS, lenient) == (
        "Let me check both.",
        [
            ("get_weather", {"city": "Paris", "note": 'a } and " inside'}),
            ("get_time", {"tz": ["UTC", {"x": 1}]}),
        ],
    )
    # get_weather's schema refuses "note": that call stays text.
    content, calls = _final(HermesToolParser(), HERMES_TWO_CALLS)
    assert [name for name, _ in calls] == ["get_time"]
    assert content.startswith("Let me check both.\n<tool_call>") and '"note"' in content


def test_hermes_text_and_partial_tags() -> None:
    assert _final(HermesToolParser(), "  just text <tool") == ("just text <tool", [])
    # While streaming, a possible start of a tag is held back.
    view = settle(HermesToolParser(), CHECKER, "just text <tool", final=False)
    assert view.content == "just text"
    text = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    assert _final(HermesToolParser(), text)[1] == [("get_weather", {"city": "Oslo"})]
    # The model stopped after the object, without the closing tag: still a call.
    assert _final(HermesToolParser(), '<tool_call>\n{"name": "get_time", "arguments": {}}') == (
        "",
        [("get_time", {})],
    )
    assert _final(HermesToolParser(), "<tool_call>garbage</tool_call>") == (
        "<tool_call>garbage</tool_call>",
        [],
    )


def test_a_call_cut_short_is_no_call() -> None:
    cut = 'Booking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    assert _final(HermesToolParser(), cut) == (cut.strip(), [])
    # Unknown functions, NaN and non-object arguments are refused too.
    for bad in (
        '{"name": "book", "arguments": {}}',
        '{"name": "get_time", "arguments": {"x": NaN}}',
        '{"name": "get_time", "arguments": [1]}',
    ):
        assert _final(HermesToolParser(), f"<tool_call>{bad}</tool_call>")[1] == []


REQUIRED = '[{"name":"get_time","parameters":{"x":[1,2]}},{"name":"get_weather","parameters":{"city":"]},"}}]'


def test_required_array_and_its_cut() -> None:
    calls = [("get_time", {"x": [1, 2]}), ("get_weather", {"city": "]},"})]
    assert _final(RequiredToolParser(), REQUIRED) == ("", calls)
    # Cut inside the second call (max_tokens): only the first is a call, and
    # the fragment is not content (the grammar wrote it, not the model's message).
    cut = REQUIRED[: REQUIRED.index('"city"') + 4]
    assert _final(RequiredToolParser(), cut) == ("", calls[:1])
    one = ToolCallChecker(FUNCTIONS, parallel=False)
    assert _final(RequiredToolParser(), REQUIRED, one) == ("", calls[:1])


def test_named_output_is_the_arguments() -> None:
    parser = NamedToolParser("get_weather")
    assert _final(parser, ' {"city":"Paris","days":3}') == (
        "",
        [("get_weather", {"city": "Paris", "days": 3})],
    )
    assert _final(parser, '{"city":"Par') == ("", [])
    assert _final(parser, '{"days":3}') == ("", [])  # city is required


def test_llama3_json_examples() -> None:
    parser = Llama3JsonToolParser()
    text = '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert _final(parser, text) == ("", [("get_time", {}), ("get_weather", {"city": "Rome"})])
    assert _final(parser, "The weather is fine.") == ("The weather is fine.", [])
    assert _final(parser, '{"name": "get_time", "parameters": {}} Done.') == (
        "Done.",
        [("get_time", {})],
    )


def test_pythonic_examples() -> None:
    parser = PythonicToolParser()
    text = '[get_weather(city="Paris", days=2), get_time()]'
    assert _final(parser, text) == (
        "",
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})],
    )
    assert _final(parser, "[get_time(flag=True, none=None)]") == (
        "",
        [("get_time", {"flag": True, "none": None})],
    )
    assert _final(parser, "[1, 2, 3]") == ("[1, 2, 3]", [])
    # Positional arguments and names that are not literals cannot become JSON.
    assert _final(parser, '[get_weather("Paris")]') == ('get_weather("Paris")', [])
    assert _final(parser, "[get_time(x=y)]") == ("get_time(x=y)", [])
    assert _final(parser, '[get_weather(city="Pa') == ('get_weather(city="Pa', [])


def test_bad_schemas_are_refused_naming_tools() -> None:
    with pytest.raises(ValueError, match=r"^tools: the parameters of 'f' are not a valid JSON"):
        ToolCallChecker({"f": {"type": "no-such-type"}}, parallel=True)


def test_scan_json_value() -> None:
    assert scan_json_value('{"a": "}"} tail', 0) == (10, True)
    assert scan_json_value('{"a": [1, {', 0) == (11, False)
    assert scan_json_value('"x\\"y" rest', 0) == (6, True)
    assert scan_json_value("12", 0) == (0, False)
    assert scan_json_value("12}", 0) == (2, True)


def test_registry() -> None:
    assert {"hermes", "llama3_json", "pythonic"} <= set(tool_parser_names())
    assert get_tool_parser("hermes") is HermesToolParser
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'.*hermes"):
        get_tool_parser("nope")

    @register_tool_parser("test-only")
    class Mine(HermesToolParser):
        pass

    assert get_tool_parser("test-only") is Mine
    with pytest.raises(ValueError, match="already registered"):
        register_tool_parser("test-only")(HermesToolParser)
