"""The Hermes tool-call format (NousResearch Hermes, Qwen, the bundled template).

Calls are JSON objects between tags, any text before them is content::

    Let me look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from tokenloom.entrypoints.openai.tool_parsers.base import (
    ParsedOutput,
    ParsedToolCall,
    ToolParser,
    loose_call,
    parse_call_object,
)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class HermesToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        first = text.find(TOOL_CALL_START)
        if first < 0:
            cut = len(text) if final else _safe_end(text, TOOL_CALL_START)
            return ParsedOutput(_content(text[:cut]))
        calls: list[ParsedToolCall] = []
        pos = first
        while pos >= 0:
            body = pos + len(TOOL_CALL_START)
            close = text.find(TOOL_CALL_END, body)
            block = text[body:] if close < 0 else text[body:close]
            call, _ = parse_call_object(block, 0, "arguments")
            if (close >= 0 or final) and (call is None or not call.complete):
                call = loose_call(block.strip(), "arguments") or call
            if call is None:
                break
            calls.append(call)
            if close < 0:
                break
            pos = text.find(TOOL_CALL_START, close + len(TOOL_CALL_END))
        return ParsedOutput(_content(text[:first]), calls)


def _content(text: str) -> str | None:
    return text.strip() or None


def _safe_end(text: str, tag: str) -> int:
    """Where to cut ``text`` so that no partial ``tag`` at its end is shown as content."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return len(text) - size
    return len(text)
