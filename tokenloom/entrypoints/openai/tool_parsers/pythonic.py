"""Python-style tool calls (Llama 3.2 and 4, vLLM's ``pythonic``).

The output opens with a Python list of calls with keyword arguments whose
values are literals::

    [get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]

The arguments become a JSON object (``True`` becomes ``true``, ...). An
output that does not open with ``[`` and a call is plain content; text after
the list is content too.
"""

from __future__ import annotations

import ast
import json
import re

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    Segment,
    ToolParser,
    balanced_end,
    text_segment,
)

_OPEN = re.compile(r"\s*\[\s*")
_CALL_START = re.compile(r"[A-Za-z_][\w.]*\s*\(")
# A possible start of a call: a name and spaces, not yet followed by "(".
_PARTIAL_NAME = re.compile(r"[A-Za-z_][\w.]*\s*")
_SEPARATOR = re.compile(r"\s*,\s*")
_CLOSE = re.compile(r"\s*\]")


class PythonicToolParser(ToolParser):
    def segments(self, text: str, final: bool) -> list[Segment]:
        opened = _OPEN.match(text)
        if opened is None:
            if not final and not text.strip():
                return []
            return text_segment(text, final)
        pos = opened.end()
        call = _CALL_START.match(text, pos)
        if call is None:
            if not final and (pos == len(text) or _PARTIAL_NAME.fullmatch(text, pos)):
                return []  # the first call's name may be arriving
            return text_segment(text, final)  # a list, but not of calls
        segments: list[Segment] = []
        while True:
            # The call's arguments: from its "(" to the matching ")".
            end = balanced_end(text, call.end() - 1, "'\"")
            if end is None:
                segments.append(ParsedToolCall(None, raw=text[pos:]))
                return segments
            segments.append(_call(text[pos:end]))
            sep = _SEPARATOR.match(text, end)
            if sep is not None:
                after = sep.end()
                next_call = _CALL_START.match(text, after)
                if next_call is not None:
                    pos, call = after, next_call
                    continue
                if not final and (after == len(text) or _PARTIAL_NAME.fullmatch(text, after)):
                    return segments  # the next call's name may be arriving
            close = _CLOSE.match(text, end)
            if close is not None:
                return segments + text_segment(text[close.end() :], final)
            if not final and not text[end:].strip():
                return segments  # a separator or the list's end may be arriving
            return segments + text_segment(text[end:], final)


def _call(source: str) -> ParsedToolCall:
    """One finished ``name(key=literal, ...)``; anything else is a call without a name."""
    failed = ParsedToolCall(None, complete=True, raw=source)
    try:
        node = ast.parse(source.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return failed
    if not isinstance(node, ast.Call) or node.args:
        return failed
    name = ast.unparse(node.func)
    if not isinstance(node.func, (ast.Name, ast.Attribute)):
        return failed
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return failed
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return failed
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        return failed
    return ParsedToolCall(name, text, complete=True, raw=source)
