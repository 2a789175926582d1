"""Tool-call parsers, by name (``--tool-call-parser``).

A parser extracts OpenAI tool calls from the text a model generated for
``tool_choice: "auto"``. Others join the registry with
``@register_tool_parser("name")`` on a ``ToolParser`` subclass.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolCallDelta,
    ToolCallStreamer,
    ToolParser,
)
from tokenloom.entrypoints.openai.tool_parsers.hermes import HermesToolParser

_REGISTRY: dict[str, type[ToolParser]] = {}

# The format the bundled tool template asks models for.
DEFAULT_TOOL_CALL_PARSER = "hermes"

T = type[ToolParser]


def register_tool_parser(name: str) -> Callable[[T], T]:
    def register(cls: T) -> T:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"tool parser {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as ``name``; ``ValueError`` listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown tool call parser {name!r} (known: {known})") from None


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


register_tool_parser(DEFAULT_TOOL_CALL_PARSER)(HermesToolParser)

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "HermesToolParser",
    "ParsedOutput",
    "ParsedToolCall",
    "ToolCallDelta",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "tool_parser_names",
]
