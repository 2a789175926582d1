from __future__ import annotations

import json

import jsonschema
import pytest

from tokenloom.entrypoints.openai.tool_parsers import HermesToolParser
from tokenloom.entrypoints.openai.tool_parsers.constrained import (
    NamedToolParser,
    RequiredToolParser,
)
from tokenloom.entrypoints.openai.tools import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    tool_choice_constraint,
    tool_parser_for,
)
from tokenloom.structured_output.backend_xgrammar import validate

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city"],
}
TOOLS = [
    ChatCompletionToolsParam.model_validate(
        {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}
    ),
    ChatCompletionToolsParam.model_validate({"type": "function", "function": {"name": "now"}}),
]


def _named(name: str) -> ChatCompletionNamedToolChoiceParam:
    return ChatCompletionNamedToolChoiceParam.model_validate(
        {"type": "function", "function": {"name": name}}
    )


def test_auto_and_none_add_no_constraint() -> None:
    assert tool_choice_constraint(TOOLS, "auto", True) is None
    assert tool_choice_constraint(TOOLS, "none", True) is None
    assert tool_choice_constraint(TOOLS, None, True) is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_schema_accepts_exactly_valid_call_lists(parallel: bool) -> None:
    params = tool_choice_constraint(TOOLS, "required", parallel)
    assert params is not None and params.disable_any_whitespace
    validate(params)
    schema = json.loads(params.schema_text())
    good = [{"name": "weather", "parameters": {"city": "Oslo"}}]
    jsonschema.validate(good, schema)
    two = good + [{"name": "now", "parameters": {}}]
    if parallel:
        jsonschema.validate(two, schema)
    else:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(two, schema)
    for bad in (
        [],
        [{"name": "weather", "parameters": {"days": 2}}],  # city missing
        [{"name": "other", "parameters": {}}],
        [{"name": "weather", "parameters": {"city": "x"}, "extra": 1}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_choice_constrains_to_the_parameters() -> None:
    params = tool_choice_constraint(TOOLS, _named("weather"), True)
    assert params is not None and json.loads(params.schema_text()) == WEATHER
    no_params = tool_choice_constraint(TOOLS, _named("now"), True)
    assert no_params is not None and json.loads(no_params.schema_text())["type"] == "object"


def test_bad_tool_choices_name_the_field() -> None:
    with pytest.raises(ValueError, match=r"^tool_choice names 'missing'"):
        tool_choice_constraint(TOOLS, _named("missing"), True)
    with pytest.raises(ValueError, match=r"^tool_choice 'required' requires tools"):
        tool_choice_constraint(None, "required", True)


def test_parser_choice() -> None:
    assert tool_parser_for(None, "auto", "hermes") is None
    assert tool_parser_for(TOOLS, "none", "hermes") is None
    with pytest.raises(ValueError, match=r'^tool_choice "auto" .* --enable-auto-tool-choice'):
        tool_parser_for(TOOLS, "auto", None)
    assert isinstance(tool_parser_for(TOOLS, "auto", "hermes"), HermesToolParser)
    assert isinstance(tool_parser_for(TOOLS, None, "hermes"), HermesToolParser)
    assert isinstance(tool_parser_for(TOOLS, "required", None), RequiredToolParser)
    named = tool_parser_for(TOOLS, _named("weather"), None)
    assert isinstance(named, NamedToolParser) and named.name == "weather"
