"""Parsers for outputs a grammar forced into tool calls (``tool_choice`` required or named).

* required: a JSON array of ``{"name": ..., "parameters": {...}}`` objects
  (vLLM's format), at least one, exactly one without ``parallel_tool_calls``.
* named: the output is the function's arguments object itself.
"""

from __future__ import annotations

import re

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    parse_call_object,
)

_SEPARATOR = re.compile(r"\s*(,|\])")


class RequiredToolParser(ToolParser):
    """``[{"name": "f", "parameters": {...}}, ...]``."""

    def parse(self, text: str, final: bool) -> ParsedOutput:
        calls: list[ParsedToolCall] = []
        start = re.compile(r"\s*\[").match(text)
        if start is None:
            return ParsedOutput(None, calls)
        pos = start.end()
        while True:
            call, end = parse_call_object(text, pos, "parameters")
            if call is None:
                break
            calls.append(call)
            if end is None:
                break
            sep = _SEPARATOR.match(text, end)
            if sep is None or sep.group(1) == "]":
                break
            pos = sep.end()
        return ParsedOutput(None, calls)


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one function the request named."""

    def __init__(self, name: str) -> None:
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput(None, [ParsedToolCall(self.name, text.strip(), complete=final)])
