"""OpenAI tool calling: the request and response models, and the grammar for forced calls.

``tool_choice`` decides how calls are produced:

* ``none``: tools are not shown to the model and no calls are parsed.
* ``auto`` (the default with tools; the server needs
  ``--enable-auto-tool-choice``): the chat template renders the tools and
  the server's tool-call parser (``--tool-call-parser``) extracts calls
  from whatever the model writes.
* ``required``: a grammar forces a JSON array of ``{"name", "parameters"}``
  objects whose parameters match the named function's schema (one call
  unless ``parallel_tool_calls``), so every call parses and validates.
* a named function: a grammar forces that function's arguments object.

Whatever the choice, only calls that hold up are returned (``tool_parsers/checked.py``).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tokenloom.entrypoints.openai.tool_parsers import (
    ToolCallChecker,
    ToolParser,
    get_tool_parser,
)
from tokenloom.entrypoints.openai.tool_parsers.constrained import (
    NamedToolParser,
    RequiredToolParser,
)
from tokenloom.structured_output.params import StructuredOutputsParams

# ---------------------------------------------------------------- requests


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam

# ---------------------------------------------------------------- responses


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: new_tool_call_id())
    type: Literal["function"] = "function"
    function: FunctionCall


def _is_none(value: object) -> bool:
    return value is None


# Streamed fragments leave unset fields out, as OpenAI does.
_OMITTED_IF_NONE: Any = Field(default=None, exclude_if=_is_none)


class DeltaFunctionCall(BaseModel):
    name: str | None = _OMITTED_IF_NONE
    arguments: str | None = _OMITTED_IF_NONE


class DeltaToolCall(BaseModel):
    """A streamed fragment of tool call ``index``: id, type and name come first."""

    index: int
    id: str | None = _OMITTED_IF_NONE
    type: Literal["function"] | None = _OMITTED_IF_NONE
    function: DeltaFunctionCall | None = _OMITTED_IF_NONE


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- forced calls


def _parameters(tool: ChatCompletionToolsParam) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params is not None else {"type": "object", "properties": {}}


def find_tool(tools: list[ChatCompletionToolsParam], name: str) -> ChatCompletionToolsParam | None:
    return next((t for t in tools if t.function.name == name), None)


def required_tools_schema(
    tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool
) -> dict[str, Any]:
    """The JSON schema of a forced list of calls: each item one of the tools."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": _parameters(tool),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


def tool_choice_constraint(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
) -> StructuredOutputsParams | None:
    """The grammar a request's ``tool_choice`` forces, or None (``auto``/``none``).

    Raises ``ValueError`` starting with ``tool_choice`` for a choice that
    names no tool or needs tools the request does not have.
    """
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if not tools:
        raise ValueError(f"tool_choice {_describe(tool_choice)} requires tools")
    if tool_choice == "required":
        schema = required_tools_schema(tools, parallel_tool_calls)
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    assert isinstance(tool_choice, ChatCompletionNamedToolChoiceParam)
    tool = find_tool(tools, tool_choice.function.name)
    if tool is None:
        raise ValueError(f"tool_choice names {tool_choice.function.name!r}, which is not in tools")
    return StructuredOutputsParams(json=_parameters(tool), disable_any_whitespace=True)


def tool_parser_for(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: ToolChoice | None,
    auto_parser: str | None,
) -> ToolParser | None:
    """The parser for one request's output, or None when it cannot contain calls.

    ``auto`` needs the server's ``--enable-auto-tool-choice`` (``auto_parser``
    is then its ``--tool-call-parser``); without it a ``ValueError`` naming
    ``tool_choice``, as vLLM answers.
    """
    if not tools or tool_choice == "none":
        return None
    if tool_choice == "required":
        return RequiredToolParser()
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        return NamedToolParser(tool_choice.function.name)
    if auto_parser is None:
        raise ValueError(
            'tool_choice "auto" (the default with tools) needs a server started with '
            '--enable-auto-tool-choice; "required", "none" or a named function work without'
        )
    return get_tool_parser(auto_parser)()


def tool_checker(
    tools: list[ChatCompletionToolsParam], parallel_tool_calls: bool
) -> ToolCallChecker:
    """What a request's returned calls must satisfy; ``ValueError`` naming ``tools``
    for a function whose parameters are not a JSON schema."""
    return ToolCallChecker(
        {tool.function.name: tool.function.parameters for tool in tools}, parallel_tool_calls
    )


def _describe(tool_choice: ToolChoice) -> str:
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        return f"naming {tool_choice.function.name!r}"
    return repr(tool_choice)
