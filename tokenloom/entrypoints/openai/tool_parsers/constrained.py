"""Parsers for outputs a grammar forced into tool calls (``tool_choice`` required or named).

* required: a JSON array of ``{"name": ..., "parameters": {...}}`` objects
  (vLLM's format), at least one, exactly one without ``parallel_tool_calls``.
* named: the output is the function's arguments object itself.

The grammar makes every finished call valid; an output cut short (by
``max_tokens``) leaves an unfinished last call, which is no call.
"""

from __future__ import annotations

import re

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    Segment,
    ToolParser,
    json_call,
    scan_json_value,
)

_OPEN = re.compile(r"\s*\[\s*")
_SEPARATOR = re.compile(r"\s*,\s*")


class RequiredToolParser(ToolParser):
    """``[{"name": "f", "parameters": {...}}, ...]``."""

    failed_calls_are_content = False

    def segments(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        start = _OPEN.match(text)
        if start is None:
            return segments
        pos = start.end()
        while pos < len(text):
            end, complete = scan_json_value(text, pos)
            if not complete:
                segments.append(ParsedToolCall(None, raw=text[pos:]))
                break
            segments.append(json_call(text[pos:end], ("parameters",), text[pos:end]))
            sep = _SEPARATOR.match(text, end)
            if sep is None:
                break
            pos = sep.end()
        return segments


class NamedToolParser(ToolParser):
    """The whole output is the arguments of the one function the request named."""

    failed_calls_are_content = False

    def __init__(self, name: str) -> None:
        self.name = name

    def segments(self, text: str, final: bool) -> list[Segment]:
        start = len(text) - len(text.lstrip())
        end, complete = scan_json_value(text, start)
        return [ParsedToolCall(self.name, text[start:end], complete=complete, raw=text)]
