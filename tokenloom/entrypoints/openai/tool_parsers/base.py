"""What every tool-call parser provides, and the streaming that all of them share.

A parser turns generated text into ``(content, calls)``. It is written once,
as ``parse(text, final)``: with ``final=False`` the text is a prefix of the
output and the parser reports only what is certain so far (a name once its
closing quote arrived, the part of the arguments that is surely theirs);
with ``final=True`` it reports everything. Streaming re-parses the text after
each delta and sends the difference (``ToolCallStreamer``), so streamed
deltas always reassemble to exactly what the non-streamed response carries.

Arguments are reported as the raw JSON text the model wrote for them (not
re-serialised), which is what makes every partial view a prefix of the final
one.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass
class ParsedToolCall:
    """One call as seen so far: ``name`` is None until it is complete."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class ParsedOutput:
    """``content`` is the text outside tool calls (None when there is none)."""

    content: str | None
    calls: list[ParsedToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Extracts tool calls from generated text; one instance per request."""

    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedOutput:
        """Content and calls in ``text`` (the whole output so far)."""


@dataclass
class ToolCallDelta:
    """A streamed fragment of call ``index``: its name (first) or more arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


class ToolCallStreamer:
    """Turns growing output text into content and tool-call deltas.

    ``update(text)`` takes the whole output so far and returns what is new
    since the previous call; ``finish(text)`` flushes the rest. Names go out
    first, each call's arguments after its name, in order.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self._content_sent = 0
        self._names_sent = 0
        self._args_sent: list[int] = []

    def update(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        parsed = self.parser.parse(text, final)
        content = parsed.content or ""
        new_content = content[self._content_sent :]
        self._content_sent = max(self._content_sent, len(content))
        deltas: list[ToolCallDelta] = []
        for index, call in enumerate(parsed.calls):
            if index >= self._names_sent:
                if call.name is None:
                    break
                deltas.append(ToolCallDelta(index, name=call.name))
                self._names_sent = index + 1
                self._args_sent.append(0)
            sent = self._args_sent[index]
            if len(call.arguments) > sent:
                fragment = call.arguments[sent:]
                if deltas and deltas[-1].index == index and not deltas[-1].arguments:
                    deltas[-1].arguments = fragment
                else:
                    deltas.append(ToolCallDelta(index, arguments=fragment))
                self._args_sent[index] = len(call.arguments)
        return new_content, deltas

    def finish(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        return self.update(text, final=True)

    @property
    def num_calls(self) -> int:
        return self._names_sent


# ---------------------------------------------------------------- JSON scanning

_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def scan_json_value(text: str, start: int) -> tuple[int, bool]:
    """Scan the JSON object, array or string starting at ``text[start]``.

    Returns ``(end, complete)``: when complete, ``text[start:end]`` is the
    whole value; otherwise ``end`` is how far the text surely belongs to the
    value (everything, since an unfinished object or array has not closed).
    Scalars (numbers, true, ...) are complete only once something follows
    them; until then ``end == start``.
    """
    n = len(text)
    if start >= n:
        return start, False
    first = text[start]
    if first not in '{["':
        match = re.compile(r"-?[0-9.eE+\-]+|true|false|null").match(text, start)
        if match is None or match.end() == n:
            return start, False
        return match.end(), True
    depth = 0
    in_string = False
    escaped = False
    i = start
    while i < n:
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1, True
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1, True
        i += 1
    return n, False


def parse_call_object(
    text: str, pos: int, args_key: str
) -> tuple[ParsedToolCall | None, int | None]:
    """Parse ``{"name": ..., "<args_key>": ...}`` at ``pos`` (leading spaces allowed).

    Returns the call seen so far (None before its name is complete) and the
    index after the object's closing brace (None until it closed).
    """
    match = _NAME.match(text, pos)
    if match is None:
        return None, None
    name = json.loads(f'"{match.group(1)}"')
    key = re.compile(r'\s*,\s*"' + re.escape(args_key) + r'"\s*:\s*').match(text, match.end())
    if key is None:
        return ParsedToolCall(name), None
    end, complete = scan_json_value(text, key.end())
    arguments = text[key.end() : end]
    if not complete:
        return ParsedToolCall(name, arguments), None
    close = re.compile(r"\s*\}").match(text, end)
    if close is None:
        return ParsedToolCall(name, arguments, complete=True), None
    return ParsedToolCall(name, arguments, complete=True), close.end()


def loose_call(block: str, args_key: str) -> ParsedToolCall | None:
    """A finished call whose keys are not in the usual order: parse it as JSON."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), complete=True)
