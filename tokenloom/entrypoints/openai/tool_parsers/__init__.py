"""Tool-call parsers, by name (``--tool-call-parser``, vLLM's names).

A parser cuts the text a model generated for ``tool_choice: "auto"`` into
content and tool calls (``hermes``, ``llama3_json``, ``pythonic``);
``checked.py`` decides which calls a client gets. Others join the registry
with ``@register_tool_parser("name")`` on a ``ToolParser`` subclass.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    Segment,
    ToolParser,
)
from tokenloom.entrypoints.openai.tool_parsers.checked import (
    CheckedCall,
    SettledOutput,
    ToolCallChecker,
    settle,
)
from tokenloom.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tokenloom.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tokenloom.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

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
register_tool_parser("llama3_json")(Llama3JsonToolParser)
register_tool_parser("pythonic")(PythonicToolParser)

__all__ = [
    "DEFAULT_TOOL_CALL_PARSER",
    "CheckedCall",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "ParsedToolCall",
    "PythonicToolParser",
    "Segment",
    "SettledOutput",
    "ToolCallChecker",
    "ToolParser",
    "get_tool_parser",
    "register_tool_parser",
    "settle",
    "tool_parser_names",
]
