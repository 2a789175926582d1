"""Llama 3.1/3.2's JSON tool calls (vLLM's ``llama3_json``).

The whole output is one or more JSON objects, separated by ``;``, maybe
after ``<|python_tag|>``::

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An output that does not open with ``{`` (after the tag) is plain content;
text after the last call is content too.
"""

from __future__ import annotations

import re

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    Segment,
    ToolParser,
    json_call,
    scan_json_value,
    text_segment,
)

PYTHON_TAG = "<|python_tag|>"
_LEAD = re.compile(r"\s*(?:" + re.escape(PYTHON_TAG) + r")?\s*")
_SEPARATOR = re.compile(r"\s*;\s*")
_ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolParser):
    def segments(self, text: str, final: bool) -> list[Segment]:
        pos = _LEAD.match(text).end()  # type: ignore[union-attr]  # matches anything
        if pos == len(text) or (not final and text_segment(text.lstrip(), False, PYTHON_TAG) == []):
            # Nothing but (the start of) the lead so far.
            return [] if not final else text_segment(text, final)
        if text[pos] != "{":
            return text_segment(text, final)
        segments: list[Segment] = []
        while True:
            end, complete = scan_json_value(text, pos)
            if not complete:
                segments.append(ParsedToolCall(None, raw=text[pos:]))
                return segments
            segments.append(json_call(text[pos:end], _ARGS_KEYS, text[pos:end]))
            sep = _SEPARATOR.match(text, end)
            if sep is not None and sep.end() < len(text) and text[sep.end()] == "{":
                pos = sep.end()
                continue
            rest = text[end:]
            if not rest.strip(" \t\r\n;"):
                return segments  # a separator, maybe before another call
            return segments + text_segment(rest, final)
