"""The Hermes tool-call format (NousResearch Hermes, Qwen, the bundled template).

Calls are JSON objects between tags; text around them is content::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A call whose closing tag never came (the model stopped after the object) is
still a call if its JSON is whole.
"""

from __future__ import annotations

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedToolCall,
    Segment,
    ToolParser,
    json_call,
    text_segment,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_ARGS_KEYS = ("arguments", "parameters")


class HermesToolParser(ToolParser):
    def segments(self, text: str, final: bool) -> list[Segment]:
        segments: list[Segment] = []
        pos = 0
        while True:
            start = text.find(TOOL_CALL_START, pos)
            if start < 0:
                return segments + text_segment(text[pos:], final, TOOL_CALL_START)
            if start > pos:
                segments.append(text[pos:start])
            body = start + len(TOOL_CALL_START)
            close = text.find(TOOL_CALL_END, body)
            if close < 0:
                if final:
                    segments.append(json_call(text[body:].strip(), _ARGS_KEYS, text[start:]))
                else:
                    segments.append(ParsedToolCall(None, raw=text[start:]))
                return segments
            end = close + len(TOOL_CALL_END)
            segments.append(json_call(text[body:close].strip(), _ARGS_KEYS, text[start:end]))
            pos = end
